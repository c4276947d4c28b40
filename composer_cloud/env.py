"""Every ``COMPOSER_CLOUD_*`` environment variable, defined once.

Launchers set them for replica jobs; replicas, supervisors and bootstraps read
them. None of them carries a secret value except :data:`RUN_KEY`, which
travels like the store credentials (the executors' own secret mechanisms,
next to the standard ``AWS_*`` / ``HF_TOKEN`` variables) and is never written
to the store, a record or a log.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Log level of a replica process (``INFO`` by default).
LOG_LEVEL = "COMPOSER_CLOUD_LOG"
#: torch intra-op threads of a replica process (the local executor splits the cores).
THREADS = "COMPOSER_CLOUD_THREADS"
#: Non-secret JSON of ``spec.store_options`` for code that must open the store
#: before it can read the spec (the HF bootstrap, the replica).
STORE_OPTIONS = "COMPOSER_CLOUD_STORE_OPTIONS"
#: Crash-test fault injection: ``phase:round:rank`` to stall at (see :mod:`composer_cloud.faults`).
STALL_AT = "COMPOSER_CLOUD_STALL_AT"
#: File the stalled replica creates when it reaches the stall point.
STALL_MARKER = "COMPOSER_CLOUD_STALL_MARKER"
#: Slow-hardware fault injection (decoupled mode): ``rank:factor[,rank:factor...]``; replica ``rank`` sleeps
#: ``(factor - 1) x`` the duration of each inner step after it (see :func:`composer_cloud.faults.slow_step`).
SLOW = "COMPOSER_CLOUD_SLOW"
#: HF Jobs bootstrap: where the staged wheel of composer-cloud lies, and its sha256.
WHEEL_URI = "COMPOSER_CLOUD_WHEEL_URI"
WHEEL_SHA256 = "COMPOSER_CLOUD_WHEEL_SHA256"
#: Extra ``pip install`` arguments for the HF Jobs bootstrap (e.g. ``--no-index``).
PIP_ARGS = "COMPOSER_CLOUD_PIP_ARGS"
#: A prebuilt wheel to stage instead of building one from this checkout.
PREBUILT_WHEEL = "COMPOSER_CLOUD_PREBUILT_WHEEL"
#: Opt-in live tests against a real Modal account, and the GPU they ask for.
LIVE_MODAL = "COMPOSER_CLOUD_LIVE_MODAL"
LIVE_MODAL_GPU = "COMPOSER_CLOUD_LIVE_MODAL_GPU"
#: Launcher side: a requirements file whose pins the HF Jobs bootstrap installs with (``-c``)
#: instead of ``composer_cloud/images/requirements.txt`` (another stack on purpose, or a test
#: environment whose versions differ from the shipped pins).
CONSTRAINTS = "COMPOSER_CLOUD_CONSTRAINTS"
#: JSON of the run's :class:`~composer_cloud.usercode.CodeRef` (key, sha256, bytes, modules). Set by the
#: launcher on each job, so a replica checks the code bundle against a digest that did not come from the store.
CODE_REF = "COMPOSER_CLOUD_CODE_REF"
#: JSON ``{setting: store key}`` of the local files a spec names, uploaded at launch (keys carry their sha256).
#: Set by the launcher on cloud jobs, so the digests a replica checks did not come from the store.
FILES = "COMPOSER_CLOUD_FILES"
#: The run key (a secret): objects in the store are signed with an HMAC derived from it, and unsigned
#: or mis-signed objects are rejected (:mod:`composer_cloud.storage.framing`). Whether a run is signed is
#: recorded in its spec at launch; a process must have the key to open a signed run, and must not have it
#: to open an unsigned one (:func:`composer_cloud.storage.run.open_run`). Unset or empty: no key.
RUN_KEY = "COMPOSER_CLOUD_RUN_KEY"
#: The standard AWS variables naming an S3-compatible endpoint (MinIO, R2, SeaweedFS), most specific first.
AWS_ENDPOINTS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def run_key(environ: Mapping[str, str] = os.environ) -> str | None:
    """The run key as set (never logged), or None when unset or empty."""
    return environ.get(RUN_KEY) or None


def s3_endpoint(environ: Mapping[str, str] = os.environ) -> str | None:
    """The S3 endpoint the standard AWS variables name, or None (the provider's default)."""
    return next((environ[n] for n in AWS_ENDPOINTS if environ.get(n)), None)


def store_options(environ: Mapping[str, str] = os.environ) -> str | None:
    """The raw JSON of :data:`STORE_OPTIONS`, or None when unset or empty."""
    return environ.get(STORE_OPTIONS) or None
