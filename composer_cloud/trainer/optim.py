"""The inner optimizer and its (pickle-free) checkpoint form, shared by trainers."""

from __future__ import annotations

import json
from typing import Any

import torch

from composer_cloud.storage.tensors import flatten, unflatten


def build_inner_optimizer(model: torch.nn.Module, cfg: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW with the spec's ``inner_optimizer`` settings and a constant learning rate.

    ``foreach=False`` keeps the update arithmetic identical whatever the
    parameter count, so a resumed run reproduces an uninterrupted one bitwise.
    """
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],  # a LoRA model: its adapters alone
        lr=float(cfg.get("lr", 4e-4)),
        weight_decay=float(cfg.get("weight_decay", 0.1)),
        betas=tuple(cfg.get("betas", (0.9, 0.95))),
        foreach=False,
    )


def optimizer_state(opt: torch.optim.Optimizer, prefix: str = "optim", *, model: torch.nn.Module | None = None,
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``opt.state_dict()`` as ``(tensors, JSON meta)`` under ``prefix``.

    With the FSDP-sharded ``model`` it optimizes: the full state (a collective; trainer/parallel.py).
    """
    from composer_cloud.trainer.parallel import optimizer_state_dict

    tensors, skeleton = flatten(opt.state_dict() if model is None else optimizer_state_dict(model, opt), prefix)
    return dict(tensors), {prefix: json.dumps(skeleton)}


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                         prefix: str = "optim", *, model: torch.nn.Module | None = None) -> None:
    from composer_cloud.trainer.parallel import load_optimizer_state_dict

    state = unflatten(tensors, json.loads(meta[prefix]))
    opt.load_state_dict(state) if model is None else load_optimizer_state_dict(model, opt, state)
