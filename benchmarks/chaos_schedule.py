"""The chaos benchmark's model of a run: its settings (:class:`Config`), the seeded fault schedule and the
accounting of goodput from the metrics rows. ``chaos.py`` (the script) and ``chaos_harness.py`` (the replica
processes it drives) both build on it; it imports neither (``tests/test_packaging.py``: no import circle).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Config:
    replicas: int = 4
    rounds: int = 12
    inner_steps: int = 40
    seed: int = 0
    modes: list[str] = field(default_factory=lambda: ["lockstep", "decoupled"])
    scenarios: list[str] = field(default_factory=lambda: ["baseline", "chaos", "mixed"])
    # model (tiny Qwen2 + the stdlib BPE, written as a local model directory)
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 172
    vocab: int = 4096
    # data and optimizer
    batch_size: int = 8
    seq_len: int = 128
    corpus_bytes: int = 8_000_000
    eval_rows: int = 128
    inner_lr: float = 3e-3
    # sync (the same for every mode; a mode's own keys go in mode_overrides)
    quorum_timeout_s: float = 15.0
    # Also how long a participant's manifest writer waits for a killed participant's state, and the replica
    # waits for its manifest writers before it exits: keep it short (see docs/chaos.md, "Known effects").
    round_timeout_s: float = 30.0
    min_replicas: int = 1
    # fault schedule: times are fractions of the baseline's training time (first step to last exit)
    kill_at: float = 0.25
    stop_at: float = 0.55
    cold_start_s: float = 15.0
    stop_s: float = 15.0
    slow_factor: float = 3.0
    duty_period_s: float = 0.3
    # reporting
    target_factor: float = 1.05
    poll_s: float = 0.5
    timeout_s: float = 900.0
    threads: int = 1
    mode_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)


QUICK = {"rounds": 8, "inner_steps": 10, "hidden": 32, "intermediate": 86, "seq_len": 64, "vocab": 1024,
         "corpus_bytes": 1_000_000, "eval_rows": 32, "cold_start_s": 3.0, "stop_s": 3.0,
         "quorum_timeout_s": 6.0, "round_timeout_s": 12.0, "timeout_s": 240.0}


# ----------------------------------------------------------------------------- schedule (pure)
@dataclass(frozen=True)
class Event:
    """``kill``: SIGKILL ``rank`` at ``t``, restart it ``duration`` s later; ``stop``: SIGSTOP, SIGCONT after ``duration``.

    ``t`` is seconds after every replica of the run has started training (its first heartbeat).
    """

    t: float
    kind: str
    rank: int
    duration: float


@dataclass(frozen=True)
class Schedule:
    events: tuple[Event, ...]
    slow_rank: int | None
    slow_factor: float
    seed: int

    def to_json(self) -> dict[str, Any]:
        return {"events": [asdict(e) for e in self.events], "slow_rank": self.slow_rank,
                "slow_factor": self.slow_factor, "seed": self.seed}


def make_schedule(scenario: str, *, replicas: int, seed: int, base_s: float, kill_at: float, stop_at: float,
                  cold_start_s: float, stop_s: float, slow_factor: float) -> Schedule:
    """The fault schedule of ``scenario``; the ranks come from ``seed``, the times from ``base_s``.

    The same seed gives the same ranks in every scenario and mode: X (killed), Y (stopped), Z (slow) are
    three distinct ranks, so each fault hits a different replica.
    """
    if replicas < 3 and scenario == "chaos":
        raise ValueError("the chaos schedule needs at least 3 replicas (kill, stop and slow hit different ones)")
    x, y, z = random.Random(seed).sample(range(replicas), min(3, replicas)) + [None] * max(0, 3 - replicas)
    if scenario == "baseline":
        return Schedule((), None, 1.0, seed)
    if scenario == "mixed":
        return Schedule((), z if z is not None else 0, slow_factor, seed)
    if scenario == "chaos":
        events = (Event(round(kill_at * base_s, 2), "kill", x, cold_start_s),
                  Event(round(stop_at * base_s, 2), "stop", y, stop_s))
        return Schedule(events, z, slow_factor, seed)
    raise ValueError(f"unknown scenario {scenario!r}")


# ----------------------------------------------------------------------------- accounting (pure)
def merged(row: dict[str, Any]) -> bool:
    """Whether a round row's inner steps were merged into the global model.

    Lock-step writes ``committed`` (the replica's pseudo-gradient was in the committed average); a mode
    that merges differently may write ``merged`` instead, which then wins.
    """
    return bool(row.get("merged", row.get("committed", False)))


def account_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, useful steps and the typical step time of one replica incarnation's metrics rows.

    The step rows between two round rows belong to the later round row (a ``steps`` field on the round row,
    if present, overrides the count). Steps after the last round row were never synced: lost. The step
    time is the median ``time_s`` of step rows that did not contain a sync (the step right before a round
    row did); it is the replica's own speed in this run (a slowed replica's median is ~3x).
    """
    steps = useful = rounds_merged = rounds_lost = 0
    pending: list[dict[str, Any]] = []
    times = [float(r.get("time_s", 0.0)) for r in _plain_steps(rows)]
    for row in rows:
        kind = row.get("kind")
        if kind == "step":
            pending.append(row)
        elif kind == "round":
            n = int(row.get("steps", len(pending)))
            steps += n
            if merged(row):
                useful += n
                rounds_merged += 1
            else:
                rounds_lost += 1
            pending = []
    steps += len(pending)
    return {"steps": steps, "useful_steps": useful, "wasted_steps": steps - useful, "unsynced_steps": len(pending),
            "rounds_merged": rounds_merged, "rounds_not_merged": rounds_lost,
            "step_time_s": statistics.median(times) if times else None}


def goodput(incarnations: list[dict[str, Any]], *, outlier: float = 10.0) -> dict[str, Any]:
    """Goodput of a run from its replica incarnations.

    Each incarnation: ``billed_s`` (seconds from its first heartbeat, i.e. model loaded and training, to
    its exit or kill; SIGSTOPped time and a slowed replica's stopped time included) and its metrics
    ``rows``. ``goodput`` = useful compute seconds / billed seconds, where useful compute seconds are the
    measured durations of the inner steps in merged rounds: a slowed replica's steps take 3x as long and
    count in full (slow hardware, busy). Two corrections: the step of each round that contained the sync
    counts as the incarnation's median step (its duration includes the sync), and a step longer than
    ``outlier`` x the run's median step (it contained a SIGSTOP) counts as the run's median.
    ``useful_steps_per_replica_s`` is the issue's raw ratio (useful inner steps / replica-seconds).
    """
    all_times = [float(r.get("time_s", 0.0)) for i in incarnations for r in _plain_steps(i["rows"])]
    med = statistics.median(all_times) if all_times else 0.0
    billed = useful_s = 0.0
    useful = steps = 0
    for inc in incarnations:
        acc = account_rows(inc["rows"])
        billed += inc["billed_s"]
        useful += acc["useful_steps"]
        steps += acc["steps"]
        own = acc["step_time_s"] or med
        pending: list[float] = []
        for row in inc["rows"]:
            if row.get("kind") == "step":
                t = float(row.get("time_s", 0.0))
                pending.append(med if med and t > outlier * med else t)
            elif row.get("kind") == "round":
                if merged(row) and pending:
                    useful_s += sum(pending[:-1]) + own
                pending = []
    return {"goodput": useful_s / billed if billed else 0.0, "replica_s": billed, "useful_compute_s": useful_s,
            "median_step_s": med, "useful_steps": useful, "steps": steps, "wasted_steps": steps - useful,
            "useful_steps_per_replica_s": useful / billed if billed else 0.0}


def _plain_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step rows that did not contain a sync (the last step row before each round row did)."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for row in rows:
        if row.get("kind") == "step":
            pending.append(row)
        elif row.get("kind") == "round":
            out += pending[:-1]
            pending = []
    return out + pending


def duty_cycle(factor: float, period_s: float) -> tuple[float, float]:
    """``(run_s, stop_s)`` per period so that a replica runs ``1/factor`` of the time."""
    run = period_s / factor
    return run, period_s - run



def first_time_at_most(curve: list[tuple[float, float]], target: float) -> float | None:
    """First ``t`` of ``(t, loss)`` points (sorted by t) with ``loss <= target``."""
    return next((t for t, v in sorted(curve) if v <= target), None)


def first_time_at_least(timeline: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, v in sorted(timeline) if v >= target), None)


__all__ = ["QUICK", "Config", "Event", "Schedule", "account_rows", "duty_cycle", "first_time_at_least", "first_time_at_most", "goodput", "make_schedule", "merged"]
