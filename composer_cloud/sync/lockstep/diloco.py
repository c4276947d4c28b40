"""torchft's DiLoCo wired to the object-store manager: the one place that builds the outer loop.

The replica, the tests and the benchmarks all call :func:`build_diloco`, so
the wiring (fragments, outer optimizers, the manager and its global-state
port, the heal hook, the resume point) exists once. torchft's ``DiLoCo`` runs
unchanged; the only torchft internal this module touches is
``DiLoCo._restore_parameters`` (copy the fragments' global backups into the
model), and only here (:func:`_restore_parameters` checks it exists).

Invariants:

* After a commit, or a heal, the model's synced parameters equal the round's
  global parameters, bitwise, on every replica.
* :meth:`OuterLoop.restore` and healing load the same tree the manager
  published (:meth:`ObjectStoreManager.state`), keyed by torchft's own
  state-dict keys (``StreamingDiLoCoFragment_<i>``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from composer_cloud.errors import CorruptCheckpoint
from composer_cloud.hooks import NO_HOOKS, Hooks
from composer_cloud.lora import is_lora_model, synced_parameters
from composer_cloud.storage import layout
from composer_cloud.storage.store import Store
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore
from composer_cloud.sync.checks import norm_floor_rms
from composer_cloud.sync.lockstep.durable import model_attempt_of
from composer_cloud.sync.lockstep.allreduce import AllReduceConfig, ObjectStoreAllReduce
from composer_cloud.sync.lockstep.gather import SparseGatherAllReduce
from composer_cloud.sync.state_tree import ORIGINAL_PARAMETERS, fragment_key
from composer_cloud.sync.lockstep.grouped import sparse_allreduce
from composer_cloud.sync.sparse import settings_of
from composer_cloud.sync.lockstep.manager import ObjectStoreManager, SyncRecord
from composer_cloud.sync.lockstep.sharded import LocalShard, ShardedAllReduce, ShardedManager, share_shards
from composer_cloud.sync.outer import OuterOptimizerConfig, outer_sgd

if TYPE_CHECKING:
    from composer_cloud.spec import RunSpec

logger = logging.getLogger(__name__)


class ParameterGroup(torch.nn.Module):
    """A DiLoCo fragment made of existing parameters (shared, not copied).

    ``source_names`` maps each registered name (dots are not allowed there) to the model's name.
    """

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__()
        self.source_names: dict[str, str] = {}
        for name, p in named:
            self.register_parameter(name.replace(".", "__"), p)
            self.source_names[name.replace(".", "__")] = name


def split_fragments(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    """Split the synced parameters, in model order, into ``n`` contiguous groups of ~equal size.

    The synced parameters are :func:`~composer_cloud.lora.synced_parameters`: every parameter, or a
    LoRA model's adapters alone (its frozen base never changes, so DiLoCo neither syncs nor stores it).
    Deterministic in the model's parameter order, so every replica (and ``export``) derives the same
    fragments from the same model.
    """
    lora = is_lora_model(model)
    if n == 1 and not lora:
        return [model]
    named = list(synced_parameters(model).items())
    if n == 1:
        return [ParameterGroup(named)]
    total = sum(p.numel() for _, p in named)
    groups: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in range(n)]
    seen = 0
    for name, p in named:
        groups[min(n - 1, seen * n // total)].append((name, p))
        seen += p.numel()
    if any(not g for g in groups):
        raise ValueError(f"sync.fragments={n} is more than the model's parameter tensors allow")
    return [ParameterGroup(g) for g in groups]


def load_global_parameters(fragments: Sequence[torch.nn.Module], tree: Mapping[str, Any]) -> None:
    """Copy the global parameters of a stored global state into ``fragments`` (export, inspection)."""
    with torch.no_grad():
        for i, frag in enumerate(fragments):
            params = tree[fragment_key(i)][ORIGINAL_PARAMETERS]
            sources = getattr(frag, "source_names", {})
            for name, p in frag.named_parameters():
                # Lock-step states are keyed by the fragment's names; decoupled ones by the model's.
                p.copy_(params[name] if name in params else params[sources.get(name, name)])


def params_digest(model: torch.nn.Module) -> str:
    """sha256 over the model's parameter names and bytes, in order: equal digests = bitwise-equal parameters.

    FSDP-sharded parameters are gathered whole first (a collective: every local rank calls it).
    """
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        whole = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        h.update(whole.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class LockstepConfig:
    """Everything the lock-step outer loop needs, from the spec (:meth:`from_spec`; no defaults here).

    Attributes:
        sync_every: inner steps per round.
        fragments: DiLoCo fragments (Streaming DiLoCo when > 1), synced in turn.
        fragment_sync_delay: inner steps a fragment's exchange may overlap.
        heal_timeout_s: how long healing may wait for a committed state to become durable.
        takeover_after_s: how long a participant waits for the others' slices of a committed
            state before writing them itself (the quorum timeout: the expected straggler spread).
        sparse: the sparse codec's settings (``sync.codec = "sparse"``), else None.
        sparse_exchange, sparse_group_size: ``sync.sparse.exchange`` / ``group_size`` (``grouped.py``).
    """

    allreduce: AllReduceConfig
    outer: OuterOptimizerConfig
    sync_every: int
    fragments: int
    fragment_sync_delay: int
    heal_timeout_s: float
    takeover_after_s: float
    sparse: Any = None  # composer_cloud.sync.sparse.SparseSettings | None
    sparse_exchange: str = "auto"
    sparse_group_size: int | None = None

    @classmethod
    def from_spec(cls, spec: RunSpec) -> "LockstepConfig":
        return cls(allreduce=AllReduceConfig.from_spec(spec), outer=OuterOptimizerConfig.from_spec(spec),
                   sync_every=spec.inner_steps, fragments=spec.sync.fragments,
                   fragment_sync_delay=spec.sync.fragment_sync_delay, heal_timeout_s=spec.sync.heal_timeout_s,
                   takeover_after_s=spec.sync.quorum_timeout_s,
                   sparse=settings_of(spec), sparse_exchange=spec.sync.sparse.exchange,
                   sparse_group_size=spec.sync.sparse.group_size)


def _restore_parameters(diloco: Any) -> None:
    """Copy the fragments' global backups into the model: torchft's private ``DiLoCo._restore_parameters``."""
    restore = getattr(diloco, "_restore_parameters", None)
    if restore is None:
        raise RuntimeError("torchft's DiLoCo has no _restore_parameters (torchft changed?); composer-cloud needs "
                           "torchft 0.2.x")
    restore()


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
    #: A multi-GPU replica's shards, in order (``fragments`` is this rank's one); empty for a one-rank replica.
    shards: list[torch.nn.Module] = field(default_factory=list)

    def __enter__(self) -> "OuterLoop":
        self.diloco.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.diloco.__exit__(*exc)

    def codec_state(self) -> dict[str, torch.Tensor]:
        """The wire codec's training state (the sparse codec's error feedback; ``{}`` for the dense codecs)."""
        exchange = self.manager.exchange
        return exchange.codec_state() if isinstance(exchange, SparseGatherAllReduce) else {}

    def load_codec_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`codec_state` output from this replica's checkpoint (bitwise)."""
        exchange = self.manager.exchange
        if isinstance(exchange, SparseGatherAllReduce):
            exchange.load_codec_state(dict(state))
        elif state:
            raise CorruptCheckpoint("codec", f"codec state {sorted(state)} for a run whose codec keeps none")

    def restore(self, tree: Mapping[str, Any]) -> None:
        """Load a stored global state (fragment backups + outer optimizer state) and copy it into the model."""
        self.manager.load_state(dict(tree))
        _restore_parameters(self.diloco)
        if isinstance(self.manager, ShardedManager):  # every shard's global parameters, on every local rank
            load_global_parameters(self.shards, tree)
            self.manager.adopt(dict(tree))

    def share_shards(self) -> None:
        """After a sync of a multi-GPU replica (a collective): every local rank gets every shard's global state."""
        if isinstance(self.manager, ShardedManager):
            share_shards(self.manager, self.shards)

    def verify_durable(self, round: int) -> None:
        """Read round ``round``'s stored global state back and check it equals this replica's, bitwise.

        Raises :class:`~composer_cloud.errors.CorruptCheckpoint` naming the round otherwise. Run at the
        end of a run: "completed" must mean the final state is durable and right.
        """
        from composer_cloud.storage.tensors import flatten

        where = layout.checkpoint_prefix(round)
        # The run's one answer to "which attempt is round r's model" (durable.py): records damaged after the
        # commit (issue 33: unsigned quorum/outcome planted over the final round's) do not take it away.
        attempt = model_attempt_of(self.manager.store)(round)
        if attempt is None:
            raise CorruptCheckpoint(where, "the round has no valid commit and no verified manifest")
        stored, _ = flatten(self.manager.global_state.load(round, attempt))
        live, _ = flatten(self.manager.state())
        if stored.keys() != live.keys():
            raise CorruptCheckpoint(where, "the stored global state has other tensors than the model's")
        for key, tensor in live.items():
            mine = tensor.detach().cpu().contiguous().reshape(-1)
            theirs = stored[key].contiguous().reshape(-1)
            if theirs.dtype != mine.dtype or not torch.equal(theirs.view(torch.uint8), mine.view(torch.uint8)):
                raise CorruptCheckpoint(where, f"the stored global state differs from the replica's at {key}")

    def close(self) -> None:
        """Finish pending uploads and stop the manager's threads."""
        self.manager.close()


def build_diloco(
    *,
    store: Store,
    rank: int,
    model: torch.nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    config: LockstepConfig,
    hooks: Hooks = NO_HOOKS,
    fragments: Sequence[torch.nn.Module] | None = None,
    use_bucketization: bool = False,
    start_round: int = 0,
    on_sync: Callable[[SyncRecord], None] | None = None,
    shard: LocalShard | None = None,
) -> OuterLoop:
    """Build torchft's DiLoCo over an :class:`ObjectStoreManager` for replica ``rank``.

    Args:
        config: the run's lock-step settings (:meth:`LockstepConfig.from_spec`).
        hooks: fault points for crash tests (the all-reduce and the global-state upload).
        fragments: the fragment modules, when not ``config.fragments`` groups of
            :func:`split_fragments` (tests with hand-made groups).
        use_bucketization: torchft's option: one ``allreduce`` per bucket instead of per parameter.
        start_round: the first round this replica syncs (checkpoint round + 1 on resume).
        on_sync: called with every :class:`SyncRecord` (see the manager).
        shard: this process's place in a multi-GPU replica: DiLoCo then runs over shard ``shard.index`` of
            ``shard.count`` (:mod:`~composer_cloud.sync.lockstep.sharded`); None: a one-rank replica.
    """
    from torchft.local_sgd import DiLoCo

    frags = split_fragments(model, config.fragments) if fragments is None else list(fragments)
    shards: list[torch.nn.Module] = []
    if shard is not None:
        if config.sparse is not None or config.fragments != 1:
            raise ValueError("gpus_per_replica > 1 runs with the dense codecs and sync.fragments = 1")
        if shard.fsdp:  # FSDP sharded every parameter: this rank's shard is its local chunk of all of them
            if is_lora_model(model):
                raise ValueError('parallelism = "fsdp" runs without [model.lora]')
            frags = [model]
        else:
            shards = split_fragments(model, shard.count)
            frags = [shards[shard.index]]
    outers = [outer_sgd(f.parameters(), config.outer) for f in frags]
    if not config.allreduce.norm_floor_rms:  # the outlier rule's no-gradient floor, from the weights as built
        config = dataclasses.replace(config, allreduce=dataclasses.replace(
            config.allreduce, norm_floor_rms=norm_floor_rms(p for f in frags for p in f.parameters())))
    if shard is not None:
        ar: ObjectStoreAllReduce = ShardedAllReduce(store, rank, config.allreduce, shard=shard, hooks=hooks)
    elif config.sparse is not None:
        ar = sparse_allreduce(store, rank, config.allreduce, settings=config.sparse,
                              exchange=config.sparse_exchange, group_size=config.sparse_group_size,
                              fragments=len(frags), hooks=hooks)
    else:
        ar = ObjectStoreAllReduce(store, rank, config.allreduce, hooks=hooks)
    loop: OuterLoop | None = None

    def on_heal(round: int) -> None:
        # The manager already loaded the registered state; copy it into the model.
        assert loop is not None
        _restore_parameters(loop.diloco)

    manager = (ObjectStoreManager if shard is None else ShardedManager)(
        ar, GlobalStateStore(store, hooks=hooks), heal_timeout_s=config.heal_timeout_s, start_step=start_round,
        on_heal=on_heal, on_sync=on_sync, takeover_after_s=config.takeover_after_s,
        # A committed round nobody can finish is voided after the round deadline (within the heal budget).
        void_after_s=min(config.allreduce.round_timeout_s, 0.5 * config.heal_timeout_s))
    if isinstance(manager, ShardedManager):
        manager.params = list(frags[0].parameters())
    diloco = DiLoCo(manager, frags, inner_optimizer, outers, sync_every=config.sync_every,
                    fragment_sync_delay=config.fragment_sync_delay, use_bucketization=use_bucketization,
                    pin_memory=False)
    loop = OuterLoop(diloco=diloco, manager=manager, fragments=frags, outer_optimizers=outers, shards=shards)
    return loop
