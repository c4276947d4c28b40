"""A run as seen from outside: status and metrics summary.

Everything here is derived from the store plus the executors' own view of
their jobs, so any process that can read the store (another terminal,
another machine) sees the same status.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from composer_cloud.errors import BadObject
from composer_cloud.jobs import ReplicaState, ReplicaStatus, executor_class, get_executor, trusted_handles
from composer_cloud.runs import metrics as _metrics
from composer_cloud.runs import sync_state
from composer_cloud.runs.states import RunState
from composer_cloud.stack import version_skew
from composer_cloud.storage import layout
from composer_cloud.storage.records import Heartbeat, HeartbeatState, StepRow
from composer_cloud.storage.run import Run, cancel_requested, load_handles
from composer_cloud.storage.store import Store
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore
from composer_cloud.sync.checkpoint.manifests import Checkpoint, read_manifest

#: What a job's state is once its heartbeat says it ended (the executor may not have noticed yet).
_FINISHED_JOB_STATE = {HeartbeatState.COMPLETED: ReplicaState.SUCCEEDED, HeartbeatState.FAILED: ReplicaState.FAILED}


@dataclass
class ReplicaInfo:
    rank: int
    executor: str
    state: str
    last_round: int | None
    job_id: str = ""
    exit_code: int | None = None
    restarts: int = 0
    message: str = ""
    #: live progress from the heartbeat (None until the replica reported it)
    step: int | None = None
    loss: float | None = None
    reward: float | None = None
    steps_per_s: float | None = None
    tokens_per_s: float | None = None
    #: seconds since the replica process started training; age of its last heartbeat
    elapsed_s: float | None = None
    heartbeat_age_s: float | None = None
    #: "replica", or "rollout-worker" for the job ranks after the replicas ([rollouts] workers)
    role: str = "replica"
    #: a rollout worker's batches published so far (its heartbeat); None for replicas
    batches_published: int | None = None


#: The step-row counters a trainer fed by rollout workers reports (trainer/three_channel/sourced.py writes them;
#: the client reads the rows, never the trainer).
_USED, _STALE, _FALLBACK, _STALENESS = "rollouts/used", "rollouts/stale", "rollouts/fallback", "rollouts/staleness"


@dataclass
class RolloutUse:
    """What the trainer replicas did with the rollout workers' batches: their step rows' counters, summed.

    ``used``: generations trained on a worker's batch; ``stale``: batches refused as older than
    ``rollouts.max_staleness``; ``fallbacks``: generations the trainer sampled itself (no batch by the deadline, or
    one refused); ``staleness``: policy versions behind (rounds) -> steps that trained on a batch that far behind.
    """

    used: int = 0
    stale: int = 0
    fallbacks: int = 0
    staleness: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, rows: Sequence[StepRow]) -> "RolloutUse":
        use = cls()
        for row in rows:
            figures = row.extra
            use.used += int(figures.get(_USED) or 0)
            use.stale += int(figures.get(_STALE) or 0)
            use.fallbacks += int(figures.get(_FALLBACK) or 0)
            behind = figures.get(_STALENESS)
            if isinstance(behind, (int, float)) and behind == behind:  # NaN: no worker batch this step
                use.staleness[int(behind)] = use.staleness.get(int(behind), 0) + 1
        use.staleness = dict(sorted(use.staleness.items()))
        return use


@dataclass(frozen=True)
class WorkerFigures:
    """One rollout worker as the fleet views show it: job ``rank`` (``replicas + w``), its job ``state``, and from
    its heartbeat the batches it published and its sampling rate (completion tokens per second of sampling)."""

    rank: int
    state: str
    batches_published: int
    tokens_per_s: float | None


@dataclass(frozen=True)
class RolloutFleet:
    """The rollout worker fleet of one :class:`RunStatus`, the one summary ``status`` and ``report`` both show.

    Everything is derived from the status (the workers' heartbeats via :class:`ReplicaInfo`, the trainers' step rows
    via :class:`RolloutUse`), never read again: :meth:`from_status` is ``None`` for a run without workers.
    ``tokens_per_s`` is summed over the workers (a worker without a rate counts 0).
    """

    workers: list[WorkerFigures]
    running: int
    batches_published: int
    tokens_per_s: float
    use: RolloutUse | None

    @classmethod
    def from_status(cls, status: "RunStatus") -> "RolloutFleet | None":
        infos = [r for r in status.replicas if r.role != "replica"]
        if not infos:
            return None
        workers = [WorkerFigures(rank=r.rank, state=r.state, batches_published=r.batches_published or 0,
                                 tokens_per_s=r.tokens_per_s) for r in infos]
        return cls(workers=workers, running=sum(r.state in ("running", "pending") for r in infos),
                   batches_published=sum(w.batches_published for w in workers),
                   tokens_per_s=sum(w.tokens_per_s or 0.0 for w in workers), use=status.rollouts)

    def line(self) -> str:
        """``rollout workers: 2 (2 running), 14 batches published, 35.2 tokens/s; trainers used 12, refused 0 as
        stale, sampled 0 themselves; policy versions behind (steps): 0 behind: 4, 1 behind: 8``."""
        line = (f"rollout workers: {len(self.workers)} ({self.running} running), {self.batches_published} batches "
                f"published, {self.tokens_per_s:.1f} tokens/s")
        use = self.use
        if use is not None:  # what the trainers did with them (their step rows)
            behind = ", ".join(f"{v} behind: {n}" for v, n in use.staleness.items()) or "-"
            line += (f"; trainers used {use.used}, refused {use.stale} as stale, sampled {use.fallbacks} themselves; "
                     f"policy versions behind (steps): {behind}")
        return line


class StepRowCache:
    """A run's current step rows, each metrics object read once (for :class:`StatusTracker`'s repeated polls).

    Metrics objects are write-once (:mod:`composer_cloud.runs.metrics`): a key's rows never change, so each poll
    lists the objects (one LIST) and the resume points, and GETs only keys it has not read. Which objects count
    is decided again on every poll (:func:`~composer_cloud.runs.metrics.superseded_objects`): rows of an object
    that a later resume or restart superseded are dropped, as :func:`~composer_cloud.runs.metrics.read_rows`
    drops them. An object that read as nothing (damaged, gone, or all rows malformed: logged by the reader) is
    not remembered, so it is read again at the next poll.
    """

    def __init__(self, store: Store, *, threads: int = 8) -> None:
        self.store = store
        self.threads = threads
        self._rows: dict[str, list[StepRow]] = {}  # object key -> its step rows (objects read with >= 1 row)

    def rows(self) -> list[StepRow]:
        """The step rows of the run's current (not superseded) objects, sorted by (round, rank, step)."""
        objs = _metrics.list_objects(self.store)
        stale = _metrics.superseded_objects(objs, _metrics.resume_points(self.store)) if objs else set()
        current = [o for o in objs if o.key not in stale]
        new = [o for o in current if o.key not in self._rows]
        if new:
            with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(new)))) as pool:
                for o, rows in zip(new, pool.map(lambda o: _metrics.read_object(self.store, o), new)):
                    if rows:
                        self._rows[o.key] = [r for r in rows if isinstance(r, StepRow)]
        for key in stale:  # superseded for good: a later launch or writer replaced it
            self._rows.pop(key, None)
        out = [r for o in current for r in self._rows.get(o.key, [])]
        out.sort(key=lambda r: (r.round, r.rank, r.step or 0))
        return out


@dataclass
class RunStatus:
    run_id: str
    run_uri: str
    state: RunState
    rounds: int
    rounds_committed: int
    replicas: list[ReplicaInfo] = field(default_factory=list)
    #: newest round (0-based, as under ``checkpoints/``) whose global state is durable; None if none yet
    last_durable_round: int | None = None
    #: what keeps a finished run from counting as completed, or what status could not read
    problems: list[str] = field(default_factory=list)
    #: things worth knowing that do not stop the run (e.g. replicas on different numeric stacks)
    warnings: list[str] = field(default_factory=list)
    #: the store error of the last poll, when the store could not be read (the rest is from the poll before)
    store_error: str | None = None
    #: total inner steps of the run (rounds x inner_steps) and the furthest step a replica reported
    total_steps: int = 0
    step: int | None = None
    #: wall seconds since launch (the spec's write time is not tracked: the earliest replica start)
    elapsed_s: float | None = None
    #: seconds left at the current rate (slowest running replica's steps/s); None when unknown
    eta_s: float | None = None
    #: the spec's ``sync.mode``: decoupled runs count merges (``rounds_committed``) and contributions, not rounds
    sync_mode: str = "lockstep"
    #: with ``[rollouts] workers``: what the trainers did with the workers' batches (None without workers)
    rollouts: RolloutUse | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _final_name(spec: Any, final: int) -> str:
    """The last round (lock-step) or the final version (decoupled: merged versions, not rounds)."""
    return f"final version {final}" if spec.sync.mode == "decoupled" else f"round {spec.rounds}/{spec.rounds}"


def _heartbeat(store: Store, rank: int, problems: list[str]) -> Heartbeat | None:
    try:
        return Heartbeat.from_json(store.try_get_json(layout.heartbeat_key(rank)), rank=rank)
    except BadObject as exc:
        problems.append(f"heartbeat of replica {rank} unreadable ({exc})")
        return None


class StatusTracker:
    """Polls one run again and again without redoing finished work (the ``wait``/watch loop).

    * one executor object per backend for the tracker's life, not one per poll;
    * round discovery resumes from the last committed round it saw (rounds
      commit in order; a durable round is committed), not from round 0;
    * a job seen in a terminal state is not polled again.
    """

    def __init__(self, run: Run, *, poll_executors: bool = True) -> None:
        self.run = run
        self.poll_executors = poll_executors
        self._executors: dict[str, Any] = {}
        self._terminal: dict[tuple[int, str], ReplicaStatus] = {}
        self._committed = 0  # rounds known committed (a count)
        self._durable: int | None = None  # newest round seen durable
        self._states = GlobalStateStore(run.store)
        self._attempt_of = sync_state.attempt_of(run.store, run.spec)
        self._verified: set[tuple[int, int, float]] = set()  # final checkpoints read back in full
        self._step_rows = StepRowCache(run.store)  # [rollouts] workers: the trainers' step rows, read incrementally

    def _newest_durable(self) -> int | None:
        """Newest round with a durable global state, checking newest first and nothing below the last seen."""
        newest = self._states.newest_durable(self._attempt_of, above=-1 if self._durable is None else self._durable)
        if newest is not None:
            self._durable = newest
        return self._durable

    def _latest_model(self, final: int | None) -> Checkpoint | None:
        """The run's latest durable model (:func:`~composer_cloud.runs.sync_state.latest_model`), the answer
        ``export`` gives too. The final round's checkpoint is read back in full once (then remembered for
        this tracker), before the run is called completed; earlier ones only by manifest and markers."""
        # A checkpoint without a manifest is normal while replicas write it: no warning (problems name it).
        found = sync_state.latest_model(self.run.store, self.run.spec, verify=False, pending_ok=True)
        if found is None or found.round != final:
            return found
        tag = (found.round, found.manifest.attempt, found.manifest.time)
        if tag not in self._verified:
            checked = sync_state.latest_model(self.run.store, self.run.spec, verify=True, pending_ok=True)
            if checked is None or (checked.round, checked.manifest.attempt, checked.manifest.time) != tag:
                return checked
            self._verified.add(tag)
        return found

    def _final_problem(self, final: int | None) -> str:
        """What keeps the final round (or version) from being the run's durable model, for ``problems``."""
        spec = self.run.spec
        if final is None:
            return "the final version is not recorded yet"
        name = _final_name(spec, final)
        attempt = self._attempt_of(final)
        if attempt is None:
            return f"{name}: no valid commit and no verified manifest"
        if not self._states.durable(final, attempt):
            return f"{name} committed (attempt {attempt}) but its global state is not durable"
        manifest = read_manifest(self._states, final)
        if manifest is None:
            return f"{name} has no checkpoint manifest yet"
        if manifest.attempt != attempt:
            return (f"{name}: the manifest names attempt {manifest.attempt}, but attempt {attempt} is the "
                    "round's commit (a manifest for it is not written yet)")
        return f"{name}: its checkpoint does not verify (corrupt or incomplete; export falls back to an earlier one)"

    def _job_status(self, h: Any) -> ReplicaStatus:
        if not self.poll_executors:
            return ReplicaStatus(ReplicaState.PENDING)
        key = (h.rank, h.job_id)
        if key in self._terminal:
            return self._terminal[key]
        try:
            ex = self._executors.get(h.executor) or self._executors.setdefault(
                h.executor, get_executor(h.executor, self.run.spec, run_key=self.run.run_key))
            status = ex.poll(h)
        except Exception as exc:  # noqa: BLE001 - status must still render
            return ReplicaStatus(ReplicaState.PENDING, None, f"cannot poll: {exc}")
        if status.state.finished:
            self._terminal[key] = status
        return status

    def poll(self) -> RunStatus:
        """The run's state from the store (rounds, heartbeats, checkpoints) and the executors (job states).

        "completed" means the run's latest durable model (:func:`~composer_cloud.runs.sync_state.latest_model`,
        what ``export`` exports) is the final round's: its manifest verified, of the round's committed attempt,
        its objects read back against it. Older round records do not matter (deleted or damaged history does
        not undo a completed run; issue 37, item 5). A run whose jobs all ended short of that is "failed", with
        ``problems`` saying what is missing.
        """
        store, spec = self.run.store, self.run.spec
        problems: list[str] = []
        recorded = load_handles(store)
        handles = trusted_handles(recorded, spec)
        progress = sync_state.progress(store, spec, start=self._committed)
        committed = self._committed = progress.committed
        infos: list[ReplicaInfo] = []
        starts: list[float] = []
        beats: list[float] = []
        stacks: list[dict[str, Any]] = []
        for h in handles:
            beat = _heartbeat(store, h.rank, problems)
            if beat is not None and beat.versions:
                stacks.append({"rank": h.rank, "versions": beat.versions})
            status = self._job_status(h)
            state = status.state.value
            restarts = status.restarts if status.restarts is not None else h.restarts
            polled = self.poll_executors and not status.message.startswith("cannot poll")
            restarting = (polled and beat is not None and beat.state is HeartbeatState.FAILED
                          and not status.state.finished and restarts < executor_class(h.executor).relaunches(spec))
            if restarting:
                # The replica failed but its job lives on and will start it again (issue 33: the run is
                # judged by what it does next, not by the first crash seen).
                pass
            elif not status.state.finished and beat is not None and beat.state is not HeartbeatState.RUNNING:
                state = _FINISHED_JOB_STATE[beat.state].value
            elif (status.state is ReplicaState.FAILED and status.exit_code is None and beat is not None
                  and beat.state is HeartbeatState.COMPLETED):
                # The job's wrapper died without recording an exit (a killed local supervisor) after the
                # replica itself finished: the replica's own word wins, the run did not fail.
                state = ReplicaState.SUCCEEDED.value
            beat_time = beat.time if beat is not None and beat.time > 0 else None
            loss = None if beat is None else beat.number("loss_ema")
            infos.append(ReplicaInfo(
                rank=h.rank, executor=h.executor, state=state, last_round=beat.round if beat else None,
                job_id=h.job_id, exit_code=status.exit_code, restarts=restarts,
                message=(f"restarting after: {beat.error}" if restarting and beat is not None else
                         (beat.error if beat else "") or status.message), step=beat.step if beat else None,
                loss=loss if loss is not None or beat is None else beat.number("loss"),
                reward=beat.number("reward") if beat else None,
                steps_per_s=beat.number("steps_per_s") if beat else None,
                tokens_per_s=beat.number("tokens_per_s") if beat else None,
                elapsed_s=beat.number("elapsed_s") if beat else None,
                heartbeat_age_s=None if beat_time is None else max(0.0, time.time() - beat_time),
                role="rollout-worker" if h.rank in spec.worker_ranks else "replica",
                batches_published=None if beat is None or h.rank not in spec.worker_ranks else
                int(beat.number("batches_published") or 0)))
            if beat_time is not None:
                beats.append(beat_time)
            started = beat.number("started_at") if beat else None
            if started is not None:
                starts.append(started)
        last_durable = self._newest_durable()
        final = sync_state.final_round(spec, progress)
        model = self._latest_model(final)
        final_durable = final is not None and model is not None and model.round == final
        if model is not None:  # a durable model at round r means r + 1 rounds committed, whatever the records say
            committed = max(committed, model.round + 1)
            last_durable = model.round if last_durable is None else max(last_durable, model.round)
        if not final_durable and progress.final is not None:
            problems.append(self._final_problem(final))
        cancelled = cancel_requested(store)
        finished = all(i.state in ("succeeded", "failed", "cancelled") for i in infos) if infos else False
        if cancelled:
            state = RunState.CANCELLED
        elif final_durable and (finished or not infos):
            state = RunState.COMPLETED
        elif finished:
            state = RunState.FAILED
        elif not recorded and not store.list(layout.HEARTBEATS):
            # Written, but no replica job was recorded and no replica ever reported (a launch or resume
            # interrupted before its jobs started): nothing runs. `resume` starts it, `rm` deletes it.
            state = RunState.NOT_STARTED
            problems.append("no replica job was started (the launch was interrupted); start it with "
                            "`composer-cloud resume`, or delete it with `composer-cloud rm`")
        else:
            state = RunState.RUNNING
        total = spec.rounds * spec.inner_steps
        steps = [i.step for i in infos if i.step is not None]
        step = max(steps) if steps else None
        if state == RunState.COMPLETED:
            step = total
        rates = [i.steps_per_s for i in infos if i.state == "running" and i.steps_per_s]
        eta = None
        if state == RunState.RUNNING and rates and steps:
            # The run ends when its slowest replica does (every round waits for the quorum).
            eta = _metrics.eta_s(step=min(s for s in steps), total_steps=total, steps_per_s=min(rates))
        elapsed = None
        if starts:  # until now, or until the last heartbeat of a finished run
            end = time.time() if state == RunState.RUNNING or not beats else max(beats)
            elapsed = max(0.0, end - min(starts))
        warnings = [f"replicas run different stacks: {w}" for w in version_skew(stacks)]
        if state.is_terminal:  # once, at the end: did it train at all (runs/signal.py)?
            from composer_cloud.runs.signal import diagnose_rounds
            from composer_cloud.trainer.settings import declared_settings

            warnings += diagnose_rounds(self._step_rows.rows(),
                                        declared_settings(spec.trainer.name, spec.trainer.settings()),
                                        decoupled=spec.sync.mode == "decoupled")
        rollouts = None
        if spec.rollouts.workers:  # each metrics object read once per tracker (write-once), new ones per poll
            rollouts = RolloutUse.from_rows(self._step_rows.rows())
        return RunStatus(run_id=spec.run_id, run_uri=store.uri, state=state, rounds=spec.rounds,
                         rounds_committed=committed, replicas=infos, last_durable_round=last_durable,
                         problems=problems, warnings=warnings,
                         total_steps=total, step=step, elapsed_s=elapsed, eta_s=eta, sync_mode=spec.sync.mode,
                         rollouts=rollouts)


def run_status(run: Run, *, poll_executors: bool = True) -> RunStatus:
    """The run's state now (one poll; see :class:`StatusTracker` for repeated polls)."""
    return StatusTracker(run, poll_executors=poll_executors).poll()


def read_metrics(store: Store, rank: int | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """The run's metric rows (one replica's with ``rank``); see :func:`composer_cloud.runs.metrics.read_metrics`."""
    return _metrics.read_metrics(store, rank=rank, **kwargs)


def exit_reason(code: int | None, state: str) -> str:
    """A replica's exit for people: ``0``, ``1``, ``killed (SIGKILL)`` for -9 (a signal), ``-`` when unknown."""
    if code is None:
        return "unknown" if state == "failed" else "-"
    if code < 0:
        try:
            return f"killed ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return str(code)
