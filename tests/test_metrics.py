"""Metrics objects (plain JSONL, one per round per replica, never rewritten), progress, and the read side."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pandas as pd
import pytest

from composer_cloud import env
from composer_cloud.storage.store import Store
from composer_cloud.replica.telemetry import MetricsLog, Progress
from composer_cloud.runs.metrics import list_objects, read_metrics, to_csv
from support.cli import cli, cli_here
from support.metrics import log_round, log_step
from support.specs import SMALL_RUN_TOML


def _log(store: Store, rank: int, launch: int, rounds: range, *, loss: float = 1.0) -> MetricsLog:
    log = MetricsLog(store, rank, launch=launch)
    for r in rounds:
        for i in range(2):
            log_step(log, r, 2 * r + i + 1, loss=loss)
        log_round(log, r, committed=True, train_loss=loss)
    return log


def test_objects_are_plain_jsonl_that_pandas_reads(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    _log(store, 0, 0, range(2))
    objs = list_objects(store)
    assert [(o.rank, o.round) for o in objs] == [(0, 0), (0, 1)]
    path = tmp_path / "run" / objs[0].key
    df = pd.read_json(path, lines=True)
    assert list(df["kind"]) == ["step", "step", "round"] and list(df["round"]) == [0, 0, 0]
    assert (path.with_suffix(".json")).exists()  # the framed digest next to it


def test_nan_is_written_as_null(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    log = MetricsLog(store, 0, launch=0)
    log_step(log, 0, 1, loss=float("nan"))
    log_round(log, 0, committed=True, train_loss=float("inf"))
    rows = read_metrics(store)
    assert rows[0]["loss"] is None and rows[1]["train_loss"] is None
    df = pd.read_json(tmp_path / "run" / list_objects(store)[0].key, lines=True)
    assert math.isnan(df["loss"][0])


def test_resume_keeps_history_and_newer_launch_supersedes(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    _log(store, 0, 0, range(4), loss=1.0)  # launch 0 ran rounds 0..3 (checkpoint after round 1)
    store.put_json("resumes/0.json", {"from_round": 1})
    _log(store, 0, 1, range(2, 3), loss=2.0)  # launch 1 re-ran round 2, then was cancelled
    rows = read_metrics(store, kind="round")
    # Round 3 of launch 0 belongs to a timeline launch 1 abandoned: superseded even though launch 1 never wrote it.
    assert [(r["round"], r["launch"]) for r in rows] == [(0, 0), (1, 0), (2, 1)]
    everything = read_metrics(store, kind="round", superseded=True)
    assert sorted((r["round"], r["launch"], r.get("superseded", False)) for r in everything) == [
        (0, 0, False), (1, 0, False), (2, 0, True), (2, 1, False), (3, 0, True)]
    assert len(list_objects(store)) == 5  # nothing deleted


def test_restart_within_a_launch_keeps_the_newest(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    _log(store, 1, 0, range(2), loss=1.0)
    time.sleep(0.01)
    _log(store, 1, 0, range(1, 2), loss=3.0)
    rows = read_metrics(store, kind="round")
    assert [(r["round"], r["train_loss"]) for r in rows] == [(0, 1.0), (1, 3.0)]


def test_tampered_or_incomplete_objects_are_ignored(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    _log(store, 0, 0, range(2))
    objs = list_objects(store)
    p = tmp_path / "run" / objs[1].key
    p.write_text(p.read_text().replace('"loss": 1.0', '"loss": 9.0'))
    (tmp_path / "run" / "metrics/0/00000005-0000-0000000000000-abcd.jsonl").write_text("{}\n")  # no digest
    rows = read_metrics(store)
    assert {r["round"] for r in rows} == {0}


def test_csv_starts_with_the_identifying_columns(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    log = MetricsLog(store, 0, launch=0)
    log_step(log, 0, 1, loss=2.0)
    log_round(log, 0, train_loss=2.0)
    assert [r["kind"] for r in read_metrics(store)] == ["step", "round"]
    assert "kind,rank,round" in to_csv(read_metrics(store)).splitlines()[0]


def test_progress_is_time_gated():
    now = [0.0]
    p = Progress(every_s=5.0, total_steps=100, clock=lambda: now[0])
    due = []
    for i in range(1, 21):
        now[0] += 0.5
        due.append(p.update(round=0, step=i, out={"loss": 2.0, "tokens": 10, "reward_mean": 0.5}, step_s=0.5))
    beats = [d for d in due if d]
    assert len(beats) == 2  # at 5 s and 10 s of 10 s
    assert beats[-1]["step"] == 20 and beats[-1]["loss"] == 2.0 and beats[-1]["reward"] == 0.5
    assert beats[-1]["steps_per_s"] == pytest.approx(2.0) and beats[-1]["tokens_per_s"] == pytest.approx(20.0)


# ---------------------------------------------------------------- end to end (local executor)

def _spec(tmp_path: Path, extra: str = "") -> Path:
    p = tmp_path / "spec.toml"
    p.write_text(extra + SMALL_RUN_TOML)
    return p


@pytest.mark.slow
def test_metrics_survive_resume_of_a_completed_run_and_cancel_resume(tmp_path):
    store = tmp_path / "store"
    cfg = _spec(tmp_path)
    res = cli("launch", "-c", str(cfg), "--replicas", "2", "--rounds", "2", "--inner-steps", "2", "--run-id", "m",
               "--store", f"file://{store}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    uri = f"file://{store}/m"
    rows = read_metrics(Store(uri))
    assert len([r for r in rows if r["kind"] == "round"]) == 4 and len([r for r in rows if r["kind"] == "step"]) == 8
    assert [r["step"] for r in rows if r["kind"] == "step" and r["rank"] == 0] == [1, 2, 3, 4]
    # Resuming a completed run on another replica count re-runs nothing it must not; history stays.
    res = cli_here("resume", uri, "--replicas", "2", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    after = read_metrics(Store(uri), superseded=True)
    assert len([r for r in after if r["kind"] == "round"]) >= 4
    assert len(read_metrics(Store(uri), kind="round")) == 4
    # Every object is still there and pandas reads each one.
    for o in list_objects(Store(uri)):
        assert not pd.read_json(store / "m" / o.key, lines=True).empty


# ---------------------------------------------------------------- logs: merge, tail, since, follow (any executor)
class _FakeExecutor:
    """Logs like every executor's: from the start; with follow, more lines until the job ends."""

    def __init__(self, lines: dict[int, list[str]], more: dict[int, list[str]]) -> None:
        self.lines, self.more = lines, more

    def logs(self, handle, *, follow=False):
        yield from self.lines[handle.rank]
        if follow:
            time.sleep(0.05 * (handle.rank + 1))
            yield from self.more[handle.rank]


def _fake_run(tmp_path, monkeypatch, ex):
    from composer_cloud.jobs import JobHandle
    from composer_cloud.runs import logs as logs_mod
    from composer_cloud.storage.run import Run, save_handles
    from composer_cloud.spec import RunSpec

    store = Store(f"file://{tmp_path}/run")
    # Handles on the executor the spec assigns to their ranks (local): others are dropped as forged.
    save_handles(store, [JobHandle("local", r, f"j{r}") for r in (0, 1)])
    monkeypatch.setattr(logs_mod, "get_executor", lambda name, spec, **kw: ex)
    return Run(uri=store.uri, store=store, spec=RunSpec(run_id="run"))


def test_logs_merge_tail_since_follow(tmp_path, monkeypatch):
    from composer_cloud.runs.logs import line_time, parse_since, replica_logs

    t = "2026-01-02T03:04:0{}.000Z r{} INFO x: {}"
    ex = _FakeExecutor({0: ["banner", t.format(1, 0, "a"), t.format(3, 0, "b"), "Traceback (most recent call last)"],
                        1: [t.format(2, 1, "c"), t.format(4, 1, "d")]},
                       {0: [t.format(7, 0, "e")], 1: [t.format(8, 1, "f")]})
    run = _fake_run(tmp_path, monkeypatch, ex)
    got = [(ll.rank, ll.line[-1]) for ll in replica_logs(run)]
    assert got == [(0, "r"), (0, "a"), (1, "c"), (0, "b"), (0, ")"), (1, "d")]  # by time; a traceback follows its line
    assert [(ll.rank, ll.line[-1]) for ll in replica_logs(run, tail=1)] == [(0, ")"), (1, "d")]
    since = parse_since("2026-01-02T03:04:03Z")
    assert [ll.line[-1] for ll in replica_logs(run, since=since)] == ["b", ")", "d"]
    assert [ll.line[-1] for ll in replica_logs(run, ranks=[1])] == ["c", "d"]
    followed = [ll.line[-1] for ll in replica_logs(run, tail=1, follow=True)]
    assert followed[:2] == [")", "d"] and sorted(followed[2:]) == ["e", "f"]  # no line twice
    assert line_time(t.format(1, 0, "a")) == parse_since("2026-01-02T03:04:01")
    assert abs(parse_since("10m", now=1000.0) - 400.0) < 1e-9
    with pytest.raises(ValueError, match="duration"):
        parse_since("yesterday")


@pytest.mark.slow
def test_metrics_survive_cancel_and_resume(tmp_path):
    store = tmp_path / "store"
    cfg = _spec(tmp_path)
    res = cli("launch", "-c", str(cfg), "--replicas", "2", "--rounds", "3", "--inner-steps", "60", "--run-id", "cr",
               "--store", f"file://{store}", "--detach", cwd=tmp_path,
               # 8x slower replicas: rounds 1-2 outlast the cancel even on a loaded CI box (the resume runs at speed).
               env={**os.environ, env.SLOW: "0:8,1:8"})
    assert res.returncode == 0, res.stdout + res.stderr
    uri = f"file://{store}/cr"
    deadline = time.monotonic() + 120
    while not list_objects(Store(uri), rank=1) and time.monotonic() < deadline:
        time.sleep(0.3)
    res = cli_here("cancel", uri, "--json", cwd=tmp_path)
    assert res.exit_code == 0 and json.loads(res.stdout)["cancelled"] == [0, 1], res.output
    before = {o.key for o in list_objects(Store(uri))}
    assert before
    res = cli_here("resume", uri, cwd=tmp_path)  # attached: waits for the end
    assert res.exit_code == 0, res.output
    after = list_objects(Store(uri))
    assert before <= {o.key for o in after}  # nothing from the first launch was deleted
    assert {o.launch for o in after} == {0, 1}
    rounds = read_metrics(Store(uri), kind="round")
    assert sorted((r["rank"], r["round"]) for r in rounds) == [(k, r) for k in (0, 1) for r in range(3)]
    assert all(r["committed"] for r in rounds)
    steps = read_metrics(Store(uri), kind="step", rank=0)
    assert [s["step"] for s in steps] == list(range(1, 181))  # every inner step of the run once, in order


def test_signed_run_accepts_only_authentic_objects(tmp_path):
    key = b"k" * 32
    signed = Store(f"file://{tmp_path}/run", signing_key=key)
    _log(signed, 0, 0, range(1))
    assert len(read_metrics(signed)) == 3
    # A bucket writer without the key adds an object with a digest that matches but is not signed.
    forger = Store(f"file://{tmp_path}/run")
    _log(forger, 0, 0, range(1, 2))
    assert {r["round"] for r in read_metrics(signed)} == {0}
