"""Round records of the object-store all-reduce: layout, schemas, and round discovery.

Layout under a run's store (``r`` zero-padded round, ``a`` attempt)::

    rounds/<r>/<a>/join/<rank>.json     "I reached sync r" (only the name is used)
    rounds/<r>/<a>/quorum.json          write-once participant set
    rounds/<r>/<a>/grad/<rank>/<slot>   encoded part ``slot`` of a participant's payload
    rounds/<r>/<a>/reduced/<slot>       encoded mean of part ``slot`` over participants
    rounds/<r>/<a>/reduced/<slot>.json  write-once digest of that mean (see ``checks.py``)
    rounds/<r>/<a>/outcome.json         write-once: committed, or aborted with a reason
    rounds/<r>/<a>/void.json            write-once: the commit was abandoned (:func:`declare_void`)

The bucket is not trusted (DESIGN.md invariant 10). Every record is parsed
here into a typed value or rejected with :class:`InvalidRecord` naming the key
and the field; callers decide what a rejection costs, and it is never more
than the attempt:

* a ``join/`` name that is not ``<rank>.json`` with ``rank`` in range is
  skipped, with one warning per name;
* an invalid ``quorum.json`` cannot be replaced (write-once), so its attempt
  is dead: replicas record an abort for it and move to attempt ``a + 1``;
* an invalid ``outcome.json`` counts as an abort of its attempt, never as a
  commit; a "committed" outcome only counts if its participants equal those
  of the same attempt's valid quorum record (a forged commit for a future
  round that does not match is ignored).

``round``/``attempt`` fields are checked when present; records written before
they existed (older runs being resumed) carry none and are accepted.

**Corrupt old outcomes.** Round discovery never raises on a bad record. A
round whose outcome cannot be read (checksum mismatch, not JSON, bad schema)
is *unknown*: it may have committed. Rounds commit in order (a replica opens
round ``r + 1`` only after round ``r`` committed or after healing past it), so
an unknown round counts as committed iff a later round has a valid commit;
otherwise discovery stops before it. A bit flip in an old record therefore
neither hides the run's progress nor makes it up.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from composer_cloud.rendezvous.store import ChecksumMismatch, Store, StoreError

logger = logging.getLogger(__name__)

_JOIN_NAME = re.compile(r"(0|[1-9][0-9]{0,8})\.json")
_ATTEMPT_NAME = re.compile(r"0|[1-9][0-9]{0,8}")
_ROUND_NAME = re.compile(r"[0-9]{8,10}")


class InvalidRecord(StoreError):
    """A record read from the store is unusable (corrupt, foreign or malformed); names key and problem."""

    def __init__(self, key: str, problem: str, *, unreadable: bool = False) -> None:
        self.key = key
        self.problem = problem
        self.unreadable = unreadable  # the bytes could not be read at all (it may have been a valid record)
        super().__init__(f"{key}: {problem}; the record was not used")


VOID = "void.json"


def round_prefix(round: int) -> str:
    return f"rounds/{round:08d}"


def attempt_prefix(round: int, attempt: int) -> str:
    return f"{round_prefix(round)}/{attempt}"


# --------------------------------------------------------------------------- warnings
_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str, *args: Any) -> None:
    """Log a warning about ``key`` once per process (discovery re-reads the same bad records every sync)."""
    with _warned_lock:
        if key in _warned or len(_warned) > 10_000:
            return
        _warned.add(key)
    logger.warning(message, *args)


# --------------------------------------------------------------------------- schemas
def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def rank_list(value: Any, *, key: str, name: str, replicas: int | None, sorted_unique: bool = True) -> list[int]:
    """Validate a list of ranks: ints in ``[0, replicas)`` (``replicas=None``: just ``>= 0``)."""
    if not isinstance(value, list) or not all(_int(v) for v in value):
        raise InvalidRecord(key, f"field {name!r} must be a list of integer ranks, got {value!r:.80}")
    bad = [v for v in value if v < 0 or (replicas is not None and v >= replicas)]
    if bad:
        raise InvalidRecord(key, f"field {name!r} has ranks {bad[:8]} outside [0, {replicas})")
    if sorted_unique and any(b <= a for a, b in zip(value, value[1:])):
        raise InvalidRecord(key, f"field {name!r} must be sorted and unique, got {value[:16]}")
    return list(value)


def _check_position(obj: dict[str, Any], *, key: str, round: int, attempt: int) -> None:
    for name, want in (("round", round), ("attempt", attempt)):
        if name in obj and obj[name] != want:
            raise InvalidRecord(key, f"field {name!r} is {obj[name]!r:.40}, expected {want} (a record copied "
                                     "from another round or attempt)")


def _as_dict(obj: Any, key: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise InvalidRecord(key, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def join_rank(name: str, *, replicas: int, where: str = "join") -> int | None:
    """The rank a ``join/`` object name announces, or None if it is not ``<rank>.json``.

    A stray name is warned about once per ``where/name`` (the join directory's full path).
    """
    m = _JOIN_NAME.fullmatch(name)
    if m is None or int(m.group(1)) >= replicas:
        warn_once(f"join:{where}/{name}", "ignoring stray object %s/%s: not <rank>.json with rank in [0, %d)",
                  where, name, replicas)
        return None
    return int(m.group(1))


def attempt_number(name: str, *, where: str = "rounds/<r>") -> int | None:
    """The attempt a ``rounds/<r>/`` child name stands for, or None (a stray name, warned about once)."""
    if _ATTEMPT_NAME.fullmatch(name) is None:
        warn_once(f"attempt:{where}/{name}", "ignoring stray name %r under %s: not an attempt number", name, where)
        return None
    return int(name)


@dataclass(frozen=True)
class Quorum:
    """A validated ``quorum.json``: who takes part in an attempt."""

    participants: list[int]
    excluded: list[int] = field(default_factory=list)
    reason: str = ""


def parse_quorum(obj: Any, *, key: str, round: int, attempt: int, replicas: int | None,
                 min_replicas: int = 1) -> Quorum:
    """Validate a quorum record: participants sorted, unique, in range, at least ``min_replicas``."""
    obj = _as_dict(obj, key)
    _check_position(obj, key=key, round=round, attempt=attempt)
    if "participants" not in obj:
        raise InvalidRecord(key, "field 'participants' is missing")
    participants = rank_list(obj["participants"], key=key, name="participants", replicas=replicas)
    if len(participants) < max(1, min_replicas):
        raise InvalidRecord(key, f"{len(participants)} participants, fewer than min_replicas={min_replicas}")
    excluded = rank_list(obj.get("excluded", []), key=key, name="excluded", replicas=replicas)
    if set(excluded) & set(participants):
        raise InvalidRecord(key, f"ranks {sorted(set(excluded) & set(participants))} are both participants "
                                 "and excluded")
    reason = obj.get("reason", "")
    return Quorum(participants=participants, excluded=excluded, reason=reason if isinstance(reason, str) else "")


@dataclass(frozen=True)
class Outcome:
    """A validated ``outcome.json``, or the abort an unusable one stands for.

    Attributes:
        committed: the attempt's result may be applied (only ever True for a
            well-formed record consistent with the attempt's quorum).
        reason: why the attempt was aborted.
        missing: ranks whose objects did not arrive.
        excluded: ranks whose payload failed a check; left out of the retries
            of this round within the same sync.
        check: which integrity check aborted the attempt (``nonfinite``,
            ``outlier``, ``malformed``, ``reduced``, ``quorum``, ``outcome``), if any.
        retry: a fresh attempt with the same payloads may pass: retried at once.
        problem: non-empty when the record itself was unusable.
        unreadable: the record's bytes could not be read (it may have been a commit).
    """

    committed: bool
    reason: str = ""
    participants: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    excluded: list[int] = field(default_factory=list)
    check: str | None = None
    retry: bool = False
    by: int | None = None
    problem: str = ""
    unreadable: bool = False

    @classmethod
    def invalid(cls, exc: InvalidRecord) -> "Outcome":
        return cls(committed=False, reason=f"invalid outcome record ({exc.problem})", check="outcome", retry=True,
                   problem=exc.problem, unreadable=exc.unreadable)


def parse_outcome(obj: Any, *, key: str, round: int, attempt: int, replicas: int | None) -> Outcome:
    """Validate an outcome record's schema (consistency with the quorum is checked by :func:`read_outcome`)."""
    obj = _as_dict(obj, key)
    _check_position(obj, key=key, round=round, attempt=attempt)
    committed = obj.get("committed")
    if not isinstance(committed, bool):
        raise InvalidRecord(key, f"field 'committed' must be true or false, got {committed!r:.40}")
    by = obj.get("by")
    if by is not None and not _int(by):
        raise InvalidRecord(key, f"field 'by' must be a rank, got {by!r:.40}")
    if committed:
        if "participants" not in obj:
            raise InvalidRecord(key, "a committed outcome must name its participants")
        participants = rank_list(obj["participants"], key=key, name="participants", replicas=replicas)
        return Outcome(committed=True, participants=participants, by=by)
    reason, check, retry = obj.get("reason", ""), obj.get("check"), obj.get("retry", False)
    if not isinstance(reason, str) or not (check is None or isinstance(check, str)) or not isinstance(retry, bool):
        raise InvalidRecord(key, "fields 'reason', 'check' must be strings and 'retry' a boolean")
    return Outcome(committed=False, reason=reason, check=check, retry=retry, by=by,
                   missing=rank_list(obj.get("missing", []), key=key, name="missing", replicas=replicas,
                                     sorted_unique=False),
                   excluded=rank_list(obj.get("excluded", []), key=key, name="excluded", replicas=replicas))


# --------------------------------------------------------------------------- reading
def read_record(store: Store, key: str) -> Any | None:
    """A JSON record, None if absent; :class:`InvalidRecord` (``unreadable``) if corrupt."""
    try:
        return store.try_get_json(key)
    except ChecksumMismatch as exc:
        raise InvalidRecord(key, str(exc), unreadable=True) from None


def read_quorum(store: Store, round: int, attempt: int, *, replicas: int | None,
                min_replicas: int = 1) -> Quorum | None:
    """The attempt's quorum, None if not decided yet; raises :class:`InvalidRecord`."""
    key = f"{attempt_prefix(round, attempt)}/quorum.json"
    obj = read_record(store, key)
    if obj is None:
        return None
    return parse_quorum(obj, key=key, round=round, attempt=attempt, replicas=replicas, min_replicas=min_replicas)


def read_outcome(store: Store, round: int, attempt: int, *, replicas: int | None,
                 participants: list[int] | None = None) -> Outcome | None:
    """The attempt's outcome, None if there is none yet. Never raises on a bad record.

    An unusable record comes back as an abort (``problem`` set). A committed
    record is checked against ``participants`` (the attempt's quorum, read
    from the store when not given); if they differ, or the quorum is missing
    or invalid, it is an abort too: a commit needs both write-once records to agree.
    """
    key = f"{attempt_prefix(round, attempt)}/outcome.json"
    try:
        obj = read_record(store, key)
        if obj is None:
            return None
        out = parse_outcome(obj, key=key, round=round, attempt=attempt, replicas=replicas)
        if not out.committed:
            return out
        if participants is None:
            quorum = read_quorum(store, round, attempt, replicas=replicas)
            if quorum is None:
                raise InvalidRecord(key, "committed, but the attempt has no quorum record")
            participants = quorum.participants
        if out.participants != participants:
            raise InvalidRecord(key, f"committed with participants {out.participants[:16]}, but the quorum "
                                     f"record names {participants[:16]}")
        if store.exists(f"{attempt_prefix(round, attempt)}/{VOID}"):
            # The commit was abandoned: its global state never became durable (see declare_void).
            return Outcome(committed=False, reason="void: the committed state was never made durable",
                           participants=out.participants, by=out.by)
        return out
    except InvalidRecord as exc:
        warn_once(f"outcome:{store.uri}/{key}:{exc.problem}", "%s", exc)
        return Outcome.invalid(exc)


def declare_void(store: Store, round: int, attempt: int, *, by: int, reason: str) -> bool:
    """Abandon the commit of ``round``'s ``attempt`` (write-once); returns whether this call did it.

    Only for a commit whose global state can never become durable (every
    participant died before writing its slice): round discovery then treats the
    attempt as aborted, and the round is run again as a new attempt from the
    previous durable state. Replicas that applied the voided commit heal back.
    """
    created = store.create_json(f"{attempt_prefix(round, attempt)}/{VOID}",
                                {"round": round, "attempt": attempt, "by": by, "reason": reason})
    if created:
        logger.warning("round %d attempt %d declared void by replica %d: %s", round, attempt, by, reason)
    return created


# --------------------------------------------------------------------------- discovery
def attempts(store: Store, round: int) -> list[int]:
    """Attempt numbers that exist under ``round`` (stray names skipped), ascending."""
    where = f"{store.uri}/{round_prefix(round)}"
    found = (attempt_number(n, where=where) for n in store.list_dirs(round_prefix(round)))
    return sorted(a for a in found if a is not None)


def _round_state(store: Store, round: int) -> tuple[int | None, bool]:
    """``(committed attempt or None, unknown)``: unknown = some outcome was unreadable."""
    unknown = False
    for a in reversed(attempts(store, round)):
        out = read_outcome(store, round, a, replicas=None)
        if out is None:
            continue
        if out.committed:
            return a, False
        unknown = unknown or out.unreadable
    return None, unknown


def committed_attempt(store: Store, round: int) -> int | None:
    """The attempt of ``round`` with a valid commit, if any (an unreadable outcome is not one)."""
    return _round_state(store, round)[0]


def latest_committed_round(store: Store, *, start: int = 0) -> int:
    """Highest committed round at or after ``start - 1`` (``start - 1`` if none newer).

    Rounds commit in order, so scanning forward from a known committed round
    is enough; ``-1`` means nothing committed yet. A round whose outcome is
    unreadable counts iff a later round has a valid commit (module docstring).
    Needs only the store, so status queries use it without joining the run.
    """
    last, r = start - 1, start
    while True:
        committed, unknown = _round_state(store, r)
        if committed is not None:
            last = r
        elif not unknown:
            return last
        r += 1


def cleanup_rounds(store: Store, *, before: int) -> int:
    """Delete transient objects of rounds ``< before``; returns rounds removed.

    Only payloads are deleted (``grad/``, ``reduced/``, ``join/``); quorum and
    outcome records stay as the run's history (they are tiny).
    """
    removed = 0
    for name in store.list_dirs("rounds"):
        if _ROUND_NAME.fullmatch(name) is None or int(name) >= before:
            continue
        for attempt in store.list_dirs(f"rounds/{name}"):
            if attempt_number(attempt, where=f"{store.uri}/rounds/{name}") is None:
                continue
            for sub in ("grad", "reduced", "join"):
                store.delete(f"rounds/{name}/{attempt}/{sub}", recursive=True)
        removed += 1
    return removed
