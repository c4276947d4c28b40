"""Round records of the lock-step all-reduce: join, quorum, outcome, void, and the reduced slot's digest.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from composer_cloud.errors import BadObject
from composer_cloud.storage.records.fields import as_object, check_position, int_field, is_int, rank_list


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
