"""The CLI end to end with local replica processes, and its input validation."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import composer_cloud as cc
import composer_cloud.cli as cli_module
from composer_cloud import env
from composer_cloud.cli import app
from composer_cloud.cli_watch import ctrl_c_between_polls
from composer_cloud.storage.store import Store
from composer_cloud.runs.metrics import read_metrics
from support.cli import cli, cli_here
from support.local_jobs import kill_replica
from support.specs import CAUSAL_LM, SMALL_RUN_TOML as SMALL_MODEL


def small_config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(extra + "\n" + SMALL_MODEL)
    return path


def status_json(run_uri: str, cwd: Path) -> dict:
    res = cli("status", run_uri, "--json", cwd=cwd)
    assert res.returncode in (0, 1), res.stderr  # 1: the run failed or was cancelled
    return json.loads(res.stdout)


@pytest.mark.slow
def test_three_replicas_three_rounds_end_to_end(tmp_path):
    cfg = small_config(tmp_path)
    res = cli("launch", "--config", str(cfg), "--replicas", "3", "--rounds", "3", "--inner-steps", "4",
              "--run-id", "e2e", "--store", f"file://{tmp_path}/store", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run_uri = f"file://{tmp_path}/store/e2e"
    assert run_uri in res.stdout
    st = status_json(run_uri, tmp_path)
    assert st["run_id"] == "e2e" and st["state"] == "completed" and st["rounds_committed"] == 3
    assert [r["state"] for r in st["replicas"]] == ["succeeded"] * 3
    assert [r["round"] for r in st["replicas"]] == [3, 3, 3]  # 1-based: the last of 3 rounds
    digests = {json.loads((tmp_path / f"store/e2e/replicas/{r}.json").read_bytes()[16:])["params_sha256"]
               for r in range(3)}
    assert len(digests) == 1  # bitwise-identical global parameters on every replica
    spec = json.loads((tmp_path / "store/e2e/spec.json").read_bytes()[16:])
    assert spec["replicas"] == 3 and spec["rounds"] == 3


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.parametrize("max_restarts", [0, 1])
def test_killed_replica_run_survives(tmp_path, max_restarts):
    cfg = small_config(tmp_path, "[sync]\nquorum_timeout_s = 4\nround_timeout_s = 60\nheal_timeout_s = 60\n")
    store = tmp_path / "store"
    res = cli("launch", "--config", str(cfg), "--replicas", "3", "--min-replicas", "2", "--rounds", "6",
              "--inner-steps", "30", "--run-id", "kill", "--store", f"file://{store}", "--max-restarts",
              str(max_restarts), "--detach", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    run_uri = f"file://{store}/kill"
    _wait(lambda: (store / "kill/rounds/00000000/0/outcome.json").exists(), 120, "round 0 to commit")
    kill_replica(run_uri, 2)
    # Followed in this process (a `status` process per poll costs its imports); the end read through the CLI.
    cc.wait(run_uri, timeout_s=240, interval_s=0.5)
    st = status_json(run_uri, tmp_path)
    assert st["state"] == "completed" and st["rounds_committed"] == 6, st
    lost = st["replicas"][2]
    if max_restarts == 0:
        assert lost["state"] == "failed" and lost["exit_code"] == -9, lost
        out = cli("status", run_uri, cwd=tmp_path).stdout
        # died while training: "lost" (not "failed at start"), and why, whole, under the table
        assert "r2 lost: replica exited with code -9" in " ".join(out.split()), out
    else:
        assert lost["state"] == "succeeded" and lost["restarts"] == 1, lost
        # It rejoined: a round after the kill committed with rank 2 among the participants.
        rounds = read_metrics(Store(f"file://{store}/kill"), rank=2)
        assert any(r.get("kind") == "round" and r["committed"] and 2 in r["participants"] and r["round"] >= 2
                   for r in rounds), rounds


runner = CliRunner()


@pytest.mark.parametrize("args,needle", [
    (["--config", "{cfg_unknown}"], "bogus"),
    (["--inner-steps", "0"], "inner_steps"),
    (["--rounds", "-1"], "rounds"),
    (["--replicas", "2", "--min-replicas", "3"], "min_replicas"),
    (["--executor", "slurm"], "slurm"),
    (["--store", "nope://bucket/x"], "nope"),
    (["--run-id", "../x"], "run_id"),
    (["--run-id", "/abs"], "run_id"),
    (["--codec", "fp8"], "codec"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "unknown.toml").write_text("bogus = 1\n")
    args = [a.replace("{cfg_unknown}", str(tmp_path / "unknown.toml")) for a in args]
    store = tmp_path / "store"
    if "--store" not in args:
        args += ["--store", f"file://{store}"]
    res = runner.invoke(app, ["launch", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert not store.exists() or not any(store.rglob("*.json"))
    assert not (tmp_path / "runs").exists()


def test_launch_onto_existing_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "store" / "taken"
    from composer_cloud.storage.store import Store

    Store(f"file://{run}").put_json("spec.json", {"sentinel": True})
    before = (run / "spec.json").read_bytes()
    res = runner.invoke(app, ["launch", "--run-id", "taken", "--store", f"file://{tmp_path}/store"])
    assert res.exit_code == 2 and "resume" in res.output
    assert (run / "spec.json").read_bytes() == before


def test_status_of_a_missing_run_is_a_clear_error(tmp_path):
    res = runner.invoke(app, ["status", f"file://{tmp_path}/nothing"])
    assert res.exit_code == 2 and "not a composer-cloud run" in res.output


@pytest.mark.slow
def test_two_replicas_with_the_three_channel_trainer(tmp_path):
    cfg = tmp_path / "tc.toml"
    cfg.write_text(SMALL_MODEL.replace(CAUSAL_LM, 'name = "three-channel"'))
    res = cli("launch", "--config", str(cfg), "--replicas", "2", "--rounds", "2", "--inner-steps", "2",
              "--run-id", "tc", "--store", f"file://{tmp_path}/store", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "mean reward" in res.stdout
    st = status_json(f"file://{tmp_path}/store/tc", tmp_path)
    assert st["state"] == "completed" and st["rounds_committed"] == 2
    step_rows = read_metrics(Store(f"file://{tmp_path}/store/tc"), rank=0, kind="step")
    assert step_rows and all({"pg", "sdpo", "dpo", "reward_mean"} <= s.keys() for s in step_rows)


# ---------------------------------------------------------------- conventions: --set, --json, Ctrl-C, progress
def test_set_overrides_nested_keys_with_typed_values(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["launch", "--dry-run", "--json", "--store", f"file://{tmp_path}/store", "--run-id", "s",
                              "--set", "sync.codec=bf16", "--set", "inner_optimizer.betas=[0.8, 0.9]",
                              "--set", "outer_optimizer.nesterov=false", "--set", "inner_optimizer.lr=1e-4",
                              "--set", "model.name=tiny", "--set", "rounds=7", "--rounds", "9"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    spec = plan["spec"]
    assert spec["sync"]["codec"] == "bf16" and spec["inner_optimizer"]["betas"] == [0.8, 0.9]
    assert spec["outer_optimizer"]["nesterov"] is False and spec["inner_optimizer"]["lr"] == 1e-4
    assert spec["rounds"] == 9  # a named flag wins over --set for the same key
    assert plan["run_uri"].endswith("/store/s") and plan["plans"][0]["executor"] == "local"
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("pair,needle", [("sync.bogus=1", "sync.bogus"), ("nope=1", "nope"),
                                         ("sync.codec=fp8", "sync.codec"), ("rounds", "KEY=VALUE")])
def test_set_rejects_unknown_keys_and_bad_values(tmp_path, monkeypatch, pair, needle):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["launch", "--dry-run", "--store", f"file://{tmp_path}/store", "--set", pair])
    assert res.exit_code == 2 and needle in res.output, res.output


def test_doctor_json(tmp_path):
    res = runner.invoke(app, ["doctor", f"file://{tmp_path}/store", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["ok"] is True and report["checks"] and all("name" in c for c in report["checks"])


@pytest.mark.slow
def test_ctrl_c_detaches_and_progress_logs_metrics_report(tmp_path):
    """Attached launch: live progress in heartbeats and status; Ctrl-C detaches; the run completes anyway."""
    store = tmp_path / "store"
    cfg = small_config(tmp_path, "progress_every_s = 0.5\n")
    run_uri = f"file://{store}/cc"
    cli_proc = subprocess.Popen(
        [sys.executable, "-m", "composer_cloud.cli", "launch", "--config", str(cfg), "--replicas", "2", "--rounds", "2",
         "--inner-steps", "50", "--run-id", "cc", "--store", f"file://{store}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # 24x slower steps (~40 s in all): the run must still be going after Ctrl-C while status is read, even on a
        # loaded CI box (100 unslowed steps take ~2 s). Few steps, mostly asleep: this test's CPU is its commands'.
        env={**os.environ, env.SLOW: "0:24,1:24"})
    try:
        run_store = Store(run_uri)

        def progress():
            beat = run_store.try_get_json("replicas/0.json") if (store / "cc/replicas/0.json").exists() else None
            return beat if beat and isinstance(beat.get("loss"), float) and beat.get("step", 0) > 0 else None

        beat = _wait(progress, 90, "a progress heartbeat")
        assert beat["steps_per_s"] > 0 and beat["elapsed_s"] >= 0 and beat["total_steps"] == 100
        # The launcher is watching once it has said "launched" (forked replicas may train before it has).
        out_lines: list[str] = []
        reader = threading.Thread(target=lambda: out_lines.extend(cli_proc.stdout), daemon=True)
        reader.start()
        _wait(lambda: any(line.startswith("launched ") for line in list(out_lines)), 60, "the launched line")
        # Ctrl-C first (the run has ~40 s left), then read status while the detached run goes on.
        os.killpg(cli_proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        cli_proc.wait(timeout=30)
        reader.join(timeout=30)
        out, err = "".join(out_lines), cli_proc.stderr.read()
    finally:
        if cli_proc.poll() is None:
            cli_proc.kill()
    assert cli_proc.returncode == 130, out + err
    assert f"detached: the run continues; cancel with: composer-cloud cancel {run_uri}" in err
    assert not (store / "cc/control/cancel.json").exists()
    st = status_json(run_uri, tmp_path)
    assert st["state"] == "running", st
    assert st["step"] and st["elapsed_s"] is not None and st["eta_s"] is not None
    assert st["replicas"][0]["loss"] is not None and st["replicas"][0]["steps_per_s"] > 0
    table = cli("status", run_uri, cwd=tmp_path).stdout
    assert "ETA" in table and "elapsed" in table and "steps/s" in table, table
    cc.wait(run_uri, timeout_s=240, interval_s=0.5)  # followed in this process; the end read through the CLI
    st = status_json(run_uri, tmp_path)
    assert st["state"] == "completed" and st["rounds_committed"] == 2 and st["step"] == 100, st

    # The finished run read through the CLI in this process (the same commands and output; a subprocess each
    # would import the package, and export and report their libraries, again).
    logs = cli_here("logs", run_uri, "--tail", "3", cwd=tmp_path)
    lines = logs.stdout.splitlines()
    assert logs.exit_code == 0 and len(lines) == 6, logs.stdout + logs.stderr
    assert {ln[:4] for ln in lines} == {"[r0]", "[r1]"}
    steps = cli_here("logs", run_uri, "--replica", "1", "--json", cwd=tmp_path)
    rows = [json.loads(ln) for ln in steps.stdout.splitlines()]
    assert {r["rank"] for r in rows} == {1}
    assert sum("step 100/100 loss" in r["line"] for r in rows) == 1  # one line per inner step
    times = [r["time"] for r in rows if r["time"] is not None]
    assert times == sorted(times)

    m = cli_here("metrics", run_uri, "--json", cwd=tmp_path)
    rows = json.loads(m.stdout)
    assert len([r for r in rows if r["kind"] == "round"]) == 4 and len([r for r in rows if r["kind"] == "step"]) == 200
    csv_out = cli_here("metrics", run_uri, "--csv", "--kind", "round", "--replica", "0",
                       cwd=tmp_path).stdout.splitlines()
    assert csv_out[0].startswith("kind,rank,round") and len(csv_out) == 3
    assert "sync s" in cli_here("metrics", run_uri, cwd=tmp_path).stdout

    rep = cli_here("report", run_uri, "--out", str(tmp_path / "rep"), "--json", cwd=tmp_path)
    assert rep.exit_code == 0, rep.stderr
    paths = json.loads(rep.stdout)
    assert Path(paths["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path(paths["png"]).stat().st_size > 10_000
    assert "data:image/png;base64," in Path(paths["html"]).read_text() and paths["replicas"] == [0, 1]

    ex = cli_here("export", run_uri, "--out", str(tmp_path / "model"), "--json", cwd=tmp_path)
    assert ex.exit_code == 0 and json.loads(ex.stdout)["round"] == 2, ex.stderr  # counted from 1
    c = cli_here("cancel", run_uri, "--json", cwd=tmp_path)
    assert c.exit_code == 0 and "already completed" in json.loads(c.stdout)["noop"], c.stderr
    r = cli_here("resume", run_uri, "--json", cwd=tmp_path)
    assert r.exit_code == 0 and "nothing to resume" in json.loads(r.stdout)["noop"], r.stderr
    assert len(read_metrics(Store(run_uri), kind="round")) == 4  # untouched by resume


def test_ctrl_c_while_the_summary_prints_exits_130_with_one_line(monkeypatch):
    """A SIGINT that landed after the run ended, while its summary printed, ended the launcher with a traceback."""
    from types import SimpleNamespace

    from composer_cloud.runs import RunState

    buf = io.StringIO()
    monkeypatch.setattr(cli_module, "err_console", Console(file=buf, soft_wrap=True))
    monkeypatch.setattr(cli_module, "follow", lambda run, console: SimpleNamespace(state=RunState.COMPLETED))

    def pressed(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module.cli_views, "print_summary", pressed)
    run = SimpleNamespace(uri="file:///runs/done", spec=SimpleNamespace(report_to=[]))
    assert cli_module._watch(run) == 130
    assert buf.getvalue().strip() == ("interrupted after the run ended (completed); its summary: "
                                      "composer-cloud status file:///runs/done")


def test_error_messages_keep_spec_table_names_in_brackets(tmp_path, monkeypatch):
    """A message naming "[hf_jobs]" must not lose it to rich markup."""
    buf = io.StringIO()
    monkeypatch.setattr(cli_module, "err_console", Console(file=buf, soft_wrap=True))
    cli_module._fail("add AWS keys to [hf_jobs] secrets")
    assert "add AWS keys to [hf_jobs] secrets" in buf.getvalue()


# ---------------------------------------------------------------- replicas larger than one GPU (issue 24)
def test_gpus_per_replica_and_parallelism_flags_reach_the_spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["launch", "--dry-run", "--json", "--store", f"file://{tmp_path}/store", "--run-id", "g",
                              "--gpus-per-replica", "2", "--parallelism", "fsdp", "--set", "device=cpu",
                              "--set", "trainer.name=causal-lm"])
    assert res.exit_code == 0, res.output
    spec = json.loads(res.stdout)["spec"]
    assert (spec["gpus_per_replica"], spec["parallelism"], spec["device"]) == (2, "fsdp", "cpu")  # gloo on CPU
    for flags, needle in ((["--gpus-per-replica", "9"], "gpus_per_replica"), (["--parallelism", "tp"], "parallelism"),
                          (["--gpus-per-replica", "2", "--set", "modal.gpu_count=4"], "modal.gpu_count")):
        res = runner.invoke(app, ["launch", "--dry-run", "--store", f"file://{tmp_path}/store", *flags])
        assert res.exit_code == 2 and needle in res.output, res.output
    assert not (tmp_path / "store").exists()


def test_local_cuda_replicas_need_as_many_gpus_as_gpus_per_replica(tmp_path, monkeypatch):
    """device = "cuda" with N local ranks on a machine with fewer GPUs is refused at launch, naming both."""
    import torch

    import composer_cloud.jobs.local as local_jobs

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(local_jobs, "cuda_device_count", lambda: 1)
    args = ["launch", "--dry-run", "--store", f"file://{tmp_path}/store", "--set", "device=cuda",
            "--set", "trainer.name=causal-lm"]
    res = runner.invoke(app, [*args, "--gpus-per-replica", "2"])
    assert res.exit_code == 2, res.output
    assert "gpus_per_replica = 2" in res.output and "this machine has 1" in res.output
    monkeypatch.setattr(local_jobs, "cuda_device_count", lambda: 2)
    res = runner.invoke(app, [*args, "--gpus-per-replica", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["plans"][0]["gpus_per_replica"] == 2
    assert not (tmp_path / "store").exists()


def test_ctrl_c_while_watching_is_taken_at_the_next_poll_and_a_second_one_at_once():
    """The first SIGINT only sets a flag (a KeyboardInterrupt inside rich's Live can hang its stop()); the
    watch loop's check raises it between polls. A second SIGINT raises wherever the main thread is."""
    previous = signal.getsignal(signal.SIGINT)
    with ctrl_c_between_polls() as check:
        check()  # nothing pressed: nothing raised
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs here, and must not raise
        with pytest.raises(KeyboardInterrupt):
            check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is previous


# ------------------------------------------- issue 34, finding 2: Ctrl-C between spec.json and the jobs
def _interrupt_before_jobs(monkeypatch) -> None:
    """SIGINT lands after the spec is written and before any job starts (the issue's 1-3 s window)."""
    import composer_cloud.runs.lifecycle as lifecycle

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lifecycle, "_start_jobs", interrupted)


def test_ctrl_c_before_the_jobs_start_leaves_a_not_started_run_that_says_what_to_do(tmp_path, monkeypatch):
    """Finding 2: the launcher printed nothing and left a run that status called "running — round 0/2" with no
    replicas. Now: one line naming resume and cancel, exit 130, and status/ls say "not started"."""
    monkeypatch.chdir(tmp_path)
    cfg = small_config(tmp_path, "replicas = 1\nrounds = 1\ninner_steps = 1")
    _interrupt_before_jobs(monkeypatch)
    res = CliRunner().invoke(app, ["launch", "--config", str(cfg), "--run-id", "cut",
                                   "--store", f"file://{tmp_path}/store"])
    uri = f"file://{tmp_path}/store/cut"
    assert res.exit_code == 130, res.output
    assert f"composer-cloud resume {uri}" in res.output and f"composer-cloud rm {uri}" in res.output
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    st = CliRunner().invoke(app, ["status", uri, "--json"])
    assert json.loads(st.stdout)["state"] == "not started", st.output
    listed = CliRunner().invoke(app, ["ls", f"file://{tmp_path}/store", "--json"])
    assert "not started" in listed.stdout, listed.output
    # cancel marks it cancelled (exit 0, nothing deleted: a store's contents never decide a deletion) ...
    cancelled = CliRunner().invoke(app, ["cancel", uri])
    assert cancelled.exit_code == 0 and "marked cancelled" in cancelled.output, cancelled.output
    assert json.loads(CliRunner().invoke(app, ["status", uri, "--json"]).stdout)["state"] == "cancelled"
    # ... and `rm` deletes it: the id is free again
    removed = CliRunner().invoke(app, ["rm", uri])
    assert removed.exit_code == 0, removed.output
    assert not (tmp_path / "store" / "cut" / "spec.json").exists()
    assert not (tmp_path / "store" / "cut" / "model").exists()


def test_resume_starts_a_run_whose_launch_was_interrupted(tmp_path, monkeypatch):
    """Finding 2: plain `resume` refused it ("still running (replicas starting)"); now it starts its jobs."""
    from composer_cloud import runs

    monkeypatch.chdir(tmp_path)
    cfg = small_config(tmp_path, "replicas = 1\nrounds = 1\ninner_steps = 1")
    _interrupt_before_jobs(monkeypatch)
    with pytest.raises(runs.LaunchInterrupted) as cut:
        runs.launch(config=cfg, overrides={"run_id": "cut", "store": f"file://{tmp_path}/store"})
    assert cut.value.written and not cut.value.started
    monkeypatch.undo()
    assert runs.get_status(cut.value.run_uri).state == "not started"
    resumed = runs.resume(cut.value.run_uri)
    try:
        assert [h.rank for h in resumed.handles] == [0] and resumed.from_round == -1
        assert runs.get_status(cut.value.run_uri).state in ("running", "completed")
    finally:
        runs.cancel(cut.value.run_uri)


def test_ctrl_c_while_uploading_leaves_nothing(tmp_path, monkeypatch):
    """Before the spec is written nothing of the run stays, and the line says so."""
    import composer_cloud.runs.lifecycle as lifecycle

    monkeypatch.chdir(tmp_path)
    cfg = small_config(tmp_path, "replicas = 1\nrounds = 1\ninner_steps = 1")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lifecycle, "_store_model_files", interrupted)
    res = CliRunner().invoke(app, ["launch", "--config", str(cfg), "--run-id", "cut2",
                                   "--store", f"file://{tmp_path}/store"])
    assert res.exit_code == 130 and "nothing was launched" in res.output, res.output
    assert not (tmp_path / "store" / "cut2" / "spec.json").exists()


# ------------------------------------------- issue 34, finding 4 and issue 33 item 4: failures where people look
class _ScriptedJobs:
    """An executor whose jobs go through given states, one per poll (the last one repeats)."""

    def __init__(self, script: dict[int, list]) -> None:
        self.script = script

    def poll(self, handle):
        states = self.script[handle.rank]
        return states.pop(0) if len(states) > 1 else states[0]


def _scripted_run(tmp_path, monkeypatch, script, beats, **spec_fields):
    """A run in a store with handles, the given heartbeats (rank -> (state, error, step)) and scripted jobs."""
    from composer_cloud.jobs import JobHandle
    from composer_cloud.runs import status as status_mod
    from composer_cloud.spec import RunSpec
    from composer_cloud.storage import layout
    from composer_cloud.storage.records import Heartbeat, HeartbeatState
    from composer_cloud.storage.run import Run, save_handles

    store = Store(f"file://{tmp_path}/store/run")
    spec = RunSpec(run_id="run", **spec_fields)
    save_handles(store, [JobHandle("local", r, f"j{r}") for r in range(spec.replicas)])
    for rank, (state, error, step, *rnd) in beats.items():
        store.put_json(layout.heartbeat_key(rank), Heartbeat(rank=rank, state=HeartbeatState(state), time=time.time(),
                                                             error=error, step=step,
                                                             round=rnd[0] if rnd else None).to_json())
    jobs = _ScriptedJobs(script)
    monkeypatch.setattr(status_mod, "get_executor", lambda name, spec, **kw: jobs)
    run = Run(uri=store.uri, store=store, spec=spec)
    monkeypatch.setattr(cli_module, "_open", lambda uri, options: run)
    return run


REFUSED = ("ValueError: model.lora.dropout: the three-channel trainer runs without dropout (GRPO's importance "
           "ratios compare two forwards of the same tokens); set it to 0 (got 0.1)")


def test_a_failed_runs_reason_is_whole_under_an_80_column_table_and_exit_codes_are_real(tmp_path, monkeypatch):
    """Finding 4: the reason was one word per line, cut mid-word; the final table said exit `unknown` for replicas
    that exited 1; the summary called replicas that refused their config "lost"."""
    from composer_cloud import runs
    from composer_cloud.jobs import ReplicaState, ReplicaStatus
    from composer_cloud.runs.summary import summarize

    running, exited = ReplicaStatus(ReplicaState.RUNNING, restarts=0), ReplicaStatus(ReplicaState.FAILED, 1, "", 0)
    # The failed heartbeat is written before the job exits: the first polls see the job still running.
    run = _scripted_run(tmp_path, monkeypatch, {0: [running, running, exited], 1: [running, exited]},
                        {0: ("failed", REFUSED, None), 1: ("failed", REFUSED, None)})
    final = runs.wait(run, interval_s=0.01)
    assert final.state == "failed" and [r.exit_code for r in final.replicas] == [1, 1]
    out = io.StringIO()
    Console(file=out, width=80, soft_wrap=True).print(cli_module.cli_views.status_table(final))
    text = " ".join(out.getvalue().split())
    assert "r0 failed at start (config): " + REFUSED in text, out.getvalue()
    assert "unknown" not in out.getvalue()
    s = summarize(run, final)
    assert s.failed_at_start_config == [0, 1] and s.lost_replicas == [] and s.reasons[1] == REFUSED
    summary = io.StringIO()
    cli_module.cli_views.print_summary(Console(file=summary, width=80), Console(file=io.StringIO()), run, final)
    assert "failed at start (config)" in summary.getvalue() and "lost" not in summary.getvalue()


def test_status_wait_metrics_and_report_of_a_failed_run_say_why_and_exit_1(tmp_path, monkeypatch):
    """Finding 4: `status` exited 0 for a failed run, there was no `wait`, `metrics` printed an empty line with
    exit 0, and the report was four empty panels without the reason."""
    from composer_cloud.jobs import ReplicaState, ReplicaStatus

    exited = ReplicaStatus(ReplicaState.FAILED, 1, "", 0)
    run = _scripted_run(tmp_path, monkeypatch, {0: [exited], 1: [exited]},
                        {0: ("failed", REFUSED, None), 1: ("failed", REFUSED, None)})
    runner = CliRunner()
    st = runner.invoke(app, ["status", run.uri])
    assert st.exit_code == 1 and "failed at start (config)" in st.output, st.output
    for args in (["wait", run.uri], ["status", run.uri, "--wait", "--json"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 1, (args, res.output)
    met = runner.invoke(app, ["metrics", run.uri])
    assert met.exit_code == 1 and "model.lora.dropout" in met.output, met.output
    rep = runner.invoke(app, ["report", run.uri, "--out", str(tmp_path / "rep")])
    assert rep.exit_code == 0, rep.output
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "failed at start (config)" in page and "model.lora.dropout" in page


def test_the_launcher_reports_the_run_not_its_first_sighting_of_a_crash(tmp_path, monkeypatch):
    """Issue 33 item 4: a replica crashed (failed heartbeat) while its supervisor had a restart left, then the
    run completed: `wait` (and so `launch`) said "failed" at the first sighting. Now it follows the run."""
    from composer_cloud import runs
    from composer_cloud.jobs import ReplicaState, ReplicaStatus

    running = ReplicaStatus(ReplicaState.RUNNING, restarts=0)
    run = _scripted_run(tmp_path, monkeypatch, {0: [running], 1: [running]},
                        {0: ("failed", "RuntimeError: the round has no valid commit", 3),
                         1: ("failed", "RuntimeError: the round has no valid commit", 3)}, max_restarts=1)
    seen = []

    def restarted_and_completed(st):
        seen.append(st.state)
        assert [r.state for r in st.replicas] == ["running", "running"]
        assert all(r.message.startswith("restarting after: ") for r in st.replicas)
        raise StopIteration  # one poll is enough to show the state; the test ends the wait here

    with pytest.raises(StopIteration):
        runs.wait(run, interval_s=0.01, on_update=restarted_and_completed)
    assert seen == ["running"]
    # Restarts used up: the same crash is the replica's end.
    used = ReplicaStatus(ReplicaState.RUNNING, restarts=1)
    run = _scripted_run(tmp_path / "b", monkeypatch, {0: [used], 1: [used]},
                        {0: ("failed", "RuntimeError: x", 3), 1: ("failed", "RuntimeError: x", 3)}, max_restarts=1)
    st = runs.get_status(run)
    assert st.state == "failed" and [r.state for r in st.replicas] == ["failed", "failed"]


# ------------------------------------------- issue 34, finding 3: one round numbering, from 1
def test_status_counts_rounds_from_1_as_the_logs_do_and_json_names_what_it_counts(tmp_path, monkeypatch):
    """Finding 3: the table said `round 0/2` while the logs said `round 1/2 step 6/20`; `status --json` had
    `last_durable_round: 3` next to `last_round: 4` for the same round."""
    from composer_cloud.jobs import ReplicaState, ReplicaStatus

    running = ReplicaStatus(ReplicaState.RUNNING, restarts=0)
    run = _scripted_run(tmp_path, monkeypatch, {0: [running], 1: [running]},
                        {0: ("running", "", 6, 0), 1: ("running", "", 5, 0)}, rounds=2, inner_steps=10)
    res = CliRunner().invoke(app, ["status", run.uri])
    assert res.exit_code == 0, res.output
    assert "round 1/2 (0 committed)" in res.output and "round 0/2" not in res.output, res.output
    assert "1/2" in res.output.split("steps/s")[1]  # each replica's row: round 1 of 2
    st = json.loads(CliRunner().invoke(app, ["status", run.uri, "--json"]).stdout)
    assert "last_durable_round" not in st and st["latest_durable_round"] is None and st["rounds_committed"] == 0
    assert [r["round"] for r in st["replicas"]] == [1, 1] and "last_round" not in st["replicas"][0]


def test_a_decoupled_run_is_shown_as_contributions_and_merges_never_round_7_of_3():
    """Finding 3: decoupled mode showed `completed — round 7/3` and "rounds committed 7/3"."""
    from composer_cloud.runs.status import ReplicaInfo, RunStatus

    st = RunStatus(run_id="d", run_uri="file:///x/d", state="completed", rounds=3, rounds_committed=7,
                   replicas=[ReplicaInfo(0, "local", "succeeded", 3, step=33),
                             ReplicaInfo(1, "local", "succeeded", 3, step=27)],
                   last_durable_round=6, sync_mode="decoupled")
    out = io.StringIO()
    Console(file=out, width=80).print(cli_module.cli_views.status_table(st))
    assert "7/3" not in out.getvalue() and "round" not in out.getvalue().split("\n")[0], out.getvalue()
    assert "contributions 6/6, 7 merges" in out.getvalue()
    js = cli_module.cli_views.status_json(st)
    assert [r["contributions"] for r in js["replicas"]] == [3, 3] and js["latest_durable_round"] == 7


def test_no_log_line_prints_a_round_as_index_dot_attempt():
    """Finding 3: `logs` printed `round 3.0 quorum [0, 1]` (a 0-based index and the attempt, read as a float)
    between `round 4/4` lines. Every log format that names a round and an attempt keeps them apart."""
    import re

    import composer_cloud

    root = Path(composer_cloud.__file__).parent
    dotted = [f"{p.relative_to(root)}: {m.group(0)}" for p in root.rglob("*.py")
              for m in re.finditer(r"round %d\.%d[^\"]*", p.read_text())]
    assert not dotted, dotted


def test_the_quorum_log_line_counts_rounds_from_1(tmp_path, caplog):
    """The quorum line of round index 3 says `round 4 quorum`, as the step lines of that round say `round 4/4`."""
    import logging

    import torch

    from composer_cloud.sync.lockstep.allreduce import ObjectStoreAllReduce
    from workers import allreduce_config

    ar = ObjectStoreAllReduce(Store(f"file://{tmp_path}/ar"), 0, allreduce_config(
        1, min_replicas=1, quorum_timeout_s=30, round_timeout_s=60))
    with caplog.at_level(logging.INFO, logger="composer_cloud.sync.lockstep.allreduce"):
        ar.allreduce(3, torch.ones(8))
    lines = [r.getMessage() for r in caplog.records if "quorum" in r.getMessage()]
    assert lines and lines[0].startswith("round 4 quorum [0]"), lines


@pytest.mark.slow
def test_sigint_to_the_launchers_group_as_spec_json_appears_leaves_no_orphan(tmp_path):
    """Finding 2 as reproduced: SIGINT to the process group just after spec.json is written printed nothing
    and left a run called "running" with no replicas. Now the line says what was left, and status agrees."""
    from support.cli import start_cli

    cfg = small_config(tmp_path, "replicas = 1\nrounds = 1\ninner_steps = 2")
    store = tmp_path / "store"
    proc = start_cli("launch", "--config", str(cfg), "--run-id", "sig", "--store", f"file://{store}", cwd=tmp_path)
    _wait(lambda: (store / "sig" / "spec.json").exists() or proc.poll() is not None, 120, "spec.json")
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    uri = f"file://{store}/sig"
    assert proc.returncode == 130, out
    st = status_json(uri, tmp_path)
    if "written but not started" in out:
        assert st["state"] == "not started", st
        assert cli("rm", uri, cwd=tmp_path).returncode == 0 and not (store / "sig" / "spec.json").exists()
    else:  # the jobs had started: the launcher says so, and they are recorded (cancel stops them)
        assert f"composer-cloud cancel {uri}" in out and st["state"] in ("running", "completed"), (out, st)
        assert [r["rank"] for r in st["replicas"]] == [0]
        cli("cancel", uri, cwd=tmp_path)


def test_ls_shows_a_decoupled_run_as_merges_not_rounds_of_its_budget(tmp_path, monkeypatch):
    """Finding 3: `ls` put a decoupled run's merges over its round count ("7/3")."""
    from composer_cloud.runs.listing import RunListing

    listed = [RunListing("d", "file:///x/d", "completed", 7, 3, None, sync_mode="decoupled"),
              RunListing("l", "file:///x/l", "completed", 3, 3, None)]
    monkeypatch.setattr(cli_module.runs, "list_runs", lambda *a, **k: listed)
    res = CliRunner().invoke(app, ["ls", str(tmp_path)])
    assert "7/3" not in res.output and "7 merges" in res.output and "3/3" in res.output, res.output


def test_rm_deletes_a_run_and_its_key_record_and_refuses_a_running_one(tmp_path, monkeypatch):
    """Issue 34 (what users expected): deleting runs and their keys (keys accumulated in run-keys/)."""
    from composer_cloud import runs
    from composer_cloud.jobs import ReplicaState, ReplicaStatus
    from composer_cloud.storage.runkeys import load_record

    monkeypatch.chdir(tmp_path)
    cfg = small_config(tmp_path, "replicas = 1\nrounds = 1\ninner_steps = 1")
    _interrupt_before_jobs(monkeypatch)
    with pytest.raises(runs.LaunchInterrupted) as cut:
        runs.launch(config=cfg, overrides={"run_id": "gone", "store": f"file://{tmp_path}/store"})
    monkeypatch.undo()
    uri = cut.value.run_uri
    assert load_record(uri) is not None
    res = CliRunner().invoke(app, ["rm", uri])
    assert res.exit_code == 0 and "run key record too" in res.output, res.output
    assert not (tmp_path / "store" / "gone").exists() and load_record(uri) is None
    running = ReplicaStatus(ReplicaState.RUNNING, restarts=0)
    run = _scripted_run(tmp_path / "live", monkeypatch, {0: [running], 1: [running]},
                        {0: ("running", "", 1, 0), 1: ("running", "", 1, 0)})
    refused = CliRunner().invoke(app, ["rm", run.uri])
    assert refused.exit_code == 2 and "--force" in refused.output, refused.output
    assert run.store.exists("replicas/0.json")  # nothing deleted


def test_init_writes_a_spec_with_every_default_that_launch_accepts(tmp_path, monkeypatch):
    """Issue 34 (what users expected): a starter spec with every default (`init`)."""
    from composer_cloud.spec import RunSpec, load_spec

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["init", "spec.toml"])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "spec.toml").read_text()
    assert load_spec(tmp_path / "spec.toml").to_json_dict() == RunSpec().to_json_dict()
    assert "quorum_timeout_s = 60.0" in text and "# hint_source = \"default\"" in text  # spec and trainer keys
    again = CliRunner().invoke(app, ["init", "spec.toml"])
    assert again.exit_code == 2 and "--force" in again.output
    dry = CliRunner().invoke(app, ["launch", "--config", "spec.toml", "--dry-run", "--store", f"file://{tmp_path}/s"])
    assert dry.exit_code == 0, dry.output
