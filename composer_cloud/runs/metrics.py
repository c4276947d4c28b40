"""Per-step and per-round metrics, and live progress, of a run's replicas.

Layout (see ``docs/metrics.md``)::

    metrics/<rank>/<round:08d>-<writer>.jsonl   plain JSONL: the round's step rows, then its round row
    metrics/<rank>/<round:08d>-<writer>.json    framed (signed with a run key) digest of the .jsonl

Each object is written once, when its round ends, and never rewritten or
deleted: ``resume`` and restarts add objects, so no history is lost. The
``.jsonl`` payload is plain (no store frame) so that any tool reads it as it
is (``pandas.read_json(path, lines=True)``); its integrity (and, with a run
key, authenticity) comes from the digest object next to it, which the writer
puts last. Readers use only objects whose digest exists and matches, and
validate every row (the bucket is not trusted).

``writer`` is ``<launch:04d>-<start ms:013d>-<4 hex>``: the launch (0, then one
per ``resume``, from ``resumes/``) and the replica process's start time, so
names sort oldest first. :func:`read_metrics` keeps, per ``(rank, round)``, the
newest object that belongs to the run's current timeline: an object of launch
``L`` for round ``r`` is *superseded* when a later launch resumed from a
checkpoint before ``r`` (it re-ran ``r``), or when a newer process of the same
launch wrote ``r`` again (a restart). ``superseded=True`` returns those too,
marked ``"superseded": true``.

Also here: :class:`Progress`, the time-gated live figures (step, loss, reward,
steps/s, tokens/s, elapsed) a replica puts into its heartbeat every
``progress_every_s`` seconds.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from composer_cloud.errors import BadObject, ObjectNotFound
from composer_cloud.storage.store import Store
from composer_cloud.storage import layout
from composer_cloud.storage.records import MetricsDigest, ResumeRecord

logger = logging.getLogger(__name__)

KINDS = ("step", "round")


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


# ---------------------------------------------------------------- reading
@dataclass(frozen=True)
class MetricsObject:
    key: str
    rank: int
    round: int
    writer: str

    @property
    def launch(self) -> int:
        return layout.writer_launch(self.writer)


def list_objects(store: Store, *, rank: int | None = None) -> list[MetricsObject]:
    """Every complete metrics object of the run (its digest exists), oldest writer first per rank and round."""
    keys = store.list(layout.metrics_prefix(rank))
    names = set(keys)
    out: list[MetricsObject] = []
    for key in keys:
        parsed = layout.parse_metrics_key(key)
        if parsed is not None and layout.metrics_digest_key(key) in names:
            out.append(MetricsObject(key, *parsed))
    return sorted(out, key=lambda o: (o.rank, o.round, o.writer))


def _valid_row(row: Any, rank: int) -> bool:
    return (isinstance(row, dict) and row.get("kind") in KINDS and row.get("rank") == rank
            and isinstance(row.get("round"), int) and not isinstance(row.get("round"), bool))


def _read_object(store: Store, obj: MetricsObject) -> list[dict[str, Any]]:
    """The object's rows, verified against its digest; [] (with a warning) for a bad object."""
    digest_key = layout.metrics_digest_key(obj.key)
    try:
        digest = MetricsDigest.from_json(store.get_json(digest_key), key=digest_key)
        body = store.get_plain(obj.key)
        if digest.sha256 != hashlib.sha256(body).hexdigest():
            logger.warning("ignoring %s: it does not match its digest %s", obj.key, digest_key)
            return []
        rows = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
    except (BadObject, ObjectNotFound, UnicodeDecodeError, json.JSONDecodeError) as exc:
        logger.warning("ignoring %s: %s", obj.key, exc)
        return []
    good = [r for r in rows if _valid_row(r, obj.rank)]
    if len(good) != len(rows):
        logger.warning("ignoring %d malformed row(s) of %s", len(rows) - len(good), obj.key)
    return good


def rows_by_writer(store: Store, rank: int) -> dict[str, list[dict[str, Any]]]:
    """One replica's verified rows per writer (one writer = one replica process), oldest writer first."""
    out: dict[str, list[dict[str, Any]]] = {}
    for obj in list_objects(store, rank=rank):  # by round within a writer
        out.setdefault(obj.writer, []).extend(_read_object(store, obj))
    return dict(sorted(out.items()))


def resume_points(store: Store) -> dict[int, int]:
    """``{launch: from_round}`` for every resume (launch n >= 1 re-ran the rounds after ``from_round``)."""
    out: dict[int, int] = {}
    for key in store.list(layout.RESUMES):
        n = layout.parse_resume_key(key)
        if n is None:
            continue
        try:
            out[n + 1] = ResumeRecord.from_json(store.get_json(key), key=key).from_round
        except (BadObject, ObjectNotFound) as exc:
            logger.warning("ignoring %s: %s", key, exc)
    return out


def _superseded(objs: Sequence[MetricsObject], resumes: dict[int, int]) -> set[str]:
    """Keys of objects a later write replaced (see the module docstring)."""
    out: set[str] = set()
    by_round: dict[tuple[int, int], list[MetricsObject]] = {}
    for o in objs:
        if any(later > o.launch and from_round < o.round for later, from_round in resumes.items()):
            out.add(o.key)
        else:
            by_round.setdefault((o.rank, o.round), []).append(o)
    for group in by_round.values():
        group.sort(key=lambda o: o.writer)
        out.update(o.key for o in group[:-1])
    return out


def read_metrics(store: Store, *, rank: int | None = None, kind: str | None = None,
                 superseded: bool = False, threads: int = 8) -> list[dict[str, Any]]:
    """The run's metric rows, sorted by (round, rank, kind: steps first, step).

    Args:
        rank: only this replica.
        kind: ``"step"`` or ``"round"`` rows only.
        superseded: also rows of objects that a resume or restart replaced, marked ``"superseded": True``.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    objs = list_objects(store, rank=rank)
    stale = _superseded(objs, resume_points(store)) if objs else set()
    if not superseded:
        objs = [o for o in objs if o.key not in stale]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(objs)))) as pool:
        loaded = list(pool.map(lambda o: _read_object(store, o), objs)) if objs else []
    rows: list[dict[str, Any]] = []
    for o, obj_rows in zip(objs, loaded):
        for r in obj_rows:
            if kind is not None and r["kind"] != kind:
                continue
            if o.key in stale:
                r = {**r, "superseded": True}
            rows.append(r)
    rows.sort(key=lambda r: (r["round"], r["rank"], r["kind"] != "step", r.get("step") or 0))
    return rows


def columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Column order for tables: the identifying fields first, then the rest alphabetically."""
    first = ["kind", "rank", "round", "step", "launch", "committed", "loss", "train_loss", "reward_mean"]
    seen = {k for r in rows for k in r}
    return [c for c in first if c in seen] + sorted(seen - set(first))


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns(rows), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()})
    return buf.getvalue()


# ---------------------------------------------------------------- live progress
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


def eta_s(*, step: int | None, total_steps: int, steps_per_s: float | None) -> float | None:
    """Seconds left at the current rate (None if unknown)."""
    if step is None or not steps_per_s or steps_per_s <= 0:
        return None
    return max(0.0, (total_steps - step) / steps_per_s)


__all__ = ["MetricsLog", "MetricsObject", "Progress", "columns", "encode_rows", "eta_s", "launch_number",
           "list_objects", "read_metrics", "resume_points", "to_csv"]
