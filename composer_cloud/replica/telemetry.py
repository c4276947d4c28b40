"""What a replica reports while it runs: metrics objects, live progress, heartbeats.

* :class:`MetricsLog` buffers a round's step rows and writes one object per
  round (``metrics/<rank>/<round>-<writer>.jsonl``, plain JSONL that any tool
  reads as it is, then its framed digest, written last; readers:
  :mod:`composer_cloud.runs.metrics`). Objects are never rewritten or deleted.
* :class:`Progress` keeps the time-gated live figures (step, loss, reward,
  steps/s, tokens/s, elapsed) a replica puts into its heartbeat every
  ``progress_every_s`` seconds.
* :class:`Telemetry` ties them to one replica process: every inner step's row
  and log line, every round's row, the heartbeat (``replicas/<rank>.json``,
  a :class:`~composer_cloud.storage.records.Heartbeat`), and the round's sample
  completions (``samples/<rank>/<round>-<writer>.json``, a
  :class:`~composer_cloud.storage.records.RoundSamples`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable
from typing import Any

from composer_cloud.errors import redact
from composer_cloud.storage import layout
from composer_cloud.storage.records import Heartbeat, HeartbeatState, MetricsDigest, RoundSamples, Sample
from composer_cloud.storage.records.samples import MAX_SAMPLES, clip_text
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become null (strict JSON has no NaN; pandas reads null as NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def encode_rows(rows: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(_clean(r), sort_keys=True, allow_nan=False) + "\n" for r in rows).encode()


def launch_number(store: Store) -> int:
    """Which launch this process belongs to: 0 for the first, n after the n-th ``resume``."""
    return sum(1 for k in store.list(layout.RESUMES) if layout.parse_resume_key(k) is not None)


def run_step_number(round: int, step: int, inner_steps: int) -> int:
    """The run's 1-based inner step of this process's ``step``-th step (from 1) in ``round``: the ``step`` of its
    metrics row, which a resumed run continues."""
    return round * inner_steps + (step - 1) % inner_steps + 1


# ---------------------------------------------------------------- writing
class MetricsLog:
    """One replica process's metrics: buffers a round's step rows, writes one object per round.

    ``step(row)`` after every inner step, ``round(row)`` when the round ends
    (writes the object), ``flush()`` at exit (writes buffered step rows of an
    unfinished round, if any). Rows get ``rank``, ``launch`` and ``time``.
    """

    def __init__(self, store: Store, rank: int, *, launch: int | None = None) -> None:
        self.store = store
        self.rank = rank
        self.launch = launch_number(store) if launch is None else launch
        self.writer = layout.new_writer_id(self.launch)
        self._steps: list[dict[str, Any]] = []

    def _stamp(self, kind: str, row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "kind": kind, "rank": self.rank, "launch": self.launch, "time": row.get("time", time.time())}

    def step(self, row: dict[str, Any]) -> None:
        self._steps.append(self._stamp("step", row))

    def round(self, row: dict[str, Any]) -> str:
        """Write the buffered step rows and this round row as the object of ``row["round"]``; return its key."""
        rows = [*self._steps, self._stamp("round", row)]
        self._steps = []
        return self._write(int(row["round"]), rows)

    def flush(self) -> str | None:
        """Write the step rows of an unfinished round (a failure, a stop) so they are not lost."""
        if not self._steps:
            return None
        rows, self._steps = self._steps, []
        return self._write(int(rows[-1].get("round", 0)), rows)

    def _write(self, round: int, rows: list[dict[str, Any]]) -> str:
        key = layout.metrics_key(self.rank, round, self.writer)
        body = encode_rows(rows)
        self.store.put_plain(key, body)
        # Written last: readers take an object only once its digest exists (and, signed, verifies).
        digest = MetricsDigest(sha256=hashlib.sha256(body).hexdigest(), bytes=len(body), rows=len(rows),
                               rank=self.rank, round=round)
        self.store.put_json(layout.metrics_digest_key(key), digest.to_json())
        return key


class Progress:
    """Live figures for the heartbeat, updated every inner step, due every ``every_s`` seconds.

    ``update`` is cheap (no I/O); it returns the heartbeat fields when a
    heartbeat is due (time-gated, so a replica writes at most one progress
    heartbeat per ``every_s``, whatever the step time), else None.
    """

    def __init__(self, *, every_s: float, total_steps: int, ema: float = 0.2,
                 clock: Any = time.monotonic) -> None:
        self.every_s = every_s
        self.total_steps = total_steps
        self.alpha = ema
        self.clock = clock
        self.started = clock()
        self.started_at = time.time()
        self._last_beat = self.started
        self._window: list[tuple[float, int, int]] = []  # (time, steps, tokens) of recent steps
        self.fields: dict[str, Any] = {}
        self._loss_ema: float | None = None
        self._steps = 0
        self._tokens = 0

    def update(self, *, round: int, step: int, out: dict[str, Any], step_s: float) -> dict[str, Any] | None:
        now = self.clock()
        self._steps += 1
        self._tokens += int(out.get("tokens", 0) or 0)
        loss = out.get("loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            self._loss_ema = loss if self._loss_ema is None else (1 - self.alpha) * self._loss_ema + self.alpha * loss
        self._window.append((now, self._steps, self._tokens))
        while len(self._window) > 2 and now - self._window[0][0] > max(30.0, 3 * self.every_s):
            self._window.pop(0)
        f: dict[str, Any] = {"round": round, "step": step, "step_time_s": step_s,
                             "elapsed_s": now - self.started, "started_at": self.started_at,
                             "total_steps": self.total_steps}
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            f["loss"] = float(loss)
        if self._loss_ema is not None:
            f["loss_ema"] = self._loss_ema
        for key in ("reward_mean", "eval_loss", "eval_reward_mean"):
            if isinstance(out.get(key), (int, float)) and math.isfinite(out[key]):
                f["reward" if key == "reward_mean" else key] = float(out[key])
        if "reward" not in f and "reward" in self.fields:
            f["reward"] = self.fields["reward"]  # rewards come with generations, not every step
        t0, s0, k0 = self._window[0]
        span = now - t0
        if span > 0 and self._steps > s0:
            f["steps_per_s"] = (self._steps - s0) / span
            if self._tokens > k0:
                f["tokens_per_s"] = (self._tokens - k0) / span
        elif step_s > 0:
            f["steps_per_s"] = 1.0 / step_s
        self.fields = f
        if now - self._last_beat >= self.every_s:
            self._last_beat = now
            return f
        return None


class Telemetry:
    """One replica process's reports: step and round rows, one log line per step, heartbeats.

    ``versions`` (python/torch/CUDA/...) rides in every heartbeat; ``progress`` is set once training starts.
    """

    def __init__(self, store: Store, rank: int, *, rounds: int, inner_steps: int, progress_every_s: float) -> None:
        self.store = store
        self.rank = rank
        self.rounds = rounds
        self.inner_steps = inner_steps
        self.progress_every_s = progress_every_s
        self.metrics = MetricsLog(store, rank)
        self.progress: Progress | None = None
        self.versions: dict[str, str] = {}

    def start(self, versions: dict[str, str]) -> None:
        """Training starts now: live figures from here on."""
        self.versions = versions
        self.progress = Progress(every_s=self.progress_every_s, total_steps=self.rounds * self.inner_steps)

    def heartbeat(self, state: HeartbeatState, **fields: Any) -> None:
        """Rewrite ``replicas/<rank>.json``: ``state``, the live figures, and ``fields`` (round, step, ...)."""
        live = dict(self.progress.fields) if self.progress is not None else {}
        position = {"round": live.pop("round", None), "step": live.pop("step", None), **fields}
        record = Heartbeat(rank=self.rank, state=state, time=time.time(), pid=os.getpid(), versions=self.versions,
                           progress=live, **position)
        self.store.put_json(layout.heartbeat_key(self.rank), record.to_json())

    def step(self, round: int, step: int, out: dict[str, Any], dt: float) -> None:
        """After every inner step: its metrics row, one log line, and a progress heartbeat when due.

        ``round`` is the round (decoupled: the contribution count) the step belongs to; ``step`` counts this
        process's steps from 1.
        """
        h = self.inner_steps
        run_step = run_step_number(round, step, h)  # 1-based inner step of the run (resumes continue it)
        self.metrics.step({"step": run_step, "round": round, "time_s": dt, **out})
        logger.info("round %d/%d step %d/%d loss %.4f%s %.3fs", round + 1, self.rounds, run_step, self.rounds * h,
                    out.get("loss", float("nan")), f" reward {out['reward_mean']:.3f}" if "reward_mean" in out else "",
                    dt)
        if self.progress is not None and self.progress.update(round=round, step=run_step, out=out, step_s=dt):
            self.heartbeat(HeartbeatState.RUNNING)

    def round(self, row: dict[str, Any]) -> str:
        """The round's row (and its buffered step rows) as one metrics object; returns its key."""
        return self.metrics.round(row)

    def flush(self) -> None:
        """Write the step rows of an unfinished round (a failure, a stop) so they are not lost."""
        self.metrics.flush()

    def samples(self, round: int, step: int, samples: list[dict[str, Any]]) -> str | None:
        """Write the round's sample completions (at most :data:`MAX_SAMPLES`, each text cut to its bound, URL
        credentials redacted) as one object next to the round's metrics; returns its key (None: nothing to write).

        ``step`` is the run's inner step the samples were generated by (the round's last).
        """
        if not samples:
            return None
        record = RoundSamples(rank=self.rank, round=round, step=step, samples=tuple(
            Sample(prompt=clip_text(redact(str(s.get("prompt", "")))),
                   completion=clip_text(redact(str(s.get("completion", "")))),
                   reward=s["reward"] if isinstance(s.get("reward"), (int, float)) and math.isfinite(s["reward"])
                   else None)
            for s in samples[:MAX_SAMPLES]))
        key = layout.samples_key(self.rank, round, self.metrics.writer)
        self.store.put_json(key, record.to_json())
        return key


__all__ = ["MetricsLog", "Progress", "Telemetry", "encode_rows", "launch_number", "run_step_number"]
