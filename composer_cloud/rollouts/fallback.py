"""A trainer's fallback batch, sampled exactly as a rollout worker samples that position.

When no worker's batch arrives by ``[rollouts] deadline_s`` (``on_deadline = "generate"``), the trainer samples the
batch itself. A worker would have sampled position ``(t, r, s)`` from policy version ``v = max(0, t -
max_staleness)`` (:func:`~composer_cloud.rollouts.batches.policy_version_for`) with the seed
:func:`~composer_cloud.rollouts.batches.sampling_seed` ``(run seed, t, r, s)`` on the ``"hf-fast"`` bf16 sampler
(:class:`~composer_cloud.rollouts.sampler.BatchSampler`). :class:`WorkerFallback` does the same, with the same
code: the worker's own stack (:func:`worker_policy`: the model built from the spec, :class:`PolicyVersions` over
the chain or the checkpoints as the run publishes, the batch sampler), so a fallback batch equals, bitwise, the
batch a worker would have written for that position (same machine type and thread count), and a run whose
workers never answer trains on the batches of a run whose workers do.

Why not the trainer's live weights: version ``v`` is the global model round ``v`` starts from. With
``max_staleness >= 1`` the live model is a later one; with ``max_staleness = 0`` it equals version ``t`` only
before the round's first inner step (from the second step on it has taken inner steps), and under LoRA the
chain's bf16 adapter merges to other bf16 weights than the live fp32 one. So the fallback always loads ``v``.

Cost: nothing until the first fallback; then, once per replica process, a second model built from the spec (fp32
parameters: 4 bytes per parameter; a bf16 LoRA base as the spec stores it), its bf16 inference copy (2 bytes per
parameter) and, when versions come from the checkpoints, a copy of the initial synced parameters (4 bytes per
synced parameter): about 6 (up to 10) bytes per parameter, the same as a rollout worker holds, plus one load of the
model. Consecutive fallbacks in a round load their version once (:class:`PolicyVersions` keeps the last).

Version ``v`` is published after round ``v - 1`` commits, in the background; the fallback waits for it up to
``wait_s`` (the run's ``deadline_s``). If it is still missing (or does not verify) :meth:`WorkerFallback.sample`
returns ``None`` and the trainer samples from its live weights as before (logged: that step is then not the
worker's batch, but it is recorded and a resumed run reads it back).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from composer_cloud.errors import BadObject
from composer_cloud.rollouts.batches import policy_version_for, sampling_seed
from composer_cloud.rollouts.sampler import BatchSampler, Sampled
from composer_cloud.rollouts.versions import PolicyVersions
from composer_cloud.storage.store import Store
from composer_cloud.trainer.three_channel.sourced import RolloutKey
from composer_cloud.trainer.three_channel.state import forked_global_rngs

logger = logging.getLogger(__name__)


def worker_policy(store: Store, spec: Any, device: torch.device) -> tuple[BatchSampler, PolicyVersions]:
    """A rollout worker's policy stack for ``spec`` on ``device``: the model and tokenizer built from the spec as
    every replica builds them (seeded by ``spec.seed``; eval mode, no gradients), the :class:`PolicyVersions`
    source the run uses (the chain when the replicas publish it, else the checkpoints) and the batch sampler.
    Seeds torch's global generator (callers that must keep their RNG streams wrap it in a fork)."""
    from composer_cloud.model import load_spec_model
    from composer_cloud.rollouts.policy import should_publish
    from composer_cloud.trainer.three_channel.settings import ThreeChannelSettings

    torch.manual_seed(spec.seed)
    model, tokenizer = load_spec_model(spec.model, seed=spec.seed, device=device)
    model.eval().requires_grad_(False)
    settings = ThreeChannelSettings.from_settings(spec.trainer.settings())
    versions = PolicyVersions(store, model, fragments=spec.sync.fragments, chain=should_publish(spec))
    return BatchSampler(model, tokenizer, settings), versions


class WorkerFallback:
    """Samples a trainer's fallback batch as a worker would (see the module).

    Args:
        build: returns ``(sampler, versions)``, the worker's stack (:func:`worker_policy`); called once, at the
            first fallback, inside a fork of every global RNG (the trainer's streams are left as they were).
        seed: the run seed (``spec.seed``), as the workers' :class:`~composer_cloud.rollouts.worker.WorkerConfig`.
        max_staleness: ``rollouts.max_staleness``.
        wait_s: seconds to wait for version ``v`` to be published before giving up (``None`` from :meth:`sample`).
        device: the device the stack is built on (its RNG is forked too when it is a CUDA device).
    """

    def __init__(self, build: Callable[[], tuple[BatchSampler, PolicyVersions]], *, seed: int, max_staleness: int,
                 wait_s: float, device: torch.device | str = "cpu", poll_s: float = 0.1) -> None:
        if max_staleness < 0 or wait_s < 0:
            raise ValueError(f"max_staleness ({max_staleness}) and wait_s ({wait_s}) must be >= 0")
        self._build = build
        self.seed = int(seed)
        self.max_staleness = int(max_staleness)
        self.wait_s = float(wait_s)
        self.device = torch.device(device)
        self.poll_s = poll_s
        self._stack: tuple[BatchSampler, PolicyVersions] | None = None
        #: How many fallbacks were sampled as a worker would, and how many could not be (version missing).
        self.sampled = 0
        self.unavailable = 0

    @classmethod
    def for_spec(cls, store: Store, spec: Any, device: torch.device) -> "WorkerFallback":
        """The fallback of a replica of ``spec`` on ``device`` (``[rollouts]`` settings, the run seed)."""
        return cls(lambda: worker_policy(store, spec, device), seed=spec.seed,
                   max_staleness=spec.rollouts.max_staleness, wait_s=spec.rollouts.deadline_s, device=device)

    def _ensure(self, version: int) -> BatchSampler | None:
        if self._stack is None:
            with forked_global_rngs(self.device):
                self._stack = self._build()
            logger.info("rollouts: built the rollout worker's policy stack for fallbacks (one more model copy)")
        sampler, versions = self._stack
        before = versions.loaded
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                if versions.ensure(version):
                    break
            except BadObject as exc:
                logger.warning("rollouts: policy version %d does not verify (%s)", version, exc.reason)
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_s)
        if versions.loaded != before:
            sampler.refresh()
        return sampler

    def sample(self, key: RolloutKey, prompt_ids: list[list[int]]) -> tuple[Sampled, int] | None:
        """``(the batch a worker would sample for key, its policy version)``; ``None`` when that version is not
        available within ``wait_s`` (the trainer then samples from its live weights)."""
        version = policy_version_for(key.round, self.max_staleness)
        sampler = self._ensure(version)
        if sampler is None:
            self.unavailable += 1
            logger.warning("rollouts %s: policy version %d is not available after %gs; sampling from the trainer's "
                           "live weights (this step's batch is not the one a worker would have sampled)", key,
                           version, self.wait_s)
            return None
        self.sampled += 1
        return sampler.sample(prompt_ids, seed=sampling_seed(self.seed, key.round, key.replica, key.step)), version


__all__ = ["WorkerFallback", "worker_policy"]
