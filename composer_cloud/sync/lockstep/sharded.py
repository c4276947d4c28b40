"""Multi-GPU replicas: local rank ``k`` exchanges shard ``k`` only; the round stays one decision per replica.

A replica has ``N = spec.gpus_per_replica`` local ranks. Shard ``k`` is what local rank ``k`` syncs:

* ``parallelism = "ddp"``: every rank keeps a full copy of the model; the synced parameters are cut into
  ``N`` contiguous shards (:func:`~composer_cloud.sync.lockstep.diloco.split_fragments`: by numel, in model
  order, the same on every replica and in ``export``).
* ``parallelism = "fsdp"``: FSDP2 already sharded every parameter; shard ``k`` is rank ``k``'s local chunk
  (dim 0, ``torch.chunk`` order) of every parameter, which torchft's DiLoCo reads with ``to_local()``, as
  it does for any ``DTensor`` (:func:`load_fsdp_shards` reassembles the full parameters for ``export``).

Local rank ``k`` runs torchft's DiLoCo over shard ``k`` alone and exchanges that shard's pseudo-gradient
through the store (``rounds/<r>/<a>/shard/<k>/...``) with rank ``k`` of the other replicas: per-rank traffic
is ~P/N.

Invariants (one decision per replica, DESIGN.md 14):

* **One quorum.** Only local rank 0 joins a round; ranks ``k > 0`` read the participant set from the same
  write-once quorum record, so every shard of every replica reduces over the same participants.
* **One outcome, created after a local vote.** A rank that gathered and verified its shard votes yes, a rank
  whose attempt failed creates the abort record first and then votes no (a gloo/NCCL all-reduce over the
  replica's ranks, :meth:`ShardedAllReduce._agree`); the commit record is created only when every shard voted
  yes. The outcome is write-once and shared by all shards, so no replica commits with some shards and not
  others; a shard whose check failed after a peer replica committed heals from the committed global state, as
  a single-rank replica does.
* **A dead local rank decides nothing.** It never votes; its peers' vote fails (:class:`LocalRankLost`) and
  they stop without creating an outcome (an abort here was a "missing replica" abort, which ends the sync
  and re-runs the round from fresh inner steps: not bitwise, issue 37). The elastic agent stops the job, the
  executor restarts the replica, and it rejoins the undecided attempt with the pseudo-gradient it recomputes
  from its last durable round (the same bytes): the one abort rule's "retry with the payload you sent". If
  the payload was already complete the other replicas may commit without waiting and the restart heals to
  it; if the replica never returns they abort the attempt for it at ``round_timeout_s``.
* **One global state.** After every sync each rank broadcasts its shard's DiLoCo state (global parameters and
  outer optimizer state) to the replica's other ranks (:func:`share_shards`): every rank then holds the full
  global parameters, and local rank 0 publishes the union, keyed ``StreamingDiLoCoFragment_<k>``: a single-rank
  run with ``N`` fragments has the same checkpoint layout, so resume, heal and ``export`` read it unchanged.
  FSDP: the ranks send their shard's state to local rank 0 alone (the others never hold the whole model);
  the stored state is plain local tensors, turned back into ``DTensor`` shards when loaded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from composer_cloud.errors import BadObject, CorruptCheckpoint, SyncError
from composer_cloud.hooks import NO_HOOKS, Hooks
from composer_cloud.retry import poll_until
from composer_cloud.round_numbers import shown_round
from composer_cloud.storage import layout
from composer_cloud.storage.store import Store
from composer_cloud.storage.tensors import decode_state, encode_state
from composer_cloud.sync.lockstep.allreduce import ObjectStoreAllReduce
from composer_cloud.sync.lockstep.config import AllReduceConfig
from composer_cloud.sync.lockstep.manager import ObjectStoreManager
from composer_cloud.sync.lockstep.results import LocalRankLost, RoundTimeout
from composer_cloud.sync.lockstep.rounds import read_quorum
from composer_cloud.sync.state_tree import fragment_key

logger = logging.getLogger(__name__)

#: torchft's state-dict key of a DiLoCo that syncs a single fragment (what each local rank's DiLoCo registers).
_OWN_FRAGMENT = fragment_key(0)


@dataclass(frozen=True)
class LocalShard:
    """This process's place in its replica: local rank ``index`` of ``count``.

    Attributes:
        index: the local rank, and the shard of the synced parameters it exchanges.
        count: local ranks of the replica (``spec.gpus_per_replica``).
        group: the gloo group of the replica's ranks for the sync's collectives (the exchange thread's vote,
            then :func:`share_shards` on the training thread, never at the same time); DDP's and FSDP's
            collectives use the default group (gloo on CPU, NCCL on GPUs).
        parallelism: ``spec.parallelism``: ``"ddp"`` (shard = a contiguous group of whole parameters) or
            ``"fsdp"`` (shard = the rank's FSDP chunk of every parameter).
    """

    index: int
    count: int
    group: Any = None
    parallelism: str = "ddp"

    @property
    def fsdp(self) -> bool:
        return self.parallelism == "fsdp"


class ShardedAllReduce(ObjectStoreAllReduce):
    """The dense exchange of one shard: its own payload keys, the replica's quorum and one outcome per attempt."""

    def __init__(self, store: Store, rank: int, config: AllReduceConfig, *, shard: LocalShard,
                 hooks: Hooks = NO_HOOKS) -> None:
        super().__init__(store, rank, config, hooks=hooks)
        self.shard = shard
        self.keys = layout.SlotKeys(shard=shard.index)
        self._attempt_at: tuple[int, int] = (-1, -1)

    def join_and_decide_quorum(self, round: int, attempt: int, *, excluded: frozenset[int] = frozenset(),
                               expected: frozenset[int] | None = None) -> tuple[list[int], float]:
        """Local rank 0 joins for the replica; ranks ``k > 0`` wait for the record it (or a peer) decided."""
        self._attempt_at = (round, attempt)
        if self.shard.index == 0:
            return super().join_and_decide_quorum(round, attempt, excluded=excluded, expected=expected)
        cfg = self.config
        t0 = time.monotonic()

        def decided() -> list[int] | None:
            quorum = read_quorum(self.store, round, attempt, replicas=cfg.replicas, min_replicas=cfg.min_replicas)
            if quorum is None:
                return None
            if set(quorum.participants) & excluded:
                raise BadObject(layout.quorum_key(round, attempt), "participants include ranks that this round's "
                                                                   "earlier attempts excluded")
            return quorum.participants

        participants = poll_until(
            decided, deadline=t0 + cfg.quorum_timeout_s + cfg.round_timeout_s, policy=self.store.poll,
            on_timeout=lambda waited: RoundTimeout(round, sorted(expected or ()), f"no quorum after {waited:.1f}s"))
        return participants, time.monotonic() - t0

    def _agree(self, ok: bool) -> bool:
        """All-reduce (MIN) of every local rank's verdict on this attempt, and of the attempt it is in.

        Ranks that disagree on the attempt (a race with an outcome record) count as a "no": the commit is
        never created from a vote that did not cover the same attempt on every shard.
        """
        round, attempt = self._attempt_at
        vote = torch.tensor([int(ok), round, attempt, -round, -attempt], dtype=torch.int64)
        try:
            dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.shard.group)
        except RuntimeError as exc:  # gloo/NCCL: a peer rank died (its agent is tearing the replica down)
            raise LocalRankLost(round, attempt, self.shard.index, exc) from exc
        same = int(vote[1]) == -int(vote[3]) and int(vote[2]) == -int(vote[4])
        if not same:
            logger.warning("shard %d: the replica's ranks voted on different attempts of round %d; not committing",
                           self.shard.index, shown_round(round))
        return bool(vote[0]) and same


class ShardedManager(ObjectStoreManager):
    """The manager of one local rank: its DiLoCo's state is shard ``k``'s; local rank 0 publishes them all.

    ``mirror`` holds the other shards' global state (filled by :func:`share_shards` after every sync), so
    :meth:`state` on local rank 0 is the replica's whole global state.
    """

    def __init__(self, allreduce: ShardedAllReduce, global_state: Any, **kwargs: Any) -> None:
        super().__init__(allreduce, global_state, **kwargs)
        self.shard = allreduce.shard
        self.mirror: dict[str, Any] = {}
        #: The parameters this rank's DiLoCo syncs, in its outer optimizer's order (FSDP: ``DTensor`` shards).
        self.params: list[torch.nn.Parameter] = []

    def register_state_dict_fn(self, key: str, load_fn: Any, save_fn: Any) -> None:
        """Register DiLoCo's state under shard ``k``'s key; stored as plain local tensors (FSDP: the shards)."""
        if key != _OWN_FRAGMENT:
            raise SyncError(f"a multi-GPU replica's rank syncs one fragment; DiLoCo registered {key!r}")
        super().register_state_dict_fn(fragment_key(self.shard.index), lambda state: load_fn(self._as_params(state)),
                                       lambda: _local_tensors(save_fn()))

    def _as_params(self, state: dict[str, Any]) -> dict[str, Any]:
        """The outer optimizer's stored momentum as ``DTensor`` shards like the parameters it belongs to."""
        from torch.distributed.tensor import DTensor

        if not any(isinstance(p, DTensor) for p in self.params):
            return state
        outer = dict(state["outer_optimizer"])
        per_param = {}
        for index, entry in outer.get("state", {}).items():
            p = self.params[int(index)]
            per_param[index] = {
                k: DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride())
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in entry.items()}
        return {**state, "outer_optimizer": {**outer, "state": per_param}}

    def own_state(self) -> dict[str, Any]:
        """This rank's shard of the global state (views: valid until the next sync)."""
        return super().state()

    def state(self) -> dict[str, Any]:
        own = self.own_state()
        if self.shard.index != 0:
            return own
        return {fragment_key(j): own[fragment_key(j)] if j == 0 else self.mirror[fragment_key(j)]
                for j in range(self.shard.count)}

    def _maybe_publish_state(self, after: Any = None) -> None:
        if self.shard.index != 0:  # local rank 0 publishes the whole replica's state
            self._publish_round = None
            return
        super()._maybe_publish_state(after)

    def adopt(self, tree: dict[str, Any]) -> None:
        """The other shards' entries of a loaded global state become the mirror (resume)."""
        self.mirror = {k: v for k, v in tree.items() if k != fragment_key(self.shard.index)}


def _local_tensors(tree: Any) -> Any:
    """``tree`` with every ``DTensor`` replaced by this rank's local shard (what the store holds)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: _local_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local_tensors(v) for v in tree)
    return tree


def _send_bytes_to_leader(data: bytes | None, src: int, group: Any) -> bytes | None:
    """``data`` of local rank ``src`` on local rank 0 (None elsewhere): point to point, length first."""
    me = dist.get_rank(group)
    if me == src:
        size = torch.tensor([len(data or b"")], dtype=torch.int64)
        dist.send(size, dst=dist.get_global_rank(group, 0), group=group)
        dist.send(torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8), dst=dist.get_global_rank(group, 0),
                  group=group)
        return None
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=dist.get_global_rank(group, src), group=group)
    buf = torch.empty(max(1, int(size)), dtype=torch.uint8)
    dist.recv(buf, src=dist.get_global_rank(group, src), group=group)
    return buf[: int(size)].numpy().tobytes()


def _broadcast_bytes(data: bytes | None, src: int, group: Any) -> bytes:
    """``data`` of local rank ``src``, on every local rank (length first, then the bytes)."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else \
        torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return buf.numpy().tobytes()


def share_shards(manager: ShardedManager, shards: list[torch.nn.Module]) -> None:
    """After every sync, on every local rank (a collective): each rank broadcasts its shard's global state.

    Every rank copies the other shards' global parameters into its model (after a sync each shard's
    parameters equal its DiLoCo backup: committed, aborted or healed), and keeps their state as the
    manager's mirror. ``shards``: the replica's shard modules, in order (:func:`split_fragments`).
    """
    me = manager.shard.index
    mirror: dict[str, Any] = {}
    if manager.shard.fsdp:  # FSDP: no rank holds the whole model; only local rank 0 (the publisher) needs it all
        for j in range(1, manager.shard.count):
            if me in (0, j):
                data = _send_bytes_to_leader(encode_state(manager.own_state()) if me == j else None, j,
                                             manager.shard.group)
                if data is not None:
                    mirror.update(decode_state(data))
        manager.mirror = mirror
        return
    for j, module in enumerate(shards):
        data = _broadcast_bytes(encode_state(manager.own_state()) if j == me else None, src=j,
                                group=manager.shard.group)
        if j == me:
            continue
        tree = decode_state(data)
        params = tree[fragment_key(j)]["original_parameters"]
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(params[name])
        mirror.update(tree)
    manager.mirror = mirror


def load_fsdp_shards(model: torch.nn.Module, tree: dict[str, Any], count: int) -> None:
    """Copy the global parameters of an FSDP replica's stored state (``count`` shards) into ``model``.

    Shard ``k`` holds local rank ``k``'s chunk of every parameter: ``torch.chunk(full, count, dim=0)[k]``,
    FSDP2's layout, so the full parameter is the shards concatenated along dim 0 (``export``).
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            try:
                full = torch.cat([tree[fragment_key(k)]["original_parameters"][name] for k in range(count)])
            except KeyError as exc:
                raise CorruptCheckpoint(layout.CHECKPOINTS, f"the global state has no shard entry {exc} of "
                                        f"parameter {name}") from None
            if full.shape != p.shape:
                raise CorruptCheckpoint(layout.CHECKPOINTS, f"parameter {name}: its {count} shards make "
                                        f"{tuple(full.shape)}, the model has {tuple(p.shape)}")
            p.copy_(full)


__all__ = ["LocalShard", "ShardedAllReduce", "ShardedManager", "load_fsdp_shards", "share_shards"]
