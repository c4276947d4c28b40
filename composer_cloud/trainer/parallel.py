"""Data parallelism inside a multi-GPU replica: one replica batch, split over its local ranks.

Every local rank draws the replica's whole batch (same data order: the same seeded generator), keeps its
contiguous share of the rows (:func:`local_rows`, deterministic) and computes its loss on them; DDP averages
the gradients over the ranks. A token-mean loss is weighted by ``N * tokens_k / tokens`` (:func:`loss_weight`)
so that the average of the ranks' gradients equals the gradient of the mean over the whole batch: the step
is the one-rank step on the same batch (up to float summation order).

``parallelism = "ddp"`` (the default) keeps a full copy of the model on every rank (DDP); ``"fsdp"`` shards
every parameter over the ranks with FSDP2's ``fully_shard`` (:func:`data_parallel`): each rank then holds
its dim-0 chunk of every parameter (a ``DTensor``), FSDP's reduce-scatter averages the gradients as DDP does,
and the inner optimizer's state is sharded the same way. Its checkpoint form is the full (unsharded)
optimizer state, gathered by every rank (a collective) and loaded back by every rank
(:func:`optimizer_state_dict`, :func:`load_optimizer_state_dict`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_cloud.errors import SpecError

if TYPE_CHECKING:
    import torch

    from composer_cloud.spec import RunSpec


#: Trainers that split their batch over local ranks (the others would train every rank on the whole batch).
LOCAL_RANK_TRAINERS = ("causal-lm",)


def check_local_ranks(spec: RunSpec) -> None:
    """Refuse a spec that a multi-GPU replica cannot run yet, naming the setting (nothing to check for N = 1)."""
    n = spec.gpus_per_replica
    if n == 1:
        return
    where = f"gpus_per_replica = {n} (docs/multi-gpu.md)"
    if spec.parallelism == "fsdp" and spec.model.lora is not None:
        raise SpecError("parallelism", f'"fsdp" with [model.lora] is not supported with {where}: use "ddp" (the '
                        "adapters are small; every rank keeps the frozen base)")
    if spec.sync.mode != "lockstep" and spec.parallelism != "ddp":
        raise SpecError("sync.mode", f'"{spec.sync.mode}" with parallelism = "{spec.parallelism}" is not supported '
                        f'with {where}: use parallelism = "ddp" (local rank 0 makes the replica\'s contribution '
                        'from its full copy of the model) or sync.mode = "lockstep"')
    if spec.sync.codec == "sparse" or spec.sync.fragments != 1:
        raise SpecError("sync", f"codec {spec.sync.codec!r} with {spec.sync.fragments} fragments is not supported "
                        f"with {where}: use a dense codec (fp32, bf16, int8) and fragments = 1")
    if spec.trainer.batch_size < n:
        raise SpecError("trainer.batch_size", f"{spec.trainer.batch_size} rows cannot be split over {where}: "
                        f"use at least {n} (each local rank trains on its share of the replica's batch)")
    if spec.trainer.name not in LOCAL_RANK_TRAINERS:
        raise SpecError("trainer.name", f"{spec.trainer.name!r} does not split its batch over local ranks; with "
                        f"{where} use one of {LOCAL_RANK_TRAINERS}")


def local_rows(rows: int, local_rank: int, local_world: int) -> slice:
    """Local rank ``local_rank``'s contiguous share of ``rows`` batch rows (the first ``rows % N`` get one more)."""
    base, extra = divmod(rows, local_world)
    start = local_rank * base + min(local_rank, extra)
    return slice(start, start + base + (1 if local_rank < extra else 0))


def loss_weight(local_tokens: int, total_tokens: int, local_world: int) -> float:
    """What a rank's token-mean loss is multiplied by so that DDP's mean gradient is the full batch's."""
    return local_world * local_tokens / total_tokens


def data_parallel(model: torch.nn.Module, local_world: int, parallelism: str = "ddp") -> torch.nn.Module:
    """``model`` made data-parallel over the default process group (gloo on CPU, NCCL on GPUs); itself if N = 1.

    ``"ddp"``: a DDP wrapper sharing the model's parameters (optimizers, DiLoCo and checkpoints keep using
    ``model``). ``"fsdp"``: FSDP2's ``fully_shard`` of every block the model names unsplittable
    (``_no_split_modules``: its decoder layers), then of the root, in place: the model's parameters become
    ``DTensor`` shards, so build the optimizer afterwards. Returns what the forward pass calls.
    """
    if local_world == 1:
        return model
    if parallelism == "fsdp":
        from torch.distributed.fsdp import fully_shard

        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in list(model.modules())[1:]:
            if type(module).__name__ in blocks:
                fully_shard(module)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [model.device.index] if getattr(model, "device", None) is not None and \
        model.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def is_sharded(model: torch.nn.Module) -> bool:
    """True when FSDP sharded ``model``'s parameters (they are ``DTensor`` shards)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def reshard(model: torch.nn.Module) -> None:
    """Put an FSDP model's parameters back into their sharded form (no-op otherwise).

    Needed after a forward pass without backward (evaluation): FSDP2 keeps the root module's parameters
    gathered after its forward, expecting a backward; the optimizer, DiLoCo and checkpoints hold the shards.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP ``DTensor`` (an all-gather: every local rank must call it); else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()``; for an FSDP model the full, unsharded state keyed by parameter names.

    FSDP: a collective (every local rank calls it at the same point); the full state lands on local rank 0
    (which writes the replica's checkpoint), the other ranks get ``{}``.
    """
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load :func:`optimizer_state_dict` output; FSDP: every local rank loads the full state (a collective)."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


__all__ = ["LOCAL_RANK_TRAINERS", "check_local_ranks", "data_parallel", "full_value", "is_sharded",
           "load_optimizer_state_dict", "local_rows", "loss_weight", "optimizer_state_dict", "reshard"]
