"""The training side of decoupled DiLoCo (``sync.mode = "decoupled"``): one replica on its own clock.

Per boundary (every ``inner_steps`` inner steps), in this order:

1. publish the contribution ``base - local`` (fp32), with the tokens and inner
   steps behind it and the version ``base`` came from;
2. :func:`~composer_cloud.sync.decoupled.protocol.try_merge`: merge the pending
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
other replica stops at its next boundary (the segment it was training is
dropped: at most one segment per replica).

Ordering and failure reasoning: the contribution is published before the
inner state is written, so a replica killed in between republishes those
steps under a new seq after its restart (at-least-once; never the same seq
twice, see :func:`~composer_cloud.sync.decoupled.protocol.next_seq`). The inner
state stores the local parameters *after* adoption, which are also the next
base, so a resumed replica continues exactly where that boundary left it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from composer_cloud.sync.checkpoint.replica_state import ReplicaStateStore, replica_state, restore_replica_state
from composer_cloud.sync.decoupled import protocol as dc
from composer_cloud.sync.decoupled.outer import FRAGMENT_KEY
from composer_cloud.errors import BadObject
from composer_cloud.runs.metrics import Progress
from composer_cloud.stack import runtime_versions
from composer_cloud.storage import layout

logger = logging.getLogger(__name__)

FINISH_CHECK_S = 2.0  # how often (seconds) a replica looks for the run's end between boundaries


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", dtype=torch.float32, copy=True) for n, p in model.named_parameters()}


class DecoupledLoop:
    """Runs one replica in decoupled mode. ``replica`` is the :class:`composer_cloud.replica.Replica`
    (its store, spec, rank, ``on_step``, metrics log and ``heartbeat`` are reused)."""

    def __init__(self, replica: Any, model: torch.nn.Module, trainer: Any, device: torch.device) -> None:
        self.replica = replica
        self.model = model
        self.trainer = trainer
        self.device = device
        self.spec = spec = replica.spec
        self.store = replica.store
        self.rank = replica.rank
        self.cfg = dc.DecoupledConfig.from_spec(spec)
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.alpha = spec.sync.fragment_update_alpha
        self.tokens_per_step = spec.trainer.batch_size * spec.trainer.seq_len
        self.replica_states = ReplicaStateStore(self.store, hooks=replica.hooks)
        self.adopted = -1  # the global version the model last adopted
        self.seq = 0  # contributions published (the next one is seq + 1)

    # ------------------------------------------------------------ state
    def _start(self) -> None:
        """Resume my inner state if I have one, else start from the newest durable global (version 0 first)."""
        resume = self.replica_states.load_decoupled(self.rank, world_size=self.spec.replicas)
        if resume is not None:
            local = restore_replica_state(self.trainer, resume.tree["inner"])
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(local[name])
            self.seq, self.adopted = resume.seq, resume.version
            logger.info("replica %d resumed its inner state after contribution %d (version %d)", self.rank,
                        resume.seq, resume.version)
        else:
            dc.ensure_initial(self.store, self.cfg, _params(self.model), rank=self.rank)
            if not self._adopt(alpha=1.0):  # a fresh model takes the global as it is
                raise BadObject(layout.checkpoint_prefix(0), "no usable global version to start from")
        # Never reuse a seq: a kill after publishing but before the inner state was written leaves
        # contributions newer than my state.
        self.seq = dc.next_seq(self.store, self.cfg, self.rank, self.seq) - 1

    def _adopt(self, *, alpha: float) -> bool:
        """Adopt the newest durable global newer than mine; False if none (or none readable)."""
        v = dc.newest_version(self.store, floor=self.adopted)
        if v is None:
            return False
        try:
            tree = dc.load_version(self.store, v, self.shapes)
        except BadObject as exc:  # never adopt an unverified object
            logger.warning("replica %d: global version %d unusable (%s); keeping version %d", self.rank, v,
                           exc, self.adopted)
            return False
        params = tree[FRAGMENT_KEY]["original_parameters"]
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                g = params[name].to(p.device, p.dtype)
                if alpha >= 1.0:
                    p.copy_(g)
                else:
                    p.mul_(1.0 - alpha).add_(g, alpha=alpha)
        self.adopted = v
        return True

    def _write_state(self, params: dict[str, torch.Tensor]) -> None:
        """Write this replica's inner state; ``params`` is a CPU copy of the model's parameters as they are now."""
        tree = {"inner": replica_state(self.trainer, params)}
        self.replica_states.write_decoupled(self.rank, self.seq, tree, version=self.adopted,
                                            world_size=self.spec.replicas, keep=2)

    # ------------------------------------------------------------ main loop
    def run(self) -> None:
        spec, rank, rep = self.spec, self.rank, self.replica
        rep.versions = runtime_versions(device=self.device.type)
        self._start()
        rep.progress = Progress(every_s=spec.progress_every_s, total_steps=spec.rounds * spec.inner_steps)
        rep.heartbeat("running", round=self.seq, version=self.adopted)
        logger.info("replica %d/%d (decoupled): contribution %d of %d, at version %d", rank, spec.replicas,
                    self.seq, spec.rounds, self.adopted)
        base = _params(self.model)
        step = 0
        budget = spec.replicas * spec.rounds
        while dc.read_final(self.store) is None and dc.published_total(self.store, self.cfg) < budget:
            round_start = time.monotonic()
            losses: list[float] = []
            rewards: list[float] = []
            compute_s = 0.0
            tokens = 0
            finished = False
            last_look = time.monotonic()
            for i in range(spec.inner_steps):
                # Every FINISH_CHECK_S, one small GET: once the run finished, the rest of this segment
                # could never be merged, so stop computing (billing) it now rather than at the boundary.
                if time.monotonic() - last_look >= FINISH_CHECK_S:
                    last_look = time.monotonic()
                    if dc.read_final(self.store) is not None:
                        finished = True
                        break
                if i == spec.inner_steps // 2:
                    rep.hooks.at("inner_step", self.seq, rank)
                t0 = time.monotonic()
                out = self.trainer.step()
                rep.hooks.after_step(rank, time.monotonic() - t0)  # simulated slow hardware counts as compute
                dt = time.monotonic() - t0
                compute_s += dt
                step += 1
                tokens += int(out.get("tokens", self.tokens_per_step))
                losses.append(out.get("loss", float("nan")))
                if "reward_mean" in out:
                    rewards.append(out["reward_mean"])
                rep.on_step(self.seq, step, out, dt)
            t_sync = time.monotonic()
            if finished or dc.read_final(self.store) is not None:
                logger.info("replica %d: the run finished while it trained; its last %d steps are dropped",
                            rank, len(losses))
                break
            local = _params(self.model)
            delta = {n: base[n] - local[n] for n in local}
            read0, written0 = self.store.bytes_read, self.store.bytes_written
            contrib = dc.publish_contribution(self.store, self.cfg, rank=rank, seq=self.seq + 1,
                                              base_version=self.adopted, tokens=tokens,
                                              inner_steps=spec.inner_steps, delta=delta)
            self.seq += 1
            outcome = self._merge()
            adopted_before = self.adopted
            self._adopt(alpha=self.alpha)
            base = _params(self.model)
            row: dict[str, Any] = {
                "kind": "round", "rank": rank, "round": self.seq - 1, "committed": True,
                "merged_version": self.adopted, "adopted": self.adopted != adopted_before,
                "merged_here": outcome.merged if outcome else None,
                "merge_reason": outcome.reason if outcome else "error",
                "grace_s": outcome.grace_s if outcome else None,
                "staleness": (outcome.base if outcome else self.adopted) - contrib.base_version,
                "participants": self._participants(), "tokens": tokens,
                "train_loss": sum(losses) / len(losses), "compute_s": compute_s,
                "sync_s": time.monotonic() - t_sync, "wait_s": 0.0, "quorum_wait_s": 0.0,
                "bytes_read": self.store.bytes_read - read0, "bytes_written": self.store.bytes_written - written0,
                "wall_s": time.monotonic() - round_start,
            }
            if rewards:
                row["reward_mean"] = sum(rewards) / len(rewards)
            if rank == 0 and hasattr(self.trainer, "evaluate") and row["adopted"]:
                row.update(self.trainer.evaluate())
            if self.seq % spec.checkpoint_every == 0 or self.seq == spec.rounds:
                t0 = time.monotonic()
                self._write_state(base)  # the model is unchanged since base was copied (evaluate() only reads)
                row["checkpoint_s"] = time.monotonic() - t0
            rep.metrics.round(row)
            rep.heartbeat("running", round=self.seq, step=step, version=self.adopted)
        # The fleet's budget is published (or another replica already made the final merge).
        final = dc.finish(self.store, self.cfg, self.shapes, rank=rank, rounds=spec.rounds)
        rep.flush_metrics()
        extra = {"final_version": final} if final is not None else {}
        rep.heartbeat("completed", round=self.seq, step=step, version=self.adopted, **extra)
        logger.info("replica %d completed %d contributions%s", rank, self.seq,
                    f"; final version {final}" if final is not None else " (others still training)")

    def _merge(self) -> dc.MergeOutcome | None:
        """:func:`try_merge`, where a bad object costs this boundary's merge attempt, never the replica."""
        try:
            return dc.try_merge(self.store, self.cfg, self.shapes, rank=self.rank)
        except BadObject as exc:
            logger.warning("replica %d: no merge at this boundary (%s)", self.rank, exc)
            return None

    def _participants(self) -> list[int]:
        """Replicas merged into the adopted version (from its record; [] for version 0 or if unreadable)."""
        if self.adopted <= 0:
            return []
        try:
            rec = dc.read_merge(self.store, self.cfg, self.adopted)
        except BadObject:
            return []
        return rec.ranks if rec else []


def run_decoupled(replica: Any, model: torch.nn.Module, trainer: Any, device: torch.device) -> None:
    """Entry point from :meth:`composer_cloud.replica.Replica.run` when ``sync.mode == "decoupled"``."""
    DecoupledLoop(replica, model, trainer, device).run()
