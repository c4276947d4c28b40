"""Rollout workers end to end on the local executor (issue 36, "Done when"): 2 trainer replicas x 2 rollout workers,
3 lock-step rounds of 2 inner steps, the three-channel trainer on a question/answer dataset, a signed run.

One uninterrupted run is the baseline every other run must end on, bitwise:

* the baseline itself completes, and every batch its trainers consumed came from a worker;
* a run whose launcher, replicas and workers are all SIGKILLed in round 2, then resumed;
* a run where a worker is SIGKILLed mid-run (its supervisor restarts it) and unsigned or foreign batches are
  planted at positions of round 2 before the trainers get there (refused, replaced by the workers' batches).

A batch is a function of (policy version, prompts, seed) only, whoever samples it, so all three end on the same
weights; the run's batches are checked through the store's records.
"""

from __future__ import annotations

import dataclasses

import json
import time
from pathlib import Path

import pytest

from composer_cloud.errors import BadObject, ObjectNotFound
from composer_cloud.rollouts.batches import Position
from composer_cloud.runs import open_run
from composer_cloud.storage import layout
from composer_cloud.storage.records.rollouts import RolloutBatch
from composer_cloud.storage.store import Store
from support.cli import cli, cli_here, start_cli, status_here
from support.faults import stall_env, wait_for_marker, with_faults
from support.local_jobs import handles, kill_replica, kill_run, replica_log
from support.resume import export_weights, same_weights
from support.specs import ROLLOUT_QA, rollout_spec

pytestmark = pytest.mark.slow

REPLICAS, WORKERS, ROUNDS, H = 2, 2, 3, 2
#: Given on the command line, as the issue's scenario does.
FLAGS = ("--replicas", str(REPLICAS), "--set", f"rollouts.workers={WORKERS}")


def write_spec(cwd: Path, top: str = "") -> Path:
    (cwd / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROLLOUT_QA))
    path = cwd / "spec.toml"
    path.write_text(rollout_spec(rounds=ROUNDS, inner_steps=H, top=top))
    return path


def launch_args(cwd: Path, store: str, run_id: str, top: str = "") -> list[str]:
    return ["launch", "--config", str(write_spec(cwd, top)), "--store", store, "--run-id", run_id, *FLAGS]


def consumed_batches(run_uri: str, *, skip_bad: bool = False) -> dict[Position, RolloutBatch]:
    """Every batch of the run, read and verified through the run's (signed) store (``skip_bad``: leave out what
    does not verify, e.g. a planted object not replaced yet)."""
    store = open_run(run_uri).store
    out = {}
    for key in store.list(layout.ROLLOUT_BATCHES):
        parsed = layout.parse_rollout_key(key)
        assert parsed is not None, key
        pos = Position(*parsed)
        try:
            out[pos] = RolloutBatch.from_json(store.get_json(key, max_bytes=1 << 26), key=key, round=pos.round,
                                              replica=pos.replica, step=pos.step)
        except (BadObject, ObjectNotFound):
            if not skip_bad:
                raise
    return out


def every_position() -> set[Position]:
    return {Position(t, r, t * H + k + 1) for t in range(ROUNDS) for r in range(REPLICAS) for k in range(H)}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The uninterrupted run: its URI and exported weights."""
    cwd = tmp_path_factory.mktemp("rollouts-baseline")
    store = f"file://{cwd}/runs"
    res = cli(*launch_args(cwd, store, "baseline"), cwd=cwd, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    run_uri = f"{store}/baseline"
    return run_uri, export_weights(cwd, run_uri, "model")


def test_two_trainers_with_two_workers_complete_on_the_workers_batches(baseline, tmp_path):
    run_uri, _ = baseline
    st = status_here(run_uri, tmp_path)
    assert st["state"] == "completed", st
    jobs = {i["rank"]: i for i in st["replicas"]}
    assert sorted(jobs) == [0, 1, 2, 3] and all(jobs[r]["state"] == "succeeded" for r in jobs)
    assert [jobs[r]["role"] for r in sorted(jobs)] == ["replica"] * 2 + ["rollout-worker"] * 2
    # What the trainers did with the batches, from their step rows: every step on a worker's batch, round 0's
    # (version 0) current, rounds 1 and 2's one version behind (max_staleness = 1).
    steps = ROUNDS * REPLICAS * H
    assert st["rollouts"] == {"used": steps, "stale": 0, "fallbacks": 0,
                              "staleness": {"0": REPLICAS * H, "1": steps - REPLICAS * H}}, st["rollouts"]
    batches = consumed_batches(run_uri)
    assert set(batches) == every_position()  # one batch per trainer step, none missing, none extra
    assert {b.sampler for b in batches.values()} <= {"worker:0", "worker:1"}
    # Round t's batches are sampled from exactly version max(0, t - 1) (max_staleness = 1).
    assert {(p.round, b.policy_version) for p, b in batches.items()} == {(0, 0), (1, 0), (2, 1)}
    store = open_run(run_uri).store
    beats = {w: store.get_json(layout.heartbeat_key(REPLICAS + w)) for w in range(WORKERS)}
    assert sum(int(b["batches_published"]) for b in beats.values()) == len(batches)
    assert all(b["role"] == "rollout-worker" and b["state"] == "completed" for b in beats.values())
    # `report` shows the same fleet as `status` (its figures, not a second reading of the records).
    pytest.importorskip("matplotlib", reason="the [report] extra")
    from composer_cloud.runs.report import write_report

    rep = write_report(open_run(run_uri), tmp_path / "report")
    assert rep.fleet is not None and dataclasses.asdict(rep.fleet.use) == {
        **st["rollouts"], "staleness": {int(k): v for k, v in st["rollouts"]["staleness"].items()}}
    assert rep.fleet.batches_published == len(batches) and "<h2>Rollout workers</h2>" in rep.html.read_text()


def test_kill_everything_in_round_2_then_resume_exports_the_uninterrupted_model(baseline, tmp_path):
    _, expected = baseline
    store = f"file://{tmp_path}/runs"
    run_uri = f"{store}/killed"
    args = launch_args(tmp_path, store, "killed")
    marker = tmp_path / "stalled-killed"
    launcher = start_cli(*args, cwd=tmp_path, env=with_faults(stall_env("inner_step", 2, 0, marker)), capture=False)
    wait_for_marker(marker, launcher, what="inner_step:2:0")
    assert sorted(handles(run_uri)) == [0, 1, 2, 3]  # the workers are jobs of the run: killed with it
    kill_run(run_uri, launcher)
    before = consumed_batches(run_uri)
    assert before and max(p.round for p in before) <= 2
    res = cli_here("resume", run_uri, cwd=tmp_path, timeout=600)
    assert res.exit_code == 0, res.output[-8000:]
    after = consumed_batches(run_uri)
    assert set(after) == every_position()
    assert all(after[p].to_json() == b.to_json() for p, b in before.items())  # write-once: the same batches
    assert same_weights(export_weights(tmp_path, run_uri, "resumed"), expected)


def test_a_killed_worker_is_restarted_and_forged_batches_are_refused_on_a_signed_run(baseline, tmp_path):
    _, expected = baseline
    store = f"file://{tmp_path}/runs"
    run_uri = f"{store}/faults"
    launcher = start_cli(*launch_args(tmp_path, store, "faults", top="max_restarts = 1\nsigned = true"), cwd=tmp_path)
    run_dir = tmp_path / "runs" / "faults"
    deadline = time.monotonic() + 300
    while not (run_dir / layout.SPEC).exists():
        assert launcher.poll() is None and time.monotonic() < deadline, "the launch never wrote its spec"
        time.sleep(0.1)
    assert open_run(run_uri).spec.signed is True
    planted = [Position(2, 0, 2 * H + 1), Position(2, 1, 2 * H + 2)]
    unsigned, foreign = Store(f"{store}/faults"), Store(f"{store}/faults", signing_key=b"f" * 32)
    for writer, pos in zip((unsigned, foreign), planted):
        writer.put_json(pos.batch_key, {"round": pos.round, "replica": pos.replica, "step": pos.step,
                                        "policy_version": 1, "prompts_sha256": "0" * 64, "completion_ids": [[1]] * 4,
                                        "sampler_logps": [[-0.1]] * 4, "rewards": [9.0] * 4, "sampler": "worker:0",
                                        "seconds": 0.0, "time": 0.0})
    # Kill worker 1 (job rank 3) once it has published a batch: its supervisor starts it again.
    while not any(b.sampler == "worker:1" for b in consumed_batches(run_uri, skip_bad=True).values()):
        assert launcher.poll() is None and time.monotonic() < deadline, "worker 1 never published a batch"
        time.sleep(0.1)
    kill_replica(run_uri, REPLICAS + 1)
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out[-4000:]
    assert "restart 1/1" in replica_log(run_uri, REPLICAS + 1)
    logs = replica_log(run_uri, 0) + replica_log(run_uri, 1)
    for pos in planted:
        assert f"refusing the rollout batch at {pos.batch_key}" in logs
    batches = consumed_batches(run_uri)
    assert set(batches) == every_position()
    assert all(batches[p].sampler.startswith("worker:") and batches[p].rewards == [None] * 4 for p in planted)
    assert same_weights(export_weights(tmp_path, run_uri, "model"), expected)
