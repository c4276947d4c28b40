"""The decoupled boundary (``sync.mode = "decoupled"``): publish, merge, adopt; one replica on its own clock.

Per boundary (every ``inner_steps`` inner steps), in this order:

1. publish the contribution ``base - local`` (fp32), with the tokens and inner
   steps behind it and the version ``base`` came from;
2. :meth:`~composer_cloud.sync.decoupled.protocol.DecoupledProtocol.try_merge`: merge the pending
   contributions if a quorum of replicas or the grace window says so (losing
   the race is fine), or finish an overdue merge of a dead merger;
3. adopt the newest durable global newer than the one adopted:
   ``local = alpha * global + (1 - alpha) * local``;
4. ``base = local`` (the next pseudo-gradient counts only new steps);
5. every ``checkpoint_every`` contributions, write the inner state.

Nothing in it waits for another replica: every store call is a read, a
write or a write-once create that returns at once. The run's work budget is
the fleet's: ``replicas * rounds`` contributions, whoever makes them (a fast
replica makes more, a slow or dead one fewer). The replica whose contribution
reaches it makes the final merge and writes ``decoupled/final.json``; every
other replica stops at its next boundary, or within :data:`FINISH_CHECK_S` of
the final record between boundaries (the segment it was training is dropped:
at most one segment per replica).

A multi-GPU replica (``gpus_per_replica = N > 1``, DDP: every local rank holds the same model and inner
state) has one contribution per boundary, made by local rank 0: it alone reads and writes the store
(publish, merge, adopt, checkpoint, the end of the run) and broadcasts what it decided (go on or stop, its
``seq`` and adopted version) and the synced parameters after adoption to the other ranks
(:class:`LeaderDecides`). The protocol merges whole contributions, so it is not split per shard: the
store bytes of a multi-GPU replica are a one-rank replica's, made by one rank.

Ordering and failure reasoning: the contribution is published before the
inner state is written, so a replica killed in between republishes those
steps under a new seq after its restart (at-least-once; never the same seq
twice, see :meth:`~composer_cloud.sync.decoupled.protocol.DecoupledProtocol.next_seq`). The inner
state stores the local parameters *after* adoption, which are also the next
base, so a resumed replica continues exactly where that boundary left it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Any

import torch

from composer_cloud.errors import BadObject, SyncError
from composer_cloud.lora import synced_parameters
from composer_cloud.replica.boundary import ReplicaContext, Segment, copy_into, cpu_params, params_replaced
from composer_cloud.storage import layout
from composer_cloud.storage.records.metrics import DecoupledFields, RoundRow
from composer_cloud.sync.checks import norm_floor_rms
from composer_cloud.sync.checkpoint.replica_state import ReplicaStateStore, replica_state, restore_replica_state
from composer_cloud.sync.decoupled.contributions import ContributionEncoder
from composer_cloud.sync.decoupled.outer import FRAGMENT_KEY
from composer_cloud.sync.decoupled.protocol import DecoupledConfig, DecoupledProtocol, MergeOutcome

logger = logging.getLogger(__name__)

#: How often (seconds) a replica looks for the run's end between boundaries: one small GET.
FINISH_CHECK_S = 2.0
#: Inner states a replica keeps (the newest, and one before it in case the newest is torn).
KEEP_STATES = 2


class LeaderDecides:
    """The collectives of a multi-GPU replica's decoupled boundary: local rank 0's decisions, on every rank.

    Every call is a collective of the replica's local ranks, made at the same point of the loop by all of
    them; with one local rank each returns its input.
    """

    def __init__(self, ctx: ReplicaContext, synced: dict[str, torch.nn.Parameter]) -> None:
        self.shard = ctx.shard
        self.synced = synced

    def ints(self, *values: int) -> list[int]:
        """Local rank 0's ``values`` (over the replica's gloo group)."""
        if self.shard is None:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(t, src=dist.get_global_rank(self.shard.group, 0), group=self.shard.group)
        return [int(v) for v in t]

    def params(self) -> None:
        """Local rank 0's synced parameters into every rank's model (over the default group: NCCL on GPUs)."""
        if self.shard is None:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for p in self.synced.values():
                dist.broadcast(p.data, src=0)

    def check_same(self, digest: str) -> None:
        """Fail the replica if its local ranks ended on different parameters (``digest``: sha256 hex)."""
        if self.shard is None:
            return
        import torch.distributed as dist

        value = int(digest[:15], 16)
        t = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.shard.group)
        if int(t[0]) != -int(t[1]):
            raise SyncError("the local ranks of this replica ended on different parameters; its contributions "
                            "were local rank 0's, so the run's model is intact, but this replica is broken")


class DecoupledBoundary:
    """Publishes, merges and adopts at every boundary; never waits for another replica."""

    def __init__(self, ctx: ReplicaContext) -> None:
        self.ctx = ctx
        self.store = ctx.run.store
        self.spec = ctx.spec
        self.rank = ctx.rank
        self.cfg = DecoupledConfig.from_spec(self.spec)
        self.synced = synced_parameters(ctx.model)  # what is published and adopted (a LoRA model: its adapters)
        numel = sum(p.numel() for p in self.synced.values())  # the guard's no-gradient floor, from the weights as built
        self.cfg = dataclasses.replace(self.cfg, norm_floor=norm_floor_rms(self.synced.values()) * math.sqrt(numel))
        self.protocol = DecoupledProtocol(self.store, self.cfg)  # one look per boundary: self.protocol.boundary()
        self.encoder = ContributionEncoder(self.cfg.sparse)  # the sparse codec's error feedback, if any
        self.shapes = {n: tuple(p.shape) for n, p in self.synced.items()}
        self.replica_states = ReplicaStateStore(self.store, hooks=ctx.hooks)
        self.budget = self.spec.replicas * self.spec.rounds
        self.adopted = -1  # the global version the model last adopted
        self.seq = 0  # contributions published (the next one is seq + 1)
        self._base: dict[str, torch.Tensor] = {}  # the parameters the next contribution is measured from
        self._last_look = time.monotonic()
        self._stopped = False
        self.leader = ctx.leader  # local rank 0 of a multi-GPU replica does the store work for it
        self.local = LeaderDecides(ctx, self.synced)

    @property
    def position(self) -> int:
        return self.seq

    # ------------------------------------------------------------ start
    def start(self) -> dict[str, Any]:
        """Resume my inner state if I have one, else start from the newest durable global (version 0 first)."""
        # Every local rank loads the replica's inner state (the same object: only local rank 0 writes it).
        resume = self.replica_states.load_decoupled(self.rank, world_size=self.spec.replicas)
        if resume is not None:
            copy_into(self.ctx.model, restore_replica_state(self.ctx.trainer, resume.tree["inner"]))
            self.encoder.load_state_dict(resume.tree["inner"].get("codec", {}))
            self.seq, self.adopted = resume.seq, resume.version
            logger.info("replica %d resumed its inner state after contribution %d (version %d)", self.rank,
                        resume.seq, resume.version)
        elif self.leader:
            self.protocol.ensure_initial(cpu_params(self.ctx.model), rank=self.rank)
            if not self._adopt(alpha=1.0):  # a fresh model takes the global as it is
                raise BadObject(layout.checkpoint_prefix(0), "no usable global version to start from")
        if self.leader:
            # Never reuse a seq: a kill after publishing but before the inner state was written leaves
            # contributions newer than my state.
            self.seq = self.protocol.next_seq(self.rank, self.seq) - 1
        self.seq, self.adopted = self.local.ints(self.seq, self.adopted)
        self.local.params()
        params_replaced(self.ctx.trainer)
        self._base = cpu_params(self.ctx.model)
        return {"round": self.seq, "version": self.adopted}

    def _adopt(self, *, alpha: float, at: DecoupledProtocol | None = None) -> bool:
        """Adopt the newest durable global newer than mine; False if none (or none readable). ``at``: this
        boundary's protocol (its look at the store), else a look of its own."""
        versions = (at or self.protocol.boundary()).versions
        v = versions.newest(floor=self.adopted)
        if v is None:
            return False
        try:
            tree = versions.load(v, self.shapes)
        except BadObject as exc:  # never adopt an unverified object
            logger.warning("replica %d: global version %d unusable (%s); keeping version %d", self.rank, v,
                           exc, self.adopted)
            return False
        params = tree[FRAGMENT_KEY]["original_parameters"]
        with torch.no_grad():
            for name, p in self.synced.items():
                g = params[name].to(p.device, p.dtype)
                if alpha >= 1.0:
                    p.copy_(g)
                else:
                    p.mul_(1.0 - alpha).add_(g, alpha=alpha)
        self.adopted = v
        return True

    # ------------------------------------------------------------ the loop's side
    def session(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def running(self, segment: Segment) -> bool:
        go = self._running(segment) if self.leader else False
        return bool(self.local.ints(int(go))[0])  # local rank 0 decides for the replica

    def _running(self, segment: Segment) -> bool:
        if self._stopped:
            return False
        if segment.steps == 0:  # a segment starts: is there still work for the fleet? (a look of its own)
            self._last_look = time.monotonic()
            at = self.protocol.boundary()
            return at.versions.final() is None and at.published_total() < self.budget
        # Between boundaries, one small GET every FINISH_CHECK_S: once the run finished, the rest of this
        # segment could never be merged, so stop computing (billing) it now rather than at the boundary.
        if time.monotonic() - self._last_look >= FINISH_CHECK_S:
            self._last_look = time.monotonic()
            if self.protocol.versions.final() is not None:
                self._drop(segment)
                return False
        return True

    def _drop(self, segment: Segment) -> None:
        logger.info("replica %d: the run finished while it trained; its last %d steps are dropped", self.rank,
                    segment.steps)
        self._stopped = True

    def sync_s(self) -> float:
        return 0.0  # the boundary runs between steps, not inside one

    def after_step(self, segment: Segment) -> RoundRow | None:
        if segment.steps < self.spec.inner_steps:
            return None
        t_sync = time.monotonic()
        if not self.leader:
            return self._follow()
        # One look at the store per folder for the whole boundary (docs/decoupled.md, "Store calls").
        at = self.protocol.boundary()
        final = at.versions.final() is not None
        self.local.ints(int(final))
        if final:
            self._drop(segment)
            return None
        local = cpu_params(self.ctx.model)
        delta = {n: self._base[n] - local[n] for n in local}
        read0, written0 = self.store.bytes_read, self.store.bytes_written
        contrib = at.publish(rank=self.rank, seq=self.seq + 1, base_version=self.adopted, tokens=segment.tokens,
                             inner_steps=self.spec.inner_steps, delta=delta, encoder=self.encoder)
        self.seq += 1
        outcome = self._merge(at)
        adopted_before = self.adopted
        self._adopt(alpha=self.spec.sync.adopt_global_weight, at=at)
        self.local.ints(self.seq, self.adopted)  # then the adopted parameters: the other ranks' _follow
        self.local.params()
        self._base = cpu_params(self.ctx.model)
        adopted = self.adopted != adopted_before
        if adopted:
            params_replaced(self.ctx.trainer)
        own = DecoupledFields(
            merged_version=self.adopted, adopted=adopted, merged_here=outcome.merged if outcome else None,
            merge_reason=outcome.reason if outcome else "error", grace_s=outcome.grace_s if outcome else None,
            staleness=(outcome.base if outcome else self.adopted) - contrib.base_version, tokens=segment.tokens,
            wait_s=0.0)
        row = self.ctx.telemetry.round_row(
            self.seq - 1, committed=True, decoupled=own, participants=self._participants(at),
            sync_s=time.monotonic() - t_sync, quorum_wait_s=0.0, bytes_read=self.store.bytes_read - read0,
            bytes_written=self.store.bytes_written - written0)
        trainer = self.ctx.trainer
        if self.rank == 0 and hasattr(trainer, "evaluate") and adopted:
            row.extra.update(trainer.evaluate())
        if self.seq % self.spec.checkpoint_every == 0 or self.seq == self.spec.rounds:
            t0 = time.monotonic()
            # The model is unchanged since the base was copied (evaluate() only reads).
            inner = replica_state(trainer, self._base, codec=self.encoder.state_dict())
            self.replica_states.write_decoupled(self.rank, self.seq, {"inner": inner},
                                                version=self.adopted, world_size=self.spec.replicas,
                                                keep=KEEP_STATES)
            own.checkpoint_s = time.monotonic() - t0
        return row

    def _follow(self) -> RoundRow | None:
        """Local ranks ``k > 0`` at a boundary: take local rank 0's outcome and parameters (its collectives)."""
        if self.local.ints(0)[0]:  # the run finished: local rank 0 dropped the segment
            self._stopped = True
            return None
        before = self.adopted
        self.seq, self.adopted = self.local.ints(self.seq, self.adopted)
        self.local.params()
        self._base = cpu_params(self.ctx.model)
        if self.adopted != before:
            params_replaced(self.ctx.trainer)
        return self.ctx.telemetry.round_row(self.seq - 1, committed=True,
                                            decoupled=DecoupledFields(merged_version=self.adopted))

    def _merge(self, at: DecoupledProtocol) -> MergeOutcome | None:
        """:meth:`~composer_cloud.sync.decoupled.protocol.DecoupledProtocol.try_merge`, where a bad object costs
        this boundary's merge attempt, never the replica."""
        try:
            return at.try_merge(self.shapes, rank=self.rank)
        except BadObject as exc:
            logger.warning("replica %d: no merge at this boundary (%s)", self.rank, exc)
            return None

    def _participants(self, at: DecoupledProtocol) -> list[int]:
        """Replicas merged into the adopted version (from its record; [] for version 0 or if unreadable)."""
        if self.adopted <= 0:
            return []
        try:
            rec = at.read_merge(self.adopted)
        except BadObject:
            return []
        return rec.ranks if rec else []

    def heartbeat_fields(self, steps: int) -> dict[str, Any]:
        return {"round": self.seq, "step": steps, "version": self.adopted}

    # ------------------------------------------------------------ the end
    def finish(self, steps: int) -> dict[str, Any]:
        """The fleet's budget is published (or another replica already made the final merge): the final merge."""
        from composer_cloud.sync.lockstep.diloco import params_digest

        self.local.check_same(params_digest(self.ctx.model))
        if not self.leader:
            return {"round": self.seq, "step": steps, "version": self.adopted}
        final = self.protocol.finish(self.shapes, rank=self.rank, rounds=self.spec.rounds)
        if final is None:
            logger.info("replica %d: others still training; the final merge is theirs", self.rank)
        fields = {"round": self.seq, "step": steps, "version": self.adopted}
        return fields if final is None else {**fields, "final_version": final}


__all__ = ["DecoupledBoundary", "FINISH_CHECK_S"]
