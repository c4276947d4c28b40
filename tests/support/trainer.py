"""A tiny task and helpers shared by the trainer's tests (three-channel, precision/LoRA, vLLM rollouts)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from composer_cloud.trainer.three_channel.replay import Pair, default_pairs_uri, load_pairs
from composer_cloud.trainer.three_channel.tasks import ColumnHints


def hash_reward(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """A TRL reward function whose value varies between completions (so GRPO's advantages are non-zero)."""
    return [float(hashlib.sha256(c.encode()).digest()[0]) / 255 for c in completions]


class HashTask:
    """A test task whose reward varies between completions (so GRPO's advantages are non-zero)."""

    name = "hash-task"

    def __init__(self, n: int = 24) -> None:
        self.rows = [
            {"prompt": f"def f{i}(x):\n    return", "hint": (f"# f{i} adds {i}" if i % 3 else None), "k": i}
            for i in range(n)
        ]

    def examples(self, split: str) -> list[dict[str, Any]]:
        return [dict(r) for r in (self.rows if split == "train" else self.rows[:4])]

    def reward(self, completions: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[float]:
        return [hashlib.sha256(f"{c}|{r['k']}".encode()).digest()[0] / 255 for c, r in zip(completions, rows)]

    def default_hints(self) -> ColumnHints:
        return ColumnHints("hint")


def shipped_pairs(n: int = 8) -> list[Pair]:
    """The first ``n`` of the replay pairs shipped with the package."""
    return load_pairs(default_pairs_uri())[:n]


def roundtrip(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """Through the checkpoint formats the runtime uses: safetensors + JSON."""
    from safetensors.torch import load, save

    return load(save(tensors)), json.loads(json.dumps(meta))


def tiny_context(settings: Mapping[str, Any], *, lr: float = 1e-3, model: Any = None, tokenizer: Any = None) -> Any:
    """A rank-0 CPU ``TrainerContext`` over a 2-layer, 32-wide tiny model (built unless ``model`` is given)."""
    from composer_cloud.model import TinyModelConfig, load_model
    from composer_cloud.trainer import TrainerContext

    if model is None:
        model, tokenizer = load_model("tiny", seed=0, tiny=TinyModelConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64))
    return TrainerContext(model=model, tokenizer=tokenizer, rank=0, world_size=1, seed=0, device=torch.device("cpu"),
                          settings=dict(settings),
                          inner_optimizer={"lr": lr, "weight_decay": 0.0, "betas": [0.9, 0.95], "grad_clip": 1.0})
