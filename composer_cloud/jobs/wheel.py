"""Build this package as a wheel and stage it in a run's store.

Cloud jobs whose image does not contain composer-cloud (Hugging Face Jobs on a
stock PyTorch image) install it at start-up from a wheel the launcher put in
the run's store, so no PyPI release is needed and every replica of a run runs
exactly the launcher's code.

Invariants:

* The wheel is built from a *copy* of the source tree in a temporary
  directory: a stale ``build/`` directory in the checkout can never leak
  deleted modules into the wheel, and the checkout is not written to.
* The staged object lives at ``<run>/executor/wheel/<sha256[:16]>/<file>.whl``
  (content-addressed: re-staging the same bytes is a no-op, different bytes
  never overwrite a wheel a running job may be reading). It is written through
  :class:`~composer_cloud.storage.store.Store`, so it is framed with a crc32
  and the job additionally checks the sha256 carried in :class:`StagedWheel`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from composer_cloud import env
from composer_cloud.jobs.base import ExecutorError
from composer_cloud.storage.store import Store
from composer_cloud.storage.layout import WHEELS as WHEEL_PREFIX  # noqa: F401 - hf_jobs names it
from composer_cloud.storage.layout import wheel_key

logger = logging.getLogger(__name__)

#: Launcher-side override: a prebuilt wheel to stage instead of building one.
WHEEL_ENV = env.PREBUILT_WHEEL
_TREE_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md", "LICENSE", "LICENSE.txt")


@dataclass(frozen=True)
class StagedWheel:
    """A wheel in a run's store.

    Attributes:
        uri: full store URI of the (framed) wheel object, as the job reads it.
        key: key relative to the run's store.
        sha256: hex digest of the wheel bytes (not of the framed object).
        filename: the wheel's file name (pip needs it to install).
    """

    uri: str
    key: str
    sha256: str
    filename: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def project_root() -> Path:
    """The source checkout this package is imported from.

    Raises :class:`ExecutorError` when composer_cloud was installed from a
    wheel (no ``pyproject.toml`` beside the package).
    """
    import composer_cloud

    root = Path(composer_cloud.__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        raise ExecutorError(
            f"cannot build a wheel: composer_cloud is imported from {root}, which is not a source checkout "
            f"(no pyproject.toml). Install composer-cloud from a checkout (pip install -e .) or set "
            f"{WHEEL_ENV}=/path/to/composer_cloud-*.whl")
    return root


def build_wheel(out_dir: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None) -> Path:
    """Build a wheel of the project at ``root`` (default: :func:`project_root`) into ``out_dir``.

    Uses ``pip wheel --no-deps --no-build-isolation --no-index``: nothing is
    downloaded, the build backend (setuptools) must already be installed.
    """
    src = Path(root) if root is not None else project_root()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="composer-cloud-src-") as tmp:
        tree = Path(tmp) / "src"
        tree.mkdir()
        for name in _TREE_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tree / name)
        shutil.copytree(src / "composer_cloud", tree / "composer_cloud",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
               "--disable-pip-version-check", "--quiet", "-w", str(out), str(tree)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ExecutorError(
                f"building the composer-cloud wheel failed (exit {proc.returncode}):\n"
                f"{(proc.stdout + proc.stderr).strip()[-2000:]}\n"
                f"Install the build backend (pip install 'setuptools>=68') or set {WHEEL_ENV} to a prebuilt wheel.")
    wheels = sorted(out.glob("composer_cloud-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise ExecutorError(f"pip wheel succeeded but left no composer_cloud-*.whl in {out}")
    logger.info("built %s", wheels[-1].name)
    return wheels[-1]


def stage_wheel(store: Store, wheel: str | os.PathLike[str]) -> StagedWheel:
    """Upload ``wheel`` to ``store`` (the run's store) under :data:`WHEEL_PREFIX`.

    Content-addressed and idempotent: if an intact object with the same bytes
    is already there, nothing is written.
    """
    path = Path(wheel)
    if not path.name.endswith(".whl"):
        raise ExecutorError(f"{path} is not a wheel (*.whl)")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    key = wheel_key(digest, path.name)
    existing = store.try_get(key)
    if existing is None or hashlib.sha256(existing).hexdigest() != digest:
        store.put(key, data)
        logger.info("staged %s (%d bytes) at %s", path.name, len(data), store.uri_of(key))
    return StagedWheel(uri=store.uri_of(key), key=key, sha256=digest, filename=path.name)


def build_and_stage_wheel(store: Store, *, wheel: str | os.PathLike[str] | None = None) -> StagedWheel:
    """Stage ``wheel``, or ``$COMPOSER_CLOUD_PREBUILT_WHEEL``, or a freshly built wheel of this checkout."""
    chosen = wheel or os.environ.get(WHEEL_ENV)
    if chosen:
        return stage_wheel(store, chosen)
    with tempfile.TemporaryDirectory(prefix="composer-cloud-wheel-") as tmp:
        return stage_wheel(store, build_wheel(tmp))
