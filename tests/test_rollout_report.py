"""``composer-cloud report`` shows the rollout worker fleet (issue 36 item 5) with ``status``'s own figures.

The store is written by the code that writes it in a run: the trainers' step rows carry the counters of a real
:class:`~composer_cloud.trainer.three_channel.sourced.SourcedRollouts` (through the replica's ``MetricsLog``), the
workers' heartbeats the progress of a real :class:`~composer_cloud.rollouts.worker.WorkerStats`, and the job handles
are the launcher's records. The end-to-end run's report is checked in ``test_rollout_workers_e2e.py``.
"""

from __future__ import annotations

import html
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from composer_cloud.replica.telemetry import MetricsLog
from composer_cloud.rollouts.worker import WorkerStats
from composer_cloud.runs import open_run
from composer_cloud.runs.status import RolloutFleet, RolloutUse, run_status
from composer_cloud.spec import load_spec
from composer_cloud.storage import layout
from composer_cloud.storage.records import Heartbeat, HeartbeatState, JobHandle
from composer_cloud.storage.run import save_handles
from composer_cloud.storage.store import Store
from composer_cloud.trainer.three_channel.sourced import InMemorySource, RolloutKey, SourcedCompletions, SourcedRollouts
from support.metrics import log_round, log_step
from support.stores import CountingBackend

PROMPTS = [[5, 6], [7, 8]]


def _batch(version: int) -> SourcedCompletions:
    return SourcedCompletions(completion_ids=[[1], [2, 3]], logprobs=[[-0.5], [-0.1, -0.2]], policy_version=version)


def _run(tmp_path: Path, *, workers: int):
    """Two replicas, two rounds of two steps, ``max_staleness = 1``: replica 0 trains on workers' batches (one stale
    one in round 1), replica 1 on nothing (it samples itself); ``workers`` heartbeats with their published batches."""
    uri = f"file://{tmp_path}/store/fleet"
    spec = load_spec(None, {"run_id": "fleet", "replicas": 2, "rounds": 2, "inner_steps": 2,
                            "rollouts.workers": workers, "rollouts.max_staleness": 1})
    store = Store(uri)
    store.create_json(layout.SPEC, spec.to_json_dict())
    source = InMemorySource()
    for key, version in {RolloutKey(0, 0, 1): 0, RolloutKey(0, 0, 2): 0, RolloutKey(1, 0, 3): 0,
                         RolloutKey(1, 0, 4): -1}.items():  # -1: no batch for this step
        if version >= 0:
            source.put(key, _batch(version))
    # A batch 2 versions behind in round 2 would be stale; here round 1's step 4 has none, step 3's is 1 behind.
    source.put(RolloutKey(1, 1, 3), _batch(0))
    sourced = {rank: SourcedRollouts(source, max_staleness=1) for rank in (0, 1)}
    for rank in (0, 1):
        log = MetricsLog(store, rank)
        for rnd in (0, 1):
            for i in (1, 2):
                step = rnd * 2 + i
                if workers:
                    taken = sourced[rank].take(RolloutKey(rnd, rank, step), PROMPTS, max_completion_length=4,
                                               vocab_size=16)
                    if taken is None:
                        sourced[rank].record(RolloutKey(rnd, rank, step), PROMPTS, [[1], [1]], None)
                log_step(log, rnd, step, loss=1.0 / step, **(sourced[rank].take_metrics() if workers else {}))
            log_round(log, rnd, committed=True, train_loss=1.0, sync_s=0.1)
    handles = [JobHandle(executor="local", rank=r, job_id=f"job-{r}") for r in range(2 + workers)]
    save_handles(store, handles)
    now = time.time()
    for w in range(workers):
        stats = WorkerStats(published=3 + w, tokens=30 * (w + 1), busy_s=2.0)
        beat = Heartbeat(rank=2 + w, state=HeartbeatState.COMPLETED, time=now,
                         progress={"role": "rollout-worker", "worker": w, **stats.progress()})
        store.put_json(layout.heartbeat_key(2 + w), beat.to_json())
    for r in range(2):
        store.put_json(layout.heartbeat_key(r), Heartbeat(rank=r, state=HeartbeatState.COMPLETED, time=now).to_json())
    return open_run(uri)


def test_the_report_shows_the_fleet_with_the_figures_status_shows(tmp_path):
    pytest.importorskip("matplotlib", reason="the [report] extra")
    from composer_cloud.cli_views import fleet_line
    from composer_cloud.runs.report import write_report

    run = _run(tmp_path, workers=2)
    status = run_status(run)
    fleet = RolloutFleet.from_status(status)
    # What the trainers did, from their step rows: replica 0 used 3 batches (0, 0, 1 versions behind) and sampled
    # step 4 itself; replica 1 had a batch only at step 3 (1 behind) and sampled its other three steps.
    assert fleet is not None and fleet.use == RolloutUse(used=4, stale=0, fallbacks=4, staleness={0: 2, 1: 2})
    assert [(w.rank, w.batches_published, w.tokens_per_s) for w in fleet.workers] == [(2, 3, 15.0), (3, 4, 30.0)]
    rep = write_report(run, tmp_path / "out")
    page = rep.html.read_text()
    assert rep.fleet == fleet
    assert "<h2>Rollout workers</h2>" in page and html.escape(fleet_line(status)) in page
    assert fleet_line(status).startswith("rollout workers: 2 (0 running), 7 batches published, 45.0 tokens/s; "
                                         "trainers used 4, refused 0 as stale, sampled 4 themselves")
    assert "<tr><td>0</td><td>2</td></tr><tr><td>1</td><td>2</td></tr>" in page  # versions behind -> steps
    assert "<tr><td>3</td><td>succeeded</td><td>4</td><td>30</td></tr>" in page  # one row per worker
    assert "<tr><td>4</td><td>0</td><td>4</td></tr>" in page  # used, refused as stale, sampled themselves
    # `report --json` carries the same fleet.
    from typer.testing import CliRunner

    from composer_cloud.cli import app

    res = CliRunner().invoke(app, ["report", run.uri, "--out", str(tmp_path / "json"), "--json"])
    assert res.exit_code == 0, res.output
    fleet_json = json.loads(res.output)["rollouts"]
    assert fleet_json["batches_published"] == 7 and fleet_json["use"]["used"] == 4
    assert [w["rank"] for w in fleet_json["workers"]] == [2, 3]


def test_a_run_without_workers_has_no_fleet_on_its_report(tmp_path):
    pytest.importorskip("matplotlib", reason="the [report] extra")
    from composer_cloud.runs.report import write_report

    run = _run(tmp_path, workers=0)
    assert RolloutFleet.from_status(run_status(run)) is None
    rep = write_report(run, tmp_path / "out")
    assert rep.fleet is None and "Rollout workers" not in rep.html.read_text()


def test_status_reads_each_step_metrics_object_once_and_drops_rows_a_resume_superseded(tmp_path):
    from composer_cloud.runs.metrics import read_rows
    from composer_cloud.runs.status import StatusTracker
    from composer_cloud.storage.records import ResumeRecord

    run = _run(tmp_path, workers=2)
    store = run.store
    counting = store.backend = CountingBackend(store.backend)
    tracker = StatusTracker(run, poll_executors=False)

    def metrics_gets() -> Counter[str]:
        return Counter({k: n for k, n in counting.gets.items() if k.startswith(layout.metrics_prefix() + "/")})

    def full_read() -> RolloutUse:  # what a fresh reader of every object says
        return RolloutUse.from_rows([r for r in read_rows(store, kind="step")])

    first = tracker.poll().rollouts
    assert metrics_gets() == Counter({k: 1 for k in metrics_gets()}) and len(metrics_gets()) == 2 * 2 * 2
    assert first == full_read() and first.used == 4  # 2 replicas x 2 rounds, each object and its digest read once
    counting.gets.clear()
    assert tracker.poll().rollouts == first
    assert not metrics_gets()  # nothing new: no GET of any metrics object

    # Launch 1 resumed replica 0 from round 0's checkpoint and re-ran round 1 on a fresh batch: launch 0's round 1
    # rows of replica 0 are superseded (its stale batch and its fallback no longer count), the new object is read.
    store.create_json(layout.resume_key(0), ResumeRecord(from_round=0, executor="local", replicas=2,
                                                         time=time.time()).to_json())
    log = MetricsLog(store, 0, launch=1)
    source = InMemorySource()
    source.put(RolloutKey(1, 0, 3), _batch(1))
    source.put(RolloutKey(1, 0, 4), _batch(1))
    sourced = SourcedRollouts(source, max_staleness=1)
    for step in (3, 4):
        assert sourced.take(RolloutKey(1, 0, step), PROMPTS, max_completion_length=4, vocab_size=16) is not None
        log_step(log, 1, step, loss=0.5, **sourced.take_metrics())
    new_key = log_round(log, 1, committed=True, train_loss=0.5, sync_s=0.1)
    counting.gets.clear()
    after = tracker.poll().rollouts
    assert set(metrics_gets()) == {new_key, layout.metrics_digest_key(new_key)}  # only the new object
    assert after == full_read()
    # The resume re-ran round 1 for the whole run: replica 0 used 2 + 2 current batches; replica 1's round 1 (its one
    # batch, 1 behind, and a fallback) is superseded and only its round 0 (2 sampled itself) counts.
    assert after == RolloutUse(used=4, stale=0, fallbacks=2, staleness={0: 4})
