"""Whether a run's training can produce, and did produce, a gradient; and if not, why and what to change.

Two checks, one vocabulary (the three channels of the three-channel loss):

* :func:`launch_refusal`, before anything is written: a spec in which no channel
  *can* produce a gradient (every weight 0, or channel 1 on with the others
  without input: no hints, no pairs) is refused by ``launch`` and ``--dry-run``.
* :func:`diagnose_rounds`, from the metrics rows a run wrote: a round in which
  every inner step of every replica had ``grad_norm == 0`` trained nothing. The
  message names each channel and why it was silent (no reward variance in any
  group, every completion truncated and masked, no hints, no pairs), and what to
  change. ``status`` (of a finished run) and the launch summary show it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

#: Metric key of each channel's loss in the step rows, and its name for users.
CHANNELS: dict[str, str] = {"pg": "channel 1 (GRPO policy gradient)", "sdpo": "channel 2 (hint self-distillation)",
                            "dpo": "channel 3 (trace-replay DPO)"}


def launch_refusal(trainer: str, settings: Mapping[str, Any], columns: Sequence[str] | None) -> str | None:
    """Why no channel of a three-channel spec can produce a gradient, or None when one can.

    ``columns`` are the dataset's columns when the launcher could read them (None: unknown, so a
    dataset's default hints are assumed to exist).
    """
    if trainer != "three-channel":
        return None
    from composer_cloud.trainer.three_channel.dataset_task import default_hint_column
    from composer_cloud.trainer.three_channel.settings import ThreeChannelSettings

    s = ThreeChannelSettings.from_settings(settings)
    why: list[str] = []
    if s.pg_weight == 0.0:
        why.append("channel 1: trainer.pg_weight = 0")
    if s.sdpo_weight == 0.0:
        why.append("channel 2: trainer.sdpo_weight = 0")
    elif s.hint_source == "none":
        why.append("channel 2: trainer.hint_source = 'none'")
    elif s.dataset is not None and s.hint_source == "default" and columns is not None and \
            default_hint_column(s.columns, columns) is None:
        why.append("channel 2: the dataset has neither a hint nor an answer column to use as the hint")
    if s.dpo_weight == 0.0:
        why.append("channel 3: trainer.dpo_weight = 0")
    elif s.effective_pairs == "none":
        why.append("channel 3: no pairs (trainer.pairs)")
    if len(why) < 3:
        return None  # a channel can work (channel 1's reward variance only the run can tell)
    return ("no channel can produce a gradient: " + "; ".join(why) + ". Give channel 2 a hint (a hint or answer "
            "column, trainer.hint_source) or channel 3 pairs (trainer.pairs), or turn channel 1 on")


def hint_note(settings: Mapping[str, Any], columns: Sequence[str] | None) -> str | None:
    """What channel 2 distils from on a dataset run with the default hint source (None: not such a run)."""
    from composer_cloud.trainer.three_channel.dataset_task import default_hint_column

    if not settings.get("dataset") or settings.get("hint_source", "default") != "default" or columns is None:
        return None
    if settings.get("sdpo_weight", 0.1) == 0:
        return None
    mapping = dict(settings.get("columns") or {})
    column = default_hint_column(mapping, columns)
    if column is None:
        return "channel 2 has no hint: the dataset has neither a hint nor an answer column"
    if column == mapping.get("hint", "hint"):
        return f"channel 2's hint: the dataset's {column!r} column"
    return (f"channel 2's hint: the reference answer (column {column!r}), as privileged information for "
            "self-distillation; trainer.hint_source = 'none' turns it off")


def _mean(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return sum(vals) / len(vals) if vals else None


def _channel_reasons(steps: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]) -> list[str]:
    """Why each channel gave nothing in ``steps`` (rows whose grad_norm was 0), with what to change."""
    reasons = []
    clipped = _mean(steps, "clipped_ratio")
    masked = clipped is not None and clipped >= 1.0 and settings.get("mask_truncated_completions", True)
    zero_std = _mean(steps, "frac_reward_zero_std")
    if zero_std is not None and zero_std >= 1.0:
        reasons.append(f"{CHANNELS['pg']}: every group's rewards were identical (frac_reward_zero_std 1.0, "
                       f"mean reward {_mean(steps, 'reward_mean') or 0.0:.3f}): start from a model that solves some "
                       "rows, or use a graded reward")
    if masked:
        reasons.append(f"every completion hit max_completion_length ({settings.get('max_completion_length')}) and "
                       "trainer.mask_truncated_completions drops truncated completions from channels 1 and 2: "
                       "raise trainer.max_completion_length or set trainer.mask_truncated_completions = false")
    elif all(r.get("sdpo", 0.0) == 0.0 for r in steps):
        reasons.append(f"{CHANNELS['sdpo']}: no hinted completion to distil (no hint column, trainer.hint_source, "
                       "or trainer.sdpo_weight = 0)")
    if all(r.get("dpo", 0.0) == 0.0 for r in steps):
        reasons.append(f"{CHANNELS['dpo']}: no pairs (trainer.pairs)")
    return reasons


def diagnose_rounds(rows: Sequence[Mapping[str, Any]], settings: Mapping[str, Any] | None = None) -> list[str]:
    """One message per stretch of rounds (1-based, as users count them) in which no inner step of any replica
    produced a gradient (``grad_norm`` 0 on every step row), saying which channel was silent and why.

    Rows without ``grad_norm`` (a trainer that does not report it) are never flagged.
    """
    by_round: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("kind") == "step" and isinstance(r.get("round"), int):
            by_round[r["round"]].append(r)
    silent = sorted(rnd for rnd, steps in by_round.items()
                    if steps and all(isinstance(s.get("grad_norm"), (int, float)) and s["grad_norm"] == 0.0
                                     for s in steps))
    if not silent:
        return []
    steps = [s for rnd in silent for s in by_round[rnd]]
    which = ("every round" if len(silent) == len(by_round) else
             "rounds " + ", ".join(str(r + 1) for r in silent))
    reasons = _channel_reasons(steps, settings or {}) or ["the trainer reported grad_norm 0 on every step"]
    return [f"no training signal in {which}: grad_norm was 0 on every inner step of every replica: no loss "
            "channel gave the model a gradient. " + "; ".join(reasons)]


__all__ = ["CHANNELS", "diagnose_rounds", "hint_note", "launch_refusal"]
