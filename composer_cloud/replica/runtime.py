"""One replica of a run: build the model and trainer, run THE inner loop, report.

Every executor runs ``python -m composer_cloud.replica --run RUN_URI --rank R``
(:mod:`composer_cloud.replica.__main__`), which builds a :class:`Replica` and
calls :meth:`Replica.run`. The loop is the same in both sync modes: inner steps
of the trainer, each with its metrics row, log line and progress heartbeat,
and a *boundary* every round that the sync mode's :class:`Boundary` strategy
handles:

* lock-step (:class:`~composer_cloud.replica.lockstep.LockstepBoundary`): the
  sync happens inside ``trainer.step()`` (torchft DiLoCo's optimizer
  post-hook); after the step the boundary checkpoints in order (inner state,
  then this replica's slice of the global state, then the manifest);
* decoupled (:class:`~composer_cloud.replica.decoupled.DecoupledBoundary`):
  after every ``inner_steps`` steps it publishes the contribution, may merge,
  and adopts the newest global.

Everything a replica reports goes to the store: ``replicas/<rank>.json``
(heartbeat), ``metrics/<rank>/...`` (:mod:`~composer_cloud.replica.telemetry`),
and the checkpoints its boundary writes.

The boundaries tell the trainer when its parameters were replaced outside
its optimizer (``on_params_replaced()``, :mod:`composer_cloud.replica.boundary`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from composer_cloud.env import JobEnv
from composer_cloud.hooks import Hooks
from composer_cloud.lora import sync_footprint
from composer_cloud.replica.boundary import Boundary, ReplicaContext, Segment
from composer_cloud.replica.decoupled import DecoupledBoundary
from composer_cloud.replica.launch import LocalRanks, init_local_group
from composer_cloud.replica.lockstep import LockstepBoundary
from composer_cloud.replica.telemetry import Telemetry, run_step_number
from composer_cloud.replica.usercode import install_code, localize_spec
from composer_cloud.round_numbers import shown_round
from composer_cloud.spec_sync import SyncSpec
from composer_cloud.stack import check_packages, runtime_versions
from composer_cloud.storage.records import CodeRef, HeartbeatState
from composer_cloud.storage.records.metrics import RoundRow
from composer_cloud.storage.run import Run, open_run
from composer_cloud.sync.lockstep.sharded import LocalShard
from composer_cloud.trainer.parallel import check_local_ranks

logger = logging.getLogger(__name__)


class Replica:
    """One replica of a run: trains, syncs through the store, checkpoints, reports.

    Opening the run is the first thing it does: a signed run without the run
    key (or an unsigned one with it) is refused there, before anything is written.
    """

    def __init__(self, run_uri: str, rank: int, *, job_env: JobEnv, hooks: Hooks,
                 local: LocalRanks = LocalRanks()) -> None:
        # Every store access rides out an outage, the first one too: a replica that starts (or restarts)
        # while the store is down must not burn its restarts in a second. Until the spec is read, the
        # budget is the spec's default; then the run's own.
        run = open_run(run_uri, outage_s=SyncSpec().store_outage_s, job_env=job_env)
        self.opened = open_run(run_uri, outage_s=run.spec.sync.store_outage_s, job_env=job_env)
        spec = self.opened.spec
        if not 0 <= rank < spec.replicas:
            raise ValueError(f"--rank {rank} out of range: the run has {spec.replicas} replicas")
        if local.count != spec.gpus_per_replica:
            raise ValueError(f"--local-ranks {local.count}: the run has gpus_per_replica = {spec.gpus_per_replica}")
        check_local_ranks(spec)
        self.rank = rank
        self.local = local
        #: With ``[rollouts] workers``: the trainer's completion source (its counters go into the step rows).
        self.rollout_source: Any = None
        self.job_env = job_env
        self.hooks = hooks
        # Local rank 0 reports for the replica (heartbeats, metrics); the other ranks of a multi-GPU replica
        # write only their shard's objects.
        self.telemetry = (Telemetry if local.leader else QuietTelemetry)(
            self.opened.store, rank, rounds=spec.rounds, inner_steps=spec.inner_steps,
            progress_every_s=spec.progress_every_s, decoupled=spec.sync.mode == "decoupled")

    def install_user_code(self) -> None:
        """Local copies of the files the spec names, and the run's user code on ``sys.path``, both verified.

        The digests come from the job's environment when the executor set them
        (not from the store, which anyone with bucket access could change).
        """
        store, cache = self.opened.store, self.job_env.cache_dir
        spec = localize_spec(store, self.opened.spec, cache_dir=cache, files=self.job_env.files)
        self.opened = Run(uri=self.opened.uri, store=store, spec=spec)
        ref_json = self.job_env.code_ref or spec.code.ref
        if ref_json:
            where = install_code(store, CodeRef.from_json(ref_json), cache_dir=cache / "code")
            logger.info("user code %s installed at %s", ref_json.get("modules"), where)

    def _build(self) -> ReplicaContext:
        from composer_cloud.model import load_spec_model
        from composer_cloud.trainer import TrainerContext, build_trainer

        spec = self.opened.spec
        device = torch.device("cuda" if spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
                              else "cpu")
        shard = None
        if self.local.count > 1:
            if device.type == "cuda":
                torch.cuda.set_device(self.local.index)
                device = torch.device("cuda", self.local.index)
            group = init_local_group(self.local, device_type=device.type,
                                     timeout_s=spec.sync.quorum_timeout_s + 2 * spec.sync.round_timeout_s)
            shard = LocalShard(index=self.local.index, count=self.local.count, group=group,
                               parallelism=spec.parallelism)
        torch.manual_seed(spec.seed)
        model, tokenizer = load_spec_model(spec.model, seed=spec.seed, device=device)
        trainer = build_trainer(spec.trainer.name, TrainerContext(
            model=model, tokenizer=tokenizer, rank=self.rank, world_size=spec.replicas, seed=spec.seed,
            device=device, settings=spec.trainer.settings(),
            inner_optimizer=spec.inner_optimizer.model_dump(mode="json"), local_rank=self.local.index,
            local_world=self.local.count, parallelism=spec.parallelism))
        if spec.rollouts.workers:
            self.rollout_source = attach_rollout_workers(trainer, self.opened, self.rank, device=device)
        return ReplicaContext(run=self.opened, rank=self.rank, model=model, trainer=trainer, device=device,
                              hooks=self.hooks, telemetry=self.telemetry, shard=shard)

    def run(self) -> None:
        # Before anything loads: a package older than the run needs fails here in one line, not mid-build.
        check_packages(self.opened.spec)
        self.install_user_code()
        ctx = self._build()
        spec = ctx.spec
        boundary: Boundary = DecoupledBoundary(ctx) if spec.sync.mode == "decoupled" else LockstepBoundary(ctx)
        first = boundary.start()
        fp = sync_footprint(ctx.model)  # what every round row says about the synced set (docs/gpu.md)
        self.telemetry.start(runtime_versions(device=ctx.device.type), synced=(fp.synced_params, fp.ratio))
        self.telemetry.heartbeat(HeartbeatState.RUNNING, **first)
        logger.info("replica %d/%d (%s) on %s: %s, %s", self.rank, spec.replicas, spec.sync.mode, ctx.device,
                    spec.model.name, _starting_at(spec, boundary.position))
        source = self.rollout_source
        steps = _inner_loop(ctx, boundary, step_fields=source.take_metrics if source is not None else None)
        final = boundary.finish(steps)
        self.telemetry.flush()
        self.telemetry.heartbeat(HeartbeatState.COMPLETED, **final)
        done = final.get("round", boundary.position)
        logger.info("replica %d completed: %s", self.rank, f"{done} contributions made" if spec.sync.mode == "decoupled"
                    else f"{done} of {spec.rounds} rounds")
        if ctx.shard is not None:
            import torch.distributed as dist

            dist.destroy_process_group()

    def report_failure(self, exc: BaseException) -> None:
        """Best effort: the steps of the unfinished round, and a failed heartbeat naming the error."""
        self.telemetry.flush()
        self.telemetry.heartbeat(HeartbeatState.FAILED, error=f"{type(exc).__name__}: {exc}")


def local_ranks_of(run_uri: str, *, job_env: JobEnv) -> tuple[int, str]:
    """The run's ``gpus_per_replica`` (how many local ranks the replica's entry point starts) and ``device``."""
    spec = open_run(run_uri, outage_s=SyncSpec().store_outage_s, job_env=job_env).spec
    return spec.gpus_per_replica, spec.device


def attach_rollout_workers(trainer: Any, run: Run, rank: int, *, device: torch.device | None = None) -> Any:
    """``[rollouts] workers > 0``: the trainer takes its completions from the rollout workers through the store
    (:class:`~composer_cloud.rollouts.source.StoreCompletionSource`, returned) instead of sampling them itself.
    With ``device`` (the trainer's), a fallback after the deadline is sampled as a worker would sample it
    (:class:`~composer_cloud.rollouts.fallback.WorkerFallback`, built on that device at the first fallback)."""
    from composer_cloud.rollouts.fallback import WorkerFallback
    from composer_cloud.rollouts.source import StoreCompletionSource

    settings = run.spec.rollouts
    attach = getattr(trainer, "set_completion_source", None)
    if attach is None:
        raise ValueError(f"rollouts.workers = {settings.workers}, but trainer {run.spec.trainer.name!r} cannot take "
                         "completions from rollout workers (it has no set_completion_source); set rollouts.workers = 0")
    source = StoreCompletionSource(run.store, replica=rank, max_staleness=settings.max_staleness,
                                   deadline_s=settings.deadline_s, on_deadline=settings.on_deadline,
                                   fallback=None if device is None else WorkerFallback.for_spec(run.store, run.spec,
                                                                                                 device))
    attach(source, max_staleness=settings.max_staleness)
    logger.info("replica %d: completions from %d rollout worker(s) (max_staleness %d, deadline %gs, then %s)", rank,
                settings.workers, settings.max_staleness, settings.deadline_s, settings.on_deadline)
    return source


def worker_rank(run_uri: str, rank: int, *, job_env: JobEnv) -> bool:
    """Whether job rank ``rank`` of the run is a rollout worker's (``replicas <= rank < replicas + workers``)."""
    return rank in open_run(run_uri, outage_s=SyncSpec().store_outage_s, job_env=job_env).spec.worker_ranks


def report_local_failure(run_uri: str, rank: int, *, job_env: JobEnv, error: str) -> None:
    """The agent of a multi-GPU replica: a failed heartbeat naming the local rank that took the job down."""
    run = open_run(run_uri, outage_s=SyncSpec().store_outage_s, job_env=job_env)
    Telemetry(run.store, rank, rounds=run.spec.rounds, inner_steps=run.spec.inner_steps,
              progress_every_s=run.spec.progress_every_s).heartbeat(HeartbeatState.FAILED, error=error)


class QuietTelemetry(Telemetry):
    """The reports of local ranks ``k > 0`` of a multi-GPU replica: none (local rank 0 reports for it)."""

    def start(self, versions: dict[str, str], *, synced: tuple[int, float] | None = None) -> None:
        return None

    def heartbeat(self, state: HeartbeatState, **fields: Any) -> None:
        return None

    def step(self, round: int, step: int, out: dict[str, Any], dt: float) -> None:
        return None

    def round(self, row: RoundRow) -> str:
        return ""

    def flush(self) -> None:
        return None

    def samples(self, round: int, step: int, samples: list[dict[str, Any]]) -> str | None:
        return None


def _starting_at(spec: Any, position: int) -> str:
    """Where a replica starts, as people count: lock-step ``starting at round 3 of 4`` (``position`` is the
    0-based round); decoupled ``starting at contribution 5 (the fleet's budget: 8)`` (``position``: the
    contributions this replica made already), never a round number (issue 34, finding 3)."""
    if spec.sync.mode == "decoupled":
        return f"starting at contribution {position + 1} (the fleet's budget: {spec.replicas * spec.rounds})"
    return f"starting at round {shown_round(position)} of {spec.rounds}"


def _inner_loop(ctx: ReplicaContext, boundary: Boundary, *,
                step_fields: Callable[[], dict[str, float]] | None = None) -> int:
    """THE inner loop of both sync modes; returns the inner steps this process took.

    ``step_fields()`` (the rollout source's counters, with rollout workers) are added to every step's row, after
    the step.
    """
    spec, trainer, hooks, rank = ctx.spec, ctx.trainer, ctx.hooks, ctx.rank
    h = spec.inner_steps
    tokens_per_step = spec.trainer.batch_size * spec.trainer.seq_len
    steps = 0
    segment = Segment()
    take_samples = getattr(trainer, "take_samples", None)
    # Which rollout batch the step consumes when the trainer takes completions from workers: (round, run step).
    set_position = getattr(trainer, "set_rollout_position", None)
    with boundary.session():
        while boundary.running(segment):
            if steps % h == h // 2:
                hooks.at("inner_step", boundary.position, rank)
            position = boundary.position  # the round this step belongs to (a sync inside it may end the round)
            if set_position is not None:
                set_position(position, run_step_number(position, steps + 1, h))
            t0 = time.monotonic()
            out = trainer.step()
            if step_fields is not None:
                out = {**out, **step_fields()}
            dt = time.monotonic() - t0
            sync_s = boundary.sync_s()
            dt += hooks.after_step(rank, dt - sync_s)  # simulated slow hardware counts as compute
            steps += 1
            segment.add(out, compute_s=max(0.0, dt - sync_s), tokens=int(out.get("tokens", tokens_per_step)))
            ctx.telemetry.step(position, steps, out, dt)
            row = boundary.after_step(segment)
            if row is None:
                continue
            ctx.telemetry.round(segment.fill(row))
            if take_samples is not None:  # the trainer's sample completions of the round (trainer.log_samples)
                r = row.round
                ctx.telemetry.samples(r, (r + 1) * h, take_samples())
            ctx.telemetry.heartbeat(HeartbeatState.RUNNING, **boundary.heartbeat_fields(steps))
            segment = Segment()
    return steps


__all__ = ["QuietTelemetry", "Replica", "attach_rollout_workers", "local_ranks_of", "report_local_failure",
           "worker_rank"]
