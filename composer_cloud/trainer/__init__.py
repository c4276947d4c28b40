"""Trainers: what one replica runs between DiLoCo syncs.

Trainers are looked up by name in :data:`TRAINERS` (or given as
``"module:SettingsClass"``): each entry is the trainer's settings class, which
names its factory (``FACTORY``, ``factory(ctx: TrainerContext) -> InnerTrainer``).
Imports are lazy so that the CLI does not pay for TRL unless a replica needs
it; :func:`check_settings` validates a ``[trainer]`` table without importing
torch or TRL.
"""

from __future__ import annotations

from composer_cloud.registry import load_object
from composer_cloud.trainer.base import InnerTrainer, TrainerContext
from composer_cloud.trainer.settings import DEFAULT_TRAINER, TRAINERS, check_settings, settings_class


def build_trainer(name: str, ctx: TrainerContext) -> InnerTrainer:
    """Build trainer ``name`` (registered, or ``"module:SettingsClass"``) with its settings class's factory."""
    return load_object(settings_class(name).FACTORY, setting="trainer.name")(ctx)


__all__ = ["DEFAULT_TRAINER", "TRAINERS", "InnerTrainer", "TrainerContext", "build_trainer", "check_settings"]
