"""The environment a replica job gets from its executor (never a secret).

Every executor starts ``python -m composer_cloud.replica`` with the variables
of :func:`job_env`; the local executor layers them over its own environment,
the remote ones (Modal, HF Jobs) send them with the job. Secrets travel only
through each backend's secret mechanism, never here.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from composer_cloud import env as cc_env

if TYPE_CHECKING:
    from composer_cloud.spec import RunSpec

#: Variables of the launcher's environment that remote jobs get too: ``HF_ENDPOINT``, so a replica
#: downloads models from the same Hub the launcher checked them on.
FORWARDED = ("HF_ENDPOINT",)


def job_env(spec: "RunSpec", *, forward: bool = False) -> dict[str, str]:
    """Environment variables of one replica job of ``spec``; with ``forward``, plus :data:`FORWARDED` ones set here.

    ``spec.store_options`` cannot hold credentials (the spec validator rejects
    credential-like keys), so it may travel as plain environment; it lets code
    open the store before it can read the spec (the HF bootstrap, the replica).
    """
    env = {"PYTHONUNBUFFERED": "1"}
    if spec.store_options:
        env[cc_env.STORE_OPTIONS] = json.dumps(spec.store_options, sort_keys=True)
    if spec.code.ref:  # the digest travels with the job, not only through the (untrusted) store
        env[cc_env.CODE_REF] = json.dumps(spec.code.ref, sort_keys=True)
    if spec.code.files:  # likewise the digests of the uploaded local files (in their keys)
        env[cc_env.FILES] = json.dumps(spec.code.files, sort_keys=True)
    if forward:
        env.update({name: os.environ[name] for name in FORWARDED if os.environ.get(name)})
    return env


__all__ = ["FORWARDED", "job_env"]
