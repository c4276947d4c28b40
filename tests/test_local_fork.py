"""The local executor's forked supervisors and replicas behave as separate interpreters would, and a handle
still proves which rank's process it may signal."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from composer_cloud import env, forking
from composer_cloud.jobs import local_fork
from composer_cloud.jobs.base import JobHandle, ReplicaState
from composer_cloud.jobs.local import LocalProcessExecutor, _supervisor_pgid
from composer_cloud.spec import RunSpec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork path is Linux-only")


def _wait(proc: local_fork.ForkedProcess, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while (code := proc.poll()) is None:
        assert time.monotonic() < deadline, "the forked child did not end"
        time.sleep(0.02)
    return code


def _fork(tmp_path: Path, main) -> tuple[local_fork.ForkedProcess, Path]:
    log = tmp_path / "child.log"
    with open(log, "ab") as f:
        return local_fork.fork_call(main, stdout=f.fileno()), log


def test_exit_codes_and_output_are_an_interpreters(tmp_path):
    def prints_and_returns() -> int:
        print("to stdout")
        print("to stderr", file=sys.stderr)
        return 3

    proc, log = _fork(tmp_path, prints_and_returns)
    assert _wait(proc) == 3
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]

    proc, _ = _fork(tmp_path, lambda: sys.exit(5))
    assert _wait(proc) == 5

    def raises() -> int:
        raise RuntimeError("boom in the child")

    proc, log = _fork(tmp_path, raises)
    assert _wait(proc) == 1
    assert "RuntimeError: boom in the child" in log.read_text()


def test_a_new_session_child_leads_its_group_when_fork_call_returns(tmp_path, monkeypatch):
    """A handed-out pid is checked at once (``getpgid(pid) == pid``): a child that has not yet run ``setsid``
    (a loaded machine) read as a vanished supervisor, so `resume` reported a fresh run failed."""
    real_setsid = os.setsid

    def slow_setsid() -> None:  # the child is scheduled late
        time.sleep(0.5)
        real_setsid()

    monkeypatch.setattr(local_fork.os, "setsid", slow_setsid)
    log = tmp_path / "child.log"
    with open(log, "ab") as f:
        proc = local_fork.fork_call(lambda: time.sleep(1), stdout=f.fileno(), new_session=True)
    try:
        assert os.getpgid(proc.pid) == proc.pid and os.getsid(proc.pid) == proc.pid
    finally:
        assert _wait(proc) == 0


def test_the_child_runs_atexit_and_joins_its_threads_before_it_ends(tmp_path):
    marker = tmp_path / "atexit"
    joined = tmp_path / "thread"

    def main() -> int:
        import atexit
        import threading

        atexit.register(marker.write_text, "ran")
        threading.Thread(target=lambda: (time.sleep(0.3), joined.write_text("done"))).start()
        return 0

    proc, _ = _fork(tmp_path, main)
    assert _wait(proc) == 0
    assert marker.read_text() == "ran" and joined.read_text() == "done"


def test_the_child_never_cleans_up_its_parents_temporary_directories(tmp_path):
    """A parent's ``TemporaryDirectory`` (a ``weakref.finalize`` run at exit) is the parent's: a forked child that
    ran it at its end deleted the data folder of a test's S3 server under it. The child's own still go."""
    import tempfile

    held = tempfile.TemporaryDirectory(dir=tmp_path)
    try:
        childs = tmp_path / "childs-finalizer"

        def main() -> int:
            own = tempfile.TemporaryDirectory(dir=tmp_path)  # the child's own: cleaned at its end
            childs.write_text(own.name)
            return 0

        proc, _ = _fork(tmp_path, main)
        assert _wait(proc) == 0
        assert Path(held.name).is_dir()
        assert not Path(childs.read_text()).exists()
    finally:
        held.cleanup()


def test_a_parents_sigterm_handler_is_not_inherited_and_a_kill_reads_as_the_signal(tmp_path):
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # the supervisor's handler
    try:
        proc, _ = _fork(tmp_path, lambda: time.sleep(60))
        time.sleep(0.2)
        proc.terminate()
        assert _wait(proc) == -signal.SIGTERM
        proc, _ = _fork(tmp_path, lambda: time.sleep(60))
        os.kill(proc.pid, signal.SIGKILL)
        assert _wait(proc) == -signal.SIGKILL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_fork_is_used_only_where_no_gpu_can_be_in_use():
    def fork_enabled(device: str, environ: dict[str, str]) -> bool:  # the local executor's decision
        return forking.fork_safe(device, allowed=env.fork_allowed(environ))

    assert fork_enabled("cpu", {})
    assert not fork_enabled("cuda", {})
    assert not fork_enabled("cpu", {env.LOCAL_FORK: "0"})
    assert fork_enabled("auto", {}) is not bool(forking.gpu_device_nodes())


def test_no_gpu_device_file_means_torch_finds_no_gpu():
    import torch

    if not forking.gpu_device_nodes():
        assert not torch.cuda.is_available()


def test_fork_replica_runs_only_the_replica_module(tmp_path):
    with open(tmp_path / "log", "ab") as log, pytest.raises(ValueError, match="composer_cloud.replica"):
        local_fork.fork_replica([sys.executable, "-c", "print(1)"], log)


def _failing_run_executor(tmp_path: Path, *, restarts: int) -> tuple[LocalProcessExecutor, str]:
    """An executor for a run whose spec was never written: every replica start fails at once (exit 1)."""
    spec = RunSpec.model_validate({"run_id": "nospec", "store": f"file://{tmp_path}/store", "replicas": 2,
                                   "device": "cpu", "max_restarts": restarts})
    (tmp_path / "store").mkdir()
    return LocalProcessExecutor(spec), f"file://{tmp_path}/store/nospec"


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_launch_reports_its_replicas_exit_and_log_forked_or_not(tmp_path, monkeypatch, fork):
    monkeypatch.setenv(env.LOCAL_FORK, fork)
    ex, run_uri = _failing_run_executor(tmp_path, restarts=1)
    handles = ex.launch(run_uri, [0, 1])
    deadline = time.monotonic() + 120
    while not all((st := ex.poll(h)).state.finished for h in handles):
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    for handle in handles:
        status = ex.poll(handle)
        assert status.state == ReplicaState.FAILED and status.exit_code == 1 and status.restarts == 1
        assert "is not a composer-cloud run" in status.message
        log = "\n".join(ex.logs(handle))
        assert log.count(f"replica {handle.rank} failed: ") == 2  # the first start and the restart
        assert "[supervisor] replica exited with code 1; restart 1/1" in log


@pytest.mark.parametrize("fork", ["server", "1", "0"])
def test_a_supervisor_answers_only_to_its_own_ranks_handle(tmp_path, monkeypatch, fork):
    monkeypatch.setenv(env.LOCAL_FORK, "0" if fork == "0" else "1")
    monkeypatch.setenv(env.LOCAL_FORK_SERVER_IDLE_S, "60" if fork == "server" else "0")
    ex, run_uri = _failing_run_executor(tmp_path, restarts=1000)  # keeps the supervisors alive, restarting
    h0, h1 = ex.launch(run_uri, [0, 1])
    try:
        cmdline = Path(f"/proc/{h0.job_id}/cmdline").read_bytes().split(b"\0")
        assert b"composer_cloud.jobs.local" in cmdline
        assert {"server": b"fork-server", "1": b"fork-supervise", "0": b"supervise"}[fork] in cmdline
        if fork != "0":
            assert local_fork.process_name(int(h0.job_id)) == local_fork.supervisor_name(0)
        assert _supervisor_pgid(h0, Path(h0.data["dir"])) == int(h0.job_id)
        # Rank 1's genuine folder and token, rank 0's process. A forked supervisor's command line names both
        # folders, or none (the fork server's): its process name and the folder it holds open bind it to rank 0.
        swapped = JobHandle("local", 1, h0.job_id, {**h1.data, "pgid": int(h0.job_id)})
        assert _supervisor_pgid(swapped, Path(h1.data["dir"])) is None
        ex.cancel(swapped)
        assert ex.poll(h0).state in (ReplicaState.RUNNING, ReplicaState.PENDING)
        ex.cancel(h0)
        assert ex.poll(h0).state == ReplicaState.CANCELLED
    finally:
        for handle in (h0, h1):
            try:
                os.killpg(int(handle.job_id), signal.SIGKILL)
            except ProcessLookupError:
                pass
