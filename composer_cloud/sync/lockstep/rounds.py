"""Round records of the object-store all-reduce: reading, validating, discovering and voiding rounds.

Keys: :mod:`composer_cloud.storage.layout` (``rounds/<r>/<a>/...``); record
schemas: :mod:`composer_cloud.storage.records` (:class:`Quorum`, :class:`Outcome`,
:class:`Void`). The bucket is not trusted (``docs/store.md``): a record that
fails its schema raises :class:`~composer_cloud.errors.BadObject` naming the
key and the field; callers decide what a rejection costs, and it is never more
than the attempt:

* a ``join/`` name that is not ``<rank>.json`` with ``rank`` in range is
  skipped, with one warning per name;
* an invalid ``quorum.json`` cannot be replaced (write-once), so its attempt
  is dead: replicas record an abort for it and move to attempt ``a + 1``;
* an invalid ``outcome.json`` counts as an abort of its attempt, never as a
  commit; a "committed" outcome only counts if its participants equal those
  of the same attempt's valid quorum record (a forged commit for a future
  round that does not match is ignored).

**Corrupt old outcomes.** Round discovery never raises on a bad record. A
round whose outcome cannot be read (checksum mismatch, not JSON, unsigned or
mis-signed in a signed run) is *unknown*: it may have committed. Rounds commit
in order (a replica opens round ``r + 1`` only after round ``r`` committed or
after healing past it), so an unknown round counts as committed iff a later
round has a valid commit; otherwise discovery stops before it. A bit flip in
an old record therefore neither hides the run's progress nor makes it up.

**Absent unless verified (issue 33).** Every decision is read here, through
:func:`read_quorum`, :func:`read_outcome` and :func:`_valid_void`, which
verify (checksum, signature, schema) and return nothing that failed. No
inference is drawn from a *listing*: "the run has left round ``r``"
(:func:`moved_past`) needs a verified record of a later round (a valid commit,
or a valid quorum of round ``r + 1``, which only a job that finished round ``r``
writes), never the mere existence of a name. :func:`open_attempt` (behind?) and
the heal path ask the same question, so a replica is never told "behind" by one
and "nothing to heal" by the other.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from composer_cloud.errors import BadObject, ChecksumMismatch
from composer_cloud.round_numbers import shown_round
from composer_cloud.storage import layout
from composer_cloud.storage.records import Outcome, Quorum, Void
from composer_cloud.storage.records.limits import ROUND_RECORD_MAX_BYTES
from composer_cloud.storage.store import Store
from composer_cloud.sync.trust import create_over_forged

logger = logging.getLogger(__name__)


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


def join_rank(name: str, *, replicas: int, where: str = "join") -> int | None:
    """The rank a ``join/`` object name announces, or None if it is not ``<rank>.json``.

    A stray name is warned about once per ``where/name`` (the join directory's full path).
    """
    rank = layout.parse_rank_json(name)
    if rank is None or rank >= replicas:
        warn_once(f"join:{where}/{name}", "ignoring stray object %s/%s: not <rank>.json with rank in [0, %d)",
                  where, name, replicas)
        return None
    return rank


def attempt_number(name: str, *, where: str) -> int | None:
    """The attempt a round's child name stands for, or None (a stray name, warned about once)."""
    attempt = layout.parse_small_int(name)
    if attempt is None:
        warn_once(f"attempt:{where}/{name}", "ignoring stray name %r under %s: not an attempt number", name, where)
    return attempt


# --------------------------------------------------------------------------- reading
def read_quorum(store: Store, round: int, attempt: int, *, replicas: int | None,
                min_replicas: int = 1) -> Quorum | None:
    """The attempt's quorum, None if not decided yet; raises :class:`BadObject` for an unusable record."""
    key = layout.quorum_key(round, attempt)
    obj = store.try_get_json(key, max_bytes=ROUND_RECORD_MAX_BYTES)
    if obj is None:
        return None
    return Quorum.from_json(obj, key=key, round=round, attempt=attempt, replicas=replicas, min_replicas=min_replicas)


def read_outcome(store: Store, round: int, attempt: int, *, replicas: int | None,
                 participants: list[int] | None = None) -> Outcome | None:
    """The attempt's outcome, None if there is none yet. Never raises on a bad record.

    An unusable record comes back as an abort (``problem`` set). A committed
    record is checked against ``participants`` (the attempt's quorum, read
    from the store when not given); if they differ, or the quorum is missing
    or invalid, it is an abort too: a commit needs both write-once records to agree.
    """
    key = layout.outcome_key(round, attempt)
    try:
        obj = store.try_get_json(key, max_bytes=ROUND_RECORD_MAX_BYTES)
        if obj is None:
            return None
        out = Outcome.from_json(obj, key=key, round=round, attempt=attempt, replicas=replicas)
        if not out.committed:
            return out
        if participants is None:
            quorum = read_quorum(store, round, attempt, replicas=replicas)
            if quorum is None:
                # Deleted (or never written?) quorum: the commit is unknown, not an abort; a later round's
                # valid commit vouches for it (issue 37: deleting an old quorum made status say "failed").
                exc = BadObject(key, "committed, but the attempt has no quorum record")
                warn_once(f"outcome:{store.uri}/{key}:{exc.reason}", "%s", exc)
                return Outcome.unusable(round, attempt, exc, unreadable=True)
            participants = quorum.participants
        if out.participants != participants:
            raise BadObject(key, f"committed with participants {out.participants[:16]}, but the quorum "
                                     f"record names {participants[:16]}")
        if _valid_void(store, round, attempt, replicas):
            # The commit was abandoned: its global state never became durable (see declare_void).
            return Outcome(round=round, attempt=attempt, committed=False,
                           reason="void: the committed state was never made durable",
                           participants=out.participants, by=out.by)
        return out
    except BadObject as exc:
        warn_once(f"outcome:{store.uri}/{key}:{exc.reason}", "%s", exc)
        return Outcome.unusable(round, attempt, exc, unreadable=isinstance(exc, ChecksumMismatch))


def _valid_void(store: Store, round: int, attempt: int, replicas: int | None) -> bool:
    """Whether the attempt holds a valid void record: read, verified (signed runs: authentic) and parsed, its
    author a rank of the run. Anything else there is ignored with a warning: the existence of an object never
    voids a commit (in a signed run only the run's jobs can void one)."""
    key = layout.void_key(round, attempt)
    try:
        obj = store.try_get_json(key, max_bytes=ROUND_RECORD_MAX_BYTES)
        if obj is None:
            return False
        void = Void.from_json(obj, key=key, round=round, attempt=attempt)
        if replicas is not None and void.by >= replicas:
            raise BadObject(key, f"declared by replica {void.by}, but the run has {replicas} replicas")
    except BadObject as exc:
        warn_once(f"void:{store.uri}/{key}:{exc.reason}", "ignoring %s", exc)
        return False
    return True


def declare_void(store: Store, round: int, attempt: int, *, by: int, reason: str) -> bool:
    """Abandon the commit of ``round``'s ``attempt`` (write-once); returns whether this call did it.

    Only for a commit whose global state can never become durable (every
    participant died before writing its slice): round discovery then treats the
    attempt as aborted, and the round is run again as a new attempt from the
    previous durable state. Replicas that applied the voided commit heal back.
    """
    key = layout.void_key(round, attempt)
    # A forged object at the key (no job of a signed run wrote it) must not block the run's own void: the
    # healer would wait out heal_timeout_s for a state that never becomes durable (issue 33 matrix).
    created = create_over_forged(store, key, Void(round=round, attempt=attempt, by=by, reason=reason).to_json(),
                                 lambda o: Void.from_json(o, key=key, round=round, attempt=attempt))
    if created:
        logger.warning("round %d attempt %d declared void by replica %d: %s", shown_round(round), attempt, by,
                       reason)
    return created


# --------------------------------------------------------------------------- discovery
def attempts(store: Store, round: int) -> list[int]:
    """Attempt numbers that exist under ``round`` (stray names skipped), ascending."""
    where = f"{store.uri}/{layout.round_prefix(round)}"
    found = (attempt_number(n, where=where) for n in store.list_dirs(layout.round_prefix(round)))
    return sorted(a for a in found if a is not None)


def _round_state(store: Store, round: int) -> tuple[int | None, bool]:
    """``(committed attempt or None, unknown)``: unknown = some outcome was unreadable, or is missing
    although the attempt's quorum was decided (in progress, or deleted: a later valid commit vouches)."""
    unknown = False
    for a in reversed(attempts(store, round)):
        out = read_outcome(store, round, a, replicas=None)
        if out is None:
            unknown = unknown or _has_quorum(store, round, a)
            continue
        if out.committed:
            return a, False
        unknown = unknown or out.unreadable
    return None, unknown


def round_unknown(store: Store, round: int) -> bool:
    """Whether ``round`` has no valid commit but an unreadable outcome (a commit may hide behind it)."""
    committed, unknown = _round_state(store, round)
    return committed is None and unknown


def moved_past(store: Store, round: int) -> bool:
    """Whether a *verified* record shows that the run left ``round``: a valid commit of a later round, or a
    valid quorum record of round ``round + 1`` (any attempt). Listed names alone never count (issue 33)."""
    if latest_committed_round(store, start=round + 1) > round:
        return True
    for a in attempts(store, round + 1):
        try:
            if read_quorum(store, round + 1, a, replicas=None) is not None:
                return True
        except BadObject:
            continue
    return False


def may_have_committed(store: Store, round: int, attempt: int) -> bool:
    """Whether ``attempt`` of ``round`` may be the round's commit although no valid commit says so.

    True when the round has no valid commit and the attempt's records do not *verifiably* deny it: its
    outcome is absent (deleted) or unreadable, and no valid void names it. A verified abort or void says
    no. Callers hold other verified evidence that the attempt committed (a signed manifest of its state,
    written only after a commit): this is how a run whose old records were damaged or deleted keeps its
    durable model (issue 33, item 3; issue 37, item 5).
    """
    if committed_attempt(store, round) is not None:
        return False
    out = read_outcome(store, round, attempt, replicas=None)
    if out is not None and not out.unreadable:
        return False
    return not _valid_void(store, round, attempt, None)


def _has_quorum(store: Store, round: int, attempt: int) -> bool:
    try:
        return read_quorum(store, round, attempt, replicas=None) is not None
    except BadObject:
        return False


def committed_attempt(store: Store, round: int) -> int | None:
    """The attempt of ``round`` with a valid commit, if any (an unreadable outcome is not one)."""
    return _round_state(store, round)[0]


def attempt_of(store: Store) -> Callable[[int], int | None]:
    """The attempt whose global state is round ``r``'s, for the checkpoint layer: the committed (not void) one."""
    return lambda round: committed_attempt(store, round)


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
    for round in round_numbers(store):
        if round >= before:
            continue
        for a in attempts(store, round):
            for sub in layout.ATTEMPT_PAYLOADS:
                store.delete(f"{layout.attempt_prefix(round, a)}/{sub}", recursive=True)
        removed += 1
    return removed


def round_numbers(store: Store) -> list[int]:
    """Rounds with a directory under ``rounds/`` (stray names skipped), ascending."""
    return sorted(r for r in map(layout.parse_num, store.list_dirs(layout.ROUNDS)) if r is not None)


def discard_after(store: Store, round: int) -> None:
    """Delete the records of every round after ``round`` (``resume``: those rounds run again)."""
    for r in round_numbers(store):
        if r > round:
            store.delete(layout.round_prefix(r), recursive=True)
