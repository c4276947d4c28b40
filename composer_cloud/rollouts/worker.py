"""``RolloutWorker``: one rollout worker's serving loop (what its job runs between heartbeats).

Each :meth:`RolloutWorker.serve_once` lists the open requests (a request without a batch,
:meth:`~composer_cloud.rollouts.batches.RolloutBatches.open_requests`) and answers those that are its own:

* a request of replica ``r`` is worker ``r % workers``'s (:func:`~composer_cloud.rollouts.batches.worker_of`);
* any worker takes over a request it has seen open for half of ``deadline_s`` (its own monotonic clock, so clock
  skew between machines does not matter): a dead or slow worker delays its replicas by half a deadline, not a
  whole one, and the trainer's own fallback stays the last resort.

Answering a request: load its policy version exactly (:class:`~composer_cloud.rollouts.versions.PolicyVersions`;
not there yet: try again next time), sample with the position's seed
(:func:`~composer_cloud.rollouts.batches.sampling_seed`, :class:`~composer_cloud.rollouts.sampler.BatchSampler`),
and create the batch write-once. Two workers racing for one position sample the same bytes (same version, same
seed), so it does not matter who wins. A request that does not verify or parse is skipped (logged once, read
again at the next poll: a signed run's trainer replaces a forged one when it asks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from composer_cloud.errors import BadObject
from composer_cloud.rollouts.batches import (
    Position,
    RolloutBatches,
    batch_from_samples,
    sampling_seed,
    worker_of,
)
from composer_cloud.rollouts.sampler import BatchSampler
from composer_cloud.rollouts.versions import PolicyVersions
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)

#: Every this many polls a worker lists every round's requests, not only the newest ones (a restarted replica
#: may ask again in an older round).
FULL_SCAN_EVERY = 20


@dataclass(frozen=True)
class WorkerConfig:
    """A worker's place in the fleet: ``index`` of ``workers``, the run's ``seed`` and ``[rollouts]`` settings."""

    index: int
    workers: int
    seed: int
    max_staleness: int
    deadline_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.workers:
            raise ValueError(f"rollout worker {self.index} out of range: the run has {self.workers} workers")


@dataclass
class WorkerStats:
    """What a worker did since it started: batches published, races lost, takeovers, tokens, busy seconds."""

    published: int = 0
    lost_races: int = 0
    taken_over: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def progress(self) -> dict[str, float]:
        """Heartbeat fields (``tokens_per_s``: sampled tokens per second of sampling)."""
        return {"batches_published": float(self.published), "lost_races": float(self.lost_races),
                "taken_over": float(self.taken_over), "tokens": float(self.tokens),
                "tokens_per_s": self.tokens / self.busy_s if self.busy_s > 0 else 0.0,
                "busy_fraction": self.busy_s / max(1e-9, time.monotonic() - self.started)}


class RolloutWorker:
    """Serves the rollout requests of ``store`` that are worker ``config.index``'s (see the module)."""

    def __init__(self, store: Store, *, config: WorkerConfig, sampler: BatchSampler, versions: PolicyVersions,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.config = config
        self.sampler = sampler
        self.versions = versions
        self.batches = RolloutBatches(store, max_staleness=config.max_staleness)
        self.stats = WorkerStats()
        self._clock = clock
        self._first_seen: dict[Position, float] = {}
        self._warned: set[Position] = set()
        self._polls = 0
        self._from_round = 0

    def _mine(self, pos: Position, now: float) -> bool:
        if worker_of(pos.replica, self.config.workers) == self.config.index:
            return True
        return now - self._first_seen[pos] >= self.config.deadline_s / 2

    def serve_once(self) -> int:
        """Answer every open request that is this worker's now; returns how many batches it created."""
        self._polls += 1
        full = self._polls % FULL_SCAN_EVERY == 1
        open_ = self.batches.open_requests(from_round=0 if full else self._from_round)
        if open_:
            self._from_round = max(0, open_[0].round - 1)
        now = self._clock()
        still = set(open_)
        self._first_seen = {p: t for p, t in self._first_seen.items() if p in still}
        for pos in open_:
            self._first_seen.setdefault(pos, now)
        served = 0
        for pos in open_:
            if not self._mine(pos, now):
                continue
            served += self._serve(pos)
        return served

    def _serve(self, pos: Position) -> int:
        try:
            request = self.batches.read_request(pos)
        except BadObject as exc:  # read again next poll: a signed run's trainer replaces a forged request
            if pos not in self._warned:
                self._warned.add(pos)
                logger.warning("rollouts: skipping the request at %s: %s", pos.request_key, exc.reason)
            return 0
        if request is None:
            return 0
        before = self.versions.loaded
        try:
            if not self.versions.ensure(request.policy_version):
                return 0  # not published yet: next poll
        except BadObject as exc:  # a damaged or forged link of the chain: that version only, tried again later
            logger.warning("rollouts: policy version %d for %s is not usable yet: %s", request.policy_version,
                           pos.request_key, exc.reason)
            return 0
        if self.versions.loaded != before:
            self.sampler.refresh()
        seed = sampling_seed(self.config.seed, pos.round, pos.replica, pos.step)
        sampled = self.sampler.sample(request.prompt_ids, seed=seed)
        batch = batch_from_samples(pos, request, completion_ids=sampled.completion_ids, sampler_logps=sampled.logps,
                                   sampler=f"worker:{self.config.index}", seconds=sampled.seconds)
        self.stats.busy_s += sampled.seconds
        if not self.batches.publish(batch):
            self.stats.lost_races += 1
            return 0
        self.stats.published += 1
        self.stats.tokens += sampled.tokens
        if worker_of(pos.replica, self.config.workers) != self.config.index:
            self.stats.taken_over += 1
        logger.info("rollouts: batch %s published (policy version %d, %d tokens, %.2fs)", pos.batch_key,
                    request.policy_version, sampled.tokens, sampled.seconds)
        return 1


__all__ = ["FULL_SCAN_EVERY", "RolloutWorker", "WorkerConfig", "WorkerStats"]
