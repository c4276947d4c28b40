"""A torchft ``Manager`` stand-in backed by the object-store all-reduce.

``torchft.local_sgd.DiLoCo`` uses only a small part of torchft's Manager;
:class:`ObjectStoreManager` provides exactly that part, so torchft's real
DiLoCo (and Streaming DiLoCo with several fragments) runs unchanged with no
Lighthouse, no TCPStore and no network path between replicas.

How a sync maps onto the store (round ``r`` = ``current_step()``):

* ``start_quorum()`` — opens round ``r``. If round ``r`` (or later) already
  committed without us, we are behind: heal first (see below).
* ``allreduce(t)`` — called once per parameter (or bucket) by DiLoCo. Calls
  are only collected; the first call that needs a result (``work.wait()``,
  ``should_commit()``) or the next inner step (``disallow_state_dict_read``)
  flushes them as **one** store round: the tensors are concatenated into one
  float32 payload, averaged over the round's participants in a background
  thread (so ``fragment_sync_delay`` overlaps inner steps with the exchange),
  and copied back in place.
* ``should_commit()`` — True iff this replica was in the round's quorum and
  the round's write-once outcome record says committed; then ``r += 1``.
  A replica left out of the quorum returns False (its pseudo-gradient is not
  in the average), then heals: it loads the round's committed global state
  through the functions DiLoCo registered with ``register_state_dict_fn``
  and calls ``on_heal`` so the caller copies the global parameters into the
  model. An aborted round returns False on every replica and is retried.

Global state: after a commit, DiLoCo's outer step produces the new global
parameters, bitwise identical on every participant. At the next manager call
(or :meth:`publish_state`) each participant hands the state of every registered
``save_fn`` to its :class:`GlobalStatePort` (the checkpoint layer, given at
construction: the manager never spells a checkpoint key), in the background:
the port writes this replica's slice and, after ``takeover_after_s``, any slice
still missing. ``start_quorum`` joins that work, so a round's global state is
durable before its participants sync again, whoever died. Healing reads only
durable states, through the same port.

Every sync is reported to ``on_sync`` (a :class:`SyncRecord`), so the caller
learns about commits, aborts and heals without inspecting the manager.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future as _ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from composer_cloud.errors import StoreTimeout, SyncError
from composer_cloud.retry import PollPolicy, poll_until
from composer_cloud.round_numbers import shown_round
from composer_cloud.storage import layout
from composer_cloud.sync.lockstep import rounds
from composer_cloud.sync.lockstep.allreduce import BehindError, ObjectStoreAllReduce, RoundResult

logger = logging.getLogger(__name__)


class HealError(SyncError):
    """No committed global state could be loaded before the heal deadline."""


class SyncStalled(SyncError):
    """A replica's syncs stopped advancing it for longer than the run's deadlines (the re-sync budget)."""


class GlobalStatePort(Protocol):
    """What the manager needs from the checkpoint layer (``GlobalStateStore`` provides it).

    Like torchft's ``CheckpointTransport``: the manager decides *when* state moves,
    the port owns *where* it lives. ``attempt`` is the round's committed attempt.
    """

    def publish(self, round: int, attempt: int, tree: dict[str, Any], *, participants: Sequence[int], rank: int,
                takeover_after_s: float) -> int:
        """Make the committed state durable (this replica's share, then any missing share); returns bytes."""
        ...

    def durable(self, round: int, attempt: int) -> bool:
        """Whether the committed state of ``round`` is durable."""
        ...

    def load(self, round: int, attempt: int) -> dict[str, Any]:
        """The committed state of ``round`` (verified; raises ``CorruptCheckpoint``)."""
        ...


def _completed(value: Any) -> _ThreadFuture:
    fut: _ThreadFuture = _ThreadFuture()
    fut.set_result(value)
    return fut


class _Work:
    """What ``Manager.allreduce`` returns: ``wait()`` and ``get_future()``."""

    def __init__(self, manager: "ObjectStoreManager", future: torch.futures.Future) -> None:
        self._manager = manager
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        with self._manager._blocking():
            self._manager._flush()
            self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        # Callers chain ``.then()`` right after each bucket's allreduce, before
        # the sync's other buckets are issued: this must not flush.
        return self._future


@dataclass
class SyncRecord:
    """One sync as this replica saw it (for metrics)."""

    round: int
    result: RoundResult | None
    committed: bool
    healed_to: int | None = None
    #: Seconds the training thread was blocked in this sync (start_quorum: the previous round's state
    #: upload and any heal; waiting for the exchange; should_commit), i.e. not computing.
    blocked_s: float = 0.0


class ObjectStoreManager:
    """Duck-typed torchft Manager for ``torchft.local_sgd.DiLoCo``.

    Args:
        allreduce: the replica's object-store all-reduce (holds store, rank, deadlines).
        global_state: where committed global states are published and healed from.
        heal_timeout_s: how long healing may wait for a committed global state.
        void_after_s: how long a healer waits for a committed round's state to
            become durable before voiding that commit (its participants are gone).
        takeover_after_s: how long a participant waits for the other slices of
            a committed global state before writing the missing ones itself.
        on_heal: called with the healed round after registered states were
            loaded; use it to copy the global parameters into the model
            (``diloco._restore_parameters``).
        on_sync: called with the :class:`SyncRecord` of every sync (commit,
            abort, heal), on the training thread, before DiLoCo's outer step.
        start_step: first round this replica syncs (from a checkpoint).
        stall_s: seconds a replica may keep syncing without advancing (no commit, no heal forward) before it
            fails with :class:`SyncStalled`; default: the heal deadline plus ``void_after_s``.
        stall_syncs: ... and at least this many syncs in a row (a slow round is not a stall).
    """

    _use_async_quorum = False

    def __init__(
        self,
        allreduce: ObjectStoreAllReduce,
        global_state: GlobalStatePort,
        *,
        heal_timeout_s: float,
        takeover_after_s: float,
        void_after_s: float,
        on_heal: Callable[[int], None] | None = None,
        on_sync: Callable[[SyncRecord], None] | None = None,
        start_step: int = 0,
        stall_s: float | None = None,
        stall_syncs: int = 8,
    ) -> None:
        self._ar = allreduce
        self.global_state = global_state
        self.store = allreduce.store
        self.rank = allreduce.rank
        self.heal_timeout_s = heal_timeout_s
        self.takeover_after_s = takeover_after_s
        self.void_after_s = void_after_s
        self._last_commit: tuple[int, int] | None = None  # (round, attempt) this replica last committed
        self.on_heal = on_heal
        self.on_sync = on_sync
        self._step = start_step
        self._load_fns: dict[str, Callable[[Any], None]] = {}
        self._save_fns: dict[str, Callable[[], Any]] = {}
        self._pending: list[tuple[torch.Tensor, torch.futures.Future]] = []
        self._exchange: _ThreadFuture | None = None
        self._exchange_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sync-r{self.rank}")
        self._publish: _ThreadFuture | None = None
        self.bytes_published = 0  # global-state bytes this replica uploaded (own slices + takeovers)
        self._publish_round: int | None = None
        self._round_open = False
        self._skip_sync = False
        self.last_sync: SyncRecord | None = None
        self._blocked_s = 0.0  # training-thread seconds inside the current sync
        self.stall_s = float(heal_timeout_s + void_after_s if stall_s is None else stall_s)
        self.stall_syncs = stall_syncs
        self._stall_round, self._stalls, self._stall_since = start_step, 0, time.monotonic()

    @property
    def exchange(self) -> ObjectStoreAllReduce:
        """The replica's object-store all-reduce (its codec state is checkpointed with the replica)."""
        return self._ar

    # ------------------------------------------------------------ torchft Manager surface
    def register_state_dict_fn(self, key: str, load_fn: Callable[[Any], None], save_fn: Callable[[], Any]) -> None:
        self._load_fns[key] = load_fn
        self._save_fns[key] = save_fn

    def allow_state_dict_read(self) -> None:
        # Nothing to guard: state is only read between inner steps, on this thread.
        pass

    def disallow_state_dict_read(self) -> None:
        # Called before every inner optimizer step: a good moment to start work
        # that overlaps with compute (a pending exchange, a state upload).
        self._flush()
        self._maybe_publish_state()

    def current_step(self) -> int:
        return self._step

    @contextlib.contextmanager
    def _blocking(self) -> Iterator[None]:
        """Count the time the training thread spends inside ``with`` as sync time (``SyncRecord.blocked_s``)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._blocked_s += time.monotonic() - t0

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        with self._blocking():
            self._start_quorum()

    def should_commit(self, timeout: Any = None) -> bool:
        try:
            with self._blocking():
                return self._should_commit()
        finally:
            if self.last_sync is not None:
                self.last_sync.blocked_s, self._blocked_s = self._blocked_s, 0.0

    def _start_quorum(self) -> None:
        self.flush_state()
        if self._pending or self._exchange is not None:
            raise RuntimeError("start_quorum called while a previous sync is still open")
        self._skip_sync = False
        if self._last_commit is not None and self._commit_was_voided(*self._last_commit):
            # Our state comes from a commit that was abandoned: go back to the newest durable state.
            round = self._last_commit[0]
            self._last_commit = None
            logger.warning("replica %d: the commit of round %d was voided; healing back", self.rank, shown_round(round))
            healed = self._heal(0, latest=rounds.latest_committed_round(self.store, start=0))
            if healed is None:
                raise HealError(f"replica {self.rank}: round {shown_round(round)} was voided and no earlier state is "
                                "durable; restart the replica (it resumes from the newest checkpoint)")
            self._skip_sync = True
            self._record(SyncRecord(healed, None, committed=False, healed_to=healed))
        latest = rounds.latest_committed_round(self.store, start=self._step)
        if not self._skip_sync and latest >= self._step:
            logger.info("replica %d is behind (at round %d; round %d has committed): healing", self.rank,
                        shown_round(self._step), shown_round(latest))
            healed = self._heal(self._step)
            if healed is not None:
                # Our pseudo-gradient was measured from stale parameters and the
                # round it was meant for is over: skip this sync (nothing is sent,
                # nobody waits for us) and train from the healed parameters.
                self._skip_sync = True
                self._record(SyncRecord(healed, None, committed=False, healed_to=healed))
        self._round_open = True

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _Work:
        if not self._round_open:
            raise RuntimeError("allreduce called outside a sync (start_quorum first)")
        fut: torch.futures.Future = torch.futures.Future()
        self._pending.append((tensor, fut))
        return _Work(self, fut)

    def _should_commit(self) -> bool:
        self._flush()
        if self._exchange is None:
            raise RuntimeError("should_commit called without a sync in flight")
        exchange, self._exchange = self._exchange, None
        self._round_open = False
        round = self._step
        result: RoundResult | None = exchange.result()  # RoundTimeout and store errors propagate
        if result is None:  # skipped after healing in start_quorum; already recorded
            return False
        if result.participated and result.committed:
            self._step += 1
            self._publish_round = round
            self._last_commit = (round, result.attempt)
            self._record(SyncRecord(round, result, committed=True))
            return True
        if result.heal:
            # The round committed, but this participant could not verify its result: heal from the
            # committed state now, exactly where the other participants are after their outer step.
            healed = self._heal(round)
            self._record(SyncRecord(round, result, committed=False, healed_to=healed))
            return False
        if not result.committed:
            logger.warning("round %d was not committed (%s); it will be retried", shown_round(round), result.reason)
            self._record(SyncRecord(round, result, committed=False))
            return False
        # Left out of a committed round: heal from its committed state.
        healed = self._heal(round)
        self._record(SyncRecord(round, result, committed=False, healed_to=healed))
        return False

    def _record(self, record: SyncRecord) -> None:
        self.last_sync = record
        if self.on_sync is not None:
            self.on_sync(record)
        self._check_progress(record)

    # ------------------------------------------------------------ exchange
    def _flush(self) -> None:
        """Start the store exchange for all collected ``allreduce`` calls (once)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        round = self._step
        if self._skip_sync:
            for t, fut in pending:
                fut.set_result(t)
            self._exchange = _completed(None)
            return
        # Snapshot to float32 now: the exchange runs concurrently with inner steps.
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t, _ in pending])

        def run() -> RoundResult:
            try:
                result = self._ar.allreduce(round, flat)
            except BehindError:
                # The round committed before we joined: we are late, not broken.
                result = RoundResult(round=round, attempt=-1, participants=[], participated=False,
                                     committed=True, reason="round committed before we joined")
            except BaseException as exc:
                for _, fut in pending:
                    fut.set_exception(exc)
                raise
            if result.participated and result.committed:
                offset = 0
                with torch.no_grad():
                    for t, _ in pending:
                        n = t.numel()
                        t.copy_(flat[offset:offset + n].view_as(t))
                        offset += n
            for t, fut in pending:
                fut.set_result(t)
            return result

        self._exchange = self._exchange_pool.submit(run)

    # ------------------------------------------------------------ global state
    def _maybe_publish_state(self, after: _ThreadFuture | None = None) -> None:
        """After a commit, every participant starts writing its slice of the new global state."""
        round, self._publish_round = self._publish_round, None
        if round is None or not self._save_fns:
            return
        last = self.last_sync.result if self.last_sync is not None else None
        if last is None or self.rank not in last.participants:
            return
        # save_fns return views of DiLoCo's backup tensors and outer optimizer
        # state, which change only at the next sync; flush_state() joins this
        # upload before that sync starts, so encoding in the background is safe.
        tree = self.state()
        self._publish = self._exchange_pool.submit(self._publish_global_state, round, last.attempt,
                                                   list(last.participants), tree, after)

    def _publish_global_state(self, round: int, attempt: int, participants: list[int], tree: dict[str, Any],
                              after: _ThreadFuture | None) -> None:
        """Hand the committed state to the port (my slice, then any missing one after a grace)."""
        if after is not None:
            after.result()  # e.g. the replica's own state first: a kill after this point loses no inner state
        self.bytes_published += self.global_state.publish(round, attempt, tree, participants=participants,
                                                          rank=self.rank, takeover_after_s=self.takeover_after_s)

    def publish_state(self, *, after: _ThreadFuture | None = None) -> None:
        """Start writing this replica's slice of the last committed round's global state (background).

        ``after``: a future to wait for before the upload starts (ordering, e.g.
        the replica's inner-state checkpoint first).
        """
        self._maybe_publish_state(after)

    def flush_state(self) -> None:
        """Finish the pending global-state upload, takeover included (before a sync; at the end of a run)."""
        self._maybe_publish_state()
        if self._publish is not None:
            publish, self._publish = self._publish, None
            publish.result()

    def state(self) -> dict[str, Any]:
        """The registered global state now (views: valid until the next sync)."""
        return {key: fn() for key, fn in self._save_fns.items()}

    def load_state(self, tree: dict[str, Any]) -> None:
        """Load a global state tree (as :meth:`state` returned it) into every registered state
        (DiLoCo's fragment backups and outer optimizers)."""
        missing = sorted(set(self._load_fns) - set(tree))
        if missing:
            raise SyncError(f"global state has no entry for {missing}; it was written for another model layout")
        for key, load_fn in self._load_fns.items():
            load_fn(tree[key])

    def _commit_was_voided(self, round: int, attempt: int) -> bool:
        # A commit is voided only when its state can never become durable (declare_void); our own commit's
        # state is durable by now (flush_state joined its publish), so a void of it was not the run's: ignore it.
        if rounds.committed_attempt(self.store, round) == attempt:
            return False
        if self.global_state.durable(round, attempt):
            logger.warning("replica %d: ignoring a void of round %d attempt %d, whose state is durable", self.rank,
                           shown_round(round), attempt)
            return False
        return True

    def _heal(self, floor: int, *, latest: int | None = None) -> int | None:
        """Load the newest durable committed global state of a round ``>= floor``; returns its round.

        Waits while the newest committed round's state is being completed by its
        participants. If no round ``>= floor`` becomes durable within
        ``void_after_s`` (every participant of the newest commit died before
        writing its slice), that commit is voided and the search goes on below
        it; None means nothing ``>= floor`` is committed any more (the round will
        be run again). Raises :class:`HealError` after ``heal_timeout_s``.
        """
        give_up = time.monotonic() + self.heal_timeout_s
        void_at = time.monotonic() + self.void_after_s
        poll = PollPolicy(initial_s=0.2, max_s=1.0)

        def newest_committed() -> int:
            return rounds.latest_committed_round(self.store, start=max(floor, 0)) if latest is None else latest

        def durable() -> tuple[int, int] | tuple[None, None] | None:
            newest = newest_committed()
            if newest < floor:
                # A damaged outcome at ``floor`` behind a verified later record: the run left the round
                # (open_attempt said "behind" for the same reason); wait for a later commit's state.
                if rounds.round_unknown(self.store, floor) and rounds.moved_past(self.store, floor):
                    return None
                return (None, None)
            for round in range(newest, floor - 1, -1):
                attempt = rounds.committed_attempt(self.store, round)
                if attempt is not None and self.global_state.durable(round, attempt):
                    return (round, attempt)
            return None

        while True:
            deadline = min(give_up, void_at)
            try:
                round, attempt = poll_until(
                    durable, deadline=deadline, policy=poll,
                    on_timeout=lambda waited: StoreTimeout("a durable global state", waited))
                break
            except StoreTimeout:
                if time.monotonic() >= give_up:
                    raise HealError(f"replica {self.rank}: no committed global state for round >= "
                                    f"{shown_round(floor)} became durable within heal_timeout_s="
                                    f"{self.heal_timeout_s} (blocking: {self._blocking_object(floor)})") from None
            newest = newest_committed()
            committed = rounds.committed_attempt(self.store, newest) if newest >= 0 else None
            if committed is not None:
                rounds.declare_void(self.store, newest, committed, by=self.rank,
                                    reason=f"its global state was not durable {self.void_after_s:.0f}s after "
                                           f"replica {self.rank} needed it; no participant is left to finish it")
            latest = None
            void_at = time.monotonic() + self.void_after_s
        if round is None:
            logger.info("replica %d: no committed round >= %d any more (voided); nothing to heal", self.rank,
                        shown_round(floor))
            return None
        self.load_state(self.global_state.load(round, attempt))
        self._step = round + 1
        if self.on_heal is not None:
            self.on_heal(round)
        logger.info("replica %d healed to committed round %d", self.rank, shown_round(round))
        return round

    def _blocking_object(self, round: int) -> str:
        """The store object that keeps ``round`` from being decided or healed, for error messages."""
        newest = rounds.latest_committed_round(self.store, start=max(round, 0))
        if newest >= round:
            attempt = rounds.committed_attempt(self.store, newest)
            return (f"{self.store.uri}/{layout.checkpoint_prefix(newest)}: the global state of round "
                    f"{shown_round(newest)} attempt {attempt} is not durable")
        found = rounds.attempts(self.store, round)
        if rounds.round_unknown(self.store, round):
            return (f"{self.store.uri}/{layout.outcome_key(round, found[-1] if found else 0)}: unreadable, and "
                    f"round {shown_round(round)} has not committed")
        return (f"{self.store.uri}/{layout.round_prefix(round)}: no attempt of round {shown_round(round)} "
                "committed")

    def _check_progress(self, record: SyncRecord) -> None:
        """The re-sync budget: a replica whose syncs stop advancing it fails, naming the object that blocks it.

        Every sync that neither commits nor heals forward counts; once ``stall_syncs`` of them in a row took
        longer than ``stall_s`` (the run's deadlines) the replica raises :class:`SyncStalled` instead of
        syncing again (issue 33: behind -> heal -> nothing to heal ran 15 times a second, forever).
        """
        progressed = record.committed or (record.healed_to is not None and record.healed_to >= self._stall_round)
        if progressed or self._step > self._stall_round:
            self._stall_round, self._stalls, self._stall_since = self._step, 0, time.monotonic()
            return
        self._stalls += 1
        waited = time.monotonic() - self._stall_since
        if self._stalls >= self.stall_syncs and waited >= self.stall_s:
            reason = record.result.reason if record.result is not None else "healed to an older round"
            raise SyncStalled(f"replica {self.rank}: round {shown_round(self._step)} made no progress in "
                              f"{self._stalls} syncs over {waited:.0f}s (budget: {self.stall_syncs} syncs and "
                              f"stall_s={self.stall_s:.0f}s; last: {reason}); blocking: "
                              f"{self._blocking_object(self._step)}")

    def close(self) -> None:
        self.flush_state()
        self._exchange_pool.shutdown(wait=True)
        self._ar.close()
