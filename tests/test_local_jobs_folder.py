"""The local executor's job folder inside a file:// store cannot be steered (issue 37, item 4).

Whoever can write the store folder can write ``<run>/jobs/<rank>/``. Planted there: links at the paths the
supervisor writes, a linked folder, a forged exit record, a cancel file written without the key, and terminal
escape sequences in a replica log. None of them makes anything outside the store change, a live run read as
ended, a run stop, or the terminal obey a log line.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_cloud import env
from composer_cloud.errors import LinkOutsideStore
from composer_cloud.jobs.base import JobHandle, ReplicaState
from composer_cloud.jobs.jobfiles import UnsafeJobFolder, records_key
from composer_cloud.jobs.local import LocalProcessExecutor, job_folder
from composer_cloud.spec import RunSpec
from composer_cloud.storage.framing import frame, new_run_salt
from composer_cloud.storage.run import run_signing_key
from composer_cloud.storage.store import Store

RUN_KEY = "a-run-key-for-the-local-jobs-folder-0123"
OUTSIDE = "the operator's file, untouched\n"


def _spec(tmp_path: Path) -> RunSpec:
    return RunSpec(run_id="run", store=f"file://{tmp_path}/store", signed=True, run_salt=new_run_salt())


def _supervise(spec: RunSpec, command: str, *, prepare=None) -> tuple[subprocess.Popen, JobHandle, Path]:
    """A real supervisor of replica 0 of ``spec``'s run, in its job folder (created as launch creates it),
    keyed as launch keys it; ``prepare(folder_path)`` plants things before it starts."""
    key = records_key(run_signing_key(spec.run_id, RUN_KEY, spec.run_salt))
    with job_folder(f"{spec.store}/{spec.run_id}", 0, key=key, create=True) as folder:
        d = folder.path
        token = secrets.token_hex(16)
        folder.create_exclusive("token", token.encode())
    if prepare is not None:
        prepare(d)
    environ = {**os.environ, env.JOB_RECORDS_KEY: key.hex()}
    proc = subprocess.Popen([sys.executable, "-m", "composer_cloud.jobs.local", "supervise", "--dir", str(d),
                             "--rank", "0", "--", sys.executable, "-c", command], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environ)
    return proc, JobHandle("local", 0, str(proc.pid), {"dir": str(d), "pgid": proc.pid, "token": token}), d


def _wait_for(d: Path, name: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
    while not (d / name).exists():
        assert time.monotonic() < deadline, f"{name} never appeared"
        time.sleep(0.05)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    d.mkdir()
    for name in ("supervisor.json", "exit.json", "supervisor.tmp", "exit.tmp", "replica.log", "cancel"):
        (d / name).write_text(OUTSIDE)
    return d


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == sorted(
        ("supervisor.json", "exit.json", "supervisor.tmp", "exit.tmp", "replica.log", "cancel"))
    assert all(p.read_text() == OUTSIDE for p in outside.iterdir())


def test_links_planted_at_the_supervisors_record_paths_write_nothing_outside(tmp_path, outside):
    """Links at every record path (and the temporary names a669e7c wrote through): the supervisor replaces the
    links, never writes through them, and the run's own records are written and verify."""
    def plant(d: Path) -> None:
        for name in ("supervisor.json", "exit.json", "supervisor.tmp", "exit.tmp", "cancel"):
            os.symlink(outside / name, d / name)

    spec = _spec(tmp_path)
    proc, handle, d = _supervise(spec, "pass", prepare=plant)
    assert proc.wait(timeout=60) == 0
    _untouched(outside)
    ex = LocalProcessExecutor(spec, run_key=RUN_KEY)
    assert ex.poll(handle).state == ReplicaState.SUCCEEDED  # its own exit record, signed, replaced the link
    assert not (d / "exit.json").is_symlink()


def test_a_link_planted_at_the_replica_log_stops_the_supervisor_before_it_writes(tmp_path, outside):
    spec = _spec(tmp_path)
    proc, handle, d = _supervise(spec, "print('x' * 100)",
                                 prepare=lambda d: os.symlink(outside / "replica.log", d / "replica.log"))
    assert proc.wait(timeout=60) != 0
    _untouched(outside)
    status = LocalProcessExecutor(spec, run_key=RUN_KEY).poll(handle)
    assert status.state == ReplicaState.FAILED and "symbolic link" in status.message


def test_a_linked_folder_in_the_store_is_refused_by_the_store_and_the_executor(tmp_path, outside):
    spec = _spec(tmp_path)
    run_dir = tmp_path / "store" / "run"
    run_dir.mkdir(parents=True)
    os.symlink(outside, run_dir / "rounds")
    os.symlink(outside, run_dir / "jobs")
    store = Store(f"file://{run_dir}")
    for act in (lambda: store.put("rounds/00000000/0/quorum.json", b"{}"), lambda: store.get("rounds/exit.json"),
                lambda: store.create("rounds/x", b"1"), lambda: store.delete("rounds", recursive=True)):
        with pytest.raises(LinkOutsideStore):
            act()
    with pytest.raises(UnsafeJobFolder, match="symbolic link"):
        job_folder(f"{spec.store}/{spec.run_id}", 0, key=None, create=True)
    ex = LocalProcessExecutor(spec, run_key=RUN_KEY)
    with pytest.raises(Exception, match="symbolic link"):
        ex.launch(f"{spec.store}/{spec.run_id}", [0])
    _untouched(outside)
    # A link that stays inside the store is the user's business: it still works.
    (run_dir / "real").mkdir()
    os.symlink(run_dir / "real", run_dir / "alias")
    store.put("alias/x", b"ok")
    assert bytes(store.get("real/x")) == b"ok"


@pytest.mark.parametrize("forgery", ["plain-json", "unsigned-frame", "other-key"])
def test_a_forged_exit_record_does_not_end_a_live_run(tmp_path, forgery):
    spec = _spec(tmp_path)
    proc, handle, d = _supervise(spec, "import time; time.sleep(60)")
    try:
        _wait_for(d, "supervisor.json")
        ex = LocalProcessExecutor(spec, run_key=RUN_KEY)
        assert ex.poll(handle).state == ReplicaState.RUNNING
        record = json.dumps({"exit_code": 0, "restarts": 0, "message": ""}).encode()
        forged = {"plain-json": record, "unsigned-frame": frame(record),
                  "other-key": frame(record, key="jobs/0/exit.json", signing_key=b"k" * 32)}[forgery]
        (d / "exit.json").write_bytes(forged)
        assert ex.poll(handle).state == ReplicaState.RUNNING
        proc.kill()  # the supervisor dies without a record: the forged one still decides nothing
        proc.wait(timeout=30)
        status = ex.poll(handle)
        assert status.state == ReplicaState.FAILED and "vanished" in status.message
    finally:
        proc.kill()


def test_a_cancel_file_without_the_key_stops_nothing_and_a_real_cancel_does(tmp_path):
    spec = _spec(tmp_path)
    proc, handle, d = _supervise(spec, "import time; time.sleep(60)")
    try:
        _wait_for(d, "supervisor.json")
        (d / "cancel").touch()  # a669e7c's cancel: a file's existence
        time.sleep(1.5)  # several of the supervisor's cancel probes (every <= 0.5 s)
        (d / "cancel").write_bytes(frame(b'{"cancel": true}'))  # framed, unsigned
        time.sleep(1.5)
        assert proc.poll() is None
        ex = LocalProcessExecutor(spec, run_key=RUN_KEY)
        assert ex.poll(handle).state == ReplicaState.RUNNING
        ex.cancel(handle)
        proc.wait(timeout=30)
        assert ex.poll(handle).state == ReplicaState.CANCELLED
    finally:
        proc.kill()


def test_escape_sequences_in_a_replica_log_are_not_printed(tmp_path, monkeypatch):
    """A log written by anyone who can write the store folder: ``logs`` shows its text, never its controls."""
    from typer.testing import CliRunner

    from composer_cloud.cli import app
    from composer_cloud.storage.run import save_handles

    monkeypatch.setenv(env.KEYS, str(tmp_path / "keys"))
    monkeypatch.delenv(env.RUN_KEY, raising=False)
    spec = RunSpec(run_id="run", store=f"file://{tmp_path}/store", signed=False)
    store = Store(f"{spec.store}/run")
    store.create_json("spec.json", spec.to_json_dict())
    with job_folder(store.uri, 0, key=None, create=True) as folder:
        token = secrets.token_hex(16)
        folder.create_exclusive("token", token.encode())
        folder.write_record("exit.json", {"exit_code": 0, "restarts": 0, "message": ""})
        evil = ("2026-01-02T03:04:05.000Z r0 INFO x: step 1 \x1b[2J\x1b]0;pwned\x07\x1b]52;c;Y3VybA==\x1b\\"
                "\x9b31m\rforged line\x1bc done\n")
        folder.write_atomic("replica.log", evil.encode())
        save_handles(store, [JobHandle("local", 0, "12345", {"dir": str(folder.path), "pgid": 12345,
                                                              "token": token})])
    res = CliRunner().invoke(app, ["logs", store.uri, "--verbose"])
    assert res.exit_code == 0, res.output
    assert "step 1" in res.output and "forged line" in res.output and "done" in res.output, res.output
    assert not any(c in res.output for c in "\x1b\x07\x9b\r"), repr(res.output)
