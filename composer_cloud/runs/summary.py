"""A finished (or running) run in a few numbers: what ``launch`` prints at the end and ``--json`` returns.

Every "first → last" pair compares like with like: the mean over replicas of the
first committed round against the mean over replicas of the last one. Rounds
are counted from 1 here, as everywhere users read them (``docs/metrics.md``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from composer_cloud.runs import metrics as _metrics
from composer_cloud.runs.signal import diagnose_rounds
from composer_cloud.runs.status import ReplicaInfo, RunStatus
from composer_cloud.storage.records.metrics import RoundRow, StepRow
from composer_cloud.storage.run import Run
from composer_cloud.trainer.data import dataset_columns, is_local_dataset
from composer_cloud.trainer.settings import declared_settings


#: A replica error that is its settings' fault (the replica refused its config), by the exception's name.
_CONFIG_ERROR = re.compile(r"^(ValueError|SpecError|ConfigError|StoreConfigError|RunKeyError|RunNotFound|"
                           r"UserCodeError|DatasetError)\b")


def replica_outcome(info: ReplicaInfo) -> str:
    """How a replica ended, for people: ``failed at start (config)`` (it refused its settings before its first
    step), ``failed at start`` (it died before its first step), ``lost`` (it died while training),
    ``cancelled``, or its state (``succeeded``, ``running``...)."""
    if info.state == "failed":
        if info.step is None:
            return "failed at start (config)" if _CONFIG_ERROR.match(reason(info)) else "failed at start"
        return "lost"
    return info.state


def reason(info: ReplicaInfo) -> str:
    """Why a replica ended, in one line, whole: the exception it reported (the last ``...Error: ...`` line of its
    message), else the executor's own first line (``replica exited with code -9 after 0 restart(s)``), else
    its exit (``exit killed (SIGKILL)``); ``""`` when nothing is known."""
    from composer_cloud.runs.status import exit_reason

    lines = [line.strip() for line in (info.message or "").splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", line)]
    if named:
        return named[-1]
    if lines and not re.match(r"^\d{4}-\d\d-\d\dT", lines[0]):  # not a log line of the tail
        return lines[0]
    if info.exit_code not in (None, 0):
        return f"exit {exit_reason(info.exit_code, info.state)}"
    return ""


@dataclass
class ChannelMean:
    """One loss channel's mean over a round's steps and replicas, in the first and last committed round."""

    key: str
    name: str
    first: float
    last: float


@dataclass
class RunSummary:
    rounds_committed: int
    loss_first: float | None
    loss_last: float | None
    eval_loss_first: float | None
    eval_loss_last: float | None
    compute_s: float
    sync_s: float
    bytes_moved: int
    #: replicas that died while training (not those that failed at start, nor cancelled ones)
    lost_replicas: list[int]
    reward_first: float | None = None
    reward_last: float | None = None
    eval_reward_first: float | None = None  # held-out greedy reward (three-channel), first/last evaluation
    eval_reward_last: float | None = None
    #: what ``loss_first``/``loss_last`` measure
    loss_name: str = ""
    #: the three-channel loss's channels (empty for other trainers)
    channels: list[ChannelMean] = field(default_factory=list)
    #: things a user must know: no training signal (which channel, why, what to change), channel 2's hint
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: bytes DiLoCo syncs vs a full fine-tune's (LoRA: the adapters' share); None when not reported
    synced_fraction: float | None = None
    #: replicas that failed before their first step (``failed_at_start_config``: because of their settings)
    failed_at_start: list[int] = field(default_factory=list)
    failed_at_start_config: list[int] = field(default_factory=list)
    cancelled_replicas: list[int] = field(default_factory=list)
    #: rank -> why it ended (the error's line, whole), for every replica that did not succeed
    reasons: dict[int, str] = field(default_factory=dict)
    #: :data:`DIAGNOSIS` field -> (first, last committed round's mean over its steps and replicas), where reported
    diagnosis: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: each :attr:`diagnosis` field's name for users (the trainer's ``DIAGNOSIS``).
    diagnosis_names: dict[str, str] = field(default_factory=dict)

    @property
    def synced_note(self) -> str:
        """`` (LoRA: 0.95% of full)`` where the run syncs a share of a full fine-tune's bytes, else ``""``."""
        if self.synced_fraction is None or self.synced_fraction >= 1.0:
            return ""
        return f" (LoRA: {100 * self.synced_fraction:.2f}% of full)"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _round_mean(rows: list[RoundRow], key: str, *, first: bool) -> float | None:
    """Mean of column ``key`` over replicas in the first (or last) committed round that reports it."""
    with_key = [m for m in rows if m.committed and _finite(m.get(key))]
    if not with_key:
        return None
    r = min(m.round for m in with_key) if first else max(m.round for m in with_key)
    vals = [m.get(key) for m in with_key if m.round == r]
    return sum(vals) / len(vals)


def _step_mean(steps: list[StepRow], committed: set[int], key: str, *, first: bool) -> float | None:
    """Mean of the trainer's figure ``key`` over every step row of every replica in the first (or last)
    committed round."""
    rounds = sorted(r for r in committed if any(s.round == r and key in s.extra for s in steps))
    if not rounds:
        return None
    vals = [float(s.extra[key]) for s in steps if s.round == rounds[0 if first else -1] and key in s.extra]
    return sum(vals) / len(vals)


def _dataset_columns(settings: dict[str, Any]) -> list[str] | None:
    """The columns of a run's dataset when this process can read them quickly (a local file), else None."""
    name = settings.get("dataset")
    if not name or not is_local_dataset(str(name)):
        return None
    try:
        return dataset_columns(str(name), settings.get("dataset_split", "train"), data_files=settings.get("data_files"))
    except Exception:  # noqa: BLE001 - a moved file: the note is left out, nothing else depends on it
        return None


def summarize(run: Run, status: RunStatus) -> RunSummary:
    """Loss (named, and per channel), reward, time and traffic of a run, from its replicas' metrics; and
    whether it trained at all (:func:`composer_cloud.runs.signal.diagnose_rounds`)."""
    spec = run.spec
    rows = _metrics.read_rows(run.store)  # sorted by (round, rank)
    rounds = [m for m in rows if isinstance(m, RoundRow)]
    steps = [m for m in rows if isinstance(m, StepRow)]
    committed = {m.round for m in rounds if m.committed}
    evals = [m.get("eval_loss") for m in rounds if "eval_loss" in m.extra]
    eval_rewards = [m.get("eval_reward_mean") for m in rounds if "eval_reward_mean" in m.extra]
    settings = spec.trainer.settings()
    trainer = declared_settings(spec.trainer.name, settings)
    channels = []
    for key, name in trainer.LOSS_CHANNELS.items():
        first = _step_mean(steps, committed, key, first=True)
        last = _step_mean(steps, committed, key, first=False)
        if first is not None and last is not None:
            channels.append(ChannelMean(key, name, first, last))
    diagnosis = {k: (first, last) for k in trainer.DIAGNOSIS
                 if (first := _step_mean(steps, committed, k, first=True)) is not None
                 and (last := _step_mean(steps, committed, k, first=False)) is not None}
    notes = trainer.diagnosis_notes(diagnosis) + trainer.launch_notes(_dataset_columns(settings))
    return RunSummary(
        rounds_committed=status.rounds_committed,
        loss_first=_round_mean(rounds, "train_loss", first=True),
        loss_last=_round_mean(rounds, "train_loss", first=False),
        eval_loss_first=evals[0] if evals else None,
        eval_loss_last=evals[-1] if evals else None,
        compute_s=sum(m.compute_s for m in rounds if m.compute_s is not None),
        sync_s=sum(m.sync_s for m in rounds if m.sync_s is not None),
        bytes_moved=sum(m.bytes_moved for m in rounds),
        lost_replicas=[i.rank for i in status.replicas if replica_outcome(i) == "lost"],
        failed_at_start=[i.rank for i in status.replicas if replica_outcome(i).startswith("failed at start")],
        failed_at_start_config=[i.rank for i in status.replicas if replica_outcome(i) == "failed at start (config)"],
        cancelled_replicas=[i.rank for i in status.replicas if i.state == "cancelled"],
        reasons={i.rank: reason(i) for i in status.replicas if i.state in ("failed", "cancelled") and reason(i)},
        reward_first=_round_mean(rounds, "reward_mean", first=True),
        reward_last=_round_mean(rounds, "reward_mean", first=False),
        eval_reward_first=eval_rewards[0] if eval_rewards else None,
        eval_reward_last=eval_rewards[-1] if eval_rewards else None,
        loss_name=trainer.LOSS_NAME or f"{spec.trainer.name} loss",
        channels=channels,
        warnings=diagnose_rounds(steps, trainer, decoupled=spec.sync.mode == "decoupled"),
        notes=notes,
        synced_fraction=next((m.synced_fraction for m in rounds if m.synced_fraction is not None), None),
        diagnosis=diagnosis,
        diagnosis_names={k: trainer.DIAGNOSIS[k] for k in diagnosis},
    )


__all__ = ["ChannelMean", "RunSummary", "reason", "replica_outcome", "summarize"]
