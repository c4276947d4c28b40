"""Object-store all-reduce: average a flat tensor over the replicas of a round.

Replicas never talk to each other; every step of a round is an object in the
store. Layout under the run's store (``r`` zero-padded round, ``a`` attempt)::

    rounds/<r>/<a>/join/<rank>.json     "I reached sync r" (overwritable, informational)
    rounds/<r>/<a>/quorum.json          write-once participant set
    rounds/<r>/<a>/grad/<rank>/<slot>   encoded part ``slot`` of a participant's payload
    rounds/<r>/<a>/reduced/<slot>       encoded mean of part ``slot`` over participants
    rounds/<r>/<a>/outcome.json         write-once: committed, or aborted with a reason

Protocol for one attempt (``W`` = number of participants, ``i`` = my index):

1. Join, then decide the quorum: as soon as every launched replica has joined,
   or when the quorum deadline passes with at least ``min_replicas`` joined,
   some replica creates ``quorum.json`` (write-once: racing writers agree on
   the first). Everyone reads the participant set from that record only.
2. Scatter: split the payload into ``W`` contiguous slots, upload each.
3. Reduce: participant ``i`` reads slot ``i`` of every participant, sums in
   float32 in participant order (deterministic), divides by ``W`` and uploads
   the encoded mean. If a reducer disappears, another participant recomputes
   its slot (same inputs, same order, same bytes).
4. Gather: read every reduced slot; everyone decodes the same bytes, so all
   participants end with bitwise-identical results.
5. Commit: create ``outcome.json`` ``{"committed": true}``. If a participant's
   payload never arrives, ``{"committed": false}`` is created instead; the
   write-once record makes the decision unique, and nobody applies a result
   whose outcome is not "committed". An aborted round is retried as attempt
   ``a + 1`` at the next sync.

Traffic per participant: ``P`` up (scatter) + ``P (W-1)/W`` down (reduce) +
``P/W`` up + ``P (W-1)/W`` down (gather) = ``(3 - 1/W) P``, independent of the
number of replicas (``P`` = encoded payload bytes).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_cloud import faults
from composer_cloud.rendezvous import codec as wire
from composer_cloud.rendezvous.store import ObjectNotFound, Store, StoreError, StoreTimeout, iter_chunks

logger = logging.getLogger(__name__)


class RoundTimeout(StoreError):
    """A round could not proceed before its deadline; names the missing ranks."""

    def __init__(self, round: int, missing_ranks: Sequence[int], what: str) -> None:
        self.round = round
        self.missing_ranks = sorted(missing_ranks)
        self.aborted = False
        super().__init__(f"round {round}: {what}; missing replicas: {self.missing_ranks}")


class _Immediate:
    """A future-like that runs its function when asked for the result (inline fetches)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._fn, self._args = fn, args

    def result(self) -> Any:
        return self._fn(*self._args)


class BehindError(StoreError):
    """The round this replica tried to join is already committed: it must heal first."""

    def __init__(self, round: int) -> None:
        self.round = round
        super().__init__(f"round {round} is already committed; heal from the committed state")


@dataclass(frozen=True)
class AllReduceConfig:
    """Settings of the object-store all-reduce. Times are seconds.

    Attributes:
        replicas: number of replicas launched (the quorum is decided early when all joined).
        min_replicas: fewest participants a round may commit with.
        codec: wire codec name (``fp32``, ``bf16``, ``int8``).
        quorum_timeout_s: after joining, how long to wait for the others.
        round_timeout_s: deadline for every other wait of the round.
        io_threads: parallel transfers per replica.
    """

    replicas: int
    min_replicas: int = 1
    codec: str = "fp32"
    quorum_timeout_s: float = 60.0
    round_timeout_s: float = 600.0
    io_threads: int = 8


@dataclass
class RoundResult:
    """What happened in one attempt of a round, from one replica's view."""

    round: int
    attempt: int
    participants: list[int]
    participated: bool
    committed: bool
    reason: str = ""
    wall_s: float = 0.0
    quorum_wait_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    payload_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)


def round_prefix(round: int) -> str:
    return f"rounds/{round:08d}"


def attempt_prefix(round: int, attempt: int) -> str:
    return f"{round_prefix(round)}/{attempt}"


class ObjectStoreAllReduce:
    """Runs all-reduce rounds for one replica over a run's store."""

    def __init__(self, store: Store, rank: int, config: AllReduceConfig) -> None:
        if not 0 <= rank < config.replicas:
            raise ValueError(f"rank {rank} out of range for {config.replicas} replicas")
        if config.codec not in wire.CODECS:
            raise ValueError(f"sync.codec: unknown codec {config.codec!r}; choose one of {wire.CODECS}")
        self.store = store
        self.rank = rank
        self.config = config
        self._pool = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix=f"allreduce-r{rank}")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------ round discovery
    def outcome(self, round: int, attempt: int) -> dict[str, Any] | None:
        return self.store.try_get_json(f"{attempt_prefix(round, attempt)}/outcome.json")

    def attempts(self, round: int) -> list[int]:
        return _attempts(self.store, round)

    def latest_committed_round(self, *, start: int = 0) -> int:
        return latest_committed_round(self.store, start=start)

    def open_attempt(self, round: int) -> int:
        """The attempt a replica arriving at ``round`` should join.

        Raises :class:`BehindError` if ``round`` already committed.
        """
        attempts = self.attempts(round)
        if not attempts:
            return 0
        last = attempts[-1]
        out = self.outcome(round, last)
        if out is None:
            return last
        if out.get("committed"):
            raise BehindError(round)
        return last + 1

    # ------------------------------------------------------------ quorum
    def join_and_decide_quorum(self, round: int, attempt: int) -> tuple[list[int], float]:
        """Announce this replica and return ``(participants, seconds waited)``."""
        prefix = attempt_prefix(round, attempt)
        t0 = time.monotonic()
        self.store.put(f"{prefix}/join/{self.rank}.json",
                       json.dumps({"rank": self.rank, "time": time.time()}).encode(), durable=False)
        deadline = t0 + self.config.quorum_timeout_s
        delay = self.store.poll.initial_s
        while True:
            quorum = self.store.try_get_json(f"{prefix}/quorum.json")
            if quorum is not None:
                return [int(r) for r in quorum["participants"]], time.monotonic() - t0
            joined = sorted(int(k.rsplit("/", 1)[1].split(".")[0]) for k in self.store.list(f"{prefix}/join"))
            now = time.monotonic()
            everyone = len(joined) >= self.config.replicas
            if everyone or now >= deadline:
                if len(joined) < self.config.min_replicas:
                    missing = sorted(set(range(self.config.replicas)) - set(joined))
                    raise RoundTimeout(
                        round, missing,
                        f"only {len(joined)} of min_replicas={self.config.min_replicas} replicas joined "
                        f"within quorum_timeout_s={self.config.quorum_timeout_s}")
                record = {"participants": joined, "decided_by": self.rank, "time": time.time(),
                          "reason": "all joined" if everyone else "quorum deadline"}
                if self.store.create_json(f"{prefix}/quorum.json", record):
                    logger.info("round %d.%d quorum %s (%s)", round, attempt, joined, record["reason"])
                continue  # read back whichever record won
            time.sleep(delay)
            delay = min(self.store.poll.max_s, delay * self.store.poll.factor)

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
        participants, quorum_wait = self.join_and_decide_quorum(round, attempt)
        result = RoundResult(round=round, attempt=attempt, participants=participants,
                             participated=self.rank in participants, committed=False, quorum_wait_s=quorum_wait)
        if not result.participated:
            out = self._wait_outcome(round, attempt, participants)
            result.committed = bool(out.get("committed"))
            result.reason = "not in quorum (late)"
        else:
            try:
                self._exchange(round, attempt, participants, flat, result)
            except BaseException as exc:
                # Tell the peers now rather than let them wait out the round deadline.
                self._abort(round, attempt, f"replica {self.rank} failed: {exc!r}", [self.rank])
                raise
        result.wall_s = time.monotonic() - t0
        result.bytes_read = self.store.bytes_read - r0
        result.bytes_written = self.store.bytes_written - w0
        return result

    def _exchange(self, round: int, attempt: int, participants: list[int], flat: torch.Tensor,
                  result: RoundResult) -> None:
        cfg = self.config
        prefix = attempt_prefix(round, attempt)
        w = len(participants)
        me = participants.index(self.rank)
        slots = list(iter_chunks(flat.numel(), w))
        deadline = time.monotonic() + cfg.round_timeout_s
        timings = result.timings

        # 1. scatter: encode and upload every slot of my payload.
        t = time.monotonic()
        encoded = list(self._pool.map(lambda se: wire.encode(cfg.codec, flat[se[0]:se[1]]), slots))
        result.payload_bytes = sum(len(e) for e in encoded)
        own_slot = encoded[me]
        uploads = [self._pool.submit(self.store.put, f"{prefix}/grad/{self.rank}/{j}", encoded[j], durable=False)
                   for j in range(w)]
        del encoded
        uploads[0].result()
        faults.stall_point("upload", round, self.rank)
        for u in uploads:
            u.result()
        timings["scatter_s"] = time.monotonic() - t

        # 2. reduce my slot; my own part comes from memory (same bytes as uploaded).
        t = time.monotonic()
        try:
            reduced_mine = self._reduce_slot(round, prefix, participants, me, deadline, own=(self.rank, own_slot))
        except RoundTimeout as exc:
            self._abort(round, attempt, str(exc), exc.missing_ranks)
            result.reason = str(exc)
            return
        self.store.put(f"{prefix}/reduced/{me}", reduced_mine, durable=False)
        faults.stall_point("reduce", round, self.rank)
        timings["reduce_s"] = time.monotonic() - t

        # 3. gather every reduced slot (recomputing a slot whose reducer vanished).
        t = time.monotonic()
        gathered: list[Any] = []
        for j in range(w):
            if j == me:
                gathered.append(None)
            else:
                gathered.append(self._pool.submit(self._fetch_reduced, round, prefix, participants, j, deadline))
        out = torch.empty_like(flat)
        try:
            for j, (s, e) in enumerate(slots):
                data = reduced_mine if j == me else gathered[j].result()
                out[s:e] = wire.decode(cfg.codec, data, key=f"{prefix}/reduced/{j}")
        except RoundTimeout as exc:
            self._abort(round, attempt, str(exc), exc.missing_ranks)
            result.reason = str(exc)
            return
        timings["gather_s"] = time.monotonic() - t

        # 4. commit. Only an outcome record that says "committed" lets anyone apply the result.
        record = {"committed": True, "participants": participants, "by": self.rank, "time": time.time()}
        self.store.create_json(f"{prefix}/outcome.json", record)
        final = self.store.get_json(f"{prefix}/outcome.json")
        if final.get("committed"):
            flat.copy_(out)
            result.committed = True
        else:
            result.reason = f"aborted by replica {final.get('by')}: {final.get('reason')}"

    def _reduce_slot(self, round: int, prefix: str, participants: list[int], slot: int, deadline: float,
                     own: tuple[int, bytes] | None = None, parallel: bool = True) -> bytes:
        """Sum slot ``slot`` over participants in order, divide, encode. Raises RoundTimeout."""
        cfg = self.config

        def fetch(rank: int) -> bytes | memoryview:
            if own is not None and rank == own[0]:
                return own[1]
            key = f"{prefix}/grad/{rank}/{slot}"
            return self._wait_in_round(round, prefix, key, deadline, rank)

        if parallel:
            futures = [self._pool.submit(fetch, p) for p in participants]
        else:
            futures = [_Immediate(fetch, p) for p in participants]
        acc: torch.Tensor | None = None
        missing: list[int] = []
        for p, fut in zip(participants, futures):
            try:
                part = wire.decode(cfg.codec, fut.result(), key=f"{prefix}/grad/{p}/{slot}")
            except RoundTimeout as exc:
                if exc.aborted:
                    raise
                missing.append(p)
                continue
            acc = part if acc is None else acc.add_(part)
        if missing:
            raise RoundTimeout(round, missing, "pseudo-gradients missing")
        assert acc is not None
        acc.div_(len(participants))
        return wire.encode(cfg.codec, acc)

    def _fetch_reduced(self, round: int, prefix: str, participants: list[int], slot: int, deadline: float) -> bytes | memoryview:
        key = f"{prefix}/reduced/{slot}"
        # Wait for the reducer for half the round's remaining time, then take over its slot.
        takeover_at = time.monotonic() + 0.5 * max(0.0, deadline - time.monotonic())
        try:
            return self._wait_in_round(round, prefix, key, takeover_at, participants[slot])
        except RoundTimeout as exc:
            if exc.aborted:
                raise
        logger.warning("%s: reducer %d did not publish; recomputing the slot", key, participants[slot])
        # Fetch inline: this already runs on the pool, and waiting on more pool
        # work from a pool thread could exhaust it.
        data = self._reduce_slot(round, prefix, participants, slot, deadline, parallel=False)
        self.store.put(key, data, durable=False)
        return data

    def _wait_in_round(self, round: int, prefix: str, key: str, deadline: float, owner: int) -> memoryview:
        """Wait for ``key`` until ``deadline``, but stop early if the attempt was aborted.

        Raises :class:`RoundTimeout` naming ``owner`` (the replica expected to
        write ``key``); ``aborted`` is set when a peer aborted the attempt.
        """
        start = time.monotonic()
        delay = self.store.poll.initial_s
        checks = 0
        while True:
            found = self.store.try_get(key)
            if found is not None:
                return found
            checks += 1
            if checks % 8 == 0:
                out = self.store.try_get_json(f"{prefix}/outcome.json")
                if out is not None and not out.get("committed"):
                    exc = RoundTimeout(round, out.get("missing", []), f"aborted by replica {out.get('by')}: "
                                       f"{out.get('reason')}")
                    exc.aborted = True
                    raise exc
            now = time.monotonic()
            if now >= deadline:
                raise RoundTimeout(round, [owner], f"{key} did not arrive within {now - start:.1f}s")
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(self.store.poll.max_s, delay * self.store.poll.factor)

    def _abort(self, round: int, attempt: int, reason: str, missing: list[int]) -> None:
        prefix = attempt_prefix(round, attempt)
        record = {"committed": False, "reason": reason, "missing": missing, "by": self.rank, "time": time.time()}
        if self.store.create_json(f"{prefix}/outcome.json", record):
            logger.warning("round %d.%d aborted: %s", round, attempt, reason)

    def _wait_outcome(self, round: int, attempt: int, participants: list[int]) -> dict[str, Any]:
        key = f"{attempt_prefix(round, attempt)}/outcome.json"
        deadline = time.monotonic() + self.config.round_timeout_s
        try:
            self.store.wait_get(key, deadline=deadline)
        except StoreTimeout:
            raise RoundTimeout(round, participants, "no outcome recorded within round_timeout_s") from None
        return self.store.get_json(key)


def _attempts(store: Store, round: int) -> list[int]:
    return sorted(int(n) for n in store.list_dirs(round_prefix(round)) if n.isdigit())


def committed_attempt(store: Store, round: int) -> int | None:
    """The attempt of ``round`` that committed, if any."""
    for a in reversed(_attempts(store, round)):
        out = store.try_get_json(f"{attempt_prefix(round, a)}/outcome.json")
        if out is not None and out.get("committed"):
            return a
    return None


def latest_committed_round(store: Store, *, start: int = 0) -> int:
    """Highest committed round at or after ``start - 1`` (``start - 1`` if none newer).

    Rounds commit in order, so scanning forward from a known committed round
    is enough; ``-1`` means nothing committed yet. Needs only the store, so
    status queries use it without joining the run.
    """
    r = start
    while committed_attempt(store, r) is not None:
        r += 1
    return r - 1


def cleanup_rounds(store: Store, *, before: int) -> int:
    """Delete transient objects of rounds ``< before``; returns rounds removed.

    Only payloads are deleted (``grad/``, ``reduced/``, ``join/``); quorum and
    outcome records stay as the run's history (they are tiny).
    """
    removed = 0
    for name in store.list_dirs("rounds"):
        if not name.isdigit() or int(name) >= before:
            continue
        for attempt in store.list_dirs(f"rounds/{name}"):
            for sub in ("grad", "reduced", "join"):
                store.delete(f"rounds/{name}/{attempt}/{sub}", recursive=True)
        removed += 1
    return removed


__all__ = [
    "AllReduceConfig",
    "BehindError",
    "ObjectNotFound",
    "ObjectStoreAllReduce",
    "RoundResult",
    "RoundTimeout",
    "attempt_prefix",
    "cleanup_rounds",
    "committed_attempt",
    "latest_committed_round",
    "round_prefix",
]
