"""Reading a run's per-step and per-round metrics (the replicas write them: :mod:`composer_cloud.replica.telemetry`).

One object per rank and round (keys: :func:`composer_cloud.storage.layout.metrics_key`;
``docs/metrics.md``): plain JSONL of the round's step rows, then its round
row, and a framed (signed with a run key) digest of it.

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

Rows are parsed into their typed records (:mod:`composer_cloud.storage.records.metrics`: ``StepRow``,
``RoundRow``, the one schema and column order): :func:`read_rows` returns them; :func:`read_metrics` and
:func:`rows_by_writer` return their JSON (the file's keys and values, as a dict per row).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from composer_cloud.errors import BadObject, ObjectNotFound
from composer_cloud.storage import layout
from composer_cloud.storage.records import MetricsDigest, ResumeRecord
from composer_cloud.storage.records.metrics import KINDS, Row, StepRow, columns, parse_row
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)


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


def _parse_rows(lines: list[Any], obj: MetricsObject) -> list[Row]:
    """The object's valid rows (typed; each must name the object's rank); a malformed row is left out."""
    good: list[Row] = []
    for line in lines:
        try:
            row = parse_row(line, key=obj.key)
        except BadObject:
            continue
        if row.rank == obj.rank:
            good.append(row)
    if len(good) != len(lines):
        logger.warning("ignoring %d malformed row(s) of %s", len(lines) - len(good), obj.key)
    return good


def read_object(store: Store, obj: MetricsObject) -> list[Row]:
    """The object's rows, verified against its digest; [] (with a warning) for a bad object."""
    digest_key = layout.metrics_digest_key(obj.key)
    try:
        digest = MetricsDigest.from_json(store.get_json(digest_key), key=digest_key)
        body = store.get_plain(obj.key)
        if digest.sha256 != hashlib.sha256(body).hexdigest():
            logger.warning("ignoring %s: it does not match its digest %s", obj.key, digest_key)
            return []
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
    except (BadObject, ObjectNotFound, UnicodeDecodeError, json.JSONDecodeError) as exc:
        logger.warning("ignoring %s: %s", obj.key, exc)
        return []
    return _parse_rows(lines, obj)


def rows_by_writer(store: Store, rank: int) -> dict[str, list[dict[str, Any]]]:
    """One replica's verified rows (their JSON) per writer (one writer = one replica process), oldest writer
    first."""
    out: dict[str, list[dict[str, Any]]] = {}
    for obj in list_objects(store, rank=rank):  # by round within a writer
        out.setdefault(obj.writer, []).extend(r.to_json() for r in read_object(store, obj))
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


def superseded_objects(objs: Sequence[MetricsObject], resumes: dict[int, int]) -> set[str]:
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


def read_rows(store: Store, *, rank: int | None = None, kind: str | None = None,
              superseded: bool = False, threads: int = 8) -> list[Row]:
    """The run's metric rows, typed, sorted by (round, rank, kind: steps first, step).

    Args:
        rank: only this replica.
        kind: ``"step"`` or ``"round"`` rows only.
        superseded: also rows of objects that a resume or restart replaced, marked ``superseded = True``.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    objs = list_objects(store, rank=rank)
    stale = superseded_objects(objs, resume_points(store)) if objs else set()
    if not superseded:
        objs = [o for o in objs if o.key not in stale]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(objs)))) as pool:
        loaded = list(pool.map(lambda o: read_object(store, o), objs)) if objs else []
    rows: list[Row] = []
    for o, obj_rows in zip(objs, loaded):
        for r in obj_rows:
            if kind is not None and r.KIND != kind:
                continue
            if o.key in stale:
                r.superseded = True
            rows.append(r)
    rows.sort(key=lambda r: (r.round, r.rank, not isinstance(r, StepRow),
                             (r.step or 0) if isinstance(r, StepRow) else 0))
    return rows


def read_metrics(store: Store, *, rank: int | None = None, kind: str | None = None,
                 superseded: bool = False, threads: int = 8) -> list[dict[str, Any]]:
    """The run's metric rows as the file has them (one dict per row: its JSON), in :func:`read_rows`' order
    and with its arguments; superseded rows are marked ``"superseded": True``."""
    return [r.to_json() for r in read_rows(store, rank=rank, kind=kind, superseded=superseded, threads=threads)]


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    """``metrics --csv``: one line per row (its JSON), in the schema's column order
    (:func:`~composer_cloud.storage.records.metrics.columns`); lists and objects as JSON."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns(rows), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()})
    return buf.getvalue()


def eta_s(*, step: int | None, total_steps: int, steps_per_s: float | None) -> float | None:
    """Seconds left at the current rate (None if unknown)."""
    if step is None or not steps_per_s or steps_per_s <= 0:
        return None
    return max(0.0, (total_steps - step) / steps_per_s)


__all__ = ["MetricsObject", "eta_s", "list_objects", "read_metrics", "read_object", "read_rows", "resume_points",
           "rows_by_writer", "superseded_objects", "to_csv"]
