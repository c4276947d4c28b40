"""Bucket attacks: someone who can write the run's bucket but holds no run key (docs/security.md).

Each test plays one attack of the matrix in ``docs/security.md`` against a signed run (the default) and,
where the outcome differs, against an unsigned one (the explicit opt-out), and asserts what users care
about: no token leaves for an address the user did not configure, no code from the store runs, no forged
object decides anything in a signed run, and a signed run damaged by forged objects ends (or resumes to)
the model of the uninterrupted run, bitwise.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from composer_cloud import env
from composer_cloud.env import JobEnv
from composer_cloud.errors import RunKeyError, SpecError, StoreConfigError
from composer_cloud.jobs.environment import job_env
from composer_cloud.jobs.hf_jobs import HFJobsExecutor
from composer_cloud.jobs.local import LocalProcessExecutor
from composer_cloud.jobs.modal_jobs import FunctionOptions, ModalExecutor, ModalSDKSeam, SpawnResult
from composer_cloud.runs import lifecycle, signing
from composer_cloud.runs.logs import replica_logs
from composer_cloud.spec import spec_from_dict
from composer_cloud.storage import layout
from composer_cloud.storage.records import CodeRef, JobHandle, Outcome, Quorum, Void
from composer_cloud.storage.run import cancel_requested, open_run, request_cancel
from composer_cloud.storage.runkeys import load_record
from composer_cloud.storage.store import Store
from composer_cloud.sync.decoupled import outer
from composer_cloud.sync.decoupled import protocol as dc
from composer_cloud.sync.decoupled.versions import VERSION_ATTEMPT, GlobalVersions
from composer_cloud.sync.lockstep import rounds
from support.cli import cli, status_here
from support.local_jobs import kill_run, launch_stalled
from support.resume import export_weights, same_weights
from support.specs import RESUME_SPEC

HF_TOKEN = "hf_canary_" + "x" * 24


# ------------------------------------------------------------------ helpers
class Recorder:
    """A loopback HTTP server that answers 404 to everything and records every request (method, path, headers)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                recorder.requests.append({"method": self.command, "path": self.path,
                                          "authorization": self.headers.get("Authorization") or ""})
                body = b'{"error": "not found"}'
                self.send_response(404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _answer  # noqa: N815 - http.server API

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def attacker() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.close()


@pytest.fixture(autouse=True)
def launcher_env(tmp_path, monkeypatch):
    """This machine's launcher: its own record folder, an HF token it must not leak, no run key set."""
    monkeypatch.setenv(env.KEYS, str(tmp_path / "run-keys"))
    monkeypatch.delenv(env.RUN_KEY, raising=False)
    monkeypatch.delenv(env.UNSIGNED, raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)


def _run(tmp_path: Path, *, signed: bool, executor: str = "local", **spec: object):
    """A run as ``launch`` leaves it before its jobs start: the spec written (signed with a key only this
    machine's launcher record holds, or unsigned), the record kept. Returns (store, spec, run key)."""
    s = spec_from_dict({"run_id": f"run-{executor}-{'s' if signed else 'u'}", "store": f"file://{tmp_path}/store",
                        "executor": executor, "replicas": 2, "signed": signed, **spec})
    s, run_key = signing.launch_key(s)
    store = Store(f"{s.store}/{s.run_id}", signing_key=signing.signing_key(s, run_key))
    assert store.create_json(layout.SPEC, s.to_json_dict())
    signing.remember(store.uri, s, run_key)
    return store, s, run_key


def _forge_handle(store: Store, rank: int, executor: str, data: dict) -> None:
    """The attacker (no key) writes ``executor/<rank>.json``."""
    forged = JobHandle(executor=executor, rank=rank, job_id="job-of-attacker", data=data)
    Store(store.uri).put_json(layout.handle_key(rank), forged.to_json())


def _no_jobs(monkeypatch) -> list:
    """Record the jobs resume would start instead of starting them (the attack acts before that point)."""
    started: list = []
    monkeypatch.setattr(lifecycle, "_start_jobs", lambda store, spec, run_key: started.append(spec) or [])
    return started


# ------------------------------------------------------------------ 1. token exfiltration
@pytest.mark.parametrize("signed", [True, False])
def test_a_forged_hf_handle_in_a_local_run_sends_no_request_anywhere(tmp_path, attacker, monkeypatch, signed):
    """status, logs, cancel and resume of a local run whose store holds an hf-jobs handle naming the
    attacker's server: the handle's executor is not the one the spec assigns, so nobody talks to it."""
    store, spec, _ = _run(tmp_path, signed=signed)
    _forge_handle(store, 0, "hf-jobs", {"endpoint": attacker.url, "namespace": "victim"})
    started = _no_jobs(monkeypatch)
    uri = store.uri
    assert lifecycle.get_status(uri).state != "completed"
    errors: list[str] = []
    assert list(replica_logs(open_run(uri), errors=errors)) == []
    lifecycle.cancel(uri)
    lifecycle.resume(uri)
    assert started, "resume went on to start the run's own jobs"
    assert attacker.requests == []


@pytest.mark.jobs_hub
@pytest.mark.parametrize("signed", [True, False])
def test_an_hf_handle_naming_another_endpoint_talks_only_to_the_configured_one(tmp_path, attacker, monkeypatch,
                                                                                 signed):
    """An hf-jobs run: forged handles are refused (signed), or their endpoint is ignored (unsigned):
    status/logs/cancel/resume reach HF_ENDPOINT only."""
    configured = Recorder()
    try:
        monkeypatch.setenv("HF_ENDPOINT", configured.url)
        store, spec, _ = _run(tmp_path, signed=signed, executor="hf-jobs", hf_jobs={"namespace": "me"})
        for rank in (0, 1):
            _forge_handle(store, rank, "hf-jobs", {"endpoint": attacker.url, "namespace": "victim"})
        started = _no_jobs(monkeypatch)
        assert lifecycle.get_status(store.uri).state != "completed"
        errors: list[str] = []
        list(replica_logs(open_run(store.uri), errors=errors))
        lifecycle.cancel(store.uri)
        lifecycle.resume(store.uri)
        assert started
        assert attacker.requests == []
        if signed:  # the forged handles are not authentic: nobody is asked anything
            assert configured.requests == []
        else:  # read as handles, but the job ids go to the configured endpoint and namespace only
            jobs = [r for r in configured.requests if r["authorization"] or r["path"].startswith("/api/jobs")]
            assert jobs and all(r["path"].startswith("/api/jobs/me/job-of-attacker") for r in jobs), jobs
    finally:
        configured.close()


def test_hf_executor_refuses_a_job_of_another_run():
    """A handle copied from another run (same namespace, real job): the job's run label must be this run's."""
    spec = spec_from_dict({"run_id": "mine", "executor": "hf-jobs", "hf_jobs": {"namespace": "me"}})
    ex = HFJobsExecutor(spec, endpoint="http://127.0.0.1:9")

    class Info:
        labels = {"composer-cloud-run": "theirs"}

    with pytest.raises(Exception, match="not a job of run mine"):
        ex._check_run_label(JobHandle("hf-jobs", 0, "j1"), Info())


def test_a_local_handle_copied_from_another_run_cannot_touch_that_run(tmp_path):
    """Run B's real handle (token and all) copied into run A: cancel/poll of A refuse it (its directory is not
    A's job directory for that rank), so B's replica is never signalled."""
    a = spec_from_dict({"run_id": "a", "store": f"file://{tmp_path}/store", "replicas": 1})
    b_dir = tmp_path / "store" / "b" / "jobs" / "0"
    b_dir.mkdir(parents=True)
    (b_dir / "token").write_text("t" * 32)
    stolen = JobHandle("local", 0, str(os.getpid()), {"dir": str(b_dir), "token": "t" * 32, "pgid": os.getpid()})
    ex = LocalProcessExecutor(a)
    for act in (ex.cancel, ex.poll):
        with pytest.raises(Exception, match="not this run's job directory"):
            act(stolen)
    assert not (b_dir / "cancel").exists() and not (b_dir / "exit.json").exists()


def test_local_job_dirs_are_keyed_by_store_and_run():
    from composer_cloud.jobs.local import job_dir

    assert job_dir("s3://one/runs/r1", 0) != job_dir("s3://two/runs/r1", 0)
    assert job_dir("s3://one/runs/r1", 0).parent.name.startswith("r1-")


# ------------------------------------------------------------------ 2. code execution on resume
def _plant_code(store: Store, marker: Path) -> dict:
    """The attacker uploads a bundle whose import creates ``marker``; returns the code reference to it."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("evilmod.py", f"open({str(marker)!r}, 'w').write('pwned')\ndef make_task(**kw):\n    return None\n")
    blob = buf.getvalue()
    sha = hashlib.sha256(blob).hexdigest()
    Store(store.uri).put(layout.code_key(sha), blob)
    return CodeRef(key=layout.code_key(sha), sha256=sha, bytes=len(blob), modules=("evilmod",)).to_json()


@pytest.mark.parametrize("case", ["signed", "unsigned-recorded", "unsigned-unknown"])
def test_a_replaced_spec_with_planted_code_runs_nothing_on_resume(tmp_path, monkeypatch, case):
    store, spec, _ = _run(tmp_path, signed=case == "signed")
    marker = tmp_path / "pwned"
    planted = _plant_code(store, marker)
    evil = {**spec.to_json_dict(), "signed": False, "code": {**spec.code.model_dump(), "ref": planted},
            "trainer": {**spec.trainer.model_dump(), "task": "evilmod:make_task"}}
    Store(store.uri).put_json(layout.SPEC, evil)  # the attacker has no key: an unsigned spec
    if case == "unsigned-unknown":  # another machine, which never launched the run
        monkeypatch.setenv(env.KEYS, str(tmp_path / "elsewhere"))
    started = _no_jobs(monkeypatch)
    with pytest.raises(RunKeyError, match="spec.json"):
        lifecycle.resume(store.uri)
    assert started == [] and not marker.exists()


def test_a_replica_refuses_a_spec_replaced_after_its_launch(tmp_path):
    """A replica (re)started by its supervisor reads the spec again: it must be the one its launcher wrote."""
    store, spec, _ = _run(tmp_path, signed=False)
    marker = tmp_path / "pwned"
    planted = _plant_code(store, marker)
    Store(store.uri).put_json(layout.SPEC, {**spec.to_json_dict(), "code": {**spec.code.model_dump(),
                                                                           "ref": planted}})
    environ = {**os.environ, **job_env(spec)}
    environ.pop(env.CODE_REF, None)  # the launch had no code bundle
    res = subprocess.run([sys.executable, "-m", "composer_cloud.replica", "--run", store.uri, "--rank", "0"],
                         env=environ, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "not the spec this job was launched with" in res.stdout + res.stderr
    assert not marker.exists()


# ------------------------------------------------------------------ 3. deciding objects: read and verified
def _committed_round(store: Store, round: int = 0) -> None:
    assert store.create_json(layout.quorum_key(round, 0), Quorum(round, 0, [0, 1]).to_json())
    assert store.create_json(layout.outcome_key(round, 0), Outcome(round, 0, True, participants=[0, 1]).to_json())


@pytest.mark.parametrize("forgery", ["garbage", "unsigned-void"])
def test_a_forged_void_does_not_undo_a_signed_commit(tmp_path, forgery):
    store, _, _ = _run(tmp_path, signed=True)
    _committed_round(store)
    bucket = Store(store.uri)
    if forgery == "garbage":
        bucket.put_plain(layout.void_key(0, 0), b"garbage")
    else:
        bucket.put_json(layout.void_key(0, 0), Void(0, 0, by=0, reason="forged").to_json())
    assert rounds.committed_attempt(store, 0) == 0 and rounds.latest_committed_round(store) == 0
    # The run's own void (a healer that found the state never durable) still works.
    store.delete(layout.void_key(0, 0))
    rounds.declare_void(store, 0, 0, by=1, reason="never durable")
    assert rounds.committed_attempt(store, 0) is None


def test_a_garbage_void_does_not_undo_an_unsigned_commit(tmp_path):
    store, _, _ = _run(tmp_path, signed=False)
    _committed_round(store)
    store.put_plain(layout.void_key(0, 0), b"\x00garbage")
    assert rounds.committed_attempt(store, 0) == 0


@pytest.mark.parametrize("signed", [True, False])
def test_a_garbage_cancel_record_cancels_nothing(tmp_path, signed):
    store, _, _ = _run(tmp_path, signed=signed)
    Store(store.uri).put_plain(layout.CANCEL, b"7 bytes")
    assert not cancel_requested(store)
    request_cancel(store)  # the user's real cancel replaces it
    assert cancel_requested(store)


def test_an_unsigned_cancel_record_in_a_signed_run_cancels_nothing(tmp_path):
    store, _, _ = _run(tmp_path, signed=True)
    Store(store.uri).put_json(layout.CANCEL, {"time": 1.0})
    assert not cancel_requested(store)
    assert lifecycle.get_status(store.uri, poll_executors=False).state != "cancelled"


SHAPES = {"w": (3,)}


def _decoupled(tmp_path: Path, signed: bool):
    store, spec, _ = _run(tmp_path, signed=signed, replicas=2, rounds=3, sync={"mode": "decoupled", "min_quorum": 2})
    cfg = dc.DecoupledConfig.from_spec(spec)
    dc.DecoupledProtocol(store, cfg).ensure_initial({"w": torch.zeros(3)}, rank=0)
    return store, cfg


def _contribute(store: Store, cfg, rank: int, seq: int, scale: float = 1.0) -> None:
    dc.DecoupledProtocol(store, cfg).publish(rank=rank, seq=seq, base_version=0, tokens=10, inner_steps=2,
                                             delta={"w": torch.tensor([0.1, -0.1, 0.2]) * scale})


def test_forged_contribution_names_do_not_count_toward_a_signed_budget(tmp_path):
    store, cfg = _decoupled(tmp_path, signed=True)
    protocol = dc.DecoupledProtocol(store, cfg)
    _contribute(store, cfg, 0, 1)
    bucket = Store(store.uri)
    for seq in (50, 51, 52):  # unsigned metas and blobs: "contributions" named far ahead
        meta = {"rank": 1, "seq": seq, "base_version": 0, "tokens": 10**9, "inner_steps": 2, "sha256": "0" * 64,
                "time": 1.0, "run_id": cfg.run_id}
        bucket.put_json(layout.contribution_key(1, seq, "json"), meta)
    assert protocol.published_total() == 1
    assert protocol.finish(SHAPES, rank=0, rounds=3) is None  # budget 6: far from reached
    _contribute(store, cfg, 1, 1)
    out = protocol.try_merge(SHAPES, rank=0)
    rec = protocol.read_merge(out.merged)
    assert rec.cursor == {0: 1, 1: 1} and rec.merged == {0: 1, 1: 1}
    assert {(r.rank, r.seq) for r in rec.rejected} == {(1, 50), (1, 51), (1, 52)}
    assert protocol.next_seq(1, own=1) == 2  # forged names never push a replica's seqs


@pytest.mark.parametrize("signed", [True, False])
def test_forged_contributions_with_equal_norms_are_refused_by_the_history_guard(tmp_path, signed):
    """Well-formed contributions (the unsigned case: they verify) of huge equal norms and token counts: the
    median rule cannot tell, the guard against each replica's own history refuses them; nothing counts."""
    store, cfg = _decoupled(tmp_path, signed=signed)
    protocol = dc.DecoupledProtocol(store, cfg)
    _contribute(store, cfg, 0, 1)
    _contribute(store, cfg, 1, 1, scale=1.5)
    assert protocol.try_merge(SHAPES, rank=0).merged == 1
    before = protocol.versions.load(1, SHAPES)
    bucket = Store(store.uri)
    for rank in (0, 1):
        dc.DecoupledProtocol(bucket, cfg).publish(rank=rank, seq=2, base_version=1, tokens=10**9, inner_steps=2,
                                                  delta={"w": torch.full((3,), 1e3)})
    out = protocol.try_merge(SHAPES, rank=1)
    if signed:  # not authentic: never pending, dropped, no merge
        assert out.merged is None and not bucket.exists(layout.contribution_key(0, 2, "json"))
    else:  # authentic as far as anyone can tell: refused by the guard
        rec = protocol.newest_merge()
        assert rec.contributions == () and rec.merged == {0: 1, 1: 1}
        assert len(rec.rejected) == 2 and all("history" in r.reason for r in rec.rejected), rec.rejected
    after = protocol.versions.load(protocol.versions.newest(), SHAPES)
    key = outer.FRAGMENT_KEY
    assert torch.equal(after[key]["original_parameters"]["w"], before[key]["original_parameters"]["w"])
    assert protocol.published_total() == 2
    # Genuine contributions of the usual size are still merged, and move the reference only slowly.
    _contribute(store, cfg, 0, 3, scale=1.2)
    _contribute(store, cfg, 1, 3, scale=1.1)
    assert len(protocol.read_merge(protocol.try_merge(SHAPES, rank=0).merged).contributions) == 2


@pytest.mark.parametrize("target", ["final", "merge"])
def test_a_garbage_final_or_merge_record_neither_finishes_nor_bricks_a_signed_run(tmp_path, target):
    store, cfg = _decoupled(tmp_path, signed=True)
    bucket = Store(store.uri)
    key = layout.FINAL if target == "final" else layout.merge_key(1)
    bucket.put_plain(key, b"garbage")
    protocol = dc.DecoupledProtocol(store, cfg)
    assert protocol.versions.final() is None and protocol.newest_merge() is None
    for seq in (1, 2, 3):
        for rank in (0, 1):
            _contribute(store, cfg, rank, seq)
        protocol.try_merge(SHAPES, rank=0)
    v = protocol.finish(SHAPES, rank=1, rounds=3)
    assert v is not None and protocol.versions.final() == v
    assert protocol.newest_merge().final and protocol.newest_merge().merged == {0: 3, 1: 3}


def test_an_unsigned_final_record_naming_no_final_merge_finishes_nothing(tmp_path):
    store, cfg = _decoupled(tmp_path, signed=False)
    store.put_json(layout.FINAL, {"version": 0, "by": 0, "time": 1.0})
    assert GlobalVersions(store).final() is None


# ------------------------------------------------------------------ signed by default, keys and secrets
def test_a_default_launch_is_signed_with_a_key_kept_off_the_store(tmp_path):
    spec = spec_from_dict({"run_id": "dflt", "store": f"file://{tmp_path}/store"})
    signed, key = signing.launch_key(spec)
    assert signed.signed is True and key and len(key) == 64
    signing.remember(f"{spec.store}/dflt", signed, key)
    record_file = next((tmp_path / "run-keys").iterdir())
    assert oct(record_file.stat().st_mode & 0o777) == "0o600"
    assert load_record(f"{spec.store}/dflt").run_key == key
    assert key not in json.dumps(signed.to_json_dict())


def test_opting_out_warns_and_refuses_a_set_key(tmp_path, monkeypatch, caplog):
    spec = spec_from_dict({"run_id": "plain", "signed": False})
    with caplog.at_level("WARNING"):
        out, key = signing.launch_key(spec)
    assert out.signed is False and key is None and "UNSIGNED" in caplog.text
    monkeypatch.setenv(env.RUN_KEY, "k" * 32)
    with pytest.raises(SpecError, match="signed"):
        signing.launch_key(spec)


def test_each_executor_delivers_the_run_key_as_a_secret_never_in_the_environment(tmp_path):
    key = "r" * 64
    spec = spec_from_dict({"run_id": "sec", "store": "s3://bucket/runs", "modal": {"secrets": ["aws"]},
                           "hf_jobs": {"namespace": "me", "secrets": []}})
    local = LocalProcessExecutor(spec, run_key=key)
    assert local._job_env()[env.RUN_KEY] == key
    assert env.RUN_KEY not in job_env(spec)

    class Seam:
        def spawn(self, *, app_name, options, requests):
            self.options, self.requests = options, requests
            return SpawnResult("app", [f"fc-{r.rank}" for r in requests])

    seam = Seam()
    handles = ModalExecutor(spec, seam=seam, run_key=key).launch("s3://bucket/runs/sec", [0, 1])
    assert dict(seam.options.secret_values) == {env.RUN_KEY: key}
    assert all(env.RUN_KEY not in r.env for r in seam.requests) and key not in repr(seam.options)
    assert key not in json.dumps([h.to_json() for h in handles])
    kwargs = ModalSDKSeam.with_options_kwargs(seam.options)
    assert len(kwargs["secrets"]) == 2  # the named one, and the run key's
    assert isinstance(seam.options, FunctionOptions)
    hf = HFJobsExecutor(spec, endpoint="http://127.0.0.1:9", run_key=key)
    assert hf._secret_values() == {env.RUN_KEY: key} and env.RUN_KEY not in hf._job_env(None)


def test_later_commands_find_the_key_of_a_run_this_machine_launched(tmp_path, monkeypatch):
    store, spec, key = _run(tmp_path, signed=True)
    run = open_run(store.uri, job_env=JobEnv())  # no key in the environment: the launcher's record has it
    assert run.store.signed and run.run_key == key
    assert store.get_json(layout.SPEC)["signed"] is True
    assert key not in repr(run) and key not in repr(load_record(store.uri))
    monkeypatch.setenv(env.KEYS, str(tmp_path / "another-machine"))  # no record, no key
    with pytest.raises(RunKeyError, match=env.RUN_KEY):
        open_run(store.uri, job_env=JobEnv())


# ------------------------------------------------------------------ end to end: forged objects, then resume
@pytest.mark.slow
@pytest.mark.parametrize("signed", [True, False])
def test_a_run_damaged_by_forged_objects_resumes_to_the_uninterrupted_model(tmp_path, baselines, signed):
    """A launch (signed: the default; or opted out), stalled in round 2; the attacker writes into every deciding
    key it can name (voids of committed rounds, cancel, quorums and outcomes of the next attempts): garbage and
    unsigned records in the signed run, well-formed ones in the unsigned run. Kill, status, resume: the exported
    model is the uninterrupted run's, bitwise."""
    expected = baselines.get(tmp_path)
    launch_env = {k: v for k, v in os.environ.items() if k not in (env.UNSIGNED, env.RUN_KEY)}
    if not signed:
        launch_env[env.UNSIGNED] = "1"
    store = f"file://{tmp_path}/store"
    (tmp_path / "spec.toml").write_text(RESUME_SPEC)
    launcher = launch_stalled(tmp_path, tmp_path / "spec.toml", store, "attacked", phase="upload", round=2, rank=0,
                              extra_env=launch_env, capture=False)
    run_uri = f"{store}/attacked"
    bucket = Store(run_uri)
    assert bucket.get_json(layout.SPEC)["signed"] is signed
    for r in (0, 1):
        if signed:
            bucket.put_plain(layout.void_key(r, 0), b"garbage")
        else:
            bucket.put_json(layout.void_key(r, 0), Void(r, 0, by=1, reason="forged").to_json())
    bucket.put_json(layout.CANCEL, {"time": 1.0})
    for a in (1, 2):
        bucket.put_json(layout.quorum_key(2, a), Quorum(2, a, [1]).to_json())
        bucket.put_json(layout.outcome_key(2, a), Outcome(2, a, True, participants=[1]).to_json())
    kill_run(run_uri, launcher)
    st = status_here(run_uri, tmp_path)
    assert st["state"] != "completed", st
    if signed:
        assert st["state"] != "cancelled", st
    res = cli("resume", run_uri, cwd=tmp_path, env=launch_env)
    assert res.returncode == 0, res.stdout + res.stderr
    st = status_here(run_uri, tmp_path)
    assert st["state"] == "completed", st
    got = export_weights(tmp_path, run_uri, "resumed")
    assert same_weights(got, expected), "a forged object changed the model"
    record = load_record(bucket.uri)  # the key the launcher created: on this machine, never in the store
    assert record is not None and (record.run_key is not None) is signed
    for key in bucket.list() if signed else ():
        assert record.run_key.encode() not in bucket.get_plain(key), key


# ------------------------------------------------------------------ secrets in URIs and options
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzzCANARY"


@pytest.mark.parametrize("where", ["uri", "endpoint"])
def test_credentials_in_a_store_url_are_refused_by_name_and_never_echoed(tmp_path, where):
    uri, options = f"s3://AKIACANARY:{SECRET}@bucket/runs", {}
    if where == "endpoint":
        uri, options = "s3://bucket/runs", {"endpoint_url": f"http://admin:{SECRET}@127.0.0.1:9"}
    with pytest.raises(StoreConfigError) as err:
        Store(uri, storage_options=options)
    assert SECRET not in str(err.value) and "AWS_SECRET_ACCESS_KEY" in str(err.value)
    assert ("store URI" if where == "uri" else "endpoint_url") in str(err.value)
    with pytest.raises(SpecError) as err:
        spec_from_dict({"store": uri, "store_options": options})
    assert SECRET not in str(err.value) and err.value.field in ("store", "store_options")


def test_the_cli_refuses_a_store_uri_with_credentials_without_echoing_them(tmp_path):
    res = cli("status", f"s3://AKIACANARY:{SECRET}@bucket/runs/r1", cwd=tmp_path)
    assert res.returncode == 2 and "credentials" in res.stderr, res.stderr
    assert SECRET not in res.stdout + res.stderr


@pytest.mark.parametrize("options", [{"aws_access_key_id": "AKIACANARY"},
                                     {"client_kwargs": {"aws_secret_access_key": SECRET}},
                                     {"config_kwargs": {"proxies": {"https": f"http://u:{SECRET}@proxy:3128"}}}])
def test_store_options_never_carry_secrets_into_the_spec(options):
    with pytest.raises(SpecError) as err:
        spec_from_dict({"store": "s3://bucket/runs", "store_options": options})
    assert err.value.field == "store_options" and SECRET not in str(err.value)


def test_write_version_does_not_depend_on_a_listing(tmp_path, monkeypatch):
    """A store whose listing lags (list-after-write) used to end a merge with a bare KeyError."""
    store, cfg = _decoupled(tmp_path, signed=True)
    monkeypatch.setattr(store, "list_dirs", lambda prefix="": [])
    GlobalVersions(store).write(3, outer.initial_state({"w": torch.ones(3)}, cfg.outer), writer=0)
    assert store.exists(layout.manifest_key(3))


@pytest.mark.parametrize("target", ["marker", "manifest"])
def test_a_forged_marker_or_manifest_neither_blocks_nor_fakes_a_signed_checkpoint(tmp_path, target):
    """Garbage at a global version's marker or manifest key, written before the run's writer gets there: the
    version is written anyway (the forged object is replaced), and until then it is neither durable nor
    complete."""
    store, cfg = _decoupled(tmp_path, signed=True)
    versions = GlobalVersions(store)
    key = layout.slice_marker_key(4, VERSION_ATTEMPT, 0, 1) if target == "marker" else layout.manifest_key(4)
    Store(store.uri).put_json(key, {"round": 4, "forged": True})
    assert not versions.durable(4) and not versions.complete(4)
    tree = outer.initial_state({"w": torch.full((3,), 2.0)}, cfg.outer)
    versions.write(4, tree, writer=1)
    assert versions.complete(4)
    assert torch.equal(versions.load(4, SHAPES)[outer.FRAGMENT_KEY]["original_parameters"]["w"],
                       torch.full((3,), 2.0))


def test_forged_manifests_do_not_make_prune_drop_real_checkpoints(tmp_path):
    from composer_cloud.sync.checkpoint import manifests

    store, cfg = _decoupled(tmp_path, signed=True)
    versions = GlobalVersions(store)
    for v in (1, 2):
        versions.write(v, outer.initial_state({"w": torch.full((3,), float(v))}, cfg.outer), writer=0)
    bucket = Store(store.uri)
    bucket.put_json(layout.slice_marker_key(3, VERSION_ATTEMPT, 0, 1), {"forged": True})
    bucket.put_json(layout.manifest_key(3), {"round": 3, "forged": True})
    manifests.prune(versions.states, keep=1, newest=3)
    assert versions.complete(2)  # the newest real checkpoint survives
    assert versions.load(2, SHAPES)[outer.FRAGMENT_KEY]["original_parameters"]["w"][0] == 2.0

