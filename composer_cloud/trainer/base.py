"""The interface between the replica runtime and whatever trains the model.

The runtime owns the DiLoCo outer loop (torchft's ``DiLoCo`` hooks the inner
optimizer); a trainer owns one replica's inner loop. One call to
:meth:`InnerTrainer.step` is exactly one inner optimizer step, so the runtime
can count H inner steps between syncs, checkpoint at round boundaries and
resume bit-exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing the trainer registry (the launcher does) must not load torch
    import torch


@dataclass
class TrainerContext:
    """Everything a trainer factory needs to build one replica's trainer.

    Attributes:
        model: the replica's model (already on ``device``); DiLoCo wraps it.
        tokenizer: a ``PreTrainedTokenizerFast`` matching the model.
        rank: this replica's rank in ``[0, world_size)``; selects its data shard.
        world_size: number of replicas launched.
        seed: run seed; trainers derive per-rank seeds from it.
        device: torch device the model lives on.
        settings: the ``[trainer]`` table of the run spec (trainer-specific keys).
        inner_optimizer: keyword arguments for AdamW (``lr``, ``weight_decay``, ``betas``).
        local_rank: this process's rank inside a multi-GPU replica (``spec.gpus_per_replica``).
        local_world: the replica's local ranks; > 1: the trainer splits each batch over them and averages
            the gradients (:mod:`composer_cloud.trainer.parallel`), so a step equals the one-rank step.
        parallelism: ``spec.parallelism`` (``"ddp"`` or ``"fsdp"``), how the local ranks hold the model.
    """

    model: torch.nn.Module
    tokenizer: Any
    rank: int
    world_size: int
    seed: int
    device: torch.device
    settings: dict[str, Any] = field(default_factory=dict)
    inner_optimizer: dict[str, Any] = field(default_factory=dict)
    local_rank: int = 0
    local_world: int = 1
    parallelism: str = "ddp"


@runtime_checkable
class InnerTrainer(Protocol):
    """One replica's inner loop.

    Invariants the runtime relies on:
      * ``optimizer`` is the optimizer whose ``step()`` is called once per
        :meth:`step`; torchft's DiLoCo registers its hooks on it.
      * Given the same model parameters and the same :meth:`state_dict`, a call
        to :meth:`step` is deterministic on CPU (data order and sampling come
        from the trainer's own seeded generators, which the state includes).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def step(self) -> dict[str, float]:
        """Run one inner optimizer step; return scalar metrics (at least ``loss``)."""
        ...

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics on the current parameters (no parameter change)."""
        ...

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Inner state for checkpoints: (tensors, JSON-serialisable metadata).

        Covers the inner optimizer state, the data position and every RNG the
        trainer draws from, so that ``load_state_dict`` resumes bit-exactly.
        """
        ...

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...
