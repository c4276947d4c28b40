"""Every JSON record of a run, typed once: one dataclass per record, with its ``to_json``/``from_json`` pair.

A writer builds the dataclass and stores ``to_json()``; a reader calls
``from_json(obj, key=...)`` on what it read. The bucket is not trusted
(``docs/store.md``), so ``from_json`` checks the schema (types, ranges, and the
record's own position where it carries one) and raises
:class:`~composer_cloud.errors.BadObject` naming the key and the field; what
a rejection costs is the caller's decision. Rules that relate several records
(an outcome must agree with its quorum, a merge's weights with its
contributions) belong to the protocols, not here. Keys: :mod:`composer_cloud.storage.layout`.

Records read by status displays (:class:`Heartbeat`) are parsed leniently
instead: a malformed field reads as unknown, never as an error.
"""

from __future__ import annotations

import enum
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from composer_cloud.errors import BadObject

_SHA256 = re.compile(r"[0-9a-f]{64}")


# --------------------------------------------------------------------------- field checks
def is_int(value: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_object(obj: Any, key: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BadObject(key, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def int_field(obj: Mapping[str, Any], name: str, key: str, *, lo: int = 0) -> int:
    v = obj.get(name)
    if not is_int(v) or v < lo:
        raise BadObject(key, f"field {name!r} must be an integer >= {lo}, got {v!r:.40}")
    return v


def float_field(obj: Mapping[str, Any], name: str, key: str) -> float:
    v = obj.get(name)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise BadObject(key, f"field {name!r} must be a finite number, got {v!r:.40}")
    return float(v)


def sha256_field(obj: Mapping[str, Any], name: str, key: str) -> str:
    v = obj.get(name)
    if not isinstance(v, str) or not _SHA256.fullmatch(v):
        raise BadObject(key, f"field {name!r} must be a sha256 hex digest")
    return v


def rank_list(value: Any, *, key: str, name: str, replicas: int | None, sorted_unique: bool = True) -> list[int]:
    """A list of ranks: ints in ``[0, replicas)`` (``replicas=None``: just ``>= 0``)."""
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise BadObject(key, f"field {name!r} must be a list of integer ranks, got {value!r:.80}")
    bad = [v for v in value if v < 0 or (replicas is not None and v >= replicas)]
    if bad:
        raise BadObject(key, f"field {name!r} has ranks {bad[:8]} outside [0, {replicas})")
    if sorted_unique and any(b <= a for a, b in zip(value, value[1:])):
        raise BadObject(key, f"field {name!r} must be sorted and unique, got {value[:16]}")
    return list(value)


def check_position(obj: Mapping[str, Any], *, key: str, **want: int) -> None:
    """The record names the position it is stored at (``round=``, ``attempt=``...): one copied elsewhere is refused."""
    for name, expected in want.items():
        if obj.get(name) != expected:
            raise BadObject(key, f"field {name!r} is {obj.get(name)!r:.40}, expected {expected} (a record copied "
                                 "from another round or attempt, or none at all)")


# --------------------------------------------------------------------------- round records (lock-step)
@dataclass(frozen=True)
class Join:
    """``join/<rank>.json``: "I reached sync r". Only the object's name is ever read."""

    rank: int
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "time": self.time}


@dataclass(frozen=True)
class Quorum:
    """``quorum.json``: who takes part in an attempt (write-once)."""

    round: int
    attempt: int
    participants: list[int]
    excluded: list[int] = field(default_factory=list)
    reason: str = ""
    decided_by: int | None = None
    time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "attempt": self.attempt, "participants": self.participants,
                "excluded": self.excluded, "decided_by": self.decided_by, "time": self.time, "reason": self.reason}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, round: int, attempt: int, replicas: int | None,
                  min_replicas: int = 1) -> "Quorum":
        """Participants sorted, unique, in range, at least ``min_replicas``; none of them excluded."""
        obj = as_object(obj, key)
        check_position(obj, key=key, round=round, attempt=attempt)
        if "participants" not in obj:
            raise BadObject(key, "field 'participants' is missing")
        participants = rank_list(obj["participants"], key=key, name="participants", replicas=replicas)
        if len(participants) < max(1, min_replicas):
            raise BadObject(key, f"{len(participants)} participants, fewer than min_replicas={min_replicas}")
        excluded = rank_list(obj.get("excluded", []), key=key, name="excluded", replicas=replicas)
        if set(excluded) & set(participants):
            raise BadObject(key, f"ranks {sorted(set(excluded) & set(participants))} are both participants "
                                 "and excluded")
        reason, by = obj.get("reason", ""), obj.get("decided_by")
        return cls(round=round, attempt=attempt, participants=participants, excluded=excluded,
                   reason=reason if isinstance(reason, str) else "", decided_by=by if is_int(by) else None,
                   time=obj["time"] if isinstance(obj.get("time"), (int, float)) else 0.0)


@dataclass(frozen=True)
class Outcome:
    """``outcome.json``: an attempt committed, or aborted with a reason (write-once).

    Attributes:
        committed: the attempt's result may be applied (a reader also checks it against the quorum).
        reason: why the attempt was aborted.
        missing: ranks whose objects did not arrive.
        excluded: ranks whose payload failed a check; left out of the retries of this round.
        check: which integrity check aborted the attempt (``nonfinite``, ``outlier``, ``malformed``,
            ``corrupt``, ``reduced``, ``quorum``, ``outcome``), if any.
        retry: a fresh attempt with the same payloads may pass: retried at once.
        by: the rank that decided.
        slot: the slot whose check failed.
        problem: set (never stored) when this stands for an unusable record, which counts as an abort.
        unreadable: the unusable record's bytes could not be read at all (it may have been a commit).
    """

    round: int
    attempt: int
    committed: bool
    reason: str = ""
    participants: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    excluded: list[int] = field(default_factory=list)
    check: str | None = None
    retry: bool = False
    by: int | None = None
    slot: int | None = None
    time: float = 0.0
    problem: str = ""
    unreadable: bool = False

    def to_json(self) -> dict[str, Any]:
        if self.committed:
            return {"round": self.round, "attempt": self.attempt, "committed": True,
                    "participants": self.participants, "by": self.by, "time": self.time}
        out: dict[str, Any] = {"round": self.round, "attempt": self.attempt, "committed": False,
                               "reason": self.reason, "missing": self.missing, "excluded": self.excluded,
                               "check": self.check, "retry": self.retry, "by": self.by, "time": self.time}
        if self.slot is not None:
            out["slot"] = self.slot
        return out

    @classmethod
    def from_json(cls, obj: Any, *, key: str, round: int, attempt: int, replicas: int | None) -> "Outcome":
        obj = as_object(obj, key)
        check_position(obj, key=key, round=round, attempt=attempt)
        committed = obj.get("committed")
        if not isinstance(committed, bool):
            raise BadObject(key, f"field 'committed' must be true or false, got {committed!r:.40}")
        by = obj.get("by")
        if by is not None and not is_int(by):
            raise BadObject(key, f"field 'by' must be a rank, got {by!r:.40}")
        if committed:
            if "participants" not in obj:
                raise BadObject(key, "a committed outcome must name its participants")
            participants = rank_list(obj["participants"], key=key, name="participants", replicas=replicas)
            return cls(round=round, attempt=attempt, committed=True, participants=participants, by=by)
        reason, check, retry = obj.get("reason", ""), obj.get("check"), obj.get("retry", False)
        if not isinstance(reason, str) or not (check is None or isinstance(check, str)) or not isinstance(retry, bool):
            raise BadObject(key, "fields 'reason', 'check' must be strings and 'retry' a boolean")
        return cls(round=round, attempt=attempt, committed=False, reason=reason, check=check, retry=retry, by=by,
                   missing=rank_list(obj.get("missing", []), key=key, name="missing", replicas=replicas,
                                     sorted_unique=False),
                   excluded=rank_list(obj.get("excluded", []), key=key, name="excluded", replicas=replicas))

    @classmethod
    def unusable(cls, round: int, attempt: int, exc: BadObject, *, unreadable: bool) -> "Outcome":
        """The abort an unusable outcome record stands for (never a commit)."""
        return cls(round=round, attempt=attempt, committed=False, reason=f"invalid outcome record ({exc.reason})",
                   check="outcome", retry=True, problem=exc.reason, unreadable=unreadable)


@dataclass(frozen=True)
class Void:
    """``void.json``: the commit of an attempt was abandoned (its global state can never become durable)."""

    round: int
    attempt: int
    by: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, *, key: str, round: int, attempt: int) -> "Void":
        obj = as_object(obj, key)
        check_position(obj, key=key, round=round, attempt=attempt)
        reason = obj.get("reason")
        return cls(round=round, attempt=attempt, by=int_field(obj, "by", key),
                   reason=reason if isinstance(reason, str) else "")


@dataclass(frozen=True)
class SlotDigest:
    """``reduced/<j>.json``: what a reducer published for its reduced slot (write-once).

    ``crc32`` pins the encoded bytes, ``input_norms`` are the decoded norms of every participant's
    part of the slot, in participant order.
    """

    round: int
    attempt: int
    slot: int
    numel: int
    crc32: int
    input_norms: list[float]
    by: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, *, key: str, round: int, attempt: int, slot: int, participants: int) -> "SlotDigest":
        if not isinstance(obj, dict):
            raise BadObject(key, "digest record is not a JSON object")
        for name, want in (("round", round), ("attempt", attempt), ("slot", slot)):
            if obj.get(name) != want:
                raise BadObject(key, f"digest field {name!r} is {obj.get(name)!r:.40}, expected {want}")
        norms = obj.get("input_norms")
        if (not isinstance(norms, list) or len(norms) != participants
                or not all(isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) and n >= 0
                           for n in norms)):
            raise BadObject(key, f"digest field 'input_norms' must be {participants} finite norms")
        return cls(round=round, attempt=attempt, slot=slot, numel=int_field(obj, "numel", key),
                   crc32=int_field(obj, "crc32", key), input_norms=[float(n) for n in norms],
                   by=int_field(obj, "by", key))


# --------------------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class SliceMarker:
    """``global-a<a>-<i>-of-<n>.json``: slice ``index`` of a global state is complete (write-once)."""

    round: int
    attempt: int
    index: int
    num_slices: int
    bytes: int
    crc32: int
    by: int

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "attempt": self.attempt, "shard": self.index, "num_shards": self.num_slices,
                "bytes": self.bytes, "crc32": self.crc32, "by": self.by}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, round: int, attempt: int, index: int, num_slices: int) -> "SliceMarker":
        obj = as_object(obj, key)
        check_position(obj, key=key, round=round, attempt=attempt, shard=index, num_shards=num_slices)
        return cls(round=round, attempt=attempt, index=index, num_slices=num_slices,
                   bytes=int_field(obj, "bytes", key), crc32=int_field(obj, "crc32", key),
                   by=int_field(obj, "by", key))


@dataclass(frozen=True)
class ReplicaMarker:
    """The marker of one replica's inner-state blob, written after the blob.

    Lock-step (``checkpoints/<r>/replica-<k>.json``): ``position`` is the round.
    Decoupled (``decoupled/replica/<k>/<seq>.json``): ``position`` is the
    contribution seq, and ``version`` the global version the state had adopted.
    ``world_size``: the run's replica count when it was written (a data position
    means nothing under another count).
    """

    rank: int
    position: int
    bytes: int
    crc32: int
    world_size: int
    version: int | None = None
    time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        if self.version is None:
            return {"round": self.position, "rank": self.rank, "bytes": self.bytes, "crc32": self.crc32,
                    "world_size": self.world_size}
        return {"rank": self.rank, "seq": self.position, "version": self.version, "world_size": self.world_size,
                "bytes": self.bytes, "crc32": self.crc32, "time": self.time}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, rank: int, position: int, decoupled: bool) -> "ReplicaMarker":
        obj = as_object(obj, key)
        check_position(obj, key=key, rank=rank, **({"seq": position} if decoupled else {"round": position}))
        return cls(rank=rank, position=position, bytes=int_field(obj, "bytes", key),
                   crc32=int_field(obj, "crc32", key), world_size=int_field(obj, "world_size", key, lo=1),
                   version=int_field(obj, "version", key) if decoupled else None,
                   time=obj["time"] if decoupled and isinstance(obj.get("time"), (int, float)) else 0.0)


@dataclass(frozen=True)
class BlobEntry:
    """One object a manifest lists: its name inside the checkpoint, size and crc32."""

    key: str
    bytes: int
    crc32: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "BlobEntry":
        obj = as_object(obj, key)
        name = obj.get("key")
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise BadObject(key, f"entry {str(name)[:40]!r} is not an object name inside the checkpoint")
        return cls(key=name, bytes=int_field(obj, "bytes", key), crc32=int_field(obj, "crc32", key))


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``: written last; the checkpoint is valid for resume and export once it exists.

    ``extra`` carries mode-specific fields (lock-step: ``replicas_launched``; decoupled: ``decoupled``).
    """

    round: int
    attempt: int
    slices: list[BlobEntry]
    replicas: dict[int, BlobEntry]
    participants: list[int]
    time: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "round": self.round, "attempt": self.attempt,
                "global": [e.to_json() for e in self.slices],
                "replicas": {str(r): e.to_json() for r, e in sorted(self.replicas.items())},
                "participants": self.participants, "time": self.time}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, round: int) -> "Manifest":
        obj = as_object(obj, key)
        check_position(obj, key=key, round=round)
        attempt = int_field(obj, "attempt", key)
        entries = obj.get("global")
        if not isinstance(entries, list) or not entries:
            raise BadObject(key, "field 'global' must list the global state's slices")
        replicas = obj.get("replicas", {})
        if not isinstance(replicas, dict) or not all(isinstance(r, str) and r.isdigit() for r in replicas):
            raise BadObject(key, "field 'replicas' must map ranks to objects")
        participants = obj.get("participants", [])
        extra = {k: v for k, v in obj.items()
                 if k not in ("round", "attempt", "global", "replicas", "participants", "time")}
        return cls(round=round, attempt=attempt, slices=[BlobEntry.from_json(e, key=key) for e in entries],
                   replicas={int(r): BlobEntry.from_json(e, key=key) for r, e in replicas.items()},
                   participants=rank_list(participants, key=key, name="participants", replicas=None),
                   time=obj["time"] if isinstance(obj.get("time"), (int, float)) else 0.0, extra=extra)


# --------------------------------------------------------------------------- decoupled
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
    (merged or rejected). The protocol checks that ``weights`` are the token
    weights of ``contributions``.
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

    @property
    def base(self) -> int:
        return self.version - 1

    @property
    def ranks(self) -> list[int]:
        return sorted({c.rank for c in self.contributions})

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "version": self.version, "base": self.base,
                "contributions": [c.to_entry() for c in self.contributions], "weights": list(self.weights),
                "cursor": {str(k): self.cursor[k] for k in sorted(self.cursor)},
                "rejected": [r.to_json() for r in self.rejected], "staleness": list(self.staleness),
                "grace_s": self.grace_s, "reason": self.reason, "final": self.final,
                "decided_by": self.decided_by, "time": self.time}

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
        by, grace, reason = obj.get("decided_by"), obj.get("grace_s"), obj.get("reason")
        return cls(run_id=run_id, version=version, contributions=tuple(contribs), weights=tuple(weights),
                   cursor=cursor, final=final, time=float_field(obj, "time", key), rejected=rejected,
                   staleness=tuple(s for s in obj.get("staleness") or [] if is_int(s)),
                   grace_s=float(grace) if isinstance(grace, (int, float)) else 0.0,
                   reason=reason if isinstance(reason, str) else "", decided_by=by if is_int(by) else None)


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


# --------------------------------------------------------------------------- replica reports
class HeartbeatState(str, enum.Enum):
    """What a replica says about itself in its heartbeat."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if is_int(value) else None


@dataclass(frozen=True)
class Heartbeat:
    """``replicas/<rank>.json``: a replica's state, position and live progress (rewritten as it goes).

    ``progress`` holds the live figures (:class:`~composer_cloud.replica.telemetry.Progress`:
    ``step``, ``loss``, ``loss_ema``, ``reward``, ``steps_per_s``, ``tokens_per_s``, ``elapsed_s``,
    ``started_at``...), stored flat beside the other fields. ``round`` is the
    lock-step round, or the decoupled contribution count.
    """

    rank: int
    state: HeartbeatState
    time: float
    pid: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    progress: dict[str, Any] = field(default_factory=dict)
    round: int | None = None
    step: int | None = None
    version: int | None = None
    final_version: int | None = None
    error: str = ""
    params_sha256: str | None = None

    _FIELDS = ("rank", "state", "time", "pid", "versions", "round", "step", "version", "final_version", "error",
               "params_sha256")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.progress, "rank": self.rank, "state": self.state.value, "time": self.time,
                               "pid": self.pid, "versions": self.versions}
        for name in ("round", "step", "version", "final_version", "params_sha256"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.error:
            out["error"] = self.error
        return out

    @classmethod
    def from_json(cls, obj: Any, *, rank: int) -> "Heartbeat | None":
        """Lenient: None if ``obj`` is not a heartbeat at all; a malformed field reads as unknown."""
        if not isinstance(obj, dict):
            return None
        try:
            state = HeartbeatState(obj.get("state"))
        except ValueError:
            return None
        versions = obj.get("versions")
        sha = obj.get("params_sha256")
        return cls(rank=rank, state=state, time=_num(obj.get("time")) or 0.0, pid=_int(obj.get("pid")),
                   versions={str(k): str(v) for k, v in versions.items()} if isinstance(versions, dict) else {},
                   progress={k: v for k, v in obj.items() if k not in cls._FIELDS},
                   round=_int(obj.get("round")), step=_int(obj.get("step")), version=_int(obj.get("version")),
                   final_version=_int(obj.get("final_version")), error=str(obj.get("error") or ""),
                   params_sha256=sha if isinstance(sha, str) else None)

    def number(self, name: str) -> float | None:
        """A live progress figure as a float (None when absent or malformed)."""
        return _num(self.progress.get(name))


@dataclass(frozen=True)
class MetricsDigest:
    """The framed digest written after a metrics object (``metrics/<rank>/<round>-<writer>.json``)."""

    sha256: str
    bytes: int
    rows: int
    rank: int
    round: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "MetricsDigest":
        obj = as_object(obj, key)
        return cls(sha256=sha256_field(obj, "sha256", key), bytes=int_field(obj, "bytes", key),
                   rows=int_field(obj, "rows", key), rank=int_field(obj, "rank", key),
                   round=int_field(obj, "round", key))


# --------------------------------------------------------------------------- launch records
@dataclass
class JobHandle:
    """How to find one replica job again (``executor/<rank>.json``). JSON-serialisable; never holds a secret.

    Attributes:
        executor: executor name (``local``, ``modal``, ``hf-jobs``).
        rank: replica rank.
        job_id: the backend's id (process id, FunctionCall id, HF job id).
        data: backend-specific details (log path, namespace, app id, ...).
        restarts: how many times the executor relaunched this replica.
    """

    executor: str
    rank: int
    job_id: str
    data: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "JobHandle":
        return cls(
            executor=str(d["executor"]),
            rank=int(d["rank"]),
            job_id=str(d["job_id"]),
            data=dict(d.get("data", {})),
            restarts=int(d.get("restarts", 0)),
        )


@dataclass(frozen=True)
class ResumeRecord:
    """``resumes/<n>.json``: the n-th resume restarted the run after checkpoint ``from_round`` (-1: the start)."""

    from_round: int
    executor: str
    replicas: int
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"from_round": self.from_round, "time": self.time, "executor": self.executor,
                "replicas": self.replicas}

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "ResumeRecord":
        obj = as_object(obj, key)
        executor, replicas, t = obj.get("executor"), obj.get("replicas"), obj.get("time")
        return cls(from_round=int_field(obj, "from_round", key, lo=-1), executor=str(executor or ""),
                   replicas=replicas if is_int(replicas) else 0, time=float(t) if isinstance(t, (int, float)) else 0.0)


@dataclass(frozen=True)
class CancelRecord:
    """``control/cancel.json``: the run was cancelled (write-once); its existence is what counts."""

    time: float

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time}


@dataclass(frozen=True)
class CodeRef:
    """Where a run's code bundle lies in its store (``code/<sha256>.zip``), and the sha256 it must have.

    Travels in the spec (``code.ref``) and in each job's environment, so a
    replica checks the bundle against a digest that did not come from the store.
    """

    key: str
    sha256: str
    bytes: int
    modules: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "modules": list(self.modules)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "CodeRef":
        """Parse and validate (the JSON may have travelled through an untrusted store)."""
        from composer_cloud.storage.layout import code_key

        try:
            ref = cls(key=str(obj["key"]), sha256=str(obj["sha256"]), bytes=int(obj["bytes"]),
                      modules=tuple(str(m) for m in obj["modules"]))
            if ref.key != code_key(ref.sha256):
                raise ValueError(f"key {ref.key!r} is not the bundle key of {ref.sha256}")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid code reference {dict(obj)!r:.200}: {exc}") from None
        return ref


def now() -> float:
    """Wall-clock time for records (seconds since the epoch)."""
    return time.time()


def sorted_rejections(rejected: Sequence[Rejected]) -> tuple[Rejected, ...]:
    return tuple(sorted(rejected, key=lambda r: (r.rank, r.seq)))
