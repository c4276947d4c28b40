"""The global-state tree's keys: how torchft's DiLoCo names a fragment's state, spelled once.

torchft's ``DiLoCo`` registers each fragment's state with its manager under ``StreamingDiLoCoFragment_<i>``
(``torchft/local_sgd.py``), holding ``original_parameters`` (the global parameters) and ``outer_optimizer``
(its state). Every global state composer-cloud stores (lock-step rounds, multi-GPU shards, decoupled versions)
is that tree, so ``export``, heals and adopts read it by these names. Nothing here imports torch.
"""

from __future__ import annotations

#: torchft's prefix of a fragment's state-dict key.
FRAGMENT_PREFIX = "StreamingDiLoCoFragment_"
#: A fragment's global parameters, by parameter name.
ORIGINAL_PARAMETERS = "original_parameters"
#: A fragment's outer optimizer state.
OUTER_OPTIMIZER = "outer_optimizer"


def fragment_key(index: int) -> str:
    """torchft's state-dict key of fragment ``index`` (a multi-GPU replica: of local rank ``index``'s shard)."""
    if index < 0:
        raise ValueError(f"fragment index {index} is negative")
    return f"{FRAGMENT_PREFIX}{index}"


__all__ = ["FRAGMENT_PREFIX", "ORIGINAL_PARAMETERS", "OUTER_OPTIMIZER", "fragment_key"]
