"""Whether a three-channel run can, and did, produce a gradient; which channel was silent and what to change.

The three channels of the three-channel loss are one vocabulary for both questions:

* :func:`launch_refusal`, before anything is written: settings in which no channel *can* produce a gradient
  (every weight 0, or channel 1 on with the others without input: no hints, no pairs) are refused by
  ``launch`` and ``--dry-run``;
* :func:`channel_reasons`, from the step rows of rounds in which no step had a gradient
  (``runs/signal.diagnose_rounds`` finds them): each channel's reason to be silent (no reward variance in any
  group, every completion truncated and masked, no hints, no pairs), and what to change.

:class:`~composer_cloud.trainer.three_channel.settings.ThreeChannelSettings` answers the client's questions
(:class:`~composer_cloud.trainer.plugin.TrainerPlugin`) with these functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from composer_cloud.trainer.three_channel.dataset_task import default_hint_column

if TYPE_CHECKING:
    from composer_cloud.trainer.three_channel.settings import ThreeChannelSettings

#: The diagnosis short of ``grad_norm = 0``: step-row fields the trainer reports on every step (from its latest
#: generation, TRL's own figures) and what each is, for people. The summary shows each first -> last round.
DIAGNOSIS: dict[str, str] = {"clipped_ratio": "truncation rate (completions that hit max_completion_length)",
                             "frac_reward_zero_std": "zero-variance groups (all rewards equal: no GRPO signal)",
                             "completion_length": "mean completion length (tokens)"}

#: Metric key of each channel's loss in the step rows, and its name for users.
CHANNELS: dict[str, str] = {"pg": "channel 1 (GRPO policy gradient)", "sdpo": "channel 2 (hint self-distillation)",
                            "dpo": "channel 3 (trace-replay DPO)"}


def launch_refusal(s: ThreeChannelSettings, columns: Sequence[str] | None) -> str | None:
    """Why no channel of a three-channel spec can produce a gradient, or None when one can.

    ``columns`` are the dataset's columns when the launcher could read them (None: unknown, so a
    dataset's default hints are assumed to exist).
    """
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


def hint_note(s: ThreeChannelSettings, columns: Sequence[str] | None) -> str | None:
    """What channel 2 distils from on a dataset run with the default hint source (None: not such a run)."""
    if not s.dataset or s.hint_source != "default" or columns is None or s.sdpo_weight == 0:
        return None
    mapping = dict(s.columns)
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


def channel_reasons(s: ThreeChannelSettings, steps: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why each channel gave nothing in ``steps`` (rows whose grad_norm was 0), with what to change."""
    reasons = []
    clipped = _mean(steps, "clipped_ratio")
    masked = clipped is not None and clipped >= 1.0 and s.mask_truncated_completions
    zero_std = _mean(steps, "frac_reward_zero_std")
    if zero_std is not None and zero_std >= 1.0:
        reasons.append(f"{CHANNELS['pg']}: every group's rewards were identical (frac_reward_zero_std 1.0, "
                       f"mean reward {_mean(steps, 'reward_mean') or 0.0:.3f}): start from a model that solves some "
                       "rows, or use a graded reward")
    if masked:
        reasons.append(f"every completion hit max_completion_length ({s.max_completion_length}) and "
                       "trainer.mask_truncated_completions drops truncated completions from channels 1 and 2: "
                       "raise trainer.max_completion_length or set trainer.mask_truncated_completions = false")
    elif all(r.get("sdpo", 0.0) == 0.0 for r in steps):
        reasons.append(f"{CHANNELS['sdpo']}: no hinted completion to distil (no hint column, trainer.hint_source, "
                       "or trainer.sdpo_weight = 0)")
    if all(r.get("dpo", 0.0) == 0.0 for r in steps):
        reasons.append(f"{CHANNELS['dpo']}: no pairs (trainer.pairs)")
    return reasons



__all__ = ["CHANNELS", "channel_reasons", "hint_note", "launch_refusal"]


def diagnosis_notes(settings: ThreeChannelSettings, diagnosis: Mapping[str, tuple[float, float]]) -> list[str]:
    """What the last committed round's diagnosis says to change, before the gradient is 0 everywhere: most groups
    with equal rewards (GRPO learns from few of them), or most completions cut at the length limit."""
    notes = []
    zero = diagnosis.get("frac_reward_zero_std", (0.0, 0.0))[1]
    if zero >= 0.5:
        notes.append(f"{zero:.0%} of GRPO groups had equal rewards in the last round (channel 1 learns only from the "
                     "others): a graded reward, more num_generations, or a model that solves some rows; "
                     "`composer-cloud logs RUN --samples` shows what it wrote")
    clipped = diagnosis.get("clipped_ratio", (0.0, 0.0))[1]
    if clipped >= 0.5:
        masked = (" (masked out of channels 1 and 2: trainer.mask_truncated_completions)"
                  if settings.mask_truncated_completions else "")
        notes.append(f"{clipped:.0%} of completions hit trainer.max_completion_length in the last round{masked}: "
                     "raise it, or reward shorter answers")
    return notes
