"""Sampling one rollout batch: a pure function of (policy weights, prompts, seed), whoever calls it.

A worker and a trainer that generates itself after the deadline must write the same bytes for the same position,
or a rerun would depend on who won the race. So the batch is sampled

* from a bf16 :class:`~composer_cloud.trainer.three_channel.fast_rollout.InferenceCopy` of the policy (the
  ``"hf-fast"`` sampler: static KV cache, the sampler's own per-token log-probs for the importance-sampling
  correction), with TRL's generation settings for the run's ``[trainer]`` (:func:`generation_kwargs`);
* with torch's RNG seeded by :func:`~composer_cloud.rollouts.batches.sampling_seed` of the position right before
  ``generate``, inside a fork of the RNG state (the caller's streams are left as they were).

On one machine type and thread count the result is bitwise reproducible (tested on CPU).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from composer_cloud.trainer.three_channel.fast_rollout import FastSampler, InferenceCopy

logger = logging.getLogger(__name__)

#: TRL's ``GRPOConfig`` defaults of the sampling settings the three-channel trainer leaves alone (trl 1.16).
TRL_SAMPLING_DEFAULTS: dict[str, Any] = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """TRL's stop tokens: the tokenizer's EOS first, then the model's generation config's (deduplicated)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def generation_kwargs(settings: Any, model: torch.nn.Module, tokenizer: Any) -> dict[str, Any]:
    """``model.generate`` keyword arguments as TRL builds them for a trainer with these
    :class:`~composer_cloud.trainer.three_channel.settings.ThreeChannelSettings`."""
    return {"max_new_tokens": settings.completion_length, "do_sample": True,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": eos_token_ids(model, tokenizer), "temperature": settings.temperature,
            **TRL_SAMPLING_DEFAULTS}


@dataclass(frozen=True)
class Sampled:
    """One batch's completions (token ids up to and including the first EOS), their sampling log-probs, and the
    wall seconds sampling took."""

    completion_ids: list[list[int]]
    logps: list[list[float]]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.completion_ids)


class BatchSampler:
    """Samples rollout batches from ``policy``'s bf16 inference copy (refresh it with :meth:`refresh` after the
    policy's weights change). ``settings``: the run's ``ThreeChannelSettings``."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, settings: Any) -> None:
        self.tokenizer = tokenizer
        self.copy = InferenceCopy(policy)
        self.sampler = FastSampler(self.copy, generation_kwargs(settings, policy, tokenizer))
        self.eos = eos_token_ids(policy, tokenizer)

    def refresh(self) -> None:
        """Copy the policy's current weights into the inference copy (after a new policy version was loaded)."""
        self.copy.refresh()

    def sample(self, prompt_ids: Sequence[Sequence[int]], *, seed: int) -> Sampled:
        """Completions of ``prompt_ids`` (one per row) drawn with torch's RNG seeded by ``seed``; the caller's RNG
        state is restored afterwards."""
        start = time.perf_counter()
        devices = [self.copy.device] if self.copy.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            completions, logps = self.sampler.generate(prompt_ids, pad_token_id=self.tokenizer.pad_token_id,
                                                       eos_token_ids=self.eos)
        return Sampled(completion_ids=completions, logps=logps, seconds=time.perf_counter() - start)


__all__ = ["BatchSampler", "Sampled", "TRL_SAMPLING_DEFAULTS", "eos_token_ids", "generation_kwargs"]
