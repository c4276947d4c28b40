"""Helpers shared by the cloud executors (Modal, Hugging Face Jobs)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from composer_cloud import env
from composer_cloud.spec import RunSpec

#: Non-secret JSON of ``spec.store_options`` for code that must open the store
#: before it can read the spec (the HF bootstrap; the replica may use it too).
STORE_OPTIONS_ENV = env.STORE_OPTIONS
#: How many trailing log lines a failed replica's status message carries.
FAILURE_TAIL_LINES = 20

_EXIT_CODE = re.compile(r"exit(?:ed)?(?: with)? (?:status |code)[:= ]*(-?\d+)", re.IGNORECASE)


def run_id_of(run_uri: str) -> str:
    """``s3://bucket/prefix/run-1`` -> ``run-1`` (the run directory's name)."""
    tail = run_uri.rstrip("/").rsplit("/", 1)[-1]
    return tail.split("://", 1)[-1]


def scheme_of(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else "file"


def job_env(spec: RunSpec) -> dict[str, str]:
    """Environment variables every cloud replica job gets. Never holds a secret.

    ``spec.store_options`` cannot hold credentials (the spec validator rejects
    credential-like keys), so it may travel as plain environment.
    """
    env = {"PYTHONUNBUFFERED": "1"}
    if spec.store_options:
        env[STORE_OPTIONS_ENV] = json.dumps(spec.store_options, sort_keys=True)
    return env


def parse_exit_code(message: str | None) -> int | None:
    """Find an exit code in a backend's failure message (``"... exit code: 3"``)."""
    if not message:
        return None
    m = _EXIT_CODE.search(message)
    return int(m.group(1)) if m else None


def failure_message(head: str, tail: Iterable[str]) -> str:
    """``head`` plus the last log lines, indented, for a FAILED :class:`ReplicaStatus`."""
    lines = [ln.rstrip("\n") for ln in tail if ln.strip()]
    if not lines:
        return head
    return head + "\nlast log lines:\n" + "\n".join(f"  | {ln}" for ln in lines)
