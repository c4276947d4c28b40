"""Whether a run trained at all: the rounds in which no inner step of any replica had a gradient.

:func:`diagnose_rounds` reads the metrics rows a run wrote: a round in which every inner step of every replica
had ``grad_norm == 0`` trained nothing. Why (which loss channel was silent, and what to change) is the
trainer's to say (:meth:`~composer_cloud.trainer.plugin.TrainerPlugin.silence_reasons`); the launch's refusal
of settings that cannot produce a gradient is the trainer's too
(:meth:`~composer_cloud.trainer.plugin.TrainerPlugin.launch_refusal`). ``status`` (of a finished run) and the
launch summary show the messages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from composer_cloud.round_numbers import shown_round
from composer_cloud.storage.records.metrics import Row, StepRow
from composer_cloud.trainer.plugin import TrainerPlugin


def diagnose_rounds(rows: Sequence[Row], trainer: TrainerPlugin | None = None, *,
                    decoupled: bool = False) -> list[str]:
    """One message per stretch of rounds (1-based, as users count them) in which no inner step of any replica
    produced a gradient (``grad_norm`` 0 on every step row), with the ``trainer``'s reasons (it is given the
    silent step rows' JSON). A ``decoupled`` run's rows count each replica's contributions, so the message names
    contributions, never rounds.

    Rows without ``grad_norm`` (a trainer that does not report it) are never flagged; round rows are skipped.
    """
    by_round: dict[int, list[StepRow]] = defaultdict(list)
    for r in rows:
        if isinstance(r, StepRow):
            by_round[r.round].append(r)
    silent = sorted(rnd for rnd, steps in by_round.items()
                    if steps and all(isinstance(s.extra.get("grad_norm"), (int, float)) and s.extra["grad_norm"] == 0.0
                                     for s in steps))
    if not silent:
        return []
    steps = [s.to_json() for rnd in silent for s in by_round[rnd]]
    unit = "contribution" if decoupled else "round"
    which = (f"every {unit}" if len(silent) == len(by_round) else
             f"{unit}{'s' * (len(silent) > 1)} " + ", ".join(str(shown_round(r)) for r in silent))
    reasons = (trainer or TrainerPlugin()).silence_reasons(steps) or ["the trainer reported grad_norm 0 on every step"]
    return [f"no training signal in {which}: grad_norm was 0 on every inner step of every replica: no loss "
            "channel gave the model a gradient. " + "; ".join(reasons)]


__all__ = ["diagnose_rounds"]
