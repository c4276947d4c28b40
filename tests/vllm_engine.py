"""A stand-in for vLLM behind TRL's own ``VLLMGeneration`` (the seam of the vLLM rollout path).

``RecordingVLLMGeneration`` subclasses ``trl.generation.vllm_generation.VLLMGeneration`` and replaces only what
needs vLLM: ``_init_vllm`` builds an "engine" that is a plain transformers model loaded from
``model.name_or_path`` (as vLLM's ``LLM(model=...)`` does), whose ``load_weights`` is the method TRL's real
``sync_weights`` calls; ``generate`` samples with that engine model and returns vLLM's output layout
(token ids and the sampled tokens' processed log-probs). So the weights TRL pushes (after inner steps, and
whatever the trainer pushes through ``on_params_replaced``) are exactly the weights the engine samples
with, and every generation records whether the engine held the policy's current weights.

``logprob_noise`` perturbs the returned log-probs, as a vLLM engine's kernels differ from the trainer's:
that is what TRL's importance-sampling correction is for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from trl.generation.vllm_generation import VLLMGeneration


@dataclass
class EngineLog:
    loads: int = 0  # sync_weights() calls
    generations: list[bool] = field(default_factory=list)  # per generate(): engine == policy?


class _EngineModel:
    """The part of vLLM's model runner TRL talks to: ``load_weights([(name, tensor)])``."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.hf = hf_model
        self._params = dict(hf_model.named_parameters())

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                self._params[name].copy_(tensor)


class RecordingVLLMGeneration(VLLMGeneration):
    """``VLLMGeneration`` over an in-process engine model (see the module docstring)."""

    logprob_noise: float = 0.0
    instances: list["RecordingVLLMGeneration"] = []

    def _init_vllm(self) -> None:
        from transformers import AutoModelForCausalLM

        assert self.mode == "colocate", self.mode
        self.log = EngineLog()
        hf = AutoModelForCausalLM.from_pretrained(self.model.name_or_path, dtype=torch.float32).eval()
        self.engine = _EngineModel(hf)
        runner = SimpleNamespace(model=self.engine)
        self.llm = SimpleNamespace(
            llm_engine=SimpleNamespace(
                model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
                model_config=SimpleNamespace(max_model_len=hf.config.max_position_embeddings),
            ),
            reset_prefix_cache=lambda: None,
        )
        self._llm_weights_sleeping = False
        type(self).instances.append(self)

    def sync_weights(self) -> None:
        self.log.loads += 1
        super().sync_weights()  # TRL's own: walks the policy's parameters (PEFT: merged) into load_weights

    @torch.no_grad()
    def engine_matches_policy(self, atol: float = 1e-5) -> bool:
        """Whether the engine computes what the policy computes now (logits on a fixed probe)."""
        probe = torch.arange(3, 19).reshape(2, 8) % self.engine.hf.config.vocab_size
        was_training = self.model.training
        self.model.eval()
        try:
            policy = self.model(input_ids=probe).logits.float()
        finally:
            self.model.train(was_training)
        engine = self.engine.hf(input_ids=probe).logits.float()
        return bool(torch.allclose(policy, engine, atol=atol, rtol=0))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None) -> tuple:
        self.log.generations.append(self.engine_matches_policy())
        pad = self.processing_class.pad_token_id
        eos = self.processing_class.eos_token_id
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.engine.hf.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0,
            max_new_tokens=self.max_completion_length, pad_token_id=pad, eos_token_id=eos,
            output_scores=True, return_dict_in_generate=True,
        )
        new = out.sequences[:, width:]
        # vLLM's processed log-probs: after temperature, of the sampled token.
        logps = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1).gather(-1, new[..., None])[..., 0]
        if self.logprob_noise:
            logps = logps + self.logprob_noise * torch.randn(logps.shape)
        completion_ids, logprobs = [], []
        for row, lp in zip(new.tolist(), logps.tolist()):
            n = row.index(eos) + 1 if eos in row else len(row)
            completion_ids.append(row[:n])
            logprobs.append([[x] for x in lp[:n]])
        return [list(p) for p in prompts], completion_ids, logprobs, None


def install(monkeypatch: Any, *, logprob_noise: float = 0.0) -> type[RecordingVLLMGeneration]:
    """Make TRL's ``GRPOTrainer`` build :class:`RecordingVLLMGeneration` instead of a vLLM engine."""
    import trl.trainer.grpo_trainer as grpo_trainer

    cls = type("Recording", (RecordingVLLMGeneration,), {"logprob_noise": logprob_noise, "instances": []})
    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", cls)
    return cls
