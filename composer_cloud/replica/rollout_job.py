"""A rollout worker's job: what ``python -m composer_cloud.replica --run RUN --rank R`` runs for a worker rank.

A run with ``[rollouts] workers = N`` has ``replicas + N`` jobs on the executors: ranks ``0 .. replicas - 1`` are
replicas, ranks ``replicas + w`` are rollout worker ``w`` (``RunSpec.worker_ranks``). Every executor launches,
restarts, polls, cancels and logs them as it does replicas (the same job mechanism, the same handles under
``executor/<rank>.json``), and a worker heartbeats at ``replicas/<rank>.json`` like a replica, with its fleet
figures (batches published, tokens/s, busy fraction) in the heartbeat's progress fields, so ``status`` lists it.

The job opens the run (refused without the run key of a signed run), installs the run's user code (a custom task
or reward lives there), builds the model and tokenizer from the spec exactly as the replicas do, and serves
requests (:class:`~composer_cloud.rollouts.worker.RolloutWorker`) until

* every replica's heartbeat says completed (exit 0), or
* the run was cancelled (exit 0), or
* every replica's heartbeat has said completed or failed for ``deadline_s`` (a failed run: exit 0, the replicas'
  heartbeats carry the error).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from composer_cloud.env import JobEnv
from composer_cloud.replica.usercode import install_code, localize_spec
from composer_cloud.rollouts.fallback import worker_policy
from composer_cloud.rollouts.worker import RolloutWorker, WorkerConfig
from composer_cloud.spec_sync import SyncSpec
from composer_cloud.stack import check_packages, runtime_versions
from composer_cloud.storage import layout
from composer_cloud.storage.records import CodeRef, Heartbeat, HeartbeatState
from composer_cloud.storage.run import Run, cancel_requested, open_run

logger = logging.getLogger(__name__)

#: Seconds between polls of the request listing when the last poll served nothing.
IDLE_POLL_S = 0.1


def publishes_chain(spec: Any) -> bool:
    """Whether the replicas publish the policy chain for this spec (the workers then read it, else checkpoints)."""
    try:
        from composer_cloud.rollouts.policy import should_publish
    except ImportError:
        return False
    return bool(should_publish(spec))


class RolloutJob:
    """Rollout worker ``rank - replicas`` of the run at ``run_uri`` (see the module)."""

    def __init__(self, run_uri: str, rank: int, *, job_env: JobEnv) -> None:
        run = open_run(run_uri, outage_s=SyncSpec().store_outage_s, job_env=job_env)
        self.opened: Run = open_run(run_uri, outage_s=run.spec.sync.store_outage_s, job_env=job_env)
        spec = self.opened.spec
        if rank not in spec.worker_ranks:
            raise ValueError(f"--rank {rank} is not a rollout worker's: the run has {spec.replicas} replicas and "
                             f"{spec.rollouts.workers} rollout workers (ranks {spec.replicas} to "
                             f"{spec.replicas + spec.rollouts.workers - 1})")
        self.rank = rank
        self.index = rank - spec.replicas
        self.job_env = job_env
        self.versions: dict[str, str] = {}
        self.started_at = time.time()

    def heartbeat(self, state: HeartbeatState, *, progress: dict[str, Any] | None = None, error: str = "") -> None:
        record = Heartbeat(rank=self.rank, state=state, time=time.time(), pid=os.getpid(), versions=self.versions,
                           progress={"role": "rollout-worker", "worker": self.index, "started_at": self.started_at,
                                     **(progress or {})}, error=error)
        self.opened.store.put_json(layout.heartbeat_key(self.rank), record.to_json())

    def _install_user_code(self) -> None:
        store, cache = self.opened.store, self.job_env.cache_dir
        spec = localize_spec(store, self.opened.spec, cache_dir=cache, files=self.job_env.files)
        self.opened = Run(uri=self.opened.uri, store=store, spec=spec)
        ref_json = self.job_env.code_ref or spec.code.ref
        if ref_json:
            install_code(store, CodeRef.from_json(ref_json), cache_dir=cache / "code")

    def _replicas_done(self) -> HeartbeatState | None:
        """COMPLETED when every replica's heartbeat says so; FAILED when each says completed or failed; else None."""
        states = []
        for rank in range(self.opened.spec.replicas):
            beat = Heartbeat.from_json(self.opened.store.try_get_json(layout.heartbeat_key(rank)), rank=rank)
            if beat is None or beat.state is HeartbeatState.RUNNING:
                return None
            states.append(beat.state)
        return HeartbeatState.COMPLETED if all(s is HeartbeatState.COMPLETED for s in states) else HeartbeatState.FAILED

    def build(self) -> RolloutWorker:
        spec = self.opened.spec
        device = torch.device("cuda" if spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
                              else "cpu")
        # The one build of a worker's policy stack: a trainer's fallback builds the same (rollouts/fallback.py).
        sampler, versions = worker_policy(self.opened.store, spec, device)
        self.versions = runtime_versions(device=device.type)
        config = WorkerConfig(index=self.index, workers=spec.rollouts.workers, seed=spec.seed,
                              max_staleness=spec.rollouts.max_staleness, deadline_s=spec.rollouts.deadline_s)
        return RolloutWorker(self.opened.store, config=config, sampler=sampler, versions=versions)

    def run(self) -> None:
        check_packages(self.opened.spec)
        self._install_user_code()
        worker = self.build()
        spec, store = self.opened.spec, self.opened.store
        self.heartbeat(HeartbeatState.RUNNING)
        logger.info("rollout worker %d/%d (job rank %d) serving replicas %s", self.index, spec.rollouts.workers,
                    self.rank, [r for r in range(spec.replicas) if r % spec.rollouts.workers == self.index])
        last_beat = time.monotonic()
        failed_since: float | None = None
        while True:
            if cancel_requested(store):
                logger.info("rollout worker %d: the run was cancelled", self.index)
                break
            served = worker.serve_once()
            now = time.monotonic()
            if now - last_beat >= spec.progress_every_s:
                self.heartbeat(HeartbeatState.RUNNING, progress=worker.stats.progress())
                last_beat = now
            if served:
                continue
            done = self._replicas_done()
            if done is HeartbeatState.COMPLETED:
                logger.info("rollout worker %d: every replica completed", self.index)
                break
            failed_since = (failed_since or now) if done is HeartbeatState.FAILED else None
            if failed_since is not None and now - failed_since >= spec.rollouts.deadline_s:
                logger.info("rollout worker %d: every replica has stopped (some failed); stopping", self.index)
                break
            time.sleep(IDLE_POLL_S)
        self.heartbeat(HeartbeatState.COMPLETED, progress=worker.stats.progress())

    def report_failure(self, exc: BaseException) -> None:
        """Best effort: a failed heartbeat naming the error."""
        self.heartbeat(HeartbeatState.FAILED, error=f"{type(exc).__name__}: {exc}")


__all__ = ["IDLE_POLL_S", "RolloutJob", "publishes_chain"]
