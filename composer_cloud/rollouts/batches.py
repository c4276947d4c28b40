"""Rollout batches through the store: the write-once request/batch protocol between trainers and rollout workers.

The batch that inner step ``step`` of round ``round`` on replica ``replica`` trains on is one write-once object,
``rollouts/batches/<round>/<replica>/<step>.json`` (:mod:`composer_cloud.storage.layout`), whoever sampled it:

1. the trainer creates its request (prompt token ids, the exact policy version
   :func:`policy_version_for` ``(round, max_staleness)``) at the same position under ``rollouts/requests/``;
2. worker ``replica % workers`` (or any worker, once the request waited half the deadline unanswered) samples the
   completions from that policy version with the seed :func:`sampling_seed` of the position, and creates the batch;
3. the trainer waits for the batch until ``deadline_s``; then it samples the batch itself, trains on it and records
   it at the position's fallback key, ``rollouts/fallbacks/...`` (``on_deadline = "generate"``), or keeps waiting
   (``"wait"``). A recorded fallback is what that position trains on from then on (a resumed run reads it first).

Invariants:
  * a position has at most one worker batch and one fallback, ever (write-once); a resumed run reads the batches
    its first launch trained on, and a worker's batch is a function of (policy version, prompts, seed) only,
    never of timing or of which worker sampled it, so lock-step resume stays bitwise;
  * a batch is used only if it verifies (signed runs: the store's HMAC binds the key and the run), parses
    (:class:`~composer_cloud.storage.records.rollouts.RolloutBatch`) and answers this request (its prompts'
    digest); anything else is refused and counted (:class:`SourceCounters`), and in a signed run an object that
    does not verify is replaced (the rule of :func:`~composer_cloud.sync.trust.create_over_forged`). The consumer then refuses
    (and counts) a batch whose policy version is older than ``round - max_staleness``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from composer_cloud.errors import BadObject, ObjectNotFound
from composer_cloud.storage import layout
from composer_cloud.storage.records.rollouts import (
    ROLLOUT_RECORD_MAX_BYTES,
    RolloutBatch,
    RolloutRequest,
    prompts_digest,
)
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)


def policy_version_for(round: int, max_staleness: int) -> int:
    """The policy version (a round's global model; 0 = the initial model) round ``round``'s batches are sampled
    from: ``max(0, round - max_staleness)``. One version per round, never "the newest available", so the batches
    do not depend on when a worker happened to look."""
    if round < 0 or max_staleness < 0:
        raise ValueError(f"round ({round}) and max_staleness ({max_staleness}) must be >= 0")
    return max(0, round - max_staleness)


def sampling_seed(run_seed: int, round: int, replica: int, step: int) -> int:
    """The sampling seed of one position (63 bits of sha256): the same for any worker, and for the trainer's own
    fallback, and independent of every trainer RNG stream."""
    text = f"composer-cloud/rollouts/{run_seed}/{round}/{replica}/{step}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1


def worker_of(replica: int, workers: int) -> int:
    """The worker that serves replica ``replica`` first (``replica % workers``)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return replica % workers


@dataclass(frozen=True)
class Position:
    """Where a batch is consumed: inner step ``step`` of round ``round`` on replica ``replica``."""

    round: int
    replica: int
    step: int

    @property
    def request_key(self) -> str:
        return layout.rollout_request_key(self.round, self.replica, self.step)

    @property
    def batch_key(self) -> str:
        return layout.rollout_batch_key(self.round, self.replica, self.step)

    @property
    def fallback_key(self) -> str:
        return layout.rollout_fallback_key(self.round, self.replica, self.step)


@dataclass
class SourceCounters:
    """What a trainer's source saw (metrics): batches read, by whom, what it refused, how long it waited (s), and
    ``fallback_live``: fallbacks sampled from the trainer's live weights because the policy version a worker would
    have used was not available (those steps are not the workers' batches; see ``rollouts/fallback.py``)."""

    from_workers: int = 0
    fallbacks_read: int = 0
    refused_bad: int = 0
    timed_out: int = 0
    waited_s: float = 0.0
    fallback_live: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {f"rollouts/{k}": float(v) for k, v in asdict(self).items()}


class RolloutBatches:
    """Requests and batches of one run (either side of the protocol). ``max_staleness``: ``[rollouts]``'s."""

    def __init__(self, store: Store, *, max_staleness: int) -> None:
        self.store = store
        self.max_staleness = max_staleness

    # ------------------------------------------------------------------ requests
    def request(self, pos: Position, prompt_ids: list[list[int]]) -> RolloutRequest:
        """Create ``pos``'s request (write-once) and return the request in force there.

        A request already there (a resumed run asks again) is kept when it asks for the same prompts and version;
        in a signed run a request that does not verify is replaced. One that verifies but asks for other
        prompts raises :class:`BadObject` (the run's records disagree with its trainer: not a state to guess in).
        """
        mine = RolloutRequest(round=pos.round, replica=pos.replica, step=pos.step,
                              policy_version=policy_version_for(pos.round, self.max_staleness),
                              prompt_ids=[list(map(int, row)) for row in prompt_ids], time=time.time())
        if self._create(pos.request_key, mine.to_json(), lambda o: self._parse_request(pos, o)):
            return mine
        existing = self.read_request(pos)
        if existing is None:  # deleted in between (a resume's cleanup): ours is as good
            self.store.create_json(pos.request_key, mine.to_json())
            return mine
        if existing.digest != mine.digest or existing.policy_version != mine.policy_version:
            raise BadObject(pos.request_key, f"a request for other prompts (or policy version "
                                             f"{existing.policy_version}, not {mine.policy_version}) is already "
                                             "there; remove rollouts/ of this run only if its trainer changed")
        return existing

    def _parse_request(self, pos: Position, obj: object) -> RolloutRequest:
        return RolloutRequest.from_json(obj, key=pos.request_key, round=pos.round, replica=pos.replica,
                                        step=pos.step)

    def read_request(self, pos: Position) -> RolloutRequest | None:
        """``pos``'s request, or None (absent). Raises :class:`BadObject` for one that does not verify or parse."""
        obj = self.store.try_get_json(pos.request_key, max_bytes=ROLLOUT_RECORD_MAX_BYTES)
        return None if obj is None else self._parse_request(pos, obj)

    def open_requests(self, *, from_round: int = 0) -> list[Position]:
        """Positions (rounds >= ``from_round``) with a request and no batch yet, in (round, replica, step) order.

        Stray names are skipped; a listed batch (or trainer's fallback) counts as answered whether or not it
        verifies (the trainer judges it, and replaces a forged one in a signed run)."""
        open_: list[Position] = []
        for name in self.store.list_dirs(layout.ROLLOUT_REQUESTS):
            round = layout.parse_num(name)
            if round is None or round < from_round:
                continue
            answered = {layout.parse_rollout_key(k) for base in (layout.ROLLOUT_BATCHES, layout.ROLLOUT_FALLBACKS)
                        for k in self.store.list(layout.rollout_round_prefix(round, base=base))}
            for key in self.store.list(layout.rollout_round_prefix(round)):
                parsed = layout.parse_rollout_key(key)
                if parsed is not None and parsed[0] == round and parsed not in answered:
                    open_.append(Position(*parsed))
        return sorted(open_, key=lambda p: (p.round, p.replica, p.step))

    # ------------------------------------------------------------------ batches
    def publish(self, batch: RolloutBatch) -> bool:
        """Create the batch at its position (write-once; a forged object there is replaced in a signed run).
        Returns whether this call's batch is the one stored."""
        pos = Position(batch.round, batch.replica, batch.step)
        return self._create(pos.batch_key, batch.to_json(), lambda o: self._parse_batch(pos, o))

    def _create(self, key: str, obj: dict, parse: Callable[[object], object]) -> bool:
        """Write-once create that a forged object cannot block in a signed run
        (:func:`~composer_cloud.sync.trust.create_over_forged`'s rule), reading what is there with the rollout
        records' own size limit (a real batch may be larger than a plain record's limit)."""
        if self.store.create_json(key, obj):
            return True
        if not self.store.signed:
            return False
        try:
            existing = self.store.try_get_json(key, max_bytes=ROLLOUT_RECORD_MAX_BYTES)
            if existing is None:
                return self.store.create_json(key, obj)
            parse(existing)
            return False
        except BadObject as exc:
            logger.warning("replacing %s, which no job of this run wrote (%s)", key, exc.reason)
        self.store.delete(key)
        return self.store.create_json(key, obj)

    def publish_fallback(self, batch: RolloutBatch) -> bool:
        """Create the trainer's own batch (``batch.fallback``) at its position's fallback key (write-once)."""
        pos = Position(batch.round, batch.replica, batch.step)
        if not batch.fallback:
            raise ValueError(f"{pos.fallback_key}: only a trainer's own batch (fallback=True) is recorded there")
        return self._create(pos.fallback_key, batch.to_json(),
                            lambda o: self._parse_batch(pos, o, key=pos.fallback_key))

    def _parse_batch(self, pos: Position, obj: object, *, key: str | None = None) -> RolloutBatch:
        return RolloutBatch.from_json(obj, key=key or pos.batch_key, round=pos.round, replica=pos.replica,
                                      step=pos.step)

    def read_batch(self, pos: Position, *, fallback: bool = False) -> RolloutBatch | None:
        """``pos``'s batch (``fallback``: the trainer's own record), or None (absent). Raises :class:`BadObject` for
        one that does not verify or parse."""
        key = pos.fallback_key if fallback else pos.batch_key
        try:
            obj = self.store.get_json(key, max_bytes=ROLLOUT_RECORD_MAX_BYTES)
        except ObjectNotFound:
            return None
        batch = self._parse_batch(pos, obj, key=key)
        if batch.fallback != fallback:
            raise BadObject(key, f"a {'worker' if fallback else 'fallback'} batch at a "
                                 f"{'fallback' if fallback else 'worker'} batch's key")
        return batch

    def refusal(self, batch: RolloutBatch, request: RolloutRequest) -> str | None:
        """Why ``batch`` cannot answer ``request`` at all (None: it can): other prompts, another row count.

        Staleness is the consumer's judgement (the trainer refuses and counts a batch whose version is below
        ``round - max_staleness``), never a reason to replace a batch a job of the run wrote."""
        if batch.prompts_sha256 != request.digest:
            return "it answers other prompts (its prompts' digest differs from the request's)"
        if len(batch.completion_ids) != len(request.prompt_ids):
            return f"it has {len(batch.completion_ids)} completions for {len(request.prompt_ids)} prompt rows"
        return None


def wait_for_batch(batches: RolloutBatches, pos: Position, request: RolloutRequest, *, deadline: float | None,
                   counters: SourceCounters, poll_s: float = 0.05,
                   replace: Callable[[str], None] | None = None) -> RolloutBatch | None:
    """Poll ``pos``'s batch until one that answers ``request`` is there (returned) or ``deadline`` (monotonic;
    None: no deadline) passes (None).

    A batch that does not verify or parse (forged, unsigned, damaged), or verifies but cannot answer the request
    (:meth:`RolloutBatches.refusal`), is counted once in ``counters.refused_bad`` and the wait goes on; for one that
    does not verify or parse ``replace(key)`` is called first (the caller decides: in a signed run it is deleted,
    so a good batch can be created). A verified batch is never replaced: a job of the run wrote it.
    """
    seen: set[str] = set()
    delay = poll_s
    while True:
        unverified = False
        try:
            batch = batches.read_batch(pos)
            reason = None if batch is None else batches.refusal(batch, request)
        except BadObject as exc:
            batch, reason, unverified = None, f"it does not verify or parse ({exc.reason})", True
        if batch is not None and reason is None:
            return batch
        if reason is not None:
            if reason not in seen:
                seen.add(reason)
                counters.refused_bad += 1
                logger.warning("refusing the rollout batch at %s: %s", pos.batch_key, reason)
            if unverified and replace is not None:
                replace(pos.batch_key)
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 1.5, 1.0)


def batch_from_samples(pos: Position, request: RolloutRequest, *, completion_ids: list[list[int]],
                       sampler_logps: list[list[float]] | None, sampler: str, seconds: float,
                       policy_version: int | None = None, rewards: list[float | None] | None = None,
                       fallback: bool = False) -> RolloutBatch:
    """The batch record of completions sampled for ``request`` (shapes checked: one row per prompt row).
    ``policy_version``: the version sampled from (default: the request's)."""
    if len(completion_ids) != len(request.prompt_ids) or (
            sampler_logps is not None and len(sampler_logps) != len(completion_ids)):
        raise ValueError(f"{len(completion_ids)} completions and {len(sampler_logps or [])} log-prob rows for "
                         f"{len(request.prompt_ids)} prompt rows at {pos.batch_key}")
    return RolloutBatch(round=pos.round, replica=pos.replica, step=pos.step,
                        policy_version=request.policy_version if policy_version is None else policy_version,
                        prompts_sha256=prompts_digest(request.prompt_ids),
                        completion_ids=[[int(t) for t in row] for row in completion_ids],
                        sampler_logps=None if sampler_logps is None else
                        [[float(v) for v in row] for row in sampler_logps],
                        rewards=list(rewards) if rewards is not None else [None] * len(completion_ids),
                        sampler=sampler, seconds=float(seconds), time=time.time(), fallback=fallback)


def discard_rollouts_after(store: Store, round: int) -> int:
    """Delete the requests and batches of rounds after ``round`` (a resume that changes the replica count: the
    prompts of those positions change with it). Returns how many rounds were discarded."""
    rounds = {r for prefix in (layout.ROLLOUT_REQUESTS, layout.ROLLOUT_BATCHES, layout.ROLLOUT_FALLBACKS)
              for name in store.list_dirs(prefix) if (r := layout.parse_num(name)) is not None and r > round}
    for r in sorted(rounds):
        for base in (layout.ROLLOUT_REQUESTS, layout.ROLLOUT_BATCHES, layout.ROLLOUT_FALLBACKS):
            store.delete(layout.rollout_round_prefix(r, base=base), recursive=True)
    return len(rounds)


__all__ = ["Position", "RolloutBatches", "SourceCounters", "batch_from_samples", "discard_rollouts_after",
           "policy_version_for", "sampling_seed", "wait_for_batch", "worker_of"]
