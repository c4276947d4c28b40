"""Replica side of the user code and local files that travel with a run: verify, extract, put in place.

The launcher packaged them (:mod:`composer_cloud.runs.packaging`); the digests
a replica checks come from its job's environment when the launcher set them
(:class:`~composer_cloud.env.JobEnv` ``code_ref`` and ``files``), else from the
spec, never from an object the store alone vouches for.

Invariants:

* **Nothing read from the store is trusted.** The sha256 is verified (on top
  of the store's crc32 framing) before a byte is used; a mismatch is a
  :class:`~composer_cloud.errors.ChecksumMismatch` naming the key. Archives are
  checked entry by entry *before* anything is written (:mod:`composer_cloud.archive`):
  absolute paths, ``..``, symlinks, special files, encrypted entries and
  oversized or over-long archives are refused. Nothing is unpickled or
  executed on extraction.
* **Atomic, shared caches.** Extraction goes to a temporary directory beside
  the target and is renamed into place, so a cache entry is either complete or
  absent; replicas sharing a cache directory race safely (the loser discards
  its copy and uses the winner's, which has the same sha256).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path

from composer_cloud.archive import extract_atomic
from composer_cloud.errors import ChecksumMismatch
from composer_cloud.spec import RunSpec
from composer_cloud.spec_paths import is_path_setting, with_paths
from composer_cloud.storage import layout
from composer_cloud.storage.records import CodeRef
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)

#: Serialises changes to ``sys.path`` and importlib's finder caches (``invalidate_caches`` iterates a dict that a
#: concurrent call mutates: KeyError) when several installers share one process.
_IMPORT_STATE = threading.Lock()


def _get_verified(store: Store, key: str, sha256: str) -> bytes:
    data = bytes(store.get(key))  # crc32 framing checked by the store
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise ChecksumMismatch(key, f"sha256 {got} does not match the expected {sha256}")
    return data


def install_code(store: Store, ref: CodeRef, *, cache_dir: str | os.PathLike[str]) -> Path:
    """Make the bundle ``ref`` importable here; returns its directory (now first on ``sys.path``).

    Downloads ``ref.key``, verifies its sha256 (a mismatch raises
    :class:`ChecksumMismatch` naming the key), checks every entry, and
    extracts it atomically to ``cache_dir/<sha256>/``. An existing extraction
    is reused without reading the store.
    """
    if ref.key != layout.code_key(ref.sha256):
        raise ValueError(f"invalid code reference: key {ref.key!r} is not the bundle key of {ref.sha256}")
    target = Path(os.path.abspath(cache_dir)) / ref.sha256
    if target.is_dir():
        logger.debug("code %s already extracted at %s", ref.sha256[:12], target)
    else:
        data = _get_verified(store, ref.key, ref.sha256)
        extract_atomic(data, ref.key, target)
        logger.info("installed code %s (%s) at %s", ref.sha256[:12], ", ".join(ref.modules) or "-", target)
    with _IMPORT_STATE:  # sys.path and importlib's caches are process-wide: one installer at a time
        if str(target) not in sys.path:
            sys.path.insert(0, str(target))
        importlib.invalidate_caches()
    stale = [m for m in ref.modules if getattr(sys.modules.get(m), "__file__", None)
             and not sys.modules[m].__file__.startswith(str(target) + os.sep)]
    if stale:
        logger.warning("modules %s were imported before the run's code was installed; the old versions stay "
                       "in use in this process", stale)
    return target


def fetch_file(store: Store, key: str, *, cache_dir: str | os.PathLike[str]) -> Path:
    """The local path of an uploaded file or folder (a key of :func:`~composer_cloud.storage.layout.file_key`).

    Verifies the sha256 in the key before using the bytes; cached under
    ``cache_dir/<files|dirs>/<sha256>/<name>`` and reused.
    """
    parsed = layout.parse_file_key(key)
    if parsed is None:
        raise ValueError(f"{key!r} is not a key written by pack_path "
                         f"({layout.file_key('<sha256>', '<name>', directory=False)} or "
                         f"{layout.file_key('<sha256>', '<name>', directory=True)})")
    is_dir, sha, name = parsed
    target = Path(os.path.abspath(cache_dir)) / key.split("/", 1)[0] / sha / name
    if target.exists():
        return target
    data = _get_verified(store, key, sha)
    if is_dir:
        extract_atomic(data, key, target)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, target)  # same bytes if a concurrent fetch won
        finally:
            tmp.unlink(missing_ok=True)
    logger.info("fetched %s to %s", key, target)
    return target


def localize_files(store: Store, files: Mapping[str, str], *, cache_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Fetch every uploaded file of ``files`` (``{setting: store key}``); returns ``{setting: local path}``."""
    out = {}
    for setting, key in files.items():
        if not is_path_setting(str(setting)) or not isinstance(key, str):
            raise ValueError(f"invalid uploaded file entry {setting!r}: {key!r}")
        out[setting] = str(fetch_file(store, key, cache_dir=cache_dir))
    return out


def localize_spec(store: Store, spec: RunSpec, *, cache_dir: str | os.PathLike[str],
                  files: Mapping[str, str] | None = None) -> RunSpec:
    """``spec`` with each uploaded local file replaced by a verified local copy under ``cache_dir``.

    ``files`` (``{setting: key}``) is what the launcher put in the job's
    environment; without it, ``spec.code.files``. Each key carries the sha256
    its bytes must have.
    """
    files = dict(spec.code.files) if files is None else dict(files)
    if not files:
        return spec
    local = localize_files(store, files, cache_dir=cache_dir)
    logger.info("local files of the spec fetched from the store: %s", local)
    return with_paths(spec, local, source="spec with fetched files")


__all__ = ["fetch_file", "install_code", "localize_files", "localize_spec"]
