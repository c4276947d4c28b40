"""The states ``benchmarks/checkpoint.py`` writes: the tiny model's real ones, and synthetic ones of a size.

``tiny`` is the built-in model with the real causal-LM trainer (its AdamW state after real
inner steps) and the real outer optimizer after one step. ``mid`` and ``0.5b`` are synthetic
fp32 tensors shaped like a Qwen2 model (from a config on the meta device; nothing is
downloaded), with optimizer states in torch's own formats.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torchft.local_sgd import extract_local_tensor
from transformers import Qwen2Config, Qwen2ForCausalLM

from composer_cloud.model import count_parameters, load_model
from composer_cloud.spec import spec_from_dict
from composer_cloud.trainer import TrainerContext, build_trainer
from composer_cloud.trainer.optim import build_inner_optimizer, optimizer_state

#: The spec a replica of a default run trains with (lock-step outer defaults filled in by the library).
SPEC = spec_from_dict({})
FRAGMENT = "StreamingDiLoCoFragment_0"  # torchft's key for fragment 0 (sync.fragments = 1)

# Synthetic shapes (Qwen2 layout; tied embeddings). 0.5b = Qwen2.5-0.5B's config.
SYNTHETIC = {
    "mid": dict(vocab_size=32000, hidden_size=640, num_hidden_layers=8, num_attention_heads=10,
                num_key_value_heads=2, intermediate_size=1728),
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864),
}

def synthetic_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    cfg = Qwen2Config(**SYNTHETIC[name], tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _fill(shape: tuple[int, ...], gen: Any) -> Any:
    return torch.empty(shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=gen)


def _sgd_param_group(n: int) -> dict[str, Any]:
    """The exact param_groups entry of the runtime's outer optimizer (Nesterov SGD, spec defaults)."""
    o = SPEC.outer_optimizer
    group = torch.optim.SGD([torch.zeros(1)], lr=o.lr, momentum=o.momentum, nesterov=o.nesterov).state_dict()
    g = dict(group["param_groups"][0])
    g["params"] = list(range(n))
    return g


def _adamw_param_group(n: int) -> dict[str, Any]:
    opt = build_inner_optimizer(torch.nn.Linear(1, 1, bias=False), SPEC.inner_optimizer.model_dump(mode="json"))
    g = dict(opt.state_dict()["param_groups"][0])
    g["params"] = list(range(n))
    return g


class SyntheticTrainer:
    """Just enough of a trainer for ``checkpoint.replica_state``: AdamW state in torch's own format."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], rows: int = 4000) -> None:
        gen = torch.Generator().manual_seed(2)
        state = {}
        for i, (_, shape) in enumerate(shapes):
            state[i] = {"step": torch.tensor(10.0), "exp_avg": _fill(shape, gen),
                        "exp_avg_sq": _fill(shape, gen).abs_()}
        self._opt_state = {"state": state, "param_groups": [_adamw_param_group(len(shapes))]}
        self.generator = torch.Generator().manual_seed(3)
        self.order = torch.randperm(rows, generator=self.generator)

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        tensors, meta = optimizer_state(types.SimpleNamespace(state_dict=lambda: self._opt_state))
        tensors["data/order"] = self.order.clone()
        tensors["data/generator"] = self.generator.get_state()
        meta["data"] = {"epoch": 0, "position": 80}
        return tensors, meta



class GlobalLive:
    """The leader's live global state of one fragment, and torchft's ``save_fn`` over it."""

    def __init__(self, backup: dict[str, Any], outer_state_dict: Any) -> None:
        self.backup = backup  # DiLoCo's original_parameters (the global params, on CPU)
        self._outer_state_dict = outer_state_dict

    def save_fn(self) -> dict[str, Any]:
        """Exactly torchft's fragment save_fn: outer optimizer state_dict (references) + cloned params."""
        return {"outer_optimizer": self._outer_state_dict(),
                "original_parameters": {n: extract_local_tensor(t) for n, t in self.backup.items()}}

    def snapshot(self) -> dict[str, Any]:
        """What ``ObjectStoreManager._maybe_publish_state`` builds on the critical path."""
        return {FRAGMENT: self.save_fn()}


def synthetic_global_live(shapes: list[tuple[str, tuple[int, ...]]]) -> GlobalLive:
    gen = torch.Generator().manual_seed(1)
    backup = {name: _fill(shape, gen) for name, shape in shapes}
    state = {"state": {i: {"momentum_buffer": _fill(shape, gen)} for i, (_, shape) in enumerate(shapes)},
             "param_groups": [_sgd_param_group(len(shapes))]}
    return GlobalLive(backup, lambda: state)


def tiny_global_live(model: Any) -> GlobalLive:
    """The real outer optimizer (Nesterov SGD, spec defaults) after one outer step, over copies of the params."""
    o = SPEC.outer_optimizer
    named = list(model.named_parameters())
    shadow = [torch.nn.Parameter(p.detach().clone()) for _, p in named]
    outer = torch.optim.SGD(shadow, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov)
    gen = torch.Generator().manual_seed(4)
    for p in shadow:
        p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3, generator=gen)
    outer.step()
    for p in shadow:
        p.grad = None
    return GlobalLive({n: p.detach().clone() for (n, _), p in zip(named, shadow)}, outer.state_dict)


def tiny_setup() -> tuple[Any, Any, int]:
    """Real tiny model + causal-LM trainer (spec defaults), warmed up so AdamW has state."""
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny", seed=0)
    trainer = build_trainer("causal-lm", TrainerContext(
        model=model, tokenizer=tokenizer, rank=0, world_size=2, seed=0, device=torch.device("cpu"),
        settings=SPEC.trainer.settings(), inner_optimizer=SPEC.inner_optimizer.model_dump(mode="json")))
    for _ in range(3):
        trainer.step()
    return model, trainer, count_parameters(model)
