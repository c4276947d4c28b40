"""The lock-step boundary: torchft's DiLoCo syncs inside the inner step; the replica checkpoints after it.

The commit of round ``r`` happens inside the inner optimizer's ``step()``, in
DiLoCo's post-hook (the manager reports it through ``on_sync``). Once
``step()`` returns, the model holds the new global parameters, so the
boundary then checkpoints round ``r`` in this order:

1. this replica's inner state (snapshot on the training thread, upload in the
   background; at most one in flight);
2. this replica's slice of the global state, which waits for (1): a replica
   killed during the global upload has a complete inner state for ``r`` and
   resumes it exactly; a participant that still misses another's slice after
   the quorum timeout writes it itself;
3. the manifest, by any participant (write-once), once the global state is
   durable and the participants' inner states are present.

Rounds that are not checkpointed still publish their global state (healers
need it). A (re)starting replica resumes from the newest durable round, with
its own inner state when it has one (:meth:`LockstepBoundary.start`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from composer_cloud.errors import BadObject, CorruptCheckpoint
from composer_cloud.lora import is_lora_model, synced_parameters
from composer_cloud.replica.boundary import ReplicaContext, Segment, copy_into, params_replaced, snapshot
from composer_cloud.retry import PollPolicy, wait_until
from composer_cloud.rollouts.policy import PolicyPublisher, policy_state, should_publish
from composer_cloud.storage import layout
from composer_cloud.sync.checkpoint import manifests
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore
from composer_cloud.sync.checkpoint.manifests import LoadedResume
from composer_cloud.sync.checkpoint.replica_state import (
    ReplicaStateStore,
    ResumePoint,
    replica_state,
    restore_replica_state,
)
from composer_cloud.sync.lockstep import rounds
from composer_cloud.sync.lockstep.diloco import LockstepConfig, build_diloco, params_digest
from composer_cloud.sync.lockstep.durable import model_attempt_of
from composer_cloud.sync.lockstep.manager import SyncRecord

logger = logging.getLogger(__name__)


class LockstepBoundary:
    """Builds torchft's DiLoCo over the object-store manager, and checkpoints after each commit."""

    def __init__(self, ctx: ReplicaContext) -> None:
        self.ctx = ctx
        self.store = ctx.run.store
        self.spec = ctx.spec
        self.rank = ctx.rank
        self.global_states = GlobalStateStore(self.store, hooks=ctx.hooks)
        self.replica_states = ReplicaStateStore(self.store, hooks=ctx.hooks)
        self._syncs: list[SyncRecord] = []  # filled by the manager's on_sync, drained after each step
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-state-io")
        self._manifest_io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="replica-manifest-io")
        self._pending_io: list[Future] = []
        self._state_write: Future | None = None
        # Rollout workers read the policy chain (issue 36): version v = the global model round v starts from.
        self._policy: PolicyPublisher | None = None
        if should_publish(self.spec) and ctx.leader and not (ctx.shard is not None and ctx.shard.fsdp):
            self._policy = PolicyPublisher(self.store, lora=is_lora_model(ctx.model))
            self._policy_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-policy-io")
        # Read before DiLoCo is built (its start round is the resume point's next): the fleet may prune the
        # chosen round meanwhile, and load_resume then chooses again.
        self._resume = self._load_resume()
        self._start_round = self._resume.point.round + 1 if self._resume else 0
        self.loop = build_diloco(store=self.store, rank=self.rank, model=ctx.model,
                                 inner_optimizer=ctx.trainer.optimizer, config=LockstepConfig.from_spec(self.spec),
                                 hooks=ctx.hooks, start_round=self._start_round, on_sync=self._syncs.append,
                                 shard=ctx.shard)

    @property
    def position(self) -> int:
        return self.loop.manager.current_step()

    # ------------------------------------------------------------ start
    def start(self) -> dict[str, Any]:
        if self._resume is not None:
            self._restore(self._resume)
            self._resume = None  # the trees are in the model and DiLoCo now: free them
            params_replaced(self.ctx.trainer)
        self._publish_policy(self._start_round)
        return {"round": self.position, "step": self._start_round * self.spec.inner_steps}

    def _load_resume(self) -> LoadedResume | None:
        """Where to start, read: the newest durable round, with my own inner state if I wrote it.

        A replica restarted right after a commit it took part in waits (up to
        ``round_timeout_s``) for that round's global state to become durable:
        the surviving participants write the missing slices, and resuming that
        round with my own inner state is exact.
        """
        committed = rounds.latest_committed_round(self.store)
        attempt = rounds.committed_attempt(self.store, committed) if committed >= 0 else None
        if (attempt is not None and self.replica_states.marker(committed, self.rank) is not None
                and not self.global_states.durable(committed, attempt)):
            logger.info("replica %d: waiting for round %d's global state to become durable", self.rank, committed)
            # Ends when the state is durable (whoever wrote it) or the commit was voided.
            if not wait_until(lambda: (self.global_states.durable(committed, attempt)
                                       or rounds.committed_attempt(self.store, committed) != attempt),
                              deadline=time.monotonic() + self.spec.sync.round_timeout_s,
                              policy=PollPolicy(initial_s=0.2, max_s=2.0)):
                logger.warning("replica %d: round %d's global state did not become durable within "
                               "round_timeout_s; resuming from an earlier round", self.rank, committed)
        loaded = manifests.load_resume(self.global_states, self.replica_states, self.rank,
                                       world_size=self.spec.replicas, attempt_of=model_attempt_of(self.store))
        if self.ctx.shard is not None:
            _same_on_every_local_rank(None if loaded is None else loaded.point, self.ctx.shard.group)
        return loaded

    def _restore(self, start: LoadedResume) -> None:
        """Load global state into DiLoCo and the model, and this replica's inner state if present."""
        self.loop.restore(start.global_state)
        if start.replica_state is None:
            if start.point.reason:
                logger.warning("%s: fresh inner state from global params", start.point.reason)
            return
        local = restore_replica_state(self.ctx.trainer, start.replica_state)
        self.loop.load_codec_state(start.replica_state.get("codec", {}))  # error feedback: restored bitwise
        copy_into(self.ctx.model, local)
        logger.info("replica %d resumed from checkpoint %d", self.rank, start.point.round)

    # ------------------------------------------------------------ the loop's side
    def session(self) -> contextlib.AbstractContextManager[Any]:
        return self.loop

    def running(self, segment: Segment) -> bool:
        return self.position < self.spec.rounds

    def sync_s(self) -> float:
        """Seconds of the last step spent in the sync, waits included (a takeover, a heal): not compute."""
        rec = self._syncs[-1] if self._syncs else None
        if rec is None:
            return 0.0
        return max(rec.blocked_s, rec.result.wall_s if rec.result is not None else 0.0)

    def after_step(self, segment: Segment) -> dict[str, Any] | None:
        """A sync happened inside this step (DiLoCo's optimizer post-hook) iff the manager reported one."""
        if not self._syncs:
            return None
        rec = self._syncs[-1]
        self._syncs.clear()
        res = rec.result
        row: dict[str, Any] = {
            "round": rec.round, "committed": rec.committed, "healed_to": rec.healed_to,
            "participants": res.participants if res else [], "sync_s": res.wall_s if res else 0.0,
            "quorum_wait_s": res.quorum_wait_s if res else 0.0, "bytes_read": res.bytes_read if res else 0,
            "bytes_written": res.bytes_written if res else 0}
        # A multi-GPU replica's ranks each synced one shard: now each gets every shard's global state.
        self.loop.share_shards()
        # Every sync replaced the synced parameters: torchft's DiLoCo restores the global backup before it
        # knows the outcome (then an outer step, or a heal, or nothing more if the round was not committed).
        params_replaced(self.ctx.trainer)
        if rec.committed and res is not None:
            if self.ctx.leader:  # local rank 0 checkpoints the replica
                self._publish_policy(rec.round + 1)
                self._after_commit(rec.round, res.attempt, res.participants, row)
            elif self.ctx.shard is not None and self.ctx.shard.fsdp:
                self._join_leader_collectives(rec.round, res.participants)
        self._reap_io()
        return row

    def heartbeat_fields(self, steps: int) -> dict[str, Any]:
        return {"round": self.position}

    # ------------------------------------------------------------ the policy chain
    def _publish_policy(self, version: int) -> None:
        """Publish the model as policy ``version`` for rollout workers, when they are configured: the bf16 copy
        is taken here (training changes the model next), the patch and the upload run in the background, in
        order. Every participant publishes (write-once, identical bytes); a bad object costs that version only."""
        if self._policy is None:
            return
        state = policy_state(self.ctx.model, lora=self._policy.lora)
        publisher = self._policy

        def publish() -> None:
            try:
                publisher.publish_state(version, state)
            except BadObject as exc:
                logger.warning("replica %d: policy version %d not published: %s", self.rank, version, exc)
        self._pending_io.append(self._policy_io.submit(publish))

    # ------------------------------------------------------------ checkpoints
    def _reap_io(self) -> None:
        """Raise the error of any finished background write; keep the unfinished ones."""
        still = []
        for fut in self._pending_io:
            if fut.done():
                fut.result()
            else:
                still.append(fut)
        self._pending_io = still

    def _after_commit(self, round: int, attempt: int, participants: list[int], row: dict[str, Any]) -> None:
        """Checkpoint round ``round``: my inner state, then my slice of the global state, then the manifest."""
        spec, trainer, manager = self.spec, self.ctx.trainer, self.loop.manager
        if self.rank == min(participants) and hasattr(trainer, "evaluate"):
            row.update(trainer.evaluate())
        if not self._checkpointed(round):
            manager.publish_state()  # global state every round: healers need it
            return
        local = None
        if spec.sync.fragments > 1:  # parameters of not-yet-synced fragments are local
            local = {n: p.detach().cpu().clone() for n, p in synced_parameters(self.ctx.model).items()}
        # At most one of this replica's state writes in flight: if the store is slower than the rounds,
        # wait here (and record it) rather than queue full snapshots. Manifest writers are not waited on:
        # they wait for other replicas, which may be gone.
        t0 = time.monotonic()
        if self._state_write is not None:
            self._state_write.result()
            self._state_write = None
        row["checkpoint_wait_s"] = time.monotonic() - t0
        # Snapshot on the critical path (training mutates optimizer state next step), then upload in the background.
        t0 = time.monotonic()
        tree = snapshot(replica_state(trainer, local, codec=self.loop.codec_state()))
        row["checkpoint_snapshot_s"] = time.monotonic() - t0
        self._state_write = self._io.submit(self.replica_states.write, round, self.rank, tree,
                                            world_size=spec.replicas)
        self._pending_io.append(self._state_write)
        manager.publish_state(after=self._state_write)

        def finish() -> None:
            if manifests.write_manifest(self.global_states, self.replica_states, round, attempt, participants,
                                        deadline_s=spec.sync.round_timeout_s,
                                        extra={"replicas_launched": spec.replicas},
                                        # Abandoned only on a verified denial (another commit, a void):
                                        # records damaged after our commit do not stop the manifest.
                                        abandoned=lambda: (rounds.committed_attempt(self.store, round) != attempt
                                                           and not rounds.may_have_committed(self.store, round,
                                                                                             attempt)),
                                        committed=lambda: rounds.committed_attempt(self.store, round) == attempt):
                manifests.prune(self.global_states, keep=spec.keep_checkpoints, newest=round)
                rounds.cleanup_rounds(self.store, before=round)
        self._pending_io.append(self._manifest_io.submit(finish))

    def _checkpointed(self, round: int) -> bool:
        """Round ``round`` writes a checkpoint (every ``checkpoint_every`` rounds, and the last)."""
        return (round + 1) % self.spec.checkpoint_every == 0 or round + 1 == self.spec.rounds

    def _join_leader_collectives(self, round: int, participants: list[int]) -> None:
        """FSDP, local ranks ``k > 0``: join the collectives of local rank 0's :meth:`_after_commit`, in its order.

        Its evaluation runs the sharded model (all-gathers) and its inner-state snapshot gathers the sharded
        optimizer state: every local rank takes part, and only local rank 0 keeps the results.
        """
        trainer = self.ctx.trainer
        if self.rank == min(participants) and hasattr(trainer, "evaluate"):
            trainer.evaluate()
        if self._checkpointed(round):
            trainer.state_dict()

    # ------------------------------------------------------------ the end
    def finish(self, steps: int) -> dict[str, Any]:
        """Finish every upload, then read the final state back: "completed" means durable and verified."""
        manager = self.loop.manager
        manager.flush_state()
        for fut in self._pending_io:
            fut.result()
        if manager.current_step() > 0 and self.ctx.leader:  # the leader's state covers every shard
            self.loop.verify_durable(manager.current_step() - 1)
        self.loop.close()
        self._io.shutdown(wait=True)
        self._manifest_io.shutdown(wait=True)
        if self._policy is not None:
            self._policy_io.shutdown(wait=True)
        return {"round": manager.current_step(), "params_sha256": params_digest(self.ctx.model)}


def _same_on_every_local_rank(point: ResumePoint | None, group: Any) -> None:
    """The local ranks of a replica resume the same round from the same inner state, or the replica stops."""
    import torch
    import torch.distributed as dist

    mine = [-1, -1] if point is None else [point.round, -1 if point.replica_crc32 is None else point.replica_crc32]
    lo, hi = torch.tensor(mine, dtype=torch.int64), torch.tensor([-x for x in mine], dtype=torch.int64)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MIN, group=group)
    if lo.tolist() != [-x for x in hi.tolist()]:
        raise CorruptCheckpoint(layout.CHECKPOINTS, "the local ranks of this replica found different resume points "
                                "(the store changed while they looked); restart the replica")


__all__ = ["LockstepBoundary"]
