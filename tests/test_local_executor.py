"""The local executor acts only on jobs it can prove are its own: a bucket writer cannot aim it."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_cloud.jobs.base import ExecutorError, JobHandle, ReplicaState
from composer_cloud.jobs.local import LocalProcessExecutor


def _alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def _supervised_sleep(d: Path) -> tuple[subprocess.Popen, JobHandle]:
    """A real supervisor (as the launcher starts it) over a harmless command, and its handle."""
    d.mkdir(parents=True)
    token = secrets.token_hex(16)
    (d / "token").write_text(token)
    proc = subprocess.Popen([sys.executable, "-m", "composer_cloud.jobs.local", "supervise", "--dir", str(d), "--",
                             sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (d / "supervisor.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc, JobHandle(executor="local", rank=0, job_id=str(proc.pid),
                           data={"dir": str(d), "pgid": proc.pid, "token": token})


@pytest.fixture
def victim():
    """A process of the operator's that a forged handle might name."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_own_job_is_polled_and_cancelled(tmp_path):
    proc, handle = _supervised_sleep(tmp_path / "job")
    ex = LocalProcessExecutor()
    assert ex.poll(handle).state == ReplicaState.RUNNING
    ex.cancel(handle)
    proc.wait(timeout=30)
    assert ex.poll(handle).state == ReplicaState.CANCELLED


@pytest.mark.parametrize("forge", ["pgid", "dir", "token", "no-token"])
def test_forged_handle_signals_nothing_and_writes_nothing(tmp_path, victim, forge):
    proc, handle = _supervised_sleep(tmp_path / "job")
    elsewhere = tmp_path / "operator-files"
    elsewhere.mkdir()
    data = dict(handle.data)
    if forge == "pgid":  # the bucket names the operator's process
        forged = JobHandle("local", 0, str(victim.pid), {**data, "pgid": victim.pid})
    elif forge == "dir":
        forged = JobHandle("local", 0, handle.job_id, {**data, "dir": str(elsewhere)})
    elif forge == "token":
        forged = JobHandle("local", 0, handle.job_id, {**data, "token": "0" * 32})
    else:
        forged = JobHandle("local", 0, handle.job_id, {k: v for k, v in data.items() if k != "token"})
    ex = LocalProcessExecutor()
    if forge == "pgid":
        ex.cancel(forged)  # its directory is genuine, but the pid is not that directory's supervisor
        assert ex.poll(forged).state != ReplicaState.RUNNING
    else:
        with pytest.raises(ExecutorError, match="refusing"):
            ex.cancel(forged)
        with pytest.raises(ExecutorError, match="refusing"):
            ex.poll(forged)
    time.sleep(0.3)
    assert _alive(victim), "a forged handle killed a process it does not own"
    assert list(elsewhere.iterdir()) == [], "a forged handle wrote a file outside the run's job directory"
    if forge != "pgid":
        assert _alive(proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_supervisor_that_died_of_a_full_disk_says_so(tmp_path, monkeypatch):
    """A full disk kills the supervisor before it can write exit.json: status names the cause, not a vanishing."""
    import shutil

    from composer_cloud.jobs import local

    from composer_cloud.jobs.jobfiles import JobFolder

    folder = JobFolder.at(tmp_path, rank=0, key=None)
    (tmp_path / "replica.log").write_text("step 3\nOSError: [Errno 28] No space left on device: 'x'\n")
    reason = local.vanished_reason(folder)
    assert reason.startswith("no space left on device") and "resume" in reason and "Errno 28" in reason
    (tmp_path / "replica.log").write_text("step 3\n")
    assert local.vanished_reason(folder).startswith("supervisor vanished")  # plenty of space, no ENOSPC
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(local.shutil, "disk_usage", lambda path: usage._replace(free=4096))
    assert "4096 bytes free" in local.vanished_reason(folder)
    folder.close()
