"""The training side of ``launch --dry-run``'s plan: what the replicas will train, resolved as they resolve it.

The trainer's part comes from its plug-in (:meth:`~composer_cloud.trainer.plugin.TrainerPlugin.training_plan`:
loss channels and their inputs, data, rollout mode on the device, generations per prompt, batch sizes); the
rest is the spec's (inner steps per round or the decoupled budget, precision, LoRA, the sync codec). Nothing
here imports a trainer's implementation (``tests/test_packaging.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from composer_cloud.spec import RunSpec
from composer_cloud.trainer.settings import declared_settings


def _per_device(spec: RunSpec, devices: Mapping[str, str]) -> list[tuple[str, str]]:
    """The trainer's rows; where executors compute on different devices and a row differs, each value is
    followed by the executors it applies to (``hf-fast (modal); hf (local)``)."""
    trainer = declared_settings(spec.trainer.name, spec.trainer.settings())
    by_device: dict[str, list[str]] = {}
    for executor, device in devices.items():
        by_device.setdefault(device, []).append(executor)
    if not by_device:
        by_device = {"cpu": []}
    tables = {device: trainer.training_plan(device) for device in by_device}
    first = next(iter(tables.values()))
    rows = []
    for i, (label, value) in enumerate(first):
        values = {device: rows_[i][1] for device, rows_ in tables.items() if i < len(rows_)}
        if len(set(values.values())) > 1:
            value = "; ".join(f"{v} ({', '.join(by_device[d])})" for d, v in values.items())
        rows.append((label, value))
    return rows


def training_plan(spec: RunSpec, devices: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(label, value)`` rows, in order: the trainer, its own rows for the replicas' devices (``devices``:
    executor -> device type, as ``runs/preflight.replica_device`` resolves it), inner steps and the work's
    size, precision, LoRA, the sync."""
    model = spec.model
    if spec.sync.mode == "decoupled":
        work = (f"{spec.inner_steps} per contribution; the fleet's budget: {spec.replicas * spec.rounds} "
                f"contributions ({spec.replicas} replicas x {spec.rounds}), merged as they arrive")
    else:
        work = f"{spec.inner_steps} per round, {spec.rounds} rounds ({spec.inner_steps * spec.rounds} per replica)"
    lora = model.lora
    precision = model.precision + (", gradient checkpointing" if model.gradient_checkpointing else "")
    return [
        ("trainer", spec.trainer.name),
        ("device", ", ".join(f"{d} ({e})" for e, d in devices.items()) or "-"),
        *_per_device(spec, devices),
        ("inner steps", work),
        ("precision", f"{precision}; attention {model.attention}"),
        ("LoRA", "off (every parameter is trained and synced)" if lora is None else
         f"r {lora.r}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, target modules {lora.target_modules}"),
        ("sync", f"{spec.sync.mode}, codec {spec.sync.codec}"),
        *_rollout_workers(spec),
    ]


def _rollout_workers(spec: RunSpec) -> list[tuple[str, str]]:
    """The ``[rollouts]`` row: how many workers, where, and what a trainer does without their batch."""
    r = spec.rollouts
    if not r.workers:
        return []
    where = r.executor or spec.executors[0].backend
    fallback = ("samples it itself" if r.on_deadline == "generate" else "keeps waiting")
    return [("rollout workers", f"{r.workers} on {where} (job ranks {spec.worker_ranks.start}.."
                                f"{spec.worker_ranks.stop - 1}); round t trains on completions sampled from the "
                                f"global model of round t - {r.max_staleness}; a trainer waits {r.deadline_s:g} s "
                                f"for a batch, then {fallback} (docs/rollouts.md)")]


__all__ = ["training_plan"]
