"""Fault-injection environments for replica processes (see ``composer_cloud/replica/faults.py``)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from composer_cloud import env
from composer_cloud.hooks import PHASES

#: The phases a replica can be stalled at (``inner_step``, ``upload``, ``reduce``, ``checkpoint``, ``global_upload``).
STALL_PHASES = PHASES


def stall_env(phase: str, round: int, rank: int, marker: Path, *, local_rank: int | None = None) -> dict[str, str]:
    """Variables that stall replica ``rank`` (its local rank ``local_rank`` in a multi-GPU replica) at ``phase``
    of ``round`` once, creating ``marker`` (with the stalled process's ``pid`` line) when it does."""
    if phase not in PHASES:
        raise ValueError(f"unknown stall phase {phase!r}; choose one of {PHASES}")
    where = f"{phase}:{round}:{rank}" + ("" if local_rank is None else f":{local_rank}")
    return {env.STALL_AT: where, env.STALL_MARKER: str(marker)}


def stalled_pid(marker: Path, *, timeout: float = 10) -> int:
    """The pid a stall marker names (the marker is created, then written: wait for its pid line)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in marker.read_text().splitlines() if line.startswith("pid ")]
        if lines:
            return int(lines[0].split()[1])
        assert time.monotonic() < deadline, f"{marker} names no pid"
        time.sleep(0.05)


def slow_env(factors: Mapping[int, float]) -> dict[str, str]:
    """Variables that make each rank in ``factors`` run ``factor`` times slower (simulated slow hardware)."""
    return {env.SLOW: ",".join(f"{rank}:{factor:g}" for rank, factor in factors.items())}


def with_faults(*parts: Mapping[str, str]) -> dict[str, str]:
    """This process's environment plus fault variables."""
    out = dict(os.environ)
    for part in parts:
        out.update(part)
    return out


def wait_for_marker(marker: Path, launcher: subprocess.Popen, *, timeout: float = 180, what: str = "") -> None:
    """Return once ``marker`` exists; fail if the launcher exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if launcher.poll() is not None:
            out = launcher.stdout.read() if launcher.stdout is not None else ""
            raise AssertionError(f"launcher exited before the stall point {what}: {out[-3000:]}")
        assert time.monotonic() < deadline, f"never reached the stall point {what}"
        time.sleep(0.2)
