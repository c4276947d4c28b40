"""Runs launched on the local executor: start one that stalls, kill it, read its replicas' logs.

Jobs are found through the run's job handles (``composer_cloud.runs.load_handles``)
and the executor's own API; the one thing no public API gives, the pid of the
replica under its supervisor, is read here and nowhere else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from composer_cloud.jobs.base import JobHandle
from composer_cloud.jobs.local import LocalProcessExecutor
from composer_cloud.runs import load_handles, open_run
from support.cli import start_cli
from support.faults import stall_env, wait_for_marker, with_faults


def launch_stalled(cwd: Path, config: Path, store: str, run_id: str, *, phase: str, round: int, rank: int,
                   extra_env: Mapping[str, str] | None = None, capture: bool = True,
                   timeout: float = 180, local_rank: int | None = None) -> subprocess.Popen:
    """Launch attached (own session); return once replica ``rank`` (its local rank ``local_rank``) stalls at
    ``phase`` of ``round``. The marker, ``cwd/stalled-<run_id>``, names the stalled process's pid."""
    marker = cwd / f"stalled-{run_id}"
    env = with_faults(stall_env(phase, round, rank, marker, local_rank=local_rank), extra_env or {})
    launcher = start_cli("launch", "--config", str(config), "--store", store, "--run-id", run_id, cwd=cwd, env=env,
                         capture=capture)
    wait_for_marker(marker, launcher, timeout=timeout, what=f"{phase}:{round}:{rank}")
    wait_for_handles(f"{store.rstrip('/')}/{run_id}", launcher)
    return launcher


def wait_for_handles(run_uri: str, launcher: subprocess.Popen, *, timeout: float = 60) -> None:
    """Until the launcher has recorded every job's handle. Forked replicas start at once and may reach a stall
    before the launcher writes the handles that :func:`kill_run` kills by."""
    spec = open_run(run_uri).spec
    expected = spec.replicas + spec.rollouts.workers
    deadline = time.monotonic() + timeout
    while len(handles(run_uri)) < expected:
        assert launcher.poll() is None, f"the launcher exited ({launcher.returncode}) before recording its jobs"
        assert time.monotonic() < deadline, f"{run_uri}: the launcher recorded no handle for some job in {timeout}s"
        time.sleep(0.05)


def handles(run_uri: str) -> dict[int, JobHandle]:
    """The run's job handles by rank."""
    return {h.rank: h for h in load_handles(open_run(run_uri).store)}


def kill_run(run_uri: str, launcher: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group and every replica's (supervisor and replica): a machine lost."""
    os.killpg(launcher.pid, signal.SIGKILL)
    for h in handles(run_uri).values():
        try:
            os.killpg(int(h.data["pgid"]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait()


def kill_replica(run_uri: str, rank: int) -> None:
    """SIGKILL replica ``rank``'s process only (its supervisor lives on and may restart it): a crash."""
    from composer_cloud.jobs.jobfiles import JobFolder

    with JobFolder.at(Path(handles(run_uri)[rank].data["dir"]), rank=rank, key=None) as folder:
        supervisor = folder.read_record("supervisor.json")  # crc-checked (a signed run's HMAC is not checked here)
    assert supervisor is not None, f"replica {rank} has no supervisor record"
    os.kill(int(supervisor["replica_pid"]), signal.SIGKILL)


def replica_log(run_uri: str, rank: int) -> str:
    """Replica ``rank``'s output so far (every restart's), through the local executor's ``logs``."""
    return "\n".join(LocalProcessExecutor().logs(handles(run_uri)[rank]))
