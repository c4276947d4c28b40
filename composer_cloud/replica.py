"""The replica entry point: ``python -m composer_cloud.replica --run RUN_URI --rank R``.

Every executor runs exactly this. The replica reads the run spec from the
store, builds model and trainer, and runs torchft's ``DiLoCo`` over the
object-store manager until ``rounds`` rounds have committed. Everything it
reports goes to the store:

* ``replicas/<rank>.json`` — heartbeat: state, round, step, last error, and
  live progress (loss, reward, steps/s, elapsed) every ``progress_every_s``.
* ``metrics/<rank>/<round>-<writer>.jsonl`` — one plain-JSONL object per round
  (its step rows, then the round row), written once, never rewritten (see
  :mod:`composer_cloud.runs.metrics`).
* ``checkpoints/<r>/...`` — see :mod:`composer_cloud.sync.checkpoint.global_state`.

Ordering at a round boundary (the commit of round ``r`` happens inside the
inner optimizer's ``step()``, in DiLoCo's post-hook): once ``step()`` returns,
the model holds the new global parameters, so the replica then writes its
inner state for checkpoint ``r``, and the round's leader (lowest participating
rank) publishes the global state and, last, the manifest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from composer_cloud import env, faults
from composer_cloud.sync.checkpoint import manifests
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore
from composer_cloud.sync.checkpoint.replica_state import (ReplicaStateStore, ResumePoint, replica_state,
                                                          restore_replica_state)
from composer_cloud.errors import CorruptCheckpoint
from composer_cloud.sync.lockstep import rounds
from composer_cloud.sync.lockstep.diloco import LockstepConfig, OuterLoop, build_diloco, params_digest
from composer_cloud.sync.lockstep.allreduce import cleanup_rounds, latest_committed_round
from composer_cloud.sync.lockstep.manager import SyncRecord
from composer_cloud.retry import PollPolicy, poll_until
from composer_cloud.runs.metrics import MetricsLog, Progress
from composer_cloud.storage.run import open_run
from composer_cloud.stack import runtime_versions
from composer_cloud.storage import layout
from composer_cloud.storage.records import Heartbeat, HeartbeatState

logger = logging.getLogger("composer_cloud.replica")


def _snapshot(tree: Any) -> Any:
    """Deep copy of a state tree's tensors (to CPU), so later training cannot change it."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _snapshot(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_snapshot(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_snapshot(v) for v in tree)
    return tree


class Replica:
    """One replica of a run: trains, syncs through the store, checkpoints, reports."""

    def __init__(self, run_uri: str, rank: int) -> None:
        self.run_uri = run_uri
        self.rank = rank
        run = open_run(run_uri)
        # Ride out store outages up to the spec's budget (the spec had to be read first).
        run = open_run(run_uri, outage_s=run.spec.sync.store_outage_s)
        self.store, self.spec = run.store, run.spec
        if not 0 <= rank < self.spec.replicas:
            raise ValueError(f"--rank {rank} out of range: the run has {self.spec.replicas} replicas")
        self.metrics = MetricsLog(self.store, rank)
        self.hooks = faults.EnvFaults()
        self.global_states = GlobalStateStore(self.store, hooks=self.hooks)
        self.replica_states = ReplicaStateStore(self.store, hooks=self.hooks)
        self.progress: Progress | None = None  # set once training starts
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-state-io")
        self._manifest_io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="replica-manifest-io")
        self._pending_io: list[Any] = []
        self._state_write: Any = None
        self._syncs: list[SyncRecord] = []  # filled by the manager's on_sync, drained after each step
        self.versions: dict[str, str] = {}  # python/torch/CUDA/... of this process, in every heartbeat

    # ------------------------------------------------------------ records
    def heartbeat(self, state: str, **extra: Any) -> None:
        live = dict(self.progress.fields) if self.progress is not None else {}
        fields = {"round": live.pop("round", None), "step": live.pop("step", None), **extra}
        record = Heartbeat(rank=self.rank, state=HeartbeatState(state), time=time.time(), pid=os.getpid(),
                           versions=self.versions, progress=live, **fields)
        self.store.put_json(layout.heartbeat_key(self.rank), record.to_json())

    def flush_metrics(self) -> None:
        """Write the step rows of an unfinished round (round objects are written as rounds end)."""
        self.metrics.flush()

    def on_step(self, round: int, step: int, out: dict[str, Any], dt: float) -> None:
        """After every inner step: its metrics row, one log line, and a progress heartbeat when due."""
        H = self.spec.inner_steps
        run_step = round * H + (step - 1) % H + 1  # 1-based inner step of the run (resumes continue it)
        self.metrics.step({"step": run_step, "round": round, "time_s": dt, **out})
        logger.info("round %d/%d step %d/%d loss %.4f%s %.3fs", round + 1, self.spec.rounds, run_step,
                    self.spec.rounds * H, out.get("loss", float("nan")),
                    f" reward {out['reward_mean']:.3f}" if "reward_mean" in out else "", dt)
        if self.progress is not None and self.progress.update(round=round, step=run_step, out=out, step_s=dt):
            self.heartbeat("running")

    # ------------------------------------------------------------ main loop
    def install_user_code(self) -> None:
        """Put the run's user code (``[code]``, ``module:factory`` settings) on ``sys.path``, verified.

        The digest comes from the job's environment when the executor set it
        (not from the store, which anyone with bucket access could change).
        """
        from composer_cloud.usercode import CodeRef, install_code, localize_spec

        raw = os.environ.get(env.CODE_REF)
        ref_json = json.loads(raw) if raw else self.spec.code.ref
        self.spec = localize_spec(self.store, self.spec)  # uploaded local files (model dir, data) -> local copies
        if not ref_json:
            return
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "composer-cloud" / "code"
        where = install_code(self.store, CodeRef.from_json(ref_json), cache_dir=cache)
        logger.info("user code %s installed at %s", ref_json.get("modules"), where)

    def run(self) -> None:
        from composer_cloud.model import load_spec_model
        from composer_cloud.trainer import TrainerContext, build_trainer

        self.install_user_code()
        spec = self.spec
        device = torch.device("cuda" if spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
                              else "cpu")
        torch.manual_seed(spec.seed)
        model, tokenizer = load_spec_model(spec.model, seed=spec.seed, device=device)
        trainer = build_trainer(spec.trainer.name, TrainerContext(
            model=model, tokenizer=tokenizer, rank=self.rank, world_size=spec.replicas, seed=spec.seed,
            device=device, settings=spec.trainer.settings(),
            inner_optimizer=spec.inner_optimizer.model_dump(mode="json")))
        if spec.sync.mode == "decoupled":  # no barrier: its own loop (docs/decoupled.md)
            from composer_cloud.decoupled_loop import run_decoupled

            run_decoupled(self, model, trainer, device)
            return

        start = self._resume_point()
        start_round = start.round + 1 if start else 0
        loop = build_diloco(store=self.store, rank=self.rank, model=model, inner_optimizer=trainer.optimizer,
                            config=LockstepConfig.from_spec(spec), hooks=self.hooks, start_round=start_round,
                            on_sync=self._syncs.append)
        manager = loop.manager
        if start is not None:
            self._restore(start, loop, trainer)
        self.versions = runtime_versions(device=device.type)
        self.progress = Progress(every_s=spec.progress_every_s, total_steps=spec.rounds * spec.inner_steps)
        self.heartbeat("running", round=manager.current_step(), step=start_round * spec.inner_steps)
        logger.info("replica %d/%d on %s: %s, starting at round %d of %d", self.rank, spec.replicas, device,
                    spec.model.name, start_round, spec.rounds)

        step = 0
        round_losses: list[float] = []
        round_rewards: list[float] = []
        round_start = time.monotonic()
        compute_s = 0.0
        with loop:
            while manager.current_step() < spec.rounds:
                if step % spec.inner_steps == spec.inner_steps // 2:
                    self.hooks.at("inner_step", manager.current_step(), self.rank)
                round_now = manager.current_step()  # the round this step belongs to (a sync may end it)
                t0 = time.monotonic()
                out = trainer.step()
                dt = time.monotonic() - t0
                in_sync = self._syncs[-1].result.wall_s if self._syncs and self._syncs[-1].result else 0.0
                dt += self.hooks.after_step(self.rank, dt - in_sync)  # simulated slow hardware counts as compute
                step += 1
                round_losses.append(out.get("loss", float("nan")))
                if "reward_mean" in out:
                    round_rewards.append(out["reward_mean"])
                self.on_step(round_now, step, out, dt)
                if not self._syncs:
                    compute_s += dt
                    continue
                # A sync happened inside this step (DiLoCo's optimizer post-hook); once step()
                # returned, the model holds the new global parameters.
                rec = self._syncs[-1]
                self._syncs.clear()
                res = rec.result
                sync_s = res.wall_s if res else 0.0
                compute_s += max(0.0, dt - sync_s)
                row = {"round": rec.round, "committed": rec.committed,
                       "healed_to": rec.healed_to, "participants": res.participants if res else [],
                       "train_loss": sum(round_losses) / len(round_losses),
                       "compute_s": compute_s, "sync_s": sync_s,
                       "quorum_wait_s": res.quorum_wait_s if res else 0.0,
                       "bytes_read": res.bytes_read if res else 0, "bytes_written": res.bytes_written if res else 0,
                       "wall_s": time.monotonic() - round_start}
                if round_rewards:
                    row["reward_mean"] = sum(round_rewards) / len(round_rewards)
                if rec.committed and res is not None:
                    self._after_commit(rec.round, res.attempt, res.participants, loop, trainer, row)
                self._reap_io()
                self.metrics.round(row)
                self.heartbeat("running", round=manager.current_step())
                round_losses, round_rewards, compute_s, round_start = [], [], 0.0, time.monotonic()
        manager.flush_state()
        for fut in self._pending_io:
            fut.result()
        if manager.current_step() > 0:
            loop.verify_durable(manager.current_step() - 1)
        loop.close()
        self.flush_metrics()
        self.heartbeat("completed", round=manager.current_step(), params_sha256=params_digest(model))
        logger.info("replica %d completed %d rounds", self.rank, manager.current_step())

    def _reap_io(self) -> None:
        """Raise the error of any finished background write; keep the unfinished ones."""
        still = []
        for fut in self._pending_io:
            if fut.done():
                fut.result()
            else:
                still.append(fut)
        self._pending_io = still

    def _after_commit(self, round: int, attempt: int, participants: list[int], loop: OuterLoop, trainer: Any,
                      row: dict[str, Any]) -> None:
        """Checkpoint round ``round``: my inner state, then my slice of the global state, then the manifest.

        Ordering: the inner state is written before this replica's global slice
        (the slice upload waits for it), so a replica killed during the global
        upload has a complete inner state for ``round`` and resumes it exactly.
        Every participant then tries to write the manifest (write-once): no
        checkpoint depends on one replica surviving.
        """
        spec = self.spec
        if self.rank == min(participants) and hasattr(trainer, "evaluate"):
            row.update(trainer.evaluate())
        if (round + 1) % spec.checkpoint_every and round + 1 != spec.rounds:
            loop.manager.publish_state()  # global state every round: healers need it
            return
        local = None
        if spec.sync.fragments > 1:  # parameters of not-yet-synced fragments are local
            local = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
        # At most one of this replica's state writes in flight: if the store
        # is slower than the rounds, wait here (and record it) rather than
        # queue full snapshots. Manifest writers are not waited on: they wait
        # for other replicas, which may be gone.
        t0 = time.monotonic()
        if self._state_write is not None:
            self._state_write.result()
            self._state_write = None
        row["checkpoint_wait_s"] = time.monotonic() - t0
        # Snapshot on the critical path (training mutates optimizer state next
        # step), then encode and upload in the background.
        t0 = time.monotonic()
        tree = _snapshot(replica_state(trainer, local))
        row["checkpoint_snapshot_s"] = time.monotonic() - t0
        self._state_write = self._io.submit(self.replica_states.write, round, self.rank, tree,
                                            world_size=spec.replicas)
        self._pending_io.append(self._state_write)
        loop.manager.publish_state(after=self._state_write)

        def finish() -> None:
            if manifests.write_manifest(self.global_states, self.replica_states, round, attempt, participants,
                                        deadline_s=spec.sync.round_timeout_s,
                                        extra={"replicas_launched": spec.replicas}):
                manifests.prune(self.global_states, keep=spec.keep_checkpoints, newest=round)
                cleanup_rounds(self.store, before=round)
        self._pending_io.append(self._manifest_io.submit(finish))

    def _resume_point(self) -> ResumePoint | None:
        """Where to start: the newest durable round, with my own inner state if I wrote it.

        A replica restarted right after a commit it took part in waits (up to
        ``round_timeout_s``) for that round's global state to become durable:
        the surviving participants write the missing slices, and resuming that
        round with my own inner state is exact.
        """
        committed = latest_committed_round(self.store)
        attempt = rounds.committed_attempt(self.store, committed) if committed >= 0 else None
        if (attempt is not None and self.replica_states.marker(committed, self.rank) is not None
                and not self.global_states.durable(committed, attempt)):
            logger.info("replica %d: waiting for round %d's global state to become durable", self.rank, committed)
            try:
                poll_until(lambda: True if self.global_states.durable(committed, attempt) else None,
                           deadline=time.monotonic() + self.spec.sync.round_timeout_s,
                           policy=PollPolicy(initial_s=0.2, max_s=2.0),
                           on_timeout=lambda waited: TimeoutError(waited))
            except TimeoutError:
                logger.warning("replica %d: round %d's global state did not become durable within "
                               "round_timeout_s; resuming from an earlier round", self.rank, committed)
        durable = self.global_states.durable_rounds(rounds.attempt_of(self.store))
        return self.replica_states.resume_point(self.rank, world_size=self.spec.replicas, durable_rounds=durable)

    def _restore(self, start: ResumePoint, loop: OuterLoop, trainer: Any) -> None:
        """Load global state into DiLoCo and the model, and this replica's inner state if present."""
        attempt = rounds.committed_attempt(self.store, start.round)
        assert attempt is not None  # a durable round is a committed one
        loop.restore(self.global_states.load(start.round, attempt))
        if start.replica_crc32 is None:
            logger.warning("%s: fresh inner state from global params", start.reason)
            return
        try:
            tree = self.replica_states.load(start.round, self.rank, start.replica_crc32)
        except CorruptCheckpoint as exc:
            logger.warning("%s; replica %d continues with fresh inner state from global params", exc, self.rank)
            return
        local = restore_replica_state(trainer, tree)
        if local:
            with torch.no_grad():
                for name, p in trainer.model.named_parameters():
                    p.copy_(local[name])
        logger.info("replica %d resumed from checkpoint %d", self.rank, start.round)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="composer_cloud.replica", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run URI, <store>/<run_id>")
    parser.add_argument("--rank", required=True, type=int)
    args = parser.parse_args(argv)
    # UTC ISO timestamps: `composer-cloud logs` merges replicas by time and filters with --since.
    logging.Formatter.converter = time.gmtime
    logging.basicConfig(level=os.environ.get(env.LOG_LEVEL, "INFO"), datefmt="%Y-%m-%dT%H:%M:%S",
                        format=f"%(asctime)s.%(msecs)03dZ r{args.rank} %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    torch.set_num_threads(int(os.environ.get(env.THREADS, "1")) or 1)
    replica = None
    try:
        replica = Replica(args.run, args.rank)
        replica.run()
        return 0
    except Exception as exc:
        logger.error("replica %d failed: %s", args.rank, exc)
        traceback.print_exc()
        if replica is not None:
            try:
                replica.flush_metrics()
                replica.heartbeat("failed", error=f"{type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
