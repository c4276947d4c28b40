"""Fast rollouts without vLLM (``[trainer] rollout = "hf-fast"``): a bf16 inference copy and its sampler.

Plain ``model.generate`` on the trainer's model is launch-bound on a GPU: every
decode step launches a few hundred small kernels from Python (measured on an
H100: ~1,300 completion tokens/s for a 0.5B model, 20-50x off the memory-bound
floor). This module samples instead from

* an **inference copy** of the policy in bf16 (:class:`InferenceCopy`): the
  trainer's fp32 master weights are never cast in place (TRL's own
  continuous-batching path does ``model.to(bfloat16)``, which would make the
  optimizer step bf16 weights). Under LoRA the copy holds the *merged* weights
  ``W + scale * B @ A`` (computed in fp32, then cast), so decoding runs plain
  linears, no adapter kernels;
* transformers' **static KV cache** (``StaticCache``) with the decode step
  **compiled** (``CompileConfig(mode="reduce-overhead")``: ``torch.compile``
  with CUDA graphs, one graph replay per decode step). The sampler keeps *one*
  cache and resets it in place between generations: its tensors are marked as
  static addresses for the CUDA graphs, and a fresh cache per call (what
  ``cache_implementation="static"`` builds) would make them re-record every
  step of training. The cache is sized to a bucketed worst case
  (:func:`cache_length`) so that a longer prompt rarely re-allocates it.
  Compilation happens on CUDA only (transformers' rule); on a CPU the same
  static-cache path runs eagerly.

Why not transformers' continuous batching (``generate_batch``, TRL's
``use_transformers_continuous_batching``)? A GRPO generation batch is one
fixed-size batch of equal-budget requests, which is what a static cache serves
best; continuous batching's paged cache pays for scheduling we do not need, its
fast decode path wants the flash-attention kernels (an extra package), and its
configuration (CUDA graphs, log-probs) keeps changing across the transformers
5.x releases this project supports. Static-cache ``generate`` is the same code on every transformers 5.x.

The sampler also returns the **sampling log-probs** of every generated token:
``log_softmax(logits / temperature)`` of the copy's decode-time logits (what the
tokens were drawn from; vLLM's ``processed_logprobs`` when temperature is the
only warper, as here: the trainer sets no top-k/top-p). The trainer feeds them
to TRL's importance-sampling correction, exactly as for vLLM
(``vllm_importance_sampling_*`` settings).

Refresh invariant: whenever the copy generates, it equals the policy's current
weights cast to bf16 (merged under LoRA). :meth:`InferenceCopy.refresh` copies
in place (tensor storage never moves, so captured CUDA graphs stay valid).
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from typing import Any, Iterator, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StaticCache
from transformers.generation.configuration_utils import CompileConfig

from composer_cloud.lora import is_lora_model

logger = logging.getLogger(__name__)

#: The static cache is sized in multiples of this many tokens (fewer re-allocations and recompilations).
CACHE_BUCKET = 256


class InferenceCopy:
    """A bf16 (``dtype``) copy of ``policy`` for sampling, refreshed in place from the policy's current weights.

    Invariants:
      * the policy's parameters are only read, never cast or moved;
      * after :meth:`refresh`, every parameter of :attr:`model` equals the policy's
        corresponding weight cast to ``dtype`` (:meth:`matches_policy`); under LoRA the
        policy's weight of a LoRA-wrapped linear is ``base + delta`` (PEFT's
        ``get_delta_weight``), summed in fp32;
      * :attr:`model` holds ``dtype`` memory only (no transient fp32 copy of the policy is built).

    Build it before TRL wraps the policy (accelerate replaces ``forward`` on the instance under
    mixed precision; a copy made afterwards would call the original's ``forward``).
    """

    def __init__(self, policy: torch.nn.Module, *, dtype: torch.dtype = torch.bfloat16) -> None:
        self.policy = policy
        self.dtype = dtype
        self.lora = is_lora_model(policy)
        if self.lora:
            _check_lora_mergeable(policy)
        # deepcopy with every parameter pre-mapped to a detached dtype clone: the copy's structure
        # (config, buffers, submodules) without ever holding a second fp32 set of weights.
        memo: dict[int, Any] = {
            id(p): torch.nn.Parameter(p.detach().to(dtype=dtype, copy=True), requires_grad=False)
            for p in policy.parameters()
        }
        model = copy.deepcopy(policy, memo)
        if self.lora:
            model = model.merge_and_unload()  # plain linears; the merged values are set by refresh() below
        model.requires_grad_(False).eval()
        model.config.use_cache = True
        _disable_checkpointing(model)
        if getattr(model, "_require_grads_hook", None) is not None:  # copied from a checkpointed policy
            model.disable_input_require_grads()
        self.model: torch.nn.Module = model
        self._targets = dict(model.named_parameters())
        missing = set(self._targets) - {name for name, _ in self._policy_weights()}
        if missing:
            raise RuntimeError(f"rollout = 'hf-fast': no policy weight for the copy's {sorted(missing)[:3]}")
        #: How many times the copy was refreshed from the policy.
        self.refreshes = 0
        self.refresh()

    def _policy_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name in the copy, the policy's current weight)``, merged under LoRA, in the policy's dtype or fp32."""
        if not self.lora:
            yield from ((n, p.detach()) for n, p in self.policy.named_parameters())
            return
        from peft.tuners.lora import LoraLayer

        base = self.policy.get_base_model()
        inside_lora: list[str] = []
        for name, module in base.named_modules():
            if any(name.startswith(prefix + ".") for prefix in inside_lora):
                continue  # base_layer / lora_A / lora_B of a wrapped layer: yielded as the merged weight
            if isinstance(module, LoraLayer):
                inside_lora.append(name)
                layer = module.get_base_layer()
                merged = layer.weight.detach().float()
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        merged = merged + module.get_delta_weight(adapter).detach().float()
                yield f"{name}.weight", merged
                if getattr(layer, "bias", None) is not None:
                    yield f"{name}.bias", layer.bias.detach()
                continue
            for pname, p in module.named_parameters(recurse=False):
                yield (f"{name}.{pname}" if name else pname), p.detach()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the policy's current weights into the copy, cast to ``dtype``, in place."""
        for name, value in self._policy_weights():
            target = self._targets.get(name)
            if target is not None:
                target.copy_(value)
        self.refreshes += 1

    @torch.no_grad()
    def matches_policy(self) -> bool:
        """Whether every weight of the copy equals the policy's current weight cast to ``dtype`` (bitwise)."""
        return all(
            torch.equal(self._targets[name], value.to(device=self._targets[name].device, dtype=self.dtype))
            for name, value in self._policy_weights()
            if name in self._targets
        )

    def to(self, device: torch.device) -> "InferenceCopy":
        """Move the copy (only) to ``device``."""
        self.model.to(device)
        self._targets = dict(self.model.named_parameters())
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _disable_checkpointing(model: torch.nn.Module) -> None:
    """Turn activation checkpointing off on the copy (transformers >= 5.23 names it so, earlier ``gradient_*``)."""
    for prefix in ("activation", "gradient"):
        if hasattr(model, f"{prefix}_checkpointing_disable"):
            if getattr(model, f"is_{prefix}_checkpointing", False):
                getattr(model, f"{prefix}_checkpointing_disable")()
            return


def _check_lora_mergeable(policy: torch.nn.Module) -> None:
    """Refuse adapters whose merge is not ``base + get_delta_weight`` (DoRA), naming the setting."""
    from peft.tuners.lora import LoraLayer

    for name, module in policy.named_modules():
        if isinstance(module, LoraLayer) and any(module.use_dora.get(a, False) for a in module.active_adapters):
            raise ValueError(f"trainer.rollout = 'hf-fast': the DoRA adapter at {name} is not supported; "
                             "use rollout = 'hf'")


def cache_length(prompt_length: int, max_new_tokens: int, bucket: int = CACHE_BUCKET, limit: int | None = None) -> int:
    """The static cache's length for a batch: ``prompt_length + max_new_tokens`` rounded up to ``bucket`` tokens.

    The rounding stops at ``limit`` (the model's ``max_position_embeddings``) unless the batch itself needs more.
    """
    need = prompt_length + max_new_tokens
    rounded = int(math.ceil(need / bucket) * bucket)
    return max(need, min(rounded, limit)) if limit is not None else rounded


class _SampledLogprobs(LogitsProcessor):
    """Records ``log_softmax(scores / temperature)`` of each step's sampled token (no change to the scores).

    Installed as a custom processor, i.e. before transformers' temperature warper: it divides by the
    temperature itself. The token sampled at step ``t`` is first visible at step ``t + 1``
    (``input_ids[:, -1]``); :meth:`finish` gathers the last one.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = float(temperature)
        self._previous: torch.Tensor | None = None
        self.values: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._previous is not None:
            self.values.append(self._previous.gather(1, input_ids[:, -1:]))
        self._previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """``(B, new_tokens)`` log-probs, given the last generated token of each row."""
        if self._previous is not None:
            self.values.append(self._previous.gather(1, last_tokens[:, None]))
            self._previous = None
        return torch.cat(self.values, dim=1) if self.values else torch.zeros(last_tokens.size(0), 0)


class FastSampler:
    """Samples completions from an :class:`InferenceCopy` with a static KV cache (compiled on CUDA).

    Args:
        copy: the inference copy to sample from.
        generation_kwargs: ``model.generate`` keyword arguments as TRL builds them for its plain
            generation path (``max_new_tokens``, ``do_sample``, ``temperature``, special tokens...).
        compile: compile the decode step (``None``: on CUDA only; transformers compiles on CUDA only
            unless asked to on every device).
    """

    def __init__(self, copy: InferenceCopy, generation_kwargs: dict[str, Any], *, compile: bool | None = None) -> None:
        self.copy = copy
        kwargs = {k: v for k, v in generation_kwargs.items() if k != "cache_implementation"}
        self.max_new_tokens = int(kwargs["max_new_tokens"])
        self.temperature = float(kwargs.get("temperature") or 1.0)
        self.compile = compile
        self._kwargs = kwargs
        shaping = {k: kwargs.get(k) for k in ("top_k", "top_p", "min_p", "repetition_penalty")}
        if shaping["top_k"] or (shaping["top_p"] or 1.0) < 1.0 or shaping["min_p"] or (
                (shaping["repetition_penalty"] or 1.0) != 1.0):
            logger.warning("rollout = 'hf-fast': the sampling log-probs for the importance-sampling correction "
                           "are log_softmax(logits / temperature); %s also shape the sampling and are not in them",
                           shaping)
        self._cache: StaticCache | None = None
        self._cache_shape: tuple[int, int] = (0, 0)  # (batch, length) of self._cache
        #: Static caches allocated so far (a new one only for a new batch size or a longer batch).
        self.cache_allocations = 0

    @property
    def compiled(self) -> bool:
        """Whether the decode step is compiled (``compile``, or by default: on CUDA)."""
        return self.compile if self.compile is not None else self.copy.device.type == "cuda"

    def generation_config(self) -> GenerationConfig:
        """The copy's generation config: TRL's sampling settings, the compiled decode step (or not)."""
        compile_config = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead")
        if self.compiled and self.copy.device.type != "cuda":
            compile_config._compile_all_devices = True
        return GenerationConfig(**self._kwargs, compile_config=compile_config, disable_compile=not self.compiled)

    def static_cache(self, batch: int, prompt_length: int) -> StaticCache:
        """The sampler's static cache, reset, for ``batch`` rows whose longest prompt has ``prompt_length`` tokens.

        Re-allocated (and so re-captured by the CUDA graphs) only for a new batch size or a batch that
        does not fit; its length is bucketed by :func:`cache_length` and never shrinks.
        """
        config = self.copy.model.config
        need = cache_length(prompt_length, self.max_new_tokens, limit=getattr(config, "max_position_embeddings", None))
        old_batch, old_len = self._cache_shape
        if self._cache is None or batch != old_batch or need > old_len:
            length = max(need, old_len) if batch == old_batch else need
            self._cache = StaticCache(config=config, max_cache_len=length)
            self._cache_shape = (batch, length)
            self.cache_allocations += 1
        else:
            self._cache.reset()
        return self._cache

    @torch.no_grad()
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], *, pad_token_id: int, eos_token_ids: Sequence[int]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Completions of ``prompt_ids`` (one per prompt, as given) and their sampling log-probs.

        Returns ``(completion_ids, logprobs)``: per row the new tokens up to and including the
        first EOS (TRL's trimming), and one log-prob per kept token. Draws from torch's global RNG
        of the copy's device (the caller's RNG scope), as ``model.generate`` does.
        """
        device = self.copy.device
        rows = [torch.tensor(list(ids), dtype=torch.long) for ids in prompt_ids]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding
            input_ids[i, width - len(r):] = r
            attention_mask[i, width - len(r):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        recorder = _SampledLogprobs(self.temperature)
        model = self.copy.model
        config = self.generation_config()
        # The copy's own generation config is replaced for the call: generate() would otherwise fill
        # fields we leave unset from it (transformers#42762, which TRL works around the same way).
        model.generation_config = config
        cache = {_cache_argument(model): self.static_cache(len(rows), width)}
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                             logits_processor=LogitsProcessorList([recorder]), **cache)
        new = out[:, width:]
        logps = recorder.finish(new[:, -1]) if new.size(1) else torch.zeros(len(rows), 0, device=device)
        eos = torch.tensor(list(eos_token_ids), device=device)
        completions: list[list[int]] = []
        logprobs: list[list[float]] = []
        for ids, lp in zip(new.cpu(), logps.float().cpu()):
            hits = torch.isin(ids, eos.cpu()).nonzero()
            keep = int(hits[0]) + 1 if hits.numel() else ids.numel()
            completions.append(ids[:keep].tolist())
            logprobs.append(lp[:keep].tolist())
        return completions, logprobs


def _cache_argument(model: torch.nn.Module) -> str:
    """``generate``'s name for a cache object: ``cache`` in recent transformers, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


__all__ = ["CACHE_BUCKET", "FastSampler", "InferenceCopy", "cache_length"]
