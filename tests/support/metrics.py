"""Metrics rows for tests: the typed rows a replica's writer (``replica/telemetry.py``) puts in the store."""

from __future__ import annotations

import time
from typing import Any

from composer_cloud.replica.telemetry import MetricsLog
from composer_cloud.storage.records.metrics import RoundRow, StepRow


def log_step(log: MetricsLog, round: int, step: int, **figures: Any) -> None:
    """One step row of ``log``'s replica and launch: ``figures`` are the trainer's (``loss``, ``grad_norm``...)."""
    log.step(StepRow(rank=log.rank, launch=log.launch, time=time.time(), round=round, step=step, extra=figures))


def log_round(log: MetricsLog, round: int, **columns: Any) -> str:
    """The round row (typed ``columns``: ``committed``, ``train_loss``...) and the object it ends; its key."""
    return log.round(RoundRow(rank=log.rank, launch=log.launch, time=time.time(), round=round, **columns))
