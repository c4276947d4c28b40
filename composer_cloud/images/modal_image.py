"""The Modal App, Image and replica Function of composer-cloud.

Importing this module defines objects only; it makes no network call and needs
no Modal credentials. The launcher (:class:`composer_cloud.jobs.modal_jobs.ModalExecutor`)
runs :data:`app` as a detached ephemeral app and spawns :data:`replica` once per
rank, with per-run options (GPU type and count, timeout, retries, secrets)
applied through ``Function.with_options``.

Image layers, in order (later layers change more often, so they come last):

1. ``debian_slim`` with Python :data:`PYTHON_VERSION` (the run's numeric stack,
   :mod:`composer_cloud.stack`),
2. the pinned dependencies of ``requirements.txt``, installed with
   ``uv_pip_install`` (``modal`` is never among them: Modal supplies its own
   client in the container),
3. ``add_local_python_source("composer_cloud")`` *last*: the launcher's source
   tree is mounted at container start (not baked into a layer), so a code change
   never rebuilds the dependency layers. Non-Python package data
   (``composer_cloud/data/*``) is included; caches and dot-files are not.

The App is created with ``include_source=False``: without it Modal would also
mount the source of the module that defines the function (this one) on its
own, a second copy next to the explicit ``add_local_python_source``; with it,
our package reaches the container exactly once.

In the container Modal imports this module by name to find :data:`replica`.
Imports go one way: this module imports :mod:`composer_cloud.images.container`
(the function body) and :mod:`composer_cloud.stack`, never ``composer_cloud.jobs``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import modal

from composer_cloud.images.container import run_replica_body
from composer_cloud.stack import PYTHON_VERSION

APP_NAME = "composer-cloud"
FUNCTION_NAME = "replica"
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
#: Patterns (modal.FilePatternMatcher syntax) left out of the mounted source.
SOURCE_IGNORE = ["**/__pycache__", "**/*.pyc", "**/.*"]
#: Default function timeout; the run spec's ``modal.timeout_s`` overrides it per launch.
DEFAULT_TIMEOUT_S = 24 * 3600


def pinned_requirements(*, exclude: tuple[str, ...] = ("modal",)) -> list[str]:
    """``name==version`` lines of ``requirements.txt``, without the ``exclude``d packages."""
    if not REQUIREMENTS.is_file():
        return []
    out = []
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and line.split("==", 1)[0].strip().lower() not in exclude:
            out.append(line)
    return out


image = (
    modal.Image.debian_slim(python_version=PYTHON_VERSION)
    .uv_pip_install(*pinned_requirements())
    .env({"PYTHONUNBUFFERED": "1"})
    .add_local_python_source("composer_cloud", ignore=SOURCE_IGNORE)  # last: see module docstring
)

# include_source=False: the explicit add_local_python_source above is the only copy of our source.
app = modal.App(APP_NAME, image=image, include_source=False)


@app.function(timeout=DEFAULT_TIMEOUT_S, serialized=False)
def replica(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run one replica (``argv``, with the extra non-secret ``env``) to completion.

    Secrets arrive as environment variables through Modal secrets. Raises
    :class:`~composer_cloud.images.container.ReplicaFailed` on a non-zero exit,
    so Modal marks the input failed and applies the function's retry policy.
    """
    return run_replica_body(argv, env)
