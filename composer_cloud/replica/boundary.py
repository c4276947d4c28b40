"""What the inner loop and the sync modes' boundary strategies share.

:class:`Boundary` is the sync mode's part of the loop
(:class:`~composer_cloud.replica.lockstep.LockstepBoundary`,
:class:`~composer_cloud.replica.decoupled.DecoupledBoundary`); it gets a
:class:`ReplicaContext`, never the replica object itself.

**Parameters replaced outside the optimizer.** After an outer step, a heal, a
resume or an adopt, the model's parameters changed without the trainer's
optimizer stepping. A trainer that keeps a copy of them elsewhere (an
inference engine's weights) defines ``on_params_replaced()``; the boundaries
call it (:func:`params_replaced`) each time, before the next inner step.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from composer_cloud.hooks import Hooks
from composer_cloud.lora import synced_parameters
from composer_cloud.replica.telemetry import Telemetry
from composer_cloud.storage.records.metrics import RoundRow
from composer_cloud.storage.run import Run
from composer_cloud.sync.lockstep.sharded import LocalShard


def params_replaced(trainer: Any) -> None:
    """Tell ``trainer`` its model's parameters were replaced outside its optimizer (if it wants to know)."""
    hook = getattr(trainer, "on_params_replaced", None)
    if hook is not None:
        hook()


@dataclass
class Segment:
    """What one round's inner steps add up to (decoupled: the steps behind one contribution)."""

    started: float = field(default_factory=time.monotonic)
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    compute_s: float = 0.0
    tokens: int = 0

    def add(self, out: dict[str, Any], *, compute_s: float, tokens: int) -> None:
        self.steps += 1
        self.losses.append(out.get("loss", float("nan")))
        if "reward_mean" in out:
            self.rewards.append(out["reward_mean"])
        self.compute_s += compute_s
        self.tokens += tokens

    def fill(self, row: RoundRow) -> RoundRow:
        """Set the columns every round row has from this segment: mean train loss (and reward), compute and wall
        seconds (wall: from the segment's start until now, so call it once the boundary passed)."""
        row.train_loss = sum(self.losses) / len(self.losses)
        row.compute_s = self.compute_s
        row.wall_s = time.monotonic() - self.started
        if self.rewards:
            row.reward_mean = sum(self.rewards) / len(self.rewards)
        return row


@dataclass
class ReplicaContext:
    """What a boundary strategy works with: the run, this replica, its model and trainer, its reports."""

    run: Run
    rank: int
    model: torch.nn.Module
    trainer: Any
    device: torch.device
    hooks: Hooks
    telemetry: Telemetry
    #: This process's place in a multi-GPU replica (``spec.gpus_per_replica > 1``), else None.
    shard: LocalShard | None = None

    @property
    def leader(self) -> bool:
        """Whether this process writes what belongs to the replica (always, but local ranks ``k > 0``)."""
        return self.shard is None or self.shard.index == 0

    @property
    def spec(self) -> Any:
        return self.run.spec


class Boundary(Protocol):
    """The sync mode's part of the loop. ``position`` is the round the next step belongs to (decoupled:
    the contributions published so far)."""

    position: int

    def start(self) -> dict[str, Any]:
        """Resume or initialise before the first step; returns the first heartbeat's fields."""
        ...

    def session(self) -> AbstractContextManager[Any]:
        """Held around the inner steps (lock-step: torchft's DiLoCo hooks on the inner optimizer)."""
        ...

    def running(self, segment: Segment) -> bool:
        """Whether to take another inner step (``segment``: the round so far)."""
        ...

    def sync_s(self) -> float:
        """Seconds of the last step that were syncing, not computing."""
        ...

    def after_step(self, segment: Segment) -> RoundRow | None:
        """After every step: the round's row (its sync columns, from ``telemetry.round_row``; the loop fills the
        segment's) when a boundary passed."""
        ...

    def heartbeat_fields(self, steps: int) -> dict[str, Any]:
        """The position fields of a heartbeat after a boundary (``steps``: this process's steps so far)."""
        ...

    def finish(self, steps: int) -> dict[str, Any]:
        """Make the end durable and verified; returns the final heartbeat's fields."""
        ...


def snapshot(tree: Any) -> Any:
    """Deep copy of a state tree's tensors (to CPU), so later training cannot change it."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: snapshot(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [snapshot(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(snapshot(v) for v in tree)
    return tree


def cpu_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A float32 CPU copy of the model's synced parameters, by name (a LoRA model's adapters alone)."""
    return {n: p.detach().to("cpu", dtype=torch.float32, copy=True) for n, p in synced_parameters(model).items()}


def copy_into(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy ``params`` (by name; a subset of the model's, e.g. the synced ones) into the model."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in params.items():
            named[name].copy_(value)


__all__ = ["Boundary", "ReplicaContext", "Segment", "copy_into", "cpu_params", "params_replaced", "snapshot"]
