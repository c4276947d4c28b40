"""Data parallelism inside a multi-GPU replica: one replica batch, split over its local ranks.

Every local rank draws the replica's whole batch (same data order: the same seeded generator), keeps its
contiguous share of the rows (:func:`local_rows`, deterministic) and computes its loss on them; DDP averages
the gradients over the ranks. A token-mean loss is weighted by ``N * tokens_k / tokens`` (:func:`loss_weight`)
so that the average of the ranks' gradients equals the gradient of the mean over the whole batch: the step
is the one-rank step on the same batch (up to float summation order).

``parallelism = "fsdp"`` (FSDP2's ``fully_shard``) is refused for now (:func:`check_local_ranks`,
docs/multi-gpu.md): the sharded DiLoCo exchange works on whole parameters of a replicated model.
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
    if spec.parallelism != "ddp":
        raise SpecError("parallelism", f'"{spec.parallelism}" is not supported with {where}: use "ddp" (each local '
                        "rank keeps a full copy of the model and syncs its shard of it)")
    if spec.sync.mode != "lockstep":
        raise SpecError("sync.mode", f'"{spec.sync.mode}" is not supported with {where}: use "lockstep"')
    if spec.sync.codec == "sparse" or spec.sync.fragments != 1:
        raise SpecError("sync", f"codec {spec.sync.codec!r} with {spec.sync.fragments} fragments is not supported "
                        f"with {where}: use a dense codec (fp32, bf16, int8) and fragments = 1")
    if spec.model.lora is not None:
        raise SpecError("model.lora", f"LoRA is not supported with {where} yet")
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


def data_parallel(model: torch.nn.Module, local_world: int) -> torch.nn.Module:
    """``model`` wrapped in DDP over the default process group (gloo on CPU, NCCL on GPUs); itself if N = 1.

    The wrapper shares the model's parameters: optimizers, DiLoCo and checkpoints keep using ``model``.
    """
    if local_world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [model.device.index] if getattr(model, "device", None) is not None and \
        model.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


__all__ = ["LOCAL_RANK_TRAINERS", "check_local_ranks", "data_parallel", "local_rows", "loss_weight"]
