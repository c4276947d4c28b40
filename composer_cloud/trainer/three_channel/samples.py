"""The few sample completions a replica reports per round (``trainer.log_samples``): TRL's ``log_completions``
triples (prompt, completion, reward), bounded, chosen without drawing a random number."""

from __future__ import annotations

from typing import Any

import torch


def as_text(value: Any) -> str:
    """A prompt or completion as text: a plain string as it is, a conversation as ``role: content`` lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in value)
    return str(value)


def pick_samples(prompts: list[Any], completions: list[Any], rewards_per_func: torch.Tensor,
                 weights: torch.Tensor, n: int) -> list[dict[str, Any]]:
    """``n`` (prompt, completion, reward) of one generation batch, evenly spaced over it (so several GRPO groups
    show), deterministic. ``rewards_per_func`` are this process's rows ``(len(prompts), n_funcs)``; the reward
    is their ``weights``-weighted sum, as GRPO trains on (``None`` where every function returned None)."""
    if n <= 0 or not prompts:
        return []
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    stride = max(1, len(prompts) // n)
    return [{"prompt": as_text(prompts[i]), "completion": as_text(completions[i]),
             "reward": None if bool(unscorable[i]) else float(rewards[i])}
            for i in range(0, len(prompts), stride)][:n]


__all__ = ["as_text", "pick_samples"]
