"""Decoupled-mode records: contributions (a meta, or a merge record's entry), merge records, the final record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from composer_cloud.errors import BadObject
from composer_cloud.storage.records.fields import as_object, float_field, int_field, is_int, sha256_field


@dataclass(frozen=True)
class Contribution:
    """A contribution's meta (``decoupled/contrib/<rank>/<seq>.json``), also an entry of a merge record.

    ``time`` is the publisher's wall clock (seconds since the epoch); ``run_id``
    and ``bytes`` are written in the meta only.
    """

    rank: int
    seq: int
    base_version: int
    tokens: int
    inner_steps: int
    sha256: str
    time: float

    def to_entry(self) -> dict[str, Any]:
        """The form listed in a merge record."""
        return {"rank": self.rank, "seq": self.seq, "base_version": self.base_version, "tokens": self.tokens,
                "inner_steps": self.inner_steps, "sha256": self.sha256, "time": self.time}

    def to_json(self, *, run_id: str, bytes: int) -> dict[str, Any]:
        """The meta object."""
        return {**self.to_entry(), "run_id": run_id, "bytes": bytes}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, run_id: str, rank: Any, seq: Any, replicas: int) -> "Contribution":
        """A meta, or a merge record's entry (which carries no ``run_id``), stored as ``rank``'s ``seq``."""
        obj = as_object(obj, key)
        if "run_id" in obj and obj["run_id"] != run_id:
            raise BadObject(key, f"belongs to run {obj.get('run_id')!r:.60}, not {run_id!r}")
        c = cls(rank=int_field(obj, "rank", key), seq=int_field(obj, "seq", key, lo=1),
                base_version=int_field(obj, "base_version", key), tokens=int_field(obj, "tokens", key, lo=1),
                inner_steps=int_field(obj, "inner_steps", key, lo=1), sha256=sha256_field(obj, "sha256", key),
                time=float_field(obj, "time", key))
        if c.rank != rank or c.seq != seq or not 0 <= c.rank < replicas:
            raise BadObject(key, f"names rank {c.rank} seq {c.seq}, stored as rank {rank} seq {seq} "
                                 f"of {replicas} replicas")
        return c


@dataclass(frozen=True)
class Rejected:
    """A contribution a merge looked at and refused (never looked at again), with why."""

    rank: int
    seq: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "seq": self.seq, "reason": self.reason[:200]}


@dataclass(frozen=True)
class MergeRecord:
    """``decoupled/merge/<v>.json``: version ``v`` = global ``v-1`` + an outer step on the weighted contributions.

    ``cursor[rank]`` is the highest seq of ``rank`` consumed through ``v``
    (merged, or valid and refused by a check; a meta that failed validation
    never moves it). ``merged[rank]`` counts the contributions of ``rank``
    merged through ``v`` (the fleet's budget; None in records written before it
    existed: the cursor stands in). The protocol checks that ``weights`` are the
    token weights of ``contributions``.
    """

    run_id: str
    version: int
    contributions: tuple[Contribution, ...]
    weights: tuple[float, ...]
    cursor: dict[int, int]
    final: bool
    time: float
    rejected: tuple[Rejected, ...] = ()
    staleness: tuple[int, ...] = ()
    grace_s: float = 0.0
    reason: str = ""
    decided_by: int | None = None
    merged: dict[int, int] | None = None
    #: Per rank, the merge guard's running reference ``(norm, tokens)`` of its accepted contributions
    #: (:mod:`composer_cloud.sync.decoupled.guard`); None in records written before it existed.
    references: dict[int, tuple[float, float]] | None = None

    def merged_count(self, rank: int) -> int:
        """Contributions of ``rank`` merged through this version."""
        return self.merged.get(rank, 0) if self.merged is not None else self.cursor.get(rank, 0)

    @property
    def base(self) -> int:
        return self.version - 1

    @property
    def ranks(self) -> list[int]:
        return sorted({c.rank for c in self.contributions})

    def to_json(self) -> dict[str, Any]:
        merged = {} if self.merged is None else {"merged": {str(k): self.merged[k] for k in sorted(self.merged)}}
        if self.references is not None:
            merged["references"] = {str(k): list(self.references[k]) for k in sorted(self.references)}
        return {"run_id": self.run_id, "version": self.version, "base": self.base,
                "contributions": [c.to_entry() for c in self.contributions], "weights": list(self.weights),
                "cursor": {str(k): self.cursor[k] for k in sorted(self.cursor)},
                "rejected": [r.to_json() for r in self.rejected], "staleness": list(self.staleness),
                "grace_s": self.grace_s, "reason": self.reason, "final": self.final,
                "decided_by": self.decided_by, "time": self.time, **merged}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, run_id: str, version: int, replicas: int) -> "MergeRecord":
        obj = as_object(obj, key)
        if obj.get("run_id") != run_id:
            raise BadObject(key, f"belongs to run {obj.get('run_id')!r:.60}, not {run_id!r}")
        if int_field(obj, "version", key, lo=1) != version or int_field(obj, "base", key) != version - 1:
            raise BadObject(key, f"names version {obj.get('version')!r}/base {obj.get('base')!r}, stored as {version}")
        entries = obj.get("contributions")
        if not isinstance(entries, list) or len(entries) > 100_000:
            raise BadObject(key, "field 'contributions' must be a list")
        contribs = []
        for e in entries:
            if not isinstance(e, dict):
                raise BadObject(key, "a contribution entry is not an object")
            contribs.append(Contribution.from_json(e, key=key, run_id=run_id, rank=e.get("rank"), seq=e.get("seq"),
                                                   replicas=replicas))
        if len({(c.rank, c.seq) for c in contribs}) != len(contribs) or contribs != sorted(
                contribs, key=lambda c: (c.rank, c.seq)):
            raise BadObject(key, "contributions must be unique and sorted by (rank, seq)")
        weights = obj.get("weights")
        if (not isinstance(weights, list) or len(weights) != len(contribs)
                or not all(isinstance(w, float) and math.isfinite(w) for w in weights)):
            raise BadObject(key, "field 'weights' must be one finite number per contribution")
        cur = obj.get("cursor")
        if not isinstance(cur, dict):
            raise BadObject(key, "field 'cursor' must be an object")
        cursor: dict[int, int] = {}
        for k, v in cur.items():
            if not (isinstance(k, str) and k.isdigit() and int(k) < replicas and is_int(v) and v >= 0):
                raise BadObject(key, f"cursor entry {k!r:.20}: {v!r:.20} is not rank: seq")
            cursor[int(k)] = v
        if any(c.seq > cursor.get(c.rank, 0) for c in contribs):
            raise BadObject(key, "a contribution lies beyond the cursor")
        final = obj.get("final", False)
        if not isinstance(final, bool):
            raise BadObject(key, "field 'final' must be a boolean")
        rejected = tuple(Rejected(r["rank"], r["seq"], str(r.get("reason", ""))) for r in obj.get("rejected") or []
                         if isinstance(r, dict) and is_int(r.get("rank")) and is_int(r.get("seq")))
        merged = _rank_counts(obj.get("merged"), key, replicas, cursor) if "merged" in obj else None
        refs = _references(obj.get("references"), key, replicas) if "references" in obj else None
        by, grace, reason = obj.get("decided_by"), obj.get("grace_s"), obj.get("reason")
        return cls(run_id=run_id, version=version, contributions=tuple(contribs), weights=tuple(weights),
                   cursor=cursor, final=final, time=float_field(obj, "time", key), rejected=rejected,
                   staleness=tuple(s for s in obj.get("staleness") or [] if is_int(s)),
                   grace_s=float(grace) if isinstance(grace, (int, float)) else 0.0,
                   reason=reason if isinstance(reason, str) else "", decided_by=by if is_int(by) else None,
                   merged=merged, references=refs)


def _references(value: Any, key: str, replicas: int) -> dict[int, tuple[float, float]]:
    """``references``: ``{rank: [norm, tokens]}``, finite, norm >= 0 and tokens > 0."""
    if not isinstance(value, dict):
        raise BadObject(key, "field 'references' must be an object")
    out: dict[int, tuple[float, float]] = {}
    for k, v in value.items():
        ok = (isinstance(k, str) and k.isdigit() and int(k) < replicas and isinstance(v, list) and len(v) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
              and v[0] >= 0 and v[1] > 0)
        if not ok:
            raise BadObject(key, f"references entry {k!r:.20}: {v!r:.40} is not rank: [norm, tokens]")
        out[int(k)] = (float(v[0]), float(v[1]))
    return out


def _rank_counts(value: Any, key: str, replicas: int, cursor: dict[int, int]) -> dict[int, int]:
    """``merged``: ``{rank: count}``, each count at most the rank's cursor (a count is of seqs consumed)."""
    if not isinstance(value, dict):
        raise BadObject(key, "field 'merged' must be an object")
    out: dict[int, int] = {}
    for k, v in value.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) < replicas and is_int(v)
                and 0 <= v <= cursor.get(int(k), 0)):
            raise BadObject(key, f"merged entry {k!r:.20}: {v!r:.20} is not rank: count <= its cursor")
        out[int(k)] = v
    return out


@dataclass(frozen=True)
class FinalRecord:
    """``decoupled/final.json``: the run's final version (write-once, after it was read back and verified)."""

    version: int
    by: int
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "time": self.time, "by": self.by}

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "FinalRecord":
        obj = as_object(obj, key)
        by, t = obj.get("by"), obj.get("time")
        return cls(version=int_field(obj, "version", key), by=by if is_int(by) else -1,
                   time=float(t) if isinstance(t, (int, float)) else 0.0)
