"""One run of ``benchmarks/chaos.py``: the replica processes, the fault schedule applied to them, the polling.

The harness is the run's executor: it writes the spec through the launch API's checks, starts
``python -m composer_cloud.replica`` per rank, kills, stops and slows them as the schedule says, and reads
their heartbeats and metrics rows back from the store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from chaos_schedule import Config, Event, Schedule, account_rows, duty_cycle, goodput


class Proc:
    """One replica incarnation: the process, its timestamps and its last metrics snapshot."""

    def __init__(self, rank: int, popen: subprocess.Popen, log: Path) -> None:
        self.rank = rank
        self.popen = popen
        self.log = log
        self.spawn_t = time.time()
        self.ready_t: float | None = None
        self.end_t: float | None = None
        self.end: str = ""
        self.rows: list[dict[str, Any]] = []
        self.stopped_s = 0.0

    def record(self) -> dict[str, Any]:
        end = self.end_t or time.time()
        billed = max(0.0, end - self.ready_t) if self.ready_t else 0.0
        return {"rank": self.rank, "pid": self.popen.pid, "spawn_t": self.spawn_t, "ready_t": self.ready_t,
                "end_t": end, "end": self.end, "startup_s": (self.ready_t or end) - self.spawn_t,
                "billed_s": billed, "rows": self.rows, **account_rows(self.rows)}


class Harness:
    """Runs one scenario of one mode to completion and collects what the report needs."""

    def __init__(self, cfg: Config, workdir: Path, model_dir: Path, mode: str, scenario: str,
                 schedule: Schedule) -> None:
        self.cfg, self.workdir, self.model_dir = cfg, workdir, model_dir
        self.mode, self.scenario, self.schedule = mode, scenario, schedule
        self.procs: dict[int, Proc] = {}
        self.history: list[Proc] = []
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()
        self.versions_seen: dict[int, float] = {}
        self.timeline: list[tuple[float, int, int]] = []  # (t, steps, useful steps) over all incarnations
        self.t_ready_all: float | None = None
        self.paused: set[int] = set()  # ranks SIGSTOPped by a "stop" event (the duty cycle leaves them alone)
        self.restarting: set[int] = set()  # ranks killed and waiting out their cold start
        self.run_key: str | None = None  # the signed run's key (write_spec), for the replicas' environment

    # ---------------------------------------------------------------- spec and processes
    def overrides(self, run_id: str, store: str) -> dict[str, Any]:
        c = self.cfg
        o: dict[str, Any] = {
            "run_id": run_id, "store": store, "executor": "local", "replicas": c.replicas,
            "min_replicas": min(c.min_replicas, c.replicas), "rounds": c.rounds, "inner_steps": c.inner_steps,
            "seed": c.seed, "device": "cpu", "checkpoint_every": 1,
            # Every global version stays for the offline evaluation: decoupled mode makes up to one per
            # contribution (rounds x replicas), not one per round.
            "keep_checkpoints": min(10_000, c.rounds * c.replicas + 2),
            "model.name": str(self.model_dir), "inner_optimizer.lr": c.inner_lr,
            "trainer.name": "causal-lm", "trainer.corpus": "stdlib", "trainer.corpus_bytes": c.corpus_bytes,
            "trainer.batch_size": c.batch_size, "trainer.seq_len": c.seq_len,
            # The round leader evaluates after each commit; we evaluate offline, so keep that cheap.
            "trainer.eval_rows": 4,
            "sync.quorum_timeout_s": c.quorum_timeout_s, "sync.round_timeout_s": c.round_timeout_s,
            "sync.mode": self.mode,
        }
        if self.mode == "lockstep":  # a setting decoupled mode never reads is refused (spec_sync.MODE_IGNORES)
            o["sync.heal_timeout_s"] = c.round_timeout_s
        o.update(c.mode_overrides.get(self.mode, {}))
        return o

    def write_spec(self) -> Any:
        """The run's spec through the launch API's checks; returns the run's Store. Raises SpecError."""
        from composer_cloud.runs import lifecycle, signing
        from composer_cloud.storage.layout import SPEC as SPEC_KEY
        from composer_cloud.spec import SpecError

        store_root = f"file://{self.workdir}/store"
        run_id = f"chaos-{self.scenario}-{self.mode}-{uuid.uuid4().hex[:6]}"
        o = self.overrides(run_id, store_root)
        try:
            spec = lifecycle.build_spec(overrides=o)
        except SpecError as exc:
            if exc.field != "sync.mode" or self.mode != "lockstep":
                raise
            # Code from before sync modes existed: lock-step is its only mode.
            o.pop("sync.mode")
            spec = lifecycle.build_spec(overrides=o)
        # Launch's own checks, in launch's order (spec, store probe, signing: signed by default, a fresh key),
        # so that the harness follows launch when it changes. It starts the replicas itself: they get the key
        # in their environment, as the local executor gives it (jobs.environment.job_secrets).
        spec, _, _, store, self.run_key = lifecycle._prepare(spec, None)
        if not store.create_json(SPEC_KEY, spec.to_json_dict()):
            raise RuntimeError(f"run {store.uri} exists")
        signing.remember(store.uri, spec, self.run_key)  # for this process's own reads (open_run), as launch does
        self.spec = spec
        return store

    def spawn(self, rank: int) -> Proc:
        from composer_cloud import env
        from composer_cloud.jobs.base import replica_command
        from composer_cloud.jobs.environment import job_secrets

        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        n = sum(1 for p in self.history if p.rank == rank)
        log = logs / f"{self.scenario}-{self.mode}-r{rank}-{n}.log"
        environ = os.environ | {env.THREADS: str(self.cfg.threads), "PYTHONUNBUFFERED": "1",
                                "TOKENIZERS_PARALLELISM": "false"} | job_secrets(self.run_key)
        with open(log, "wb") as f, open(os.devnull, "rb") as devnull:
            popen = subprocess.Popen(replica_command(self.store.uri, rank, python=sys.executable), stdin=devnull,
                                     stdout=f, stderr=subprocess.STDOUT, env=environ)
        p = Proc(rank, popen, log)
        with self.lock:
            self.procs[rank] = p
            self.history.append(p)
        return p

    def signal(self, p: Proc, sig: int) -> None:
        try:
            os.kill(p.popen.pid, sig)
        except ProcessLookupError:
            pass

    # ---------------------------------------------------------------- polling
    def poll(self) -> None:
        from composer_cloud.errors import StoreError
        from composer_cloud.runs.sync_state import attempt_of
        from composer_cloud.storage.run import open_run
        from composer_cloud.sync.checkpoint.global_state import GlobalStateStore

        now = time.time()
        with self.lock:
            current = dict(self.procs)
        for rank, p in current.items():
            if p.end_t is None and p.popen.poll() is not None:
                p.end_t, p.end = now, p.end or f"exit {p.popen.returncode}"
            if p.end_t is not None and p.rows and p.ready_t:
                continue
            try:
                if p.ready_t is None:
                    hb = self.store.get_json(f"replicas/{rank}.json")
                    if isinstance(hb, dict) and hb.get("pid") == p.popen.pid and hb.get("state") == "running":
                        # The heartbeat's own time: the first one is written when training starts.
                        p.ready_t = float(hb.get("time", now)) if "step" not in hb else now
                if p.ready_t is not None and p.popen.pid is not None:
                    self._read_rows(p)
            except (StoreError, ValueError):
                pass
        steps = useful = 0
        for p in list(self.history):
            acc = account_rows(p.rows)
            steps += acc["steps"]
            useful += acc["useful_steps"]
        self.timeline.append((now, steps, useful))
        try:
            states, run = GlobalStateStore(self.store), open_run(self.store.uri)
            for r in states.durable_rounds(attempt_of(run.store, run.spec)):
                self.versions_seen.setdefault(r, now)
        except StoreError:
            pass

    def _read_rows(self, p: Proc) -> None:
        """This incarnation's metrics rows: the writer (one per replica process) that started while it ran."""
        from composer_cloud.runs.metrics import rows_by_writer
        from composer_cloud.storage.layout import writer_started

        by_writer = rows_by_writer(self.store, p.rank)
        end = p.end_t or time.time()
        mine = [w for w in by_writer if p.spawn_t - 1.0 <= writer_started(w) <= end + 1.0]
        if mine:
            p.rows = by_writer[mine[-1]]

    # ---------------------------------------------------------------- faults
    def slow_loop(self, rank: int) -> None:
        run_s, stop_s = duty_cycle(self.schedule.slow_factor, self.cfg.duty_period_s)
        while not self.stop_flag.is_set():
            p = self.procs.get(rank)
            if p is None or p.end_t is not None:
                time.sleep(0.05)
                continue
            if rank not in self.paused:
                self.signal(p, signal.SIGCONT)
            self.stop_flag.wait(run_s)
            if self.stop_flag.is_set():
                break
            if rank not in self.paused:
                self.signal(p, signal.SIGSTOP)
            self.stop_flag.wait(stop_s)
        p = self.procs.get(rank)
        if p is not None:
            self.signal(p, signal.SIGCONT)

    def run_event(self, ev: Event, t0: float) -> None:
        delay = t0 + ev.t - time.time()
        if self.stop_flag.wait(max(0.0, delay)):
            return
        p = self.procs.get(ev.rank)
        if p is None or p.end_t is not None:
            self.fault_log.append({"t": time.time() - t0, "event": ev.kind, "rank": ev.rank, "skipped": "not running"})
            return
        if ev.kind == "kill":
            self.restarting.add(ev.rank)
            self.signal(p, signal.SIGCONT)  # (a no-op unless it is also stopped) so that SIGKILL ends it at once
            self.signal(p, signal.SIGKILL)
            p.popen.wait()
            p.end_t, p.end = time.time(), "killed"
            self._read_rows(p)  # its last flushed metrics, before the restart overwrites them
            self.fault_log.append({"t": p.end_t - t0, "event": "kill", "rank": ev.rank})
            if self.stop_flag.wait(ev.duration):
                return
            self.spawn(ev.rank)
            self.restarting.discard(ev.rank)
            self.fault_log.append({"t": time.time() - t0, "event": "restart", "rank": ev.rank})
        elif ev.kind == "stop":
            self.paused.add(ev.rank)
            self.signal(p, signal.SIGSTOP)
            self.fault_log.append({"t": time.time() - t0, "event": "sigstop", "rank": ev.rank})
            self.stop_flag.wait(ev.duration)
            self.paused.discard(ev.rank)
            self.signal(p, signal.SIGCONT)
            self.fault_log.append({"t": time.time() - t0, "event": "sigcont", "rank": ev.rank})

    # ---------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        c = self.cfg
        self.fault_log: list[dict[str, Any]] = []
        self.store = self.write_spec()
        t_launch = time.time()
        for r in range(c.replicas):
            self.spawn(r)
        threads: list[threading.Thread] = []
        deadline = time.monotonic() + c.timeout_s
        timed_out = False
        try:
            while True:
                self.poll()
                live = [p for p in self.procs.values() if p.end_t is None]
                if self.t_ready_all is None and all(p.ready_t for p in self.procs.values()):
                    self.t_ready_all = max(p.ready_t for p in self.procs.values())  # type: ignore[type-var]
                    if self.schedule.slow_rank is not None:
                        threads.append(threading.Thread(target=self.slow_loop, args=(self.schedule.slow_rank,),
                                                        daemon=True))
                    threads += [threading.Thread(target=self.run_event, args=(ev, self.t_ready_all), daemon=True)
                                for ev in self.schedule.events]
                    for t in threads:
                        t.start()
                if not live and not self.restarting:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(c.poll_s)
        finally:
            self.stop_flag.set()
            for t in threads:
                t.join(timeout=5)
            for p in self.history:
                if p.popen.poll() is None:
                    self.signal(p, signal.SIGCONT)
                    self.signal(p, signal.SIGKILL)
                    p.popen.wait()
                    p.end_t, p.end = p.end_t or time.time(), p.end or "killed at timeout"
        t_end = max((p.end_t or time.time()) for p in self.history)
        self.poll()
        for p in self.history:
            if p.ready_t and not p.end.startswith("killed"):
                self._read_rows(p)
        t0 = self.t_ready_all or t_launch
        incs = [p.record() for p in self.history]
        return {
            "mode": self.mode, "scenario": self.scenario, "run_uri": self.store.uri,
            "schedule": self.schedule.to_json(), "faults": self.fault_log, "timed_out": timed_out,
            "launch_to_ready_s": t0 - t_launch, "train_wall_s": t_end - t0, "t0": t0,
            "exit": {p.rank: p.end for p in self.history},
            "incarnations": incs,  # with their metrics rows: goodput can be recomputed from the JSON
            "goodput": goodput(incs),
            "timeline": [(t - t0, s, u) for t, s, u in self.timeline],
            "versions_seen": {r: t - t0 for r, t in sorted(self.versions_seen.items())},
        }
