"""Completions from rollout workers: the trainer's side of issue 36 (a *completion source* instead of sampling).

A GRPO generation normally samples on the trainer's own device. With a :class:`CompletionSource` the
trainer asks the source for the completions of the step it is about to take instead, named by a
:class:`RolloutKey` ``(round, replica, step)``, and trains on them exactly as it trains on its fast
sampler's output (``rollout = "hf-fast"``): the completion token ids, and the sampler's per-token
log-probs through TRL's vLLM importance-sampling correction (the ``vllm_importance_sampling_*``
settings). Everything after the generation (scoring, advantages, the three channels) is unchanged.

:class:`SourcedRollouts` is the trainer's policy for one generation (the GRPO subclass calls it):

* **use** a batch that is well formed (:meth:`SourcedCompletions.problem`) and fresh enough:
  ``policy_version >= round - max_staleness`` (versions count rounds, see :class:`SourcedCompletions`);
* **refuse** a stale or malformed batch (counted, logged), and **fall back** when the source returns
  ``None`` (nothing arrived by its deadline) or refused: the trainer generates with its own rollout path
  inside :func:`seeded_fallback`, whose torch generator is seeded from the key and the run seed and
  whose global RNG streams are restored afterwards. So the trainer's RNG stream is the same whether or
  not a step fell back, and a step that falls back twice (a resumed run) samples the same completions;
* hand a fallback's completions to :meth:`CompletionSource.record_fallback`, so that the store
  protocol can write them once under the key and a resumed run reads the same batch;
* a source that can sample the key's batch as its workers would (:class:`WorkerEqualFallback`: the store's
  source, from the policy version a worker would use, with the worker's seed and sampler) provides the
  fallback instead of the trainer's own rollout path, so a step trains on the same batch whether a worker
  answered or not.

Per-step counters (:meth:`SourcedRollouts.take_metrics`) go into the step metrics the replica reports:
``rollouts/used``, ``rollouts/stale``, ``rollouts/invalid``, ``rollouts/missing``, ``rollouts/fallback``
(counts of this step's generations, 0 or 1 each) and ``rollouts/staleness`` (rounds behind, of the
batch the source returned; absent when it returned none): summed and histogrammed by whoever reads
the metrics.

Nothing here reads the store: a source (the store-backed one lives in :mod:`composer_cloud.rollouts`)
implements the protocol. :class:`InMemorySource` is the reference implementation of the contract.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
from typing import Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch

from composer_cloud.round_numbers import shown_round
from composer_cloud.trainer.three_channel.state import forked_global_rngs

logger = logging.getLogger(__name__)

#: The step-metric names :meth:`SourcedRollouts.take_metrics` reports (counts per step, and the staleness).
ROLLOUT_METRICS = ("rollouts/used", "rollouts/stale", "rollouts/invalid", "rollouts/missing", "rollouts/fallback",
                   "rollouts/staleness")


@dataclasses.dataclass(frozen=True)
class RolloutKey:
    """Names the generation batch of one trainer step: ``(round, replica, step)``.

    Attributes:
        round: the round the step belongs to, as the replica numbers it (its boundary's ``position``: the
            lock-step round, or the decoupled contributions published so far), from 0.
        replica: the replica's rank, from 0.
        step: the run's inner step that consumes the batch, from 1: the ``step`` of that step's metrics row
            (``round * inner_steps + k`` for the round's ``k``-th step, so a resumed run names it the same).
    """

    round: int
    replica: int
    step: int

    def __post_init__(self) -> None:
        for name in ("round", "replica", "step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"RolloutKey.{name} must be an int >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SourcedCompletions:
    """The completions of one generation batch, as a source serves them (one row per prompt, in its order).

    Attributes:
        completion_ids: per prompt row, the sampled token ids up to and including the first EOS (at most
            ``max_completion_length`` tokens, at least one): TRL's trimming.
        logprobs: per row, the sampler's log-probability (nats, float32 values) of each completion token,
            ``log_softmax(logits / temperature)`` at the sampled token (vLLM's ``processed_logprobs``);
            ``NaN`` where the sampler has none (TRL then applies no correction to that token). ``None`` only
            for a trainer's own fallback generated with ``rollout = "hf"`` (``fallback`` set): such a batch
            is trained on-policy, as the fallback was.
        policy_version: the round whose starting policy sampled the batch (the global policy after
            ``policy_version`` outer steps). A trainer in round ``r`` uses it when ``r - max_staleness <=
            policy_version <= r``.
        rewards: per row, the reward the worker scored (the run's single reward function, unweighted),
            or ``None``. The trainer scores completions itself unless told to trust these.
        prompt_ids: the prompt token ids the batch answers, if the source knows them; when given they must
            equal the trainer's (a batch for other prompts is refused).
        fallback: the trainer's own generation for this key, recorded by :meth:`CompletionSource.record_fallback`
            and read back (a resumed run); it is trained exactly as the fallback was.
    """

    completion_ids: Sequence[Sequence[int]]
    logprobs: Sequence[Sequence[float]] | None
    policy_version: int
    rewards: Sequence[float] | None = None
    prompt_ids: Sequence[Sequence[int]] | None = None
    fallback: bool = False

    def problem(self, prompt_ids: Sequence[Sequence[int]], *, max_completion_length: int,
                vocab_size: int) -> str | None:
        """Why this batch cannot train the generation of ``prompt_ids``; ``None`` when it can.

        Checked: one row per prompt (and the same prompts when :attr:`prompt_ids` is given), every
        completion 1 to ``max_completion_length`` token ids in ``[0, vocab_size)``, one finite-or-NaN
        log-prob per token, finite-or-NaN rewards, one per row. The bucket is not trusted (design
        invariant 10): a malformed batch costs its step's generation (the trainer falls back), never the run.
        """
        n = len(prompt_ids)
        if isinstance(self.policy_version, bool) or not isinstance(self.policy_version, int) or self.policy_version < 0:
            return f"policy_version {self.policy_version!r} is not an int >= 0"
        if len(self.completion_ids) != n:
            return f"{len(self.completion_ids)} completions for {n} prompts"
        if self.prompt_ids is not None and [list(p) for p in self.prompt_ids] != [list(p) for p in prompt_ids]:
            return "the batch answers other prompts than this step's"
        for i, ids in enumerate(self.completion_ids):
            if not 1 <= len(ids) <= max_completion_length:
                return f"completion {i} has {len(ids)} tokens (1 to max_completion_length = {max_completion_length})"
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
                return f"completion {i} has a token id outside [0, {vocab_size})"
        if self.logprobs is None:
            if not self.fallback:
                return "no sampler log-probs (a worker's batch must carry them for the importance-sampling correction)"
        else:
            if len(self.logprobs) != n:
                return f"{len(self.logprobs)} log-prob rows for {n} completions"
            for i, (ids, lps) in enumerate(zip(self.completion_ids, self.logprobs)):
                if len(lps) != len(ids):
                    return f"completion {i} has {len(ids)} tokens but {len(lps)} log-probs"
                if any(math.isinf(float(v)) for v in lps):
                    return f"completion {i} has an infinite log-prob"
        if self.rewards is not None:
            if len(self.rewards) != n:
                return f"{len(self.rewards)} rewards for {n} completions"
            if any(math.isinf(float(r)) for r in self.rewards):
                return "an infinite reward"
        return None


@runtime_checkable
class CompletionSource(Protocol):
    """Where a trainer's completions come from instead of its own sampler (rollout workers, through the store).

    Contract (what exact resume rests on):
      * :meth:`completions` for a key the trainer already consumed returns the same batch again (a resumed
        run re-reads what it read), and after :meth:`record_fallback` for a key it returns that record
        (``fallback`` set) or ``None``;
      * :meth:`completions` returns by the source's own deadline (``None``: nothing arrived); the trainer
        never waits longer than the source does;
      * :meth:`record_fallback` is idempotent for equal completions (a resumed run records the same
        fallback again) and may write in the background.
    """

    def completions(self, key: RolloutKey, prompt_ids: list[list[int]], *,
                    policy_version: int) -> SourcedCompletions | None:
        """The batch for ``key`` (completions of ``prompt_ids``, in order), or ``None`` by the deadline.

        ``policy_version`` is the trainer's current version (its round): a source may wait for a batch
        at least ``policy_version - max_staleness`` recent, and may return any batch; the trainer judges.
        """
        ...

    def record_fallback(self, key: RolloutKey, completions: SourcedCompletions) -> None:
        """The trainer generated ``key``'s batch itself (``completions.fallback`` is set): keep it for a resume."""
        ...


class InMemorySource:
    """A :class:`CompletionSource` over dicts: the reference implementation of the contract, and the test double.

    :meth:`put` offers a worker's batch for a key, :meth:`record_fallback` keeps the trainer's own; both are
    write-once per key (a different second value raises, an equal one is a no-op), as a store's records are.
    :meth:`completions` serves a key's fallback record if there is one, else its offered batch, else ``None``.
    """

    def __init__(self) -> None:
        self.batches: dict[RolloutKey, SourcedCompletions] = {}
        self.fallbacks: dict[RolloutKey, SourcedCompletions] = {}
        #: Every ``(key, completions)`` handed to :meth:`record_fallback`, in order (duplicates included).
        self.recorded: list[tuple[RolloutKey, SourcedCompletions]] = []
        #: Every key asked for, in order.
        self.asked: list[RolloutKey] = []

    @staticmethod
    def _write_once(records: dict[RolloutKey, SourcedCompletions], key: RolloutKey,
                    completions: SourcedCompletions) -> None:
        held = records.get(key)
        if held is not None and held != completions:
            raise ValueError(f"rollout batch {key} already holds a different batch (records are write-once)")
        records[key] = completions

    def put(self, key: RolloutKey, completions: SourcedCompletions) -> None:
        """Offer ``completions`` (a worker's batch) for ``key``."""
        self._write_once(self.batches, key, completions)

    def completions(self, key: RolloutKey, prompt_ids: list[list[int]], *,
                    policy_version: int) -> SourcedCompletions | None:
        self.asked.append(key)
        return self.fallbacks.get(key) or self.batches.get(key)

    def record_fallback(self, key: RolloutKey, completions: SourcedCompletions) -> None:
        self.recorded.append((key, completions))
        self._write_once(self.fallbacks, key, completions)


@runtime_checkable
class WorkerEqualFallback(Protocol):
    """A :class:`CompletionSource` that can also sample a key's fallback exactly as its workers would have."""

    def sample_fallback(self, key: RolloutKey, prompt_ids: list[list[int]]
                        ) -> tuple[list[list[int]], list[list[float]], int] | None:
        """``(completion_ids, sampler log-probs, policy version)`` of the batch a worker would have written for
        ``key``, or ``None`` when it cannot (the trainer then generates itself)."""
        ...


def fallback_seed(key: RolloutKey, seed: int) -> int:
    """The torch seed of ``key``'s fallback generation: a hash of the run seed and the key (63 bits).

    The same for a resumed run, different for every ``(round, replica, step)``.
    """
    digest = hashlib.sha256(f"composer-cloud/rollout-fallback/{seed}/{key.round}/{key.replica}/{key.step}".encode())
    return int.from_bytes(digest.digest()[:8], "big") & (2**63 - 1)


@contextlib.contextmanager
def seeded_fallback(key: RolloutKey, seed: int, device: torch.device) -> Iterator[None]:
    """Run a fallback generation from torch generators seeded by ``(seed, key)``; every global RNG restored after.

    Seeds torch's CPU generator and, on a CUDA ``device``, that device's (the generators sampling draws
    from); python's ``random`` and numpy's are saved and restored too (:func:`.state.forked_global_rngs`).
    """
    with forked_global_rngs(device):
        value = fallback_seed(key, seed)
        torch.default_generator.manual_seed(value)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(value)
        yield


class SourcedRollouts:
    """The trainer's use of a :class:`CompletionSource`: staleness, validation, fallback seeds, counters.

    Args:
        source: where completions come from.
        max_staleness: rounds a batch's ``policy_version`` may lag the trainer's round (0: only batches
            sampled from this round's starting policy).
        seed: the run seed; with the key it seeds each fallback generation.
        trust_rewards: use the rewards that come with a batch instead of scoring its completions (the
            default scores them: see :attr:`trust_rewards`).
    """

    def __init__(self, source: CompletionSource, *, max_staleness: int = 0, seed: int = 0,
                 trust_rewards: bool = False) -> None:
        if not isinstance(source, CompletionSource):
            raise TypeError(f"completion_source: {type(source).__name__} has no completions()/record_fallback(); "
                            "implement composer_cloud.trainer.three_channel.sourced.CompletionSource")
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness: {max_staleness!r}; give the rounds a batch may lag, an int >= 0")
        self.source = source
        self.max_staleness = max_staleness
        self.seed = int(seed)
        #: Train on the batch's own rewards when it has them. Off by default: the trainer's reward is cheap
        #: and deterministic next to sampling, scoring locally keeps rewards (and so advantages, samples
        #: and reward metrics) exactly the colocated trainer's, and a number read from the bucket would
        #: steer the gradient directly (design invariant 10: the bucket is not trusted).
        self.trust_rewards = bool(trust_rewards)
        self._counts: dict[str, float] = {}
        self._staleness: list[int] = []
        #: Totals since construction (``used``, ``stale``, ``invalid``, ``missing``, ``fallback``).
        self.totals: dict[str, int] = dict.fromkeys(("used", "stale", "invalid", "missing", "fallback"), 0)

    def check_trainer(self, *, gradient_accumulation_steps: int, steps_per_generation: int, num_iterations: int,
                      multi_turn: bool, reward_functions: int) -> None:
        """Refuse (``ValueError`` naming the setting) a trainer this policy cannot feed.

        A key names one generation, so an optimizer step may generate at most once
        (``gradient_accumulation_steps <= steps_per_generation * num_iterations``); batches are single-turn
        (no tools, no ``rollout_func``); trusted rewards are one number per completion (one reward function).
        """
        every = steps_per_generation * num_iterations
        if gradient_accumulation_steps > every:
            raise ValueError(
                f"completion source: trainer.gradient_accumulation_steps ({gradient_accumulation_steps}) > "
                f"steps_per_generation × num_iterations ({every}) generates more than once per step, and a rollout "
                "batch is named by its step; raise trainer.steps_per_generation to match")
        if multi_turn:
            raise ValueError("completion source: sourced batches are single-turn completions; tools and "
                             "rollout_func generate here only (no completion source)")
        if self.trust_rewards and reward_functions != 1:
            raise ValueError(f"completion source: trust_rewards needs one reward function, this trainer has "
                             f"{reward_functions}; leave trust_rewards off to score here")

    def generation(self, key: RolloutKey, prompt_ids: list[list[int]], generate: Callable[[], tuple[list, list | None]],
                   *, max_completion_length: int, vocab_size: int, device: torch.device
                   ) -> tuple[list[list[int]], list[list[float]] | None, list[float] | None]:
        """``(completion_ids, sampler log-probs or None, trusted rewards or None)`` for ``key``'s generation.

        The source's batch when :meth:`take` accepts it; otherwise the batch a worker would have sampled, when
        the source can provide it (:class:`WorkerEqualFallback`), else ``generate()`` (the trainer's own
        rollout path) under :func:`seeded_fallback`; either is recorded with :meth:`record`.
        """
        batch = self.take(key, prompt_ids, max_completion_length=max_completion_length, vocab_size=vocab_size)
        if batch is not None:
            rewards = list(batch.rewards) if self.trust_rewards and batch.rewards is not None else None
            logprobs = None if batch.logprobs is None else [[float(v) for v in row] for row in batch.logprobs]
            return [list(c) for c in batch.completion_ids], logprobs, rewards
        as_worker = (self.source.sample_fallback(key, prompt_ids) if isinstance(self.source, WorkerEqualFallback)
                     else None)
        if as_worker is not None:
            completion_ids, logprobs, version = as_worker
        else:
            with seeded_fallback(key, self.seed, device):
                completion_ids, logprobs = generate()
            version = key.round
        self.record(key, prompt_ids, completion_ids, logprobs, policy_version=version)
        return completion_ids, logprobs, None

    def _count(self, what: str) -> None:
        self._counts[what] = self._counts.get(what, 0) + 1
        self.totals[what] += 1

    def take(self, key: RolloutKey, prompt_ids: list[list[int]], *, max_completion_length: int,
             vocab_size: int) -> SourcedCompletions | None:
        """The source's batch for ``key`` if the trainer may train on it; ``None``: generate (and record) yourself.

        A fallback record read back (``fallback`` set) is returned as it is and counted as a fallback.
        """
        batch = self.source.completions(key, prompt_ids, policy_version=key.round)
        if batch is None:
            self._count("missing")
            logger.info("rollouts %s: no batch by the source's deadline; generating here", key)
            return None
        problem = batch.problem(prompt_ids, max_completion_length=max_completion_length, vocab_size=vocab_size)
        if problem is None and batch.policy_version > key.round:
            problem = (f"policy_version {batch.policy_version} is newer than version {key.round}, the policy this "
                       f"trainer started round {shown_round(key.round)} from")
        if problem is not None:
            self._count("invalid")
            logger.warning("rollouts %s: refused a malformed batch (%s); generating here", key, problem)
            return None
        if batch.fallback:
            self._count("fallback")
            return batch
        staleness = key.round - batch.policy_version
        self._staleness.append(staleness)
        if staleness > self.max_staleness:
            self._count("stale")
            logger.info("rollouts %s: refused a batch %d rounds stale (max_staleness = %d); generating here",
                        key, staleness, self.max_staleness)
            return None
        self._count("used")
        return batch

    def record(self, key: RolloutKey, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
               logprobs: Sequence[Sequence[float]] | None, *, policy_version: int | None = None) -> SourcedCompletions:
        """Count a fallback generation and hand it to the source (``policy_version``: the version it was sampled
        from, ``<= key.round``; default the key's round, the trainer's live policy)."""
        version = key.round if policy_version is None else int(policy_version)
        if not 0 <= version <= key.round:
            raise ValueError(f"rollouts {key}: a fallback's policy_version must be in [0, {key.round}], got {version}")
        record = SourcedCompletions(
            completion_ids=[list(c) for c in completion_ids],
            logprobs=None if logprobs is None else [[float(v) for v in row] for row in logprobs],
            policy_version=version, prompt_ids=[list(p) for p in prompt_ids], fallback=True)
        self._count("fallback")
        self.source.record_fallback(key, record)
        return record

    def take_metrics(self) -> dict[str, float]:
        """This step's counters (every name of :data:`ROLLOUT_METRICS` but the staleness: 0 when nothing
        happened) and the staleness of the batch the source returned, if any; then reset for the next step."""
        out = {name: float(self._counts.get(name.split("/", 1)[1], 0)) for name in ROLLOUT_METRICS[:-1]}
        if self._staleness:
            out["rollouts/staleness"] = float(max(self._staleness))
        self._counts, self._staleness = {}, []
        return out


__all__ = [
    "ROLLOUT_METRICS",
    "CompletionSource",
    "InMemorySource",
    "RolloutKey",
    "SourcedCompletions",
    "SourcedRollouts",
    "WorkerEqualFallback",
    "fallback_seed",
    "seeded_fallback",
]
