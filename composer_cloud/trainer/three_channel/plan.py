"""What ``launch --dry-run`` shows of a three-channel run: its channels and their inputs, data, rollout, sizes.

:func:`plan_rows` is what :meth:`ThreeChannelSettings.training_plan` returns (``TrainerPlugin.training_plan``),
so the launcher prints the trainer side of the plan without importing this package's trainer (no torch, no
TRL). Every value is resolved as the replicas resolve it: ``rollout = "auto"`` on the device they will get,
``pairs = "auto"`` for the task, the completion length from ``seq_len``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_cloud.trainer.three_channel.signal import CHANNELS

if TYPE_CHECKING:
    from composer_cloud.trainer.three_channel.settings import ThreeChannelSettings


def _channels(s: ThreeChannelSettings) -> list[tuple[str, str]]:
    """One row per loss channel: its weight and what it learns from, or why it is off."""
    pairs = s.effective_pairs
    reward = f"reward {s.effective_reward}" if s.dataset is not None else f"the task's reward ({s.task})"
    inputs = {
        "pg": (s.pg_weight, "pg_weight = 0", reward),
        "sdpo": (s.sdpo_weight, "sdpo_weight = 0", None if s.hint_source == "none" else f"hints: {s.hint_source}"
                 + (" (the task's, or a dataset's hint/answer column)" if s.hint_source == "default" else "")),
        "dpo": (s.dpo_weight, "dpo_weight = 0", None if pairs == "none" else f"pairs: {pairs}"),
    }
    rows = []
    for key, name in CHANNELS.items():
        weight, off, source = inputs[key]
        if weight == 0:
            rows.append((name, f"off ({off})"))
        elif source is None:
            rows.append((name, f"weight {weight:g}, but no input (hint_source = 'none')" if key == "sdpo"
                         else f"weight {weight:g}, but no input (trainer.pairs: none)"))
        else:
            rows.append((name, f"weight {weight:g}; {source}"))
    return rows


def _data(s: ThreeChannelSettings) -> str:
    if s.dataset is None:
        return f"task {s.task}" + (f" {dict(s.task_options)}" if s.task_options else "")
    held_out = f"eval split {s.eval_split!r}" if s.eval_split else f"{s.eval_fraction:g} of it held out"
    return f"dataset {s.dataset} (split {s.dataset_split!r}, {held_out})"


def plan_rows(s: ThreeChannelSettings, device_type: str, rollout: str) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the dry run's training plan for replicas computing on ``device_type``, where
    ``s.rollout`` resolves to ``rollout`` (:func:`~.settings.resolve_rollout`)."""
    why = f" (rollout = 'auto' on {device_type})" if s.rollout == "auto" else ""
    generation_batch = s.batch_size * s.steps_per_generation
    return [
        ("data", _data(s)),
        *_channels(s),
        ("rollout", f"{rollout}{why}"),
        ("generations per prompt", f"{s.num_generations} (temperature {s.temperature:g})"),
        ("batch", f"{s.batch_size} completions per micro-batch, {s.gradient_accumulation_steps} micro-batch(es) per "
                  f"optimizer step; {generation_batch // s.num_generations} prompts x {s.num_generations} per "
                  f"generation"),
        ("replay batch", f"{s.replay_batch_size} pairs per step" if s.dpo_weight and s.effective_pairs != "none"
         else "-"),
        ("completion length", f"{s.completion_length} new tokens at most"),
    ]


__all__ = ["plan_rows"]
