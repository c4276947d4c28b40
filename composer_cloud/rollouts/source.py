"""``StoreCompletionSource``: the trainer's :class:`~composer_cloud.trainer.three_channel.sourced.CompletionSource`
backed by the run's store and its rollout workers (protocol: :mod:`composer_cloud.rollouts.batches`).

For each generation the trainer asks for, it creates the request at the step's position; then it returns the
trainer's own recorded fallback for that position if there is one (a resumed run), else waits for a worker's
batch until ``[rollouts] deadline_s`` (``on_deadline = "wait"``: with no deadline) and returns it, or ``None``.
The trainer then samples itself, trains on that, and hands its completions to :meth:`record_fallback`, which
creates them at the position's fallback key (``rollouts/fallbacks/...``): a resumed run reads that first, so it
trains on what the first run trained on even when a worker's batch arrived after the deadline.

In a signed run an object at the batch's key that does not verify (forged, unsigned, another run's) is deleted
and counted, so a worker (or the trainer's fallback) can create the real one; nothing unverified is ever
returned. Staleness is judged by the trainer (:class:`~composer_cloud.trainer.three_channel.sourced.SourcedRollouts`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Literal

from composer_cloud.errors import BadObject
from composer_cloud.rollouts.batches import Position, RolloutBatches, SourceCounters, batch_from_samples, wait_for_batch
from composer_cloud.storage.records.rollouts import RolloutBatch, RolloutRequest
from composer_cloud.storage.store import Store
from composer_cloud.trainer.three_channel.sourced import RolloutKey, SourcedCompletions

if TYPE_CHECKING:
    from composer_cloud.rollouts.fallback import WorkerFallback

logger = logging.getLogger(__name__)


def as_completions(batch: RolloutBatch, prompt_ids: list[list[int]]) -> SourcedCompletions:
    """A verified batch record as the trainer's :class:`SourcedCompletions` (rewards only when every row has one)."""
    rewards = batch.rewards if all(r is not None for r in batch.rewards) else None
    return SourcedCompletions(completion_ids=batch.completion_ids, logprobs=batch.sampler_logps,
                              policy_version=batch.policy_version, rewards=rewards,  # type: ignore[arg-type]
                              prompt_ids=prompt_ids, fallback=batch.fallback)


class StoreCompletionSource:
    """Rollout batches of replica ``replica`` through ``store`` (``[rollouts]``: ``max_staleness``, ``deadline_s``,
    ``on_deadline``). :attr:`counters` says what it read, refused and waited (seconds).

    ``fallback``: samples a fallback as the workers would (:class:`~composer_cloud.rollouts.fallback.WorkerFallback`,
    :meth:`sample_fallback`); ``None``: the trainer samples from its live weights."""

    def __init__(self, store: Store, *, replica: int, max_staleness: int, deadline_s: float,
                 on_deadline: Literal["generate", "wait"] = "generate", poll_s: float = 0.05,
                 fallback: "WorkerFallback | None" = None) -> None:
        if deadline_s <= 0 or not math.isfinite(deadline_s):
            raise ValueError(f"rollouts.deadline_s must be a finite number of seconds > 0, got {deadline_s!r}")
        self.store = store
        self.replica = replica
        self.batches = RolloutBatches(store, max_staleness=max_staleness)
        self.deadline_s = float(deadline_s)
        self.on_deadline = on_deadline
        self.poll_s = poll_s
        self.counters = SourceCounters()
        self.fallback = fallback
        self._requests: dict[Position, RolloutRequest] = {}
        self._reported = SourceCounters()

    def _position(self, key: RolloutKey) -> Position:
        if key.replica != self.replica:
            raise ValueError(f"rollout key {key} is replica {key.replica}'s; this source serves replica {self.replica}")
        return Position(key.round, key.replica, key.step)

    def _replace(self, batch_key: str) -> None:
        """A batch that does not verify in a signed run was written by no job of the run: delete it."""
        if self.store.signed:
            self.store.delete(batch_key)

    def completions(self, key: RolloutKey, prompt_ids: list[list[int]], *,
                    policy_version: int) -> SourcedCompletions | None:
        """``key``'s batch: the trainer's own recorded fallback if there is one (a resumed run trains on what it
        trained on), else a worker's, waited for until the deadline (``None`` then); see the module."""
        pos = self._position(key)
        prompts = [[int(t) for t in row] for row in prompt_ids]
        request = self.batches.request(pos, prompts)
        self._requests[pos] = request
        own = self._recorded(pos, request)
        if own is not None:
            self.counters.fallbacks_read += 1
            return as_completions(own, prompts)
        start = time.monotonic()
        deadline = None if self.on_deadline == "wait" else start + self.deadline_s
        batch = wait_for_batch(self.batches, pos, request, deadline=deadline, counters=self.counters,
                               poll_s=self.poll_s, replace=self._replace)
        self.counters.waited_s += time.monotonic() - start
        if batch is None:
            self.counters.timed_out += 1
            logger.info("rollouts %s: no batch within rollouts.deadline_s = %gs", pos.batch_key, self.deadline_s)
            return None
        self.counters.from_workers += 1
        return as_completions(batch, prompts)

    def _recorded(self, pos: Position, request: RolloutRequest) -> RolloutBatch | None:
        """This replica's recorded fallback for ``pos`` if it verifies and answers ``request``; else None (an object
        there that does not verify is replaced in a signed run, and counted)."""
        try:
            own = self.batches.read_batch(pos, fallback=True)
        except BadObject as exc:
            self.counters.refused_bad += 1
            logger.warning("refusing the fallback record at %s: %s", pos.fallback_key, exc.reason)
            self._replace(pos.fallback_key)
            return None
        if own is not None and self.batches.refusal(own, request) is not None:
            self.counters.refused_bad += 1
            logger.warning("refusing the fallback record at %s: %s", pos.fallback_key,
                           self.batches.refusal(own, request))
            return None
        return own

    def sample_fallback(self, key: RolloutKey, prompt_ids: list[list[int]]
                        ) -> tuple[list[list[int]], list[list[float]], int] | None:
        """``(completion_ids, sampler log-probs, policy version)`` of the batch a worker would have written for
        ``key`` (:class:`~composer_cloud.rollouts.fallback.WorkerFallback`); ``None`` without one, or when the
        version is not available (the trainer then samples from its live weights)."""
        self._position(key)
        if self.fallback is None:
            return None
        got = self.fallback.sample(key, [[int(t) for t in row] for row in prompt_ids])
        if got is None:
            self.counters.fallback_live += 1
            return None
        sampled, version = got
        return sampled.completion_ids, sampled.logps, version

    def take_metrics(self) -> dict[str, float]:
        """The counters since the last call, as step metrics (``rollouts/from_workers``, ``rollouts/fallbacks_read``,
        ``rollouts/refused_bad``, ``rollouts/timed_out``, ``rollouts/waited_s``: seconds this step waited)."""
        now, last = self.counters.as_metrics(), self._reported.as_metrics()
        self._reported = dataclasses.replace(self.counters)
        return {k: now[k] - last[k] for k in now}

    def record_fallback(self, key: RolloutKey, completions: SourcedCompletions) -> None:
        """Keep the trainer's own batch for ``key`` at the position's fallback key (write-once; an equal record
        from a resumed run changes nothing). :meth:`completions` serves it before any worker's batch, so a resumed
        run trains on what this run trained on, even when a worker's batch arrived after the deadline."""
        pos = self._position(key)
        request = self._requests.get(pos) or self.batches.read_request(pos)
        if request is None:  # the source was not asked for this key (no request): record the prompts now
            request = self.batches.request(pos, [list(p) for p in (completions.prompt_ids or [])])
        batch = batch_from_samples(pos, request, completion_ids=[list(c) for c in completions.completion_ids],
                                   sampler_logps=None if completions.logprobs is None else
                                   [list(r) for r in completions.logprobs], sampler=f"trainer:{self.replica}",
                                   seconds=0.0, policy_version=completions.policy_version, fallback=True)
        if not self.batches.publish_fallback(batch):
            logger.debug("rollouts %s: a fallback was already recorded", pos.fallback_key)


__all__ = ["StoreCompletionSource", "as_completions"]
