"""torchft's DiLoCo wired to the object-store manager: the one place that builds the outer loop.

The replica, the tests and the benchmarks all call :func:`build_diloco`, so
the wiring (fragments, outer optimizers, the manager, the heal hook, the
resume point) exists once. torchft's ``DiLoCo`` runs unchanged; the only
torchft internal this module touches is ``DiLoCo._restore_parameters`` (copy
the fragments' global backups into the model), and only here.

Invariants:

* After a commit, or a heal, the model's synced parameters equal the round's
  global parameters, bitwise, on every replica.
* :meth:`OuterLoop.restore` and healing load the same tree that
  :func:`composer_cloud.sync.checkpoint.global_state.write_global_state` wrote, keyed by
  torchft's own state-dict keys (``StreamingDiLoCoFragment_<i>``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from composer_cloud.sync.lockstep.allreduce import AllReduceConfig, ObjectStoreAllReduce
from composer_cloud.sync.lockstep.manager import ObjectStoreManager, SyncRecord
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)


class ParameterGroup(torch.nn.Module):
    """A DiLoCo fragment made of existing parameters (shared, not copied)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"), p)


def split_fragments(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    """Split parameters, in model order, into ``n`` contiguous groups of ~equal size.

    Deterministic in the model's parameter order, so every replica (and
    ``export``) derives the same fragments from the same model.
    """
    if n == 1:
        return [model]
    named = list(model.named_parameters())
    total = sum(p.numel() for _, p in named)
    groups: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in range(n)]
    seen = 0
    for name, p in named:
        groups[min(n - 1, seen * n // total)].append((name, p))
        seen += p.numel()
    if any(not g for g in groups):
        raise ValueError(f"sync.fragments={n} is more than the model's parameter tensors allow")
    return [ParameterGroup(g) for g in groups]


def fragment_key(index: int) -> str:
    """torchft's state-dict key of fragment ``index`` (what the global state is keyed by)."""
    return f"StreamingDiLoCoFragment_{index}"


def load_global_parameters(fragments: Sequence[torch.nn.Module], tree: Mapping[str, Any]) -> None:
    """Copy the global parameters of a stored global state into ``fragments`` (export, inspection)."""
    with torch.no_grad():
        for i, frag in enumerate(fragments):
            params = tree[fragment_key(i)]["original_parameters"]
            for name, p in frag.named_parameters():
                p.copy_(params[name])


def params_digest(model: torch.nn.Module) -> str:
    """sha256 over the model's parameter names and bytes, in order: equal digests = bitwise-equal parameters."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class OuterOptimizerConfig:
    """Nesterov SGD on the averaged pseudo-gradient (DiLoCo's outer step)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass
class OuterLoop:
    """A built DiLoCo outer loop. Use as a context manager around the inner steps.

    Attributes:
        diloco: torchft's ``DiLoCo`` (hooks the inner optimizer).
        manager: the object-store manager (``current_step()`` is the next round).
        fragments: the model's parameter groups, one per DiLoCo fragment.
        outer_optimizers: one per fragment.
    """

    diloco: Any
    manager: ObjectStoreManager
    fragments: list[torch.nn.Module]
    outer_optimizers: list[torch.optim.Optimizer]

    def __enter__(self) -> "OuterLoop":
        self.diloco.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.diloco.__exit__(*exc)

    def restore(self, tree: Mapping[str, Any]) -> None:
        """Load a stored global state (fragment backups + outer optimizer state) and copy it into the model."""
        self.manager.load_state(dict(tree))
        self.diloco._restore_parameters()

    def verify_durable(self, round: int) -> None:
        """Read round ``round``'s stored global state back and check it equals this replica's, bitwise.

        Raises :class:`~composer_cloud.sync.checkpoint.global_state.CorruptCheckpoint` naming the round otherwise. Run at
        the end of a run: "completed" must mean the final state is durable and right.
        """
        from composer_cloud.sync.checkpoint import global_state as checkpoint
        from composer_cloud.storage.tensors import flatten

        stored, _ = flatten(checkpoint.load_global(self.manager.store, round))
        live, _ = flatten(self.manager.state())
        if stored.keys() != live.keys():
            raise checkpoint.CorruptCheckpoint(f"stored global state of round {round} has other tensors than the "
                                               "model's")
        for key, tensor in live.items():
            mine = tensor.detach().cpu().contiguous().reshape(-1)
            theirs = stored[key].contiguous().reshape(-1)
            if theirs.dtype != mine.dtype or not torch.equal(theirs.view(torch.uint8), mine.view(torch.uint8)):
                raise checkpoint.CorruptCheckpoint(f"stored global state of round {round} differs from the "
                                                   f"replica's at {key}")

    def close(self) -> None:
        """Finish pending uploads and stop the manager's threads."""
        self.manager.close()


def build_diloco(
    *,
    store: Store,
    rank: int,
    model: torch.nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    sync_every: int,
    allreduce: AllReduceConfig,
    outer: OuterOptimizerConfig = OuterOptimizerConfig(),
    fragments: int | Sequence[torch.nn.Module] = 1,
    fragment_sync_delay: int = 0,
    use_bucketization: bool = False,
    heal_timeout_s: float = 600.0,
    takeover_after_s: float | None = None,
    start_round: int = 0,
    on_sync: Callable[[SyncRecord], None] | None = None,
) -> OuterLoop:
    """Build torchft's DiLoCo over an :class:`ObjectStoreManager` for replica ``rank``.

    Args:
        fragments: a fragment count (parameters split by :func:`split_fragments`)
            or the fragment modules themselves.
        takeover_after_s: how long to wait for other participants' slices of a
            committed global state before writing them (default: the quorum timeout,
            the expected straggler spread).
        start_round: the first round this replica syncs (checkpoint round + 1 on resume).
        on_sync: called with every :class:`SyncRecord` (see the manager).
    """
    from torchft.local_sgd import DiLoCo

    frags = split_fragments(model, fragments) if isinstance(fragments, int) else list(fragments)
    outers = [torch.optim.SGD(f.parameters(), lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
              for f in frags]
    ar = ObjectStoreAllReduce(store, rank, allreduce)
    loop: OuterLoop | None = None

    def on_heal(round: int) -> None:
        # The manager already loaded the registered state; copy it into the model.
        assert loop is not None
        loop.diloco._restore_parameters()

    manager = ObjectStoreManager(
        ar, heal_timeout_s=heal_timeout_s, start_step=start_round, on_heal=on_heal, on_sync=on_sync,
        takeover_after_s=allreduce.quorum_timeout_s if takeover_after_s is None else takeover_after_s,
        # A committed round nobody can finish is voided after the round deadline (within the heal budget).
        void_after_s=min(allreduce.round_timeout_s, 0.5 * heal_timeout_s))
    diloco = DiLoCo(manager, frags, inner_optimizer, outers, sync_every=sync_every,
                    fragment_sync_delay=fragment_sync_delay, use_bucketization=use_bucketization, pin_memory=False)
    loop = OuterLoop(diloco=diloco, manager=manager, fragments=frags, outer_optimizers=outers)
    return loop
