"""Object-store all-reduce: average a flat tensor over the replicas of a round.

Replicas never talk to each other; every step of a round is an object in the
store (keys: ``storage/layout.py``; records: ``storage/records/`` and ``rounds.py``;
payload checks: ``checks.py``).

Protocol for one attempt (``W`` = number of participants, ``i`` = my index):

1. Join, then decide the quorum: as soon as every expected replica has joined,
   or when the quorum deadline passes with at least ``min_replicas`` joined,
   some replica creates ``quorum.json`` (write-once: racing writers agree on
   the first). Everyone reads the participant set from that record only.
2. Scatter: check my payload is finite, split it into ``W`` contiguous slots,
   upload each.
3. Reduce: participant ``i`` reads slot ``i`` of every participant, checks
   each part (well-formed, finite, no outlier norm), sums in float32 in
   participant order (deterministic), divides by ``W``, uploads the encoded
   mean and then its write-once digest. If a reducer disappears, another
   participant recomputes its slot (same inputs, same order, same bytes).
4. Gather: read every reduced slot and check it against its digest; everyone
   decodes the same bytes, so all participants end with bitwise-identical results.
5. Commit: create ``outcome.json`` ``{"committed": true}``. A missing payload
   or a failed check creates ``{"committed": false, "reason": ...}`` instead;
   the write-once record makes the decision unique, and nobody applies a
   result whose outcome is not a valid commit. (A multi-GPU replica creates
   the commit only once every shard verified its part: ``_agree``, sharded.py.)

Retries (the abort rule, docs/architecture.md). An attempt aborted by an integrity check is retried at
once as attempt ``a + 1`` in the same call, by every participant with the payload it sent, without the
ranks the check named (``excluded``: they heal at their next sync); at most ``max_attempts`` back to back.
The decision depends only on write-once records, so every participant takes the same one. A round aborted
for a missing replica, or after ``max_attempts``, is retried at the next sync with fresh payloads.

Traffic per participant: ``P`` up (scatter) + ``P (W-1)/W`` down (reduce) +
``P/W`` up + ``P (W-1)/W`` down (gather) = ``(3 - 1/W) P``, plus ``2 W`` tiny
digest objects: independent of the number of replicas (``P`` = encoded payload bytes).
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from composer_cloud.errors import BadObject, ChecksumMismatch, ObjectNotFound, StoreTimeout
from composer_cloud.hooks import NO_HOOKS, Hooks
from composer_cloud.retry import poll_until
from composer_cloud.round_numbers import shown_round
from composer_cloud.storage import layout
from composer_cloud.storage.records import Join, Outcome, Quorum, SlotDigest
from composer_cloud.storage.store import Store, iter_chunks
from composer_cloud.sync.checks import (RejectedPayload, check_finite, check_outliers, digest_mismatch, l2,
                                        verify_reduced)
from composer_cloud.sync.lockstep import codec as wire
from composer_cloud.sync.lockstep.config import AllReduceConfig
from composer_cloud.sync.lockstep.results import (BehindError, LocalRankLost, RoundResult, RoundTimeout,
                                                  exclusion_note)
from composer_cloud.sync.lockstep.rounds import join_rank, moved_past, read_outcome, read_quorum

logger = logging.getLogger(__name__)


class InlineFuture:
    """A future-like that runs ``fn(*args)`` when asked for its result: a fetch done inline, where the exchanges
    would otherwise submit it to their thread pool (so both kinds are read with ``.result()``)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._fn, self._args = fn, args

    def result(self) -> Any:
        return self._fn(*self._args)


@dataclass(frozen=True)
class _Chain:
    """Where an attempt stands in a run of back-to-back retries (derived from write-once records only)."""

    position: int  # 0: first attempt of a sync; k: k-th immediate retry
    excluded: frozenset[int]  # ranks left out by the aborts of this run
    expected: frozenset[int]  # who the quorum waits for


def publish_with_digest(store: Store, key: str, data: bytes, digest_key: str, digest: SlotDigest, *, what: str,
                        settle: bool = True) -> dict[str, Any]:
    """Upload ``data`` at ``key``, then create its write-once digest; returns the digest record.

    A digest already there is fine when it is the same (another participant took over this work: same inputs,
    same order, same bytes); a different one (a forgery, or a bug) raises ``RejectedPayload`` naming ``what``.
    """
    store.put(key, data, durable=False)
    if not store.create_json(digest_key, digest.to_json(), settle=settle):
        try:
            problem = digest_mismatch(digest, store.try_get_json(digest_key), key=digest_key)
        except BadObject as exc:
            problem = exc
        if problem is not None:
            raise RejectedPayload(f"{what}: the digest in the store is not this participant's ({problem.reason})",
                                  check="reduced", slot=digest.slot)
    return digest.to_json()


class ObjectStoreAllReduce:
    """Runs all-reduce rounds for one replica over a run's store (dense codecs: scatter-reduce)."""

    codecs: tuple[str, ...] = wire.CODECS  # the exchange of the sparse codec is a subclass (gather.py)
    def __init__(self, store: Store, rank: int, config: AllReduceConfig, *, hooks: Hooks = NO_HOOKS) -> None:
        if not 0 <= rank < config.replicas:
            raise ValueError(f"rank {rank} out of range for {config.replicas} replicas")
        if config.codec not in self.codecs:
            raise ValueError(f"sync.codec: codec {config.codec!r} is not one of {self.codecs}")
        if not 1 <= config.min_replicas <= config.replicas:
            raise ValueError(f"min_replicas: {config.min_replicas} must be in [1, replicas={config.replicas}]")
        factor = config.outlier_factor
        if factor is not None and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
            raise ValueError(f"sync.outlier_factor: {factor!r} must be a finite number > 1, or null to disable")
        if not isinstance(config.max_attempts, int) or config.max_attempts < 1:
            raise ValueError(f"sync.max_attempts: {config.max_attempts!r} must be an integer >= 1")
        self.store = store
        self.rank = rank
        self.config = config
        self.hooks = hooks
        self.keys = layout.SlotKeys()  # the sharded exchange of a multi-GPU replica names its shard's keys
        self._pool = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix=f"allreduce-r{rank}")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------ round discovery
    def outcome(self, round: int, attempt: int) -> Outcome | None:
        """The attempt's validated outcome (an unusable record reads as an abort), None if undecided."""
        return read_outcome(self.store, round, attempt, replicas=self.config.replicas)

    def open_attempt(self, round: int) -> int:
        """The attempt a replica arriving at ``round`` should join: the first without an outcome.

        Attempt ``a + 1`` only opens once attempt ``a`` has its outcome, so
        the first undecided one is where the others are (a stray attempt
        directory further on is never joined). Raises :class:`BehindError`
        if ``round`` already committed.

        A damaged (unreadable, unsigned) outcome may hide a commit: it counts as one only when a verified
        record shows that the run left the round (:func:`~composer_cloud.sync.lockstep.rounds.moved_past`),
        the same test the heal path uses; a listed name never does (issue 33: garbage at an outcome plus any
        name under the next round made replicas go behind -> nothing to heal -> behind, forever).
        """
        attempt = 0
        while (out := self.outcome(round, attempt)) is not None:
            if out.committed or (out.unreadable and moved_past(self.store, round)):
                raise BehindError(round)
            attempt += 1
        # An attempt already under way (quorum decided) whose outcome is gone (deleted) while the run moved
        # on: the round committed; joining it would wait out the deadlines for peers that left.
        if self._quorum_exists(round, attempt) and moved_past(self.store, round):
            raise BehindError(round)
        return attempt

    def _quorum_exists(self, round: int, attempt: int) -> bool:
        try:
            return read_quorum(self.store, round, attempt, replicas=self.config.replicas) is not None
        except BadObject:
            return False

    def _chain(self, round: int, attempt: int) -> _Chain:
        """How ``attempt`` follows the attempts before it (same answer on every replica)."""
        cfg = self.config
        aborts: list[Outcome] = []
        a = attempt - 1
        while a >= 0 and (out := self.outcome(round, a)) is not None and not out.committed and out.retry:
            aborts.append(out)
            a -= 1
        # Back-to-back runs are cut into blocks of max_attempts: a block's first attempt is a new sync.
        position = len(aborts) % cfg.max_attempts
        everyone = frozenset(range(cfg.replicas))
        if position == 0:
            return _Chain(0, frozenset(), everyone)
        excluded = frozenset(r for out in aborts[:position] for r in out.excluded)
        previous = None
        if aborts[0].check != "quorum":  # the retry waits for the last attempt's participants, if known
            try:
                previous = read_quorum(self.store, round, attempt - 1, replicas=cfg.replicas,
                                       min_replicas=cfg.min_replicas)
            except BadObject:
                pass
        base = frozenset(previous.participants) if previous is not None else everyone
        return _Chain(position, excluded, base - excluded)

    def _retry_at_once(self, round: int, attempt: int) -> bool:
        """Whether aborted ``attempt`` is retried now as ``attempt + 1`` (and this replica takes part)."""
        nxt = self._chain(round, attempt + 1)
        return (nxt.position != 0 and self.rank not in nxt.excluded
                and len(nxt.expected) >= self.config.min_replicas)

    # ------------------------------------------------------------ quorum
    def join_and_decide_quorum(self, round: int, attempt: int, *, excluded: frozenset[int] = frozenset(),
                               expected: frozenset[int] | None = None) -> tuple[list[int], float]:
        """Announce this replica and return ``(participants, seconds waited)``.

        The quorum is decided once every rank in ``expected`` (default: all
        replicas) joined, or at the quorum deadline; ``excluded`` ranks never
        take part. Raises :class:`BadObject` if the attempt's quorum
        record is unusable (the attempt must then be abandoned: the record is
        write-once), :class:`RoundTimeout` if too few replicas joined.
        """
        cfg = self.config
        key = layout.quorum_key(round, attempt)
        t0 = time.monotonic()
        self.store.put(layout.join_key(round, attempt, self.rank),
                       json.dumps(Join(rank=self.rank, time=time.time()).to_json()).encode(), durable=False)
        expected = (frozenset(range(cfg.replicas)) if expected is None else expected) - excluded
        deadline = t0 + cfg.quorum_timeout_s

        def decided() -> list[int] | None:
            quorum = read_quorum(self.store, round, attempt, replicas=cfg.replicas, min_replicas=cfg.min_replicas)
            if quorum is None:
                return None
            if set(quorum.participants) & excluded:
                raise BadObject(key, f"participants include ranks {sorted(set(quorum.participants) & excluded)} "
                                         "that this round's earlier attempts excluded")
            return quorum.participants

        def probe() -> list[int] | None:
            if (participants := decided()) is not None:
                return participants
            joined = sorted(self._joined(round, attempt) - excluded)
            everyone = expected <= set(joined)
            if not everyone and time.monotonic() < deadline:
                return None
            if len(joined) < cfg.min_replicas:
                missing = sorted(set(range(cfg.replicas)) - set(joined) - excluded)
                raise RoundTimeout(
                    round, missing,
                    f"only {len(joined)} of min_replicas={cfg.min_replicas} replicas joined "
                    f"within quorum_timeout_s={cfg.quorum_timeout_s}" + self._exclusion_note(round, attempt, excluded))
            record = Quorum(round=round, attempt=attempt, participants=joined, excluded=sorted(excluded),
                            decided_by=self.rank, time=time.time(),
                            reason="all joined" if everyone else "quorum deadline")
            if self.store.create_json(key, record.to_json(), settle=False):  # decided() reads the winner
                logger.info("round %d quorum %s (attempt %d, %s)", shown_round(round), joined, attempt, record.reason)
            return decided()  # whichever record won the race

        # The probe decides at the quorum deadline itself; the poll deadline is only a backstop.
        participants = poll_until(
            probe, deadline=deadline + cfg.round_timeout_s, policy=self.store.poll,
            on_timeout=lambda waited: RoundTimeout(round, sorted(expected), f"no quorum after {waited:.1f}s"))
        return participants, time.monotonic() - t0

    def _exclusion_note(self, round: int, attempt: int, excluded: frozenset[int]) -> str:
        """The earlier attempts' exclusions that leave attempt ``attempt`` short of replicas (see results.py)."""
        aborts = [out for a in range(attempt) if excluded and (out := self.outcome(round, a)) is not None]
        return exclusion_note(aborts, min_replicas=self.config.min_replicas, outlier_factor=self.config.outlier_factor)

    def _joined(self, round: int, attempt: int) -> set[int]:
        """Ranks with a well-named ``join/<rank>.json`` (stray objects are skipped with a warning)."""
        base = layout.join_prefix(round, attempt) + "/"
        ranks = set()
        for k in self.store.list(base[:-1]):
            name = k[len(base):] if k.startswith(base) else k
            rank = join_rank(name, replicas=self.config.replicas, where=f"{self.store.uri}/{base[:-1]}") \
                if "/" not in name else None
            if rank is not None:
                ranks.add(rank)
        return ranks

    # ------------------------------------------------------------ the round
    def allreduce(self, round: int, flat: torch.Tensor) -> RoundResult:
        """Average ``flat`` (1-D float32, modified in place) over the round's participants.

        On return, ``flat`` holds the mean iff ``result.committed`` and
        ``result.participated``; otherwise it is unchanged. Raises
        :class:`BehindError` if the round already committed without us and
        :class:`RoundTimeout` if too few replicas joined.
        """
        if flat.dim() != 1 or flat.dtype != torch.float32:
            raise ValueError("allreduce payload must be a 1-D float32 tensor")
        t0 = time.monotonic()
        r0, w0 = self.store.bytes_read, self.store.bytes_written
        attempt = self.open_attempt(round)
        tries = 0
        while True:
            tries += 1
            result, retry = self._attempt(round, attempt, flat)
            if not retry:
                break
            logger.warning("round %d attempt %d aborted (%s); retrying at once as attempt %d",
                           shown_round(round), attempt, result.reason, attempt + 1)
            attempt += 1
        result.attempts = tries
        result.wall_s = time.monotonic() - t0
        result.bytes_read = self.store.bytes_read - r0
        result.bytes_written = self.store.bytes_written - w0
        return result

    def _attempt(self, round: int, attempt: int, flat: torch.Tensor) -> tuple[RoundResult, bool]:
        """Run one attempt; returns its result and whether to retry at once as ``attempt + 1``."""
        chain = self._chain(round, attempt)
        if self.rank in chain.excluded:
            # Wait (within the deadlines) for the attempt the others run without us: returning at once made an
            # excluded replica whose peers had failed sync again and again with no deadline (issue 37, item 3).
            out = self._wait_excluded(round, attempt)
            return RoundResult(round=round, attempt=attempt, participants=[], participated=False,
                               committed=out.committed,
                               reason=f"excluded from round {shown_round(round)} by an earlier attempt's check",
                               excluded=sorted(chain.excluded)), False
        try:
            participants, quorum_wait = self.join_and_decide_quorum(
                round, attempt, excluded=chain.excluded, expected=chain.expected)
        except BadObject as exc:
            # Write-once: a bad quorum record cannot be replaced, so the attempt is dead.
            # Recording the abort lets everyone (and later arrivals) move on to a + 1.
            out = self._abort(round, attempt, f"invalid quorum record ({exc.reason})", check="quorum", retry=True)
            result = RoundResult(round=round, attempt=attempt, participants=[], participated=False,
                                 committed=False, reason=out.reason)
            return result, out.retry and self._retry_at_once(round, attempt)
        result = RoundResult(round=round, attempt=attempt, participants=participants,
                             participated=self.rank in participants, committed=False, quorum_wait_s=quorum_wait)
        if not result.participated:
            out = self._wait_outcome(round, attempt, participants)
            result.committed = out.committed
            result.reason = "not in quorum (late)"
            return result, False
        try:
            out = self._exchange(round, attempt, participants, flat, result)
        except LocalRankLost:
            raise  # the replica stops as one and its restart rejoins this attempt: no abort (results.py)
        except BaseException as exc:
            # Tell the peers now rather than let them wait out the round deadline.
            self._abort(round, attempt, f"replica {self.rank} failed: {exc!r}", missing=[self.rank])
            raise
        if result.committed:
            return result, False
        result.excluded = list(out.excluded)
        return result, out.retry and self._retry_at_once(round, attempt)

    def _exchange(self, round: int, attempt: int, participants: list[int], flat: torch.Tensor,
                  result: RoundResult) -> Outcome:
        """Scatter, reduce, gather, commit; returns the attempt's final outcome."""
        cfg = self.config
        w = len(participants)
        me = participants.index(self.rank)
        slots = list(iter_chunks(flat.numel(), w))
        deadline = time.monotonic() + cfg.round_timeout_s
        timings = result.timings
        my_norms: list[float] | None = None
        try:
            # 0. my own payload first: a replica whose local state went NaN says so before uploading.
            my_norms = [check_finite(flat[s:e], rank=self.rank, slot=None) for s, e in slots]

            # 1. scatter: encode and upload every slot of my payload.
            t = time.monotonic()
            encoded = list(self._pool.map(lambda se: wire.encode(cfg.codec, flat[se[0]:se[1]]), slots))
            result.payload_bytes = sum(len(e) for e in encoded)
            own_slot = encoded[me]
            uploads = [self._pool.submit(self.store.put, self.keys.grad(round, attempt, self.rank, j), encoded[j],
                                         durable=False) for j in range(w)]
            del encoded
            uploads[0].result()
            self.hooks.at("upload", round, self.rank)
            for u in uploads:
                u.result()
            timings["scatter_s"] = time.monotonic() - t

            # 2. reduce my slot; my own part comes from memory (same bytes as uploaded).
            t = time.monotonic()
            s, e = slots[me]
            reduced_mine, norms = self._reduce_slot(round, attempt, participants, me, e - s, deadline,
                                                    own=(self.rank, own_slot))
            self._publish_reduced(round, attempt, me, reduced_mine, e - s, norms)
            self.hooks.at("reduce", round, self.rank)
            timings["reduce_s"] = time.monotonic() - t

            # 3. gather every reduced slot (recomputing a slot whose reducer vanished) and check it.
            t = time.monotonic()
            out = self._gather(round, attempt, participants, slots, my_norms, deadline,
                               mine=(me, reduced_mine))
            timings["gather_s"] = time.monotonic() - t
        except RoundTimeout as exc:
            final = self._finish_aborted(round, attempt, participants, result, str(exc), missing=exc.missing_ranks)
            self._agree(False)
            return self._settle_after_commit(round, attempt, participants, flat, result, final, slots, my_norms)
        except RejectedPayload as exc:
            final = self._finish_aborted(round, attempt, participants, result, exc.reason, check=exc.check,
                                         excluded=exc.excluded, slot=exc.slot, retry=True)
            self._agree(False)
            return self._settle_after_commit(round, attempt, participants, flat, result, final, slots, my_norms)
        return self._commit(round, attempt, participants, out, flat, result)

    def _commit(self, round: int, attempt: int, participants: list[int], out: torch.Tensor, flat: torch.Tensor,
                result: RoundResult) -> Outcome:
        """4. commit. Only a valid "committed" outcome lets anyone apply the result (``out`` into ``flat``)."""
        commit = Outcome(round=round, attempt=attempt, committed=True, participants=participants, by=self.rank,
                         time=time.time())
        if self._agree(True):  # a multi-GPU replica commits only once every shard verified (sharded.py)
            self.store.create_json(layout.outcome_key(round, attempt), commit.to_json(), settle=False)
        final = read_outcome(self.store, round, attempt, replicas=self.config.replicas, participants=participants)
        if final is not None and final.committed:
            flat.copy_(out)
            result.committed = True
            return final
        final = final or Outcome(round=round, attempt=attempt, committed=False, reason="outcome record vanished",
                                 check="outcome", retry=True)
        result.reason = f"aborted by replica {final.by}: {final.reason}"
        return final

    def _agree(self, ok: bool) -> bool:
        """Whether every local rank of this replica verified its part of the attempt (one rank: ``ok``)."""
        return ok

    def _gather(self, round: int, attempt: int, participants: list[int], slots: list[tuple[int, int]],
                my_norms: list[float], deadline: float, *, mine: tuple[int, bytes] | None = None) -> torch.Tensor:
        """Every reduced slot, fetched (or taken from ``mine``: ``(slot, bytes)``), checked and decoded.

        Raises :class:`RejectedPayload` (a slot fails its digest or norms) or :class:`RoundTimeout`.
        """
        cfg = self.config
        me = participants.index(self.rank)
        gathered = [None if mine is not None and j == mine[0] else
                    self._pool.submit(self._fetch_reduced, round, attempt, participants, j, e - s, deadline)
                    for j, (s, e) in enumerate(slots)]
        out = torch.empty(slots[-1][1] if slots else 0, dtype=torch.float32)
        for j, (s, e) in enumerate(slots):
            if gathered[j] is None:
                out[s:e] = wire.decode(cfg.codec, mine[1], numel=e - s)
                continue
            key = self.keys.reduced(round, attempt, j)
            record, data = gathered[j].result()
            try:
                decoded = wire.decode(cfg.codec, data, key=key, numel=e - s)
            except wire.PayloadError as exc:
                raise RejectedPayload(f"reduced slot {j}: {exc}", check="reduced", slot=j) from None
            verify_reduced(record, data, decoded, key=key, round=round, attempt=attempt, slot=j,
                           participants=participants, me=me, my_norm=my_norms[j], rtol=wire.norm_rtol(cfg.codec))
            out[s:e] = decoded
        return out

    def _settle_after_commit(self, round: int, attempt: int, participants: list[int], flat: torch.Tensor,
                             result: RoundResult, final: Outcome, slots: list[tuple[int, int]],
                             my_norms: list[float] | None) -> Outcome:
        """After this replica's attempt failed: if the round committed anyway, apply its result or heal.

        The record decides: a committed round is applied by every participant. A fresh read of every
        reduced slot (the failure may have been a damaged read or a slow part, not a bad object) either
        verifies, and this replica applies it like everyone else, or ``result.heal`` stays set and the
        manager heals from the round's committed global state. Bytes that failed a check are never applied.
        """
        if not result.heal or my_norms is None:
            return final
        try:
            out = self._gather(round, attempt, participants, slots, my_norms,
                               time.monotonic() + self.config.round_timeout_s)
        except (RoundTimeout, RejectedPayload) as again:
            logger.warning("round %d (attempt %d) committed, but replica %d cannot verify its result (%s); healing "
                           "from the committed state", shown_round(round), attempt, self.rank, again)
            return final
        flat.copy_(out)
        result.committed, result.heal, result.reason = True, False, ""
        return read_outcome(self.store, round, attempt, replicas=self.config.replicas,
                            participants=participants) or final

    def _finish_aborted(self, round: int, attempt: int, participants: list[int], result: RoundResult,
                        reason: str, **record: Any) -> Outcome:
        out = self._abort(round, attempt, reason, participants=participants, **record)
        if out.committed:
            # A peer committed before this replica's check failed. The record decides: the round is
            # over and nobody retries it; never apply what failed here (``heal``: the caller reads
            # the result again or heals from the committed state, like a replica left out of it).
            result.heal = True
            result.reason = f"check failed after the round committed ({reason}); not applied"
            return Outcome(round=round, attempt=attempt, committed=False, reason=result.reason)
        result.reason = out.reason if out.by is None or out.by == self.rank else \
            f"aborted by replica {out.by}: {out.reason}"
        return out

    def _reduce_slot(self, round: int, attempt: int, participants: list[int], slot: int, numel: int,
                     deadline: float, own: tuple[int, bytes] | None = None,
                     parallel: bool = True) -> tuple[bytes, list[float]]:
        """Check, sum in participant order, divide, encode slot ``slot``; returns it and the input norms.

        Raises :class:`RoundTimeout` (parts missing) or :class:`RejectedPayload` (a part failed a check).
        """
        cfg = self.config

        def fetch(rank: int) -> bytes | memoryview:
            if own is not None and rank == own[0]:
                return own[1]
            return self._wait_in_round(round, attempt, self.keys.grad(round, attempt, rank, slot), deadline, rank)

        if parallel:
            futures = [self._pool.submit(fetch, p) for p in participants]
        else:
            futures = [InlineFuture(fetch, p) for p in participants]
        acc: torch.Tensor | None = None
        missing: list[int] = []
        norms: list[float] = []
        for p, fut in zip(participants, futures):
            key = self.keys.grad(round, attempt, p, slot)
            try:
                part = wire.decode(cfg.codec, fut.result(), key=key, numel=numel)
            except RoundTimeout as exc:
                if exc.aborted:
                    raise
                missing.append(p)
                continue
            except ChecksumMismatch as exc:
                # Damaged in storage or transit: nobody to blame, a fresh attempt re-uploads it.
                raise RejectedPayload(str(exc), check="corrupt", slot=slot) from None
            except wire.PayloadError as exc:
                raise RejectedPayload(f"pseudo-gradient of replica {p}, slot {slot}: {exc.problem}",
                                      check="malformed", slot=slot, excluded=[p]) from None
            norms.append(check_finite(part, rank=p, slot=slot))
            acc = part if acc is None else acc.add_(part)
        if missing:
            raise RoundTimeout(round, missing, "pseudo-gradients missing")
        check_outliers(participants, norms, slot=slot, outlier_factor=cfg.outlier_factor,
                       floor=cfg.norm_floor_rms * math.sqrt(numel))
        assert acc is not None
        acc.div_(len(participants))
        if not math.isfinite(l2(acc)):  # finite inputs can still overflow float32 when summed
            worst = participants[max(range(len(norms)), key=norms.__getitem__)]
            raise RejectedPayload(f"pseudo-gradient slot {slot}: the sum overflows float32 (largest norm: "
                                  f"replica {worst})", check="nonfinite", slot=slot, excluded=[worst])
        return wire.encode(cfg.codec, acc), norms

    def _publish_reduced(self, round: int, attempt: int, slot: int, data: bytes, numel: int,
                         norms: list[float]) -> dict[str, Any]:
        """Upload a reduced slot, then its write-once digest (readers wait for the digest)."""
        digest = SlotDigest(round=round, attempt=attempt, slot=slot, numel=numel, crc32=zlib.crc32(data),
                            input_norms=list(norms), by=self.rank)
        return publish_with_digest(self.store, self.keys.reduced(round, attempt, slot), data,
                                   self.keys.reduced_digest(round, attempt, slot), digest,
                                   what=f"reduced slot {slot}")

    def _fetch_reduced(self, round: int, attempt: int, participants: list[int], slot: int, numel: int,
                       deadline: float) -> tuple[Any, bytes | memoryview]:
        """Wait for reduced slot ``slot`` and its digest; returns ``(digest record, slot bytes)``."""
        key = self.keys.reduced(round, attempt, slot)
        # Wait for the reducer for half the round's remaining time, then take over its slot.
        takeover_at = time.monotonic() + 0.5 * max(0.0, deadline - time.monotonic())
        try:
            digest = self._wait_in_round(round, attempt, self.keys.reduced_digest(round, attempt, slot),
                                         takeover_at, participants[slot])
            record = json.loads(bytes(digest))
        except RoundTimeout as exc:
            if exc.aborted:
                raise
            logger.warning("%s: reducer %d did not publish; recomputing the slot", key, participants[slot])
            # Fetch inline: this already runs on the pool, and waiting on more pool
            # work from a pool thread could exhaust it.
            data, norms = self._reduce_slot(round, attempt, participants, slot, numel, deadline, parallel=False)
            return self._publish_reduced(round, attempt, slot, data, numel, norms), data
        except (ChecksumMismatch, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RejectedPayload(f"reduced slot {slot}: unreadable digest ({exc})", check="reduced",
                                  slot=slot) from None
        try:
            return record, self.store.get(key)
        except (ObjectNotFound, ChecksumMismatch) as exc:
            raise RejectedPayload(f"reduced slot {slot}: {exc}", check="reduced", slot=slot) from None

    def _wait_in_round(self, round: int, attempt: int, key: str, deadline: float, owner: int) -> memoryview:
        """Wait for ``key`` until ``deadline``, but stop early if the attempt was aborted.

        Raises :class:`RoundTimeout` naming ``owner`` (the replica expected to
        write ``key``); ``aborted`` is set when a peer aborted the attempt.
        """
        def between(misses: int) -> None:
            if misses % 8:
                return
            out = self.outcome(round, attempt)
            if out is not None and not out.committed:
                exc = RoundTimeout(round, out.missing, f"aborted by replica {out.by}: {out.reason}")
                exc.aborted = True
                raise exc

        try:
            return self.store.wait_get(key, deadline=deadline, between=between)
        except StoreTimeout as exc:
            raise RoundTimeout(round, [owner], f"{key} did not arrive within {exc.waited_s:.1f}s") from None

    def _abort(self, round: int, attempt: int, reason: str, *, participants: list[int] | None = None,
               missing: Sequence[int] = (), excluded: Sequence[int] = (), check: str | None = None,
               slot: int | None = None, retry: bool = False) -> Outcome:
        """Create the attempt's abort record (unless an outcome exists); returns the outcome that won."""
        record = Outcome(round=round, attempt=attempt, committed=False, reason=reason, missing=sorted(missing),
                         excluded=sorted(excluded), check=check, retry=retry, by=self.rank, slot=slot,
                         time=time.time())
        if self.store.create_json(layout.outcome_key(round, attempt), record.to_json(), settle=False):
            logger.warning("round %d (attempt %d) aborted: %s", shown_round(round), attempt, reason)
        out = read_outcome(self.store, round, attempt, replicas=self.config.replicas, participants=participants)
        return out or Outcome(round=round, attempt=attempt, committed=False, reason=reason, check=check, retry=retry,
                              by=self.rank)

    def _wait_excluded(self, round: int, attempt: int) -> Outcome:
        """The outcome of an attempt this replica was excluded from, once its participants record one.

        Raises :class:`RoundTimeout` naming the outcome key when none is recorded within
        ``quorum_timeout_s + round_timeout_s`` (the participants failed; the replica exits with that reason).
        """
        cfg = self.config
        key = layout.outcome_key(round, attempt)
        return poll_until(
            lambda: self.outcome(round, attempt),
            deadline=time.monotonic() + cfg.quorum_timeout_s + cfg.round_timeout_s, policy=self.store.poll,
            on_timeout=lambda waited: RoundTimeout(
                round, [], f"excluded from attempt {attempt}, and its participants recorded no outcome at "
                            f"{self.store.uri}/{key} within quorum_timeout_s + round_timeout_s ({waited:.1f}s)"))

    def _wait_outcome(self, round: int, attempt: int, participants: list[int]) -> Outcome:
        return poll_until(
            lambda: read_outcome(self.store, round, attempt, replicas=self.config.replicas,
                                 participants=participants),
            deadline=time.monotonic() + self.config.round_timeout_s, policy=self.store.poll,
            on_timeout=lambda waited: RoundTimeout(round, participants, "no outcome recorded within "
                                                                        f"round_timeout_s ({waited:.1f}s)"))


__all__ = ["AllReduceConfig", "BehindError", "InlineFuture", "ObjectStoreAllReduce", "RoundResult", "RoundTimeout"]
