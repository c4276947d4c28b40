"""The metrics rows (``metrics/<rank>/<round>-<writer>.jsonl``): one dataclass per row kind, the file's one schema.

A metrics object is plain JSONL (``docs/metrics.md``): a round's :class:`StepRow` lines, then its
:class:`RoundRow`. This module owns the row's columns; the replica's writer
(:mod:`composer_cloud.replica.telemetry`) builds these dataclasses, never a dict, and every reader
(:mod:`composer_cloud.runs.metrics` and what reads through it) gets them back from :meth:`StepRow.from_json` /
:meth:`RoundRow.from_json` (:func:`parse_row`).

The JSON is flat and stays as it was: each typed field is one key; the sync mode's fields
(:class:`LockstepFields`, :class:`DecoupledFields`) are flattened into the round row; the trainer's own
figures (its ``step()`` output on a step row, its ``evaluate()`` output on a round row: ``loss``,
``grad_norm``, per-channel losses, rollout counters, ``eval_loss``, ...) are the row's ``extra`` mapping, so a
trainer adds a figure without touching this module.

Invariants:
  * A typed field that is ``None`` is absent from the JSON, except the *nullable* ones (``healed_to`` of a
    lock-step row; ``merged_here``, ``grace_s`` of a decoupled merge), which are written as ``null``.
  * Non-finite floats are written as ``null`` (strict JSON has no NaN); a typed float read back from ``null``
    is NaN, so a row read and written again has the same keys and values.
  * Reading is tolerant of other versions: a missing field takes its default (``None``: unknown), and a key
    this version does not type is **kept** in ``extra`` (and written again as it was). A typed field of the
    wrong JSON type, or a row without a valid ``kind``/``rank``/``round``, raises
    :class:`~composer_cloud.errors.BadObject` naming the key and the field (the bucket is not trusted).
  * ``extra`` never holds the name of a column the row types (``ValueError`` at construction and on writing);
    the writer keeps every mode's column names out of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from composer_cloud.errors import BadObject
from composer_cloud.storage.records.fields import as_object, is_int

#: The row kinds, in the order a round's object holds them.
KINDS = ("step", "round")


def _col(check: str, *, nullable: bool = False, series: bool = True, default: Any = None) -> Any:
    """A typed column: ``check`` is its JSON type (int | float | bool | str | ranks); ``nullable``: written as
    ``null`` when None instead of left out; ``series``: a measurement (tracking plots it), not a coordinate."""
    return field(default=default, metadata={"check": check, "nullable": nullable, "series": series})


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become None (``null``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _checked(value: Any, check: str, *, name: str, key: str, nullable: bool) -> Any:
    """``value`` of column ``name`` as read, or BadObject naming it; ``null`` reads as NaN for a float."""
    if value is None:
        if nullable:
            return None
        if check == "float":
            return math.nan
        raise BadObject(key, f"metrics row field {name!r} is null; it must be a {check}")
    ok = {"int": is_int(value),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool),
          "str": isinstance(value, str),
          "ranks": isinstance(value, list) and all(is_int(v) for v in value)}[check]
    if not ok:
        raise BadObject(key, f"metrics row field {name!r} must be a {check}, got {value!r:.40}")
    return list(value) if check == "ranks" else value


def _columns(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if "check" in f.metadata)


def _parse(cls: type, obj: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The typed columns of ``cls`` that ``obj`` has, checked."""
    return {f.name: _checked(obj[f.name], f.metadata["check"], name=f.name, key=key, nullable=f.metadata["nullable"])
            for f in fields(cls) if "check" in f.metadata and f.name in obj}


def _emit(row: Any, out: dict[str, Any]) -> dict[str, Any]:
    """``row``'s typed columns into ``out`` (None left out unless nullable)."""
    for f in fields(row):
        if "check" not in f.metadata:
            continue
        v = getattr(row, f.name)
        if v is not None or f.metadata["nullable"]:
            out[f.name] = _clean(list(v) if f.metadata["check"] == "ranks" else v)
    return out


def _ordered(out: dict[str, Any]) -> dict[str, Any]:
    """The JSON in the file's key order (sorted), the reader's ``superseded`` mark last (as it was added)."""
    mark = out.pop("superseded", None)
    ordered = dict(sorted(out.items()))
    if mark is not None:
        ordered["superseded"] = mark
    return ordered


def _check_extra(extra: Mapping[str, Any], owned: Iterable[str], kind: str) -> None:
    clash = sorted(set(extra) & set(owned))
    if clash:
        raise ValueError(f"{kind} row: extra field(s) {clash} have the name of a column the row owns "
                         f"(composer_cloud.storage.records.metrics); rename the trainer's figure")


def _row_head(obj: Any, key: str, kind: str) -> dict[str, Any]:
    obj = as_object(obj, key)
    if obj.get("kind") != kind:
        raise BadObject(key, f"metrics row field 'kind' must be {kind!r}, got {obj.get('kind')!r:.40}")
    for name in ("rank", "round"):
        if not is_int(obj.get(name)):
            raise BadObject(key, f"metrics row field {name!r} must be an integer, got {obj.get(name)!r:.40}")
    return obj


# --------------------------------------------------------------------------- step rows
@dataclass
class StepRow:
    """One inner step of one replica (``kind: "step"``).

    ``step`` is the run's 1-based inner step (``round * inner_steps + i``; resumes continue it); ``round`` the
    store's 0-based round (decoupled: the contributions published before it); ``time`` unix seconds;
    ``time_s`` the step's wall seconds (the step that syncs includes the sync). ``extra``: the trainer's
    ``step()`` output (``loss`` at least; ``grad_norm``, ``tokens``, channel losses, counters...).
    ``superseded`` is never written by a replica: the reader marks rows a resume or restart replaced.
    """

    KIND: ClassVar[str] = "step"

    rank: int = _col("int", series=False, default=MISSING)
    round: int = _col("int", series=False, default=MISSING)
    step: int | None = _col("int", series=False)
    launch: int | None = _col("int", series=False)
    time: float | None = _col("float", series=False)
    time_s: float | None = _col("float")
    superseded: bool | None = _col("bool", series=False)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_extra(self.extra, STEP_COLUMNS, self.KIND)

    @property
    def loss(self) -> float | None:
        """The trainer's step loss (None: not reported, or not finite)."""
        v = self.extra.get("loss")
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    def get(self, name: str, default: Any = None) -> Any:
        """Column ``name`` as the JSON has it (typed or the trainer's; non-finite as None)."""
        return self.to_json().get(name, default)

    def to_json(self) -> dict[str, Any]:
        _check_extra(self.extra, STEP_COLUMNS, self.KIND)
        return _ordered(_emit(self, {**_clean(self.extra), "kind": self.KIND}))

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "StepRow":
        obj = _row_head(obj, key, cls.KIND)
        known = {*STEP_COLUMNS, "kind"}
        return cls(**_parse(cls, obj, key), extra={k: v for k, v in obj.items() if k not in known})


# --------------------------------------------------------------------------- round rows
@dataclass
class LockstepFields:
    """A lock-step round row's own columns. ``healed_to`` (always written, ``null`` when it did not heal): the
    round whose committed state this replica loaded instead of taking part; the checkpoint times are set on
    the rounds this replica checkpointed (seconds on the critical path)."""

    healed_to: int | None = _col("int", nullable=True, series=False)
    checkpoint_wait_s: float | None = _col("float")
    checkpoint_snapshot_s: float | None = _col("float")


@dataclass
class DecoupledFields:
    """A decoupled boundary's own columns (``round`` is the replica's contribution count minus one).

    ``merged_version``: the global version adopted after it (every decoupled row has it). The rest is set by
    the replica that published (local rank 0): whether it adopted a newer version, the merge it made
    (``merged_here``: the version, null if none) and why (``merge_reason``, ``grace_s``), how many versions
    its contribution's base was behind (``staleness``), its tokens, and its checkpoint seconds.
    ``merged_here`` and ``grace_s`` are written (``null`` or not) exactly when ``merge_reason`` is set.
    """

    merged_version: int = _col("int", series=False, default=MISSING)
    adopted: bool | None = _col("bool", series=False)
    merged_here: int | None = _col("int", nullable=True, series=False)
    merge_reason: str | None = _col("str", series=False)
    grace_s: float | None = _col("float", nullable=True)
    staleness: int | None = _col("int")
    tokens: int | None = _col("int")
    wait_s: float | None = _col("float")
    checkpoint_s: float | None = _col("float")

    def to_json(self) -> dict[str, Any]:
        out = _emit(self, {})
        if self.merge_reason is None:
            for name in ("merged_here", "grace_s"):
                if getattr(self, name) is None:
                    out.pop(name)
        return out


@dataclass
class RoundRow:
    """One round of one replica (``kind: "round"``), written when its boundary passed.

    Sync outcome as this replica saw it (``committed``, ``participants``), the round's means over its inner
    steps (``train_loss``, ``reward_mean``), seconds (``compute_s`` in inner steps, ``sync_s`` in the sync,
    ``quorum_wait_s`` waiting for the quorum, ``wall_s`` the whole round), the sync's store traffic (bytes),
    the synced set (``synced_params``; ``synced_fraction`` of a full fine-tune's bytes), then the mode's own
    columns (exactly one of ``lockstep`` / ``decoupled`` in a replica's row) and ``extra``: the trainer's
    evaluation (``eval_loss``, ``eval_reward_mean``, ...) and any column this version does not know.
    """

    KIND: ClassVar[str] = "round"

    rank: int = _col("int", series=False, default=MISSING)
    round: int = _col("int", series=False, default=MISSING)
    launch: int | None = _col("int", series=False)
    time: float | None = _col("float", series=False)
    committed: bool | None = _col("bool", series=False)
    participants: list[int] | None = _col("ranks", series=False)
    train_loss: float | None = _col("float")
    reward_mean: float | None = _col("float")
    compute_s: float | None = _col("float")
    sync_s: float | None = _col("float")
    quorum_wait_s: float | None = _col("float")
    wall_s: float | None = _col("float")
    bytes_read: int | None = _col("int")
    bytes_written: int | None = _col("int")
    synced_params: int | None = _col("int")
    synced_fraction: float | None = _col("float")
    superseded: bool | None = _col("bool", series=False)
    lockstep: LockstepFields | None = None
    decoupled: DecoupledFields | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_extra(self.extra, self.owned(), self.KIND)

    def owned(self) -> tuple[str, ...]:
        """The columns this row types: its own and its mode's (a mode's column in a row of no mode is a figure)."""
        return ("kind", *_columns(RoundRow), *(_columns(LockstepFields) if self.lockstep is not None else ()),
                *(_columns(DecoupledFields) if self.decoupled is not None else ()))

    @property
    def bytes_moved(self) -> int:
        """Store bytes the sync read and wrote (0 where not reported)."""
        return (self.bytes_read or 0) + (self.bytes_written or 0)

    def get(self, name: str, default: Any = None) -> Any:
        """Column ``name`` as the JSON has it (typed, the mode's or the trainer's; non-finite as None)."""
        return self.to_json().get(name, default)

    def to_json(self) -> dict[str, Any]:
        _check_extra(self.extra, self.owned(), self.KIND)
        out = _emit(self, {**_clean(self.extra), "kind": self.KIND})
        if self.lockstep is not None:
            _emit(self.lockstep, out)
        if self.decoupled is not None:
            out.update(self.decoupled.to_json())
        return _ordered(out)

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "RoundRow":
        """``healed_to`` present: a lock-step row; ``merged_version`` present: a decoupled one."""
        obj = _row_head(obj, key, cls.KIND)
        lockstep = LockstepFields(**_parse(LockstepFields, obj, key)) if "healed_to" in obj else None
        decoupled = DecoupledFields(**_parse(DecoupledFields, obj, key)) if "merged_version" in obj else None
        row = cls(**_parse(cls, obj, key), lockstep=lockstep, decoupled=decoupled)
        known = set(row.owned())
        row.extra = {k: v for k, v in obj.items() if k not in known}
        return row


Row = StepRow | RoundRow

#: Each row kind's typed columns (the mode's columns flattened into the round row's), from the dataclasses.
STEP_COLUMNS: tuple[str, ...] = ("kind", *_columns(StepRow))
ROUND_COLUMNS: tuple[str, ...] = ("kind", *_columns(RoundRow), *_columns(LockstepFields), *_columns(DecoupledFields))
#: Typed columns that are coordinates or bookkeeping, not measurements (tracking plots none of them).
NOT_SERIES: frozenset[str] = frozenset({"kind"} | {f.name for c in (StepRow, RoundRow, LockstepFields, DecoupledFields)
                                                   for f in fields(c) if not f.metadata.get("series", True)})
#: The table's column order: these first (where present), then every other column alphabetically. ``loss`` is
#: the trainer's step loss (every trainer reports it: ``InnerTrainer.step``).
LEADING_COLUMNS = ("kind", "rank", "round", "step", "launch", "committed", "loss", "train_loss", "reward_mean")


def parse_row(obj: Any, *, key: str) -> Row:
    """A row of either kind (by its ``kind``), or BadObject naming the key and the field."""
    kind = obj.get("kind") if isinstance(obj, dict) else None
    if kind == RoundRow.KIND:
        return RoundRow.from_json(obj, key=key)
    if kind == StepRow.KIND:
        return StepRow.from_json(obj, key=key)
    raise BadObject(key, f"metrics row field 'kind' must be one of {KINDS}, got {kind!r:.40}")


def columns(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The column order of a table of rows (their JSON): :data:`LEADING_COLUMNS` first, the rest alphabetically."""
    seen = {k for r in rows for k in r}
    return [c for c in LEADING_COLUMNS if c in seen] + sorted(seen - set(LEADING_COLUMNS))


def encode_rows(rows: Iterable[Row]) -> bytes:
    """The object's JSONL body: one sorted-key strict-JSON line per row."""
    return "".join(json.dumps(r.to_json(), sort_keys=True, allow_nan=False) + "\n" for r in rows).encode()


__all__ = ["KINDS", "LEADING_COLUMNS", "NOT_SERIES", "ROUND_COLUMNS", "STEP_COLUMNS", "DecoupledFields",
           "LockstepFields", "RoundRow", "Row", "StepRow", "columns", "encode_rows", "parse_row"]
