"""The launcher's local record of the runs it launched: run key and spec digest, never in the store.

``launch`` creates a run key when none is set (runs are signed by default) and
hands it to each job through the executor's secret mechanism. So that later
commands on the same machine (``status``, ``logs``, ``cancel``, ``resume``,
``export``) can open the run without the user copying the key around, the
launcher keeps it here: one JSON file per run, named by the sha256 of the run's
URI, in :func:`composer_cloud.env.keys_dir` (``$COMPOSER_CLOUD_KEYS``, default
``~/.config/composer-cloud/run-keys``), the folder 0700 and each file 0600.

The record also holds the sha256 of the spec the launcher wrote
(:func:`spec_digest`): ``resume`` of an *unsigned* run compares the stored
``spec.json`` with it before using anything in it, because nothing else can
vouch for an unsigned spec.

Invariants: the key is never logged, never in ``repr``, never written outside
this folder; a file that is not ours (unreadable, not JSON, for another URI) is
ignored, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_cloud import env

logger = logging.getLogger(__name__)


def spec_digest(spec_json: Mapping[str, Any]) -> str:
    """sha256 of a spec's canonical JSON (sorted keys, no spaces): what a launcher vouches for."""
    return hashlib.sha256(json.dumps(spec_json, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class RunRecord:
    """What the launcher remembers about one run it launched or resumed."""

    uri: str
    spec_sha256: str
    run_key: str | None = field(default=None, repr=False)
    #: The run's salt as launched (``spec.run_salt``; ``""``: unsigned). Resume never changes it, so a spec with
    #: another salt at this URI is another launch's spec, copied over this run's.
    run_salt: str = ""


def _path(uri: str, directory: Path | None) -> Path:
    root = env.keys_dir() if directory is None else directory
    return root / f"{hashlib.sha256(uri.rstrip('/').encode()).hexdigest()}.json"


def save_record(record: RunRecord, *, directory: Path | None = None) -> Path:
    """Write ``record`` (0600, atomically; the folder 0700). Returns its path."""
    path = _path(record.uri, directory)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"uri": record.uri.rstrip("/"), "spec_sha256": record.spec_sha256, "run_key": record.run_key,
                   "run_salt": record.run_salt}, f)
    os.replace(tmp, path)
    return path


def delete_record(uri: str, *, directory: Path | None = None) -> bool:
    """Remove the record (and so the run key) of run ``uri`` from this machine; False when none was kept."""
    try:
        _path(uri, directory).unlink()
    except FileNotFoundError:
        return False
    return True


def load_record(uri: str, *, directory: Path | None = None) -> RunRecord | None:
    """The record of run ``uri``, or None (none kept here, or a file that is not a valid record for it)."""
    path = _path(uri, directory)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: not a readable run record (%s)", path, type(exc).__name__)
        return None
    key, sha = (obj.get("run_key"), obj.get("spec_sha256")) if isinstance(obj, dict) else (None, None)
    salt = obj.get("run_salt", "") if isinstance(obj, dict) else ""
    if (not isinstance(obj, dict) or obj.get("uri") != uri.rstrip("/") or not isinstance(sha, str)
            or not (key is None or isinstance(key, str)) or not isinstance(salt, str)):
        logger.warning("ignoring %s: not a run record of %s", path, uri)
        return None
    return RunRecord(uri=uri.rstrip("/"), spec_sha256=sha, run_key=key or None, run_salt=salt)


__all__ = ["RunRecord", "delete_record", "load_record", "save_record", "spec_digest"]
