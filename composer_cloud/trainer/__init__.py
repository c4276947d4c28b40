"""Trainers: what one replica runs between DiLoCo syncs.

Trainers are looked up by name; each entry is ``"module:factory"`` where
``factory(ctx: TrainerContext) -> InnerTrainer``. Imports are lazy so that the
CLI does not pay for TRL unless a replica needs it; :func:`check_settings`
validates a ``[trainer]`` table without importing torch or TRL.
"""

from __future__ import annotations

from composer_cloud.registry import load_object
from composer_cloud.trainer.base import InnerTrainer, TrainerContext
from composer_cloud.trainer.settings import check_settings

TRAINERS: dict[str, str] = {
    "causal-lm": "composer_cloud.trainer.causal_lm:build_causal_lm_trainer",
    "three-channel": "composer_cloud.trainer.three_channel.adapter:build_three_channel_trainer",
}
DEFAULT_TRAINER = "three-channel"


def build_trainer(name: str, ctx: TrainerContext) -> InnerTrainer:
    """Build the trainer registered as ``name``."""
    if name not in TRAINERS:
        raise ValueError(f"trainer.name: unknown trainer {name!r}; choose one of {sorted(TRAINERS)}")
    return load_object(TRAINERS[name], setting="trainer.name")(ctx)


__all__ = ["DEFAULT_TRAINER", "TRAINERS", "InnerTrainer", "TrainerContext", "build_trainer", "check_settings"]
