"""Local process executor: one supervised OS process per replica.

Each replica runs under a small supervisor (``python -m
composer_cloud.jobs.local supervise ...``) in its own session, so that:

* ``cancel`` kills the whole process group (supervisor, replica, children);
* the replica's exit code survives the launcher: the supervisor writes it to
  ``<job dir>/exit.json``, which ``status`` in another process reads;
* a replica that dies is restarted up to ``max_restarts`` times (it then
  rejoins the run by loading the latest checkpoint and healing).

On Linux without a GPU for the replicas, the supervisors of one launch are forked from a single process that has
imported torch and transformers (``fork-supervise``, :mod:`composer_cloud.jobs.local_fork`), and each forks its
replica from that memory: the imports, most of a small replica's CPU, are paid once per launch.

Job files live in ``<run dir>/jobs/<rank>/`` for ``file://`` stores, else in
``./runs/.local-jobs/<run_id>-<digest of the run URI>/<rank>/`` (two runs with one id
in two stores never share a folder): ``replica.log``, ``supervisor.json``
(pids), ``exit.json``, ``cancel``, ``token``. Anyone who can write the store can
write there, so every file is opened without following links and the records
are signed in a signed run (:mod:`composer_cloud.jobs.jobfiles`).

Handles are read back from the store, which is not trusted (anyone with write
access to the bucket can edit ``executor/<rank>.json``). Before this executor
signals a process or writes a file for a handle, the handle must prove it is
this machine's job *of this run and rank*: its directory must be the one this
executor derives for the run and the rank (:func:`job_dir`, from the spec, not
from the handle), hold the ``token`` file the launcher wrote (0600) with the
handle's token, and the process group to signal must be the supervisor named in
that directory, running ``composer_cloud.jobs.local supervise --dir <that
directory>``. Anything else is refused with an
:class:`~composer_cloud.jobs.base.ExecutorError`: a handle copied from another
run cannot stop that run's replicas.

A signed run's key reaches the replicas through their process environment
(the local executor's secret mechanism), never through the store.

Every wait here (following a log, a cancelled job's exit, the supervised
replica) goes through :func:`composer_cloud.retry.poll_until`.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, ClassVar, Protocol

from composer_cloud import env, forking
from composer_cloud.jobs import local_fork, local_forkserver
from composer_cloud.jobs.credentials import Check
from composer_cloud.jobs.base import (
    ExecutorError,
    JobHandle,
    LaunchPlan,
    ReplicaState,
    ReplicaStatus,
    replica_command,
    run_id_of,
)
from composer_cloud.jobs.environment import job_env, job_secrets
from composer_cloud.jobs.jobfiles import JobFolder, UnsafeJobFolder, records_key
from composer_cloud.retry import PollPolicy, poll_until
from composer_cloud.storage.run import run_signing_key

if TYPE_CHECKING:
    from composer_cloud.spec import RunSpec

logger = logging.getLogger(__name__)

#: Seconds a cancelled supervisor gets to stop its replica (SIGTERM) before its group is killed.
CANCEL_GRACE_S = 10.0
#: Spacing of the waits on a log file, a process, a cancel file.
_WAIT = PollPolicy(initial_s=0.05, max_s=0.5, factor=1.5)


def job_dir(run_uri: str, rank: int) -> Path:
    """Where the files of replica ``rank``'s job live: in the run's directory for a ``file://`` store, else
    under ``./runs/.local-jobs/``, keyed by the run id and a digest of the whole run URI (store + run)."""
    root, parts = _job_location(run_uri, rank)
    return root.joinpath(*parts) if root is not None else Path(*parts)


def _job_location(run_uri: str, rank: int) -> tuple[Path | None, tuple[str, ...]]:
    """``(root, parts)`` of replica ``rank``'s job folder: the root is the user's (the store folder; None: the
    working directory), the parts below it are walked without following links (anyone with write access to
    the store can plant links there)."""
    if run_uri.startswith("file://"):
        run_dir = Path(run_uri[len("file://"):].rstrip("/"))
        return run_dir.parent, (run_dir.name, "jobs", str(rank))
    digest = hashlib.sha256(run_uri.rstrip("/").encode()).hexdigest()[:12]
    return None, ("runs", ".local-jobs", f"{run_id_of(run_uri)}-{digest}", str(rank))


def _expected_dir(run_uri: str, rank: int) -> Path:
    """The job folder's path as the launcher wrote it into the handle: its root resolved, nothing below."""
    root, parts = _job_location(run_uri, rank)
    return Path(os.path.realpath(root)).joinpath(*parts) if root is not None else Path(*parts)


def job_folder(run_uri: str, rank: int, *, key: bytes | None, create: bool = False) -> JobFolder:
    """Replica ``rank``'s job folder, opened without following links (:class:`UnsafeJobFolder` for one)."""
    root, parts = _job_location(run_uri, rank)
    return JobFolder(root if root is not None else Path.cwd(), parts, rank=rank, key=key, create=create)


def _creatable_dir_problem(d: Path) -> str | None:
    """Why directory ``d`` could not be created by this process, or None. Creates nothing."""
    existing = d
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


_SUPERVISOR_MODULE = "composer_cloud.jobs.local"


def _verified_dir(handle: JobHandle, run_uri: str | None, key: bytes | None) -> JobFolder:
    """The handle's job folder (opened without links; close it), once the handle proved it belongs to a job this
    machine launched for replica ``handle.rank`` of the run at ``run_uri`` (None: the run is unknown; only the
    token is checked). ``key``: the run's :func:`~composer_cloud.jobs.jobfiles.records_key`."""
    raw = handle.data.get("dir")
    token = handle.data.get("token")
    if not isinstance(raw, str) or not isinstance(token, str) or not token:
        raise ExecutorError(f"replica {handle.rank}: the local job handle has no job directory or token; "
                            "it was not written by this version's launcher (refusing to act on it)")
    d = Path(raw)
    if run_uri is not None and not _same_dir(d, _expected_dir(run_uri, handle.rank)):
        raise ExecutorError(f"replica {handle.rank}: the job handle names {raw[:200]!r}, which is not this run's "
                            "job directory for that rank; the handle in the store was altered or copied from "
                            "another run; refusing to act on it")
    try:
        folder = (job_folder(run_uri, handle.rank, key=key) if run_uri is not None
                  else JobFolder.at(d, rank=handle.rank, key=key))
    except UnsafeJobFolder:
        raise
    except OSError:
        raise ExecutorError(f"replica {handle.rank}: no local job at {d} (launched on another machine, or the "
                            "handle in the store was altered); refusing to act on it") from None
    try:
        stored = (folder.read_bytes("token") or b"").decode(errors="replace").strip()
    except BaseException:
        folder.close()
        raise
    if not stored or not hmac.compare_digest(stored, token):
        folder.close()
        raise ExecutorError(f"replica {handle.rank}: the job handle's token does not match {d}/token; "
                            "the handle in the store was altered; refusing to act on it")
    return folder


def _same_dir(given: Path, expected: Path) -> bool:
    """Whether ``given`` (absolute, from a handle) is ``expected``; a relative ``expected`` (a non-file store's
    job folder under the launcher's working directory) matches by its trailing components."""
    if expected.is_absolute():
        return given == expected
    return given.is_absolute() and given.parts[-len(expected.parts):] == expected.parts


def _supervisor_pgid(handle: JobHandle, d: Path) -> int | None:
    """The supervisor's process group, if it is alive and really is the supervisor of ``d``."""
    if not handle.job_id.isdigit() or int(handle.job_id) <= 1:
        return None
    pid = int(handle.job_id)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in cmdline]
    if _SUPERVISOR_MODULE not in args or not (_supervises(args, d) or _fork_supervises(args, pid, handle.rank, d)):
        return None
    try:
        return os.getpgid(pid) if os.getpgid(pid) == pid else None
    except ProcessLookupError:
        return None


def _supervises(args: list[str], d: Path) -> bool:
    """``args`` is ``... supervise --dir D ...`` for the folder ``d``."""
    return "supervise" in args and "--dir" in args and args[args.index("--dir") + 1:][:1] == [str(d)]


def _fork_supervises(args: list[str], pid: int, rank: int, d: Path) -> bool:
    """Process ``pid`` is a forked supervisor (``fork-supervise``'s, or the fork server's fork of it: their
    command lines name other ranks' folders, or none), named for ``rank``, holding the folder ``d`` open."""
    if "fork-supervise" not in args and "fork-server" not in args:
        return False
    return (local_fork.process_name(pid) == local_fork.supervisor_name(rank)
            and any(_same_dir(held, d.resolve() if d.is_absolute() else d) for held in local_fork.open_paths(pid)))


def cuda_device_count() -> int:
    """CUDA GPUs this machine's replicas can see (``torch.cuda.device_count()``; imports torch)."""
    import torch

    return torch.cuda.device_count()


class LocalProcessExecutor:
    """Runs replicas as local processes (the default, and what CI uses).

    ``cuda_devices``: how many CUDA GPUs this machine has (default :func:`cuda_device_count`; tests pass
    their own), asked only for ``device = "cuda"`` with ``gpus_per_replica`` above 1.
    """

    name: ClassVar[str] = "local"
    sdk: ClassVar[tuple[str, str] | None] = None

    @classmethod
    def check_credentials(cls) -> list[Check]:
        """Nothing to sign in to: the jobs run on this machine."""
        return [Check(f"{cls.name}: nothing to sign in to", True, "runs on this machine")]

    @classmethod
    def relaunches(cls, spec: "RunSpec") -> int:
        """The supervisor process starts a failed replica again ``max_restarts`` times."""
        return spec.max_restarts

    def __init__(self, spec: "RunSpec | None" = None, *, run_key: str | None = None,
                 cuda_devices: Callable[[], int] | None = None) -> None:
        self.spec = spec
        self._cuda_devices = cuda_devices or cuda_device_count
        self._run_key = run_key  # delivered to the replicas in their environment, never stored
        # The job folders' records are signed in a signed run (an unsigned run's carry a crc32 only).
        self._records_key = (records_key(run_signing_key(spec.run_id, run_key, spec.run_salt))
                             if spec is not None and run_key is not None and spec.run_id else None)
        self.max_restarts = self.relaunches(spec) if spec is not None else 0
        jobs = spec.replicas + spec.rollouts.workers if spec is not None else 1  # rollout workers share the cores
        self.threads = max(1, (os.cpu_count() or 1) // max(1, jobs))

    def _job_env(self) -> dict[str, str]:
        """This process's environment plus the replica's variables (no secret is added; the replica inherits)."""
        environ = os.environ.copy()
        environ.setdefault(env.THREADS, str(self.threads))
        if self.spec is not None:
            environ.update(job_env(self.spec))
        else:
            environ.setdefault("PYTHONUNBUFFERED", "1")
        environ.update(job_secrets(self._run_key))
        if self._records_key is not None:
            environ[env.JOB_RECORDS_KEY] = self._records_key.hex()
        return environ

    def _run_uri(self) -> str | None:
        """The run this executor acts for, derived from the spec (never from a handle)."""
        if self.spec is None or not self.spec.run_id:
            return None
        return self.spec.store.rstrip("/") + "/" + self.spec.run_id

    def _uses_cuda(self) -> bool:
        """``device = "cuda"``: each local rank of a replica takes one of this machine's GPUs."""
        return self.spec is not None and self.spec.device == "cuda"

    def _preflight_problems(self, run_uri: str) -> list[str]:
        problems = []
        jobs = job_dir(run_uri, 0).resolve().parent
        problem = _creatable_dir_problem(jobs)
        if problem is not None:
            problems.append(f"the job directory {jobs} cannot be created ({problem}); launch from a directory you "
                            "can write to, or use a file:// store there (jobs then live in the run's directory)")
        spec = self.spec
        if spec is not None and self._uses_cuda() and spec.gpus_per_replica > 1:
            # One CUDA GPU per local rank; the replicas on this machine share the same GPUs.
            have = self._cuda_devices()
            if have < spec.gpus_per_replica:
                problems.append(f"gpus_per_replica = {spec.gpus_per_replica} with device = \"cuda\" needs "
                                f"{spec.gpus_per_replica} CUDA GPUs, but this machine has {have}; lower "
                                "gpus_per_replica, use device = \"cpu\" (gloo processes) or a GPU executor")
        return problems

    def preflight(self, run_uri: str, ranks: Sequence[int]) -> None:
        """Refuse a launch whose job directories (logs, exit codes) cannot be created here. Creates nothing."""
        problems = self._preflight_problems(run_uri)
        if problems:
            raise ExecutorError(f"{self.name}: cannot launch: " + "; ".join(problems))

    def plan(self, run_uri: str, ranks: Sequence[int]) -> LaunchPlan:
        return LaunchPlan(executor=self.name, ranks=list(ranks), image="(this machine's Python environment)",
                          command=replica_command(run_uri, ranks[0] if ranks else 0, python=sys.executable),
                          env_names=[env.THREADS], secret_names=sorted(job_secrets(self._run_key)),
                          gpu="none", estimated_gpu_hours=0.0,
                          gpus_per_replica=self.spec.gpus_per_replica if self._uses_cuda() else 0,
                          notes=[f"max_restarts={self.max_restarts}", f"logs in {job_dir(run_uri, 0).parent}",
                                 *(f"launch would fail: {p}" for p in self._preflight_problems(run_uri))])

    def launch(self, run_uri: str, ranks: Sequence[int]) -> list[JobHandle]:
        self.preflight(run_uri, ranks)
        environ = self._job_env()
        jobs: list[tuple[int, Path, str]] = []  # (rank, job folder, token)
        for rank in ranks:
            try:
                folder = job_folder(self._run_uri() or run_uri, rank, key=self._records_key, create=True)
            except UnsafeJobFolder as exc:
                raise ExecutorError(f"{self.name}: cannot launch replica {rank}: {exc}") from None
            with folder:
                for stale in ("exit.json", "supervisor.json", "cancel", "token"):
                    folder.unlink(stale)
                token = secrets.token_hex(16)
                folder.create_exclusive("token", token.encode())
            jobs.append((rank, folder.path, token))  # no link below the root: the supervisor walks it without any
        pids = self._start_supervisors(run_uri, jobs, environ)
        logger.info("launched replicas %s as local process groups %s", [j[0] for j in jobs], list(pids.values()))
        return [JobHandle(executor=self.name, rank=rank, job_id=str(pids[rank]),
                          data={"dir": str(d), "pgid": pids[rank], "token": token}) for rank, d, token in jobs]

    def _start_supervisors(self, run_uri: str, jobs: list[tuple[int, Path, str]],
                           environ: dict[str, str]) -> dict[int, int]:
        """Start one supervisor per job, each in its own session; returns their pids (= process groups) by rank.

        Forked from one preloaded process where :func:`~composer_cloud.forking.fork_safe` allows (the imports
        are paid once per launch), else one interpreter per supervisor.
        """
        base = [sys.executable, "-m", _SUPERVISOR_MODULE]
        device = self.spec.device if self.spec is not None else "auto"
        if not forking.fork_safe(device, allowed=env.fork_allowed(environ)):
            pids = {}
            for rank, d, _ in jobs:
                cmd = [*base, "supervise", "--dir", str(d), "--rank", str(rank), "--max-restarts",
                       str(self.max_restarts), "--", *replica_command(run_uri, rank, python=sys.executable)]
                with open(os.devnull, "rb") as devnull:
                    proc = subprocess.Popen(cmd, stdin=devnull, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True, env=environ)
                pids[rank] = proc.pid
            return pids
        cmd = [*base, "fork-supervise", "--run", run_uri, "--max-restarts", str(self.max_restarts)]
        for rank, d, _ in jobs:
            cmd += ["--job", str(rank), str(d)]
        return local_fork.start_forked(cmd, [rank for rank, _, _ in jobs], environ=environ,
                                       spawn=local_forkserver.spawn)

    def poll(self, handle: JobHandle) -> ReplicaStatus:
        with _verified_dir(handle, self._run_uri(), self._records_key) as folder:
            return self._poll(handle, folder)

    def _poll(self, handle: JobHandle, folder: JobFolder) -> ReplicaStatus:
        exit_rec = folder.read_record("exit.json")
        alive = _supervisor_pgid(handle, folder.path) is not None
        if exit_rec is not None and not alive:
            # A live supervisor has not ended, whatever a record says (it writes its exit record last).
            code = exit_rec.get("exit_code")
            code = code if isinstance(code, int) and not isinstance(code, bool) else None
            restarts = _count(exit_rec.get("restarts"))
            if exit_rec.get("cancelled"):
                return ReplicaStatus(ReplicaState.CANCELLED, code, "cancelled", restarts)
            if code == 0:
                return ReplicaStatus(ReplicaState.SUCCEEDED, 0, "", restarts)
            return ReplicaStatus(ReplicaState.FAILED, code, str(exit_rec.get("message", ""))[:1000] + _tail(folder),
                                 restarts)
        if alive:
            sup = folder.read_record("supervisor.json") or {}
            return ReplicaStatus(ReplicaState.RUNNING if sup.get("replica_pid") else ReplicaState.PENDING, None, "",
                                 _count(sup.get("restarts")))
        return ReplicaStatus(ReplicaState.FAILED, None, vanished_reason(folder))

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        """The replica's output lines (every restart's); with ``follow``, until the job ends."""
        with _verified_dir(handle, self._run_uri(), self._records_key) as folder:
            pos = 0
            while True:
                # The state is read before the file, so the lines written before the end are all read.
                finished = not follow or self._poll(handle, folder).state.finished
                f = folder.open_text("replica.log")
                if f is not None:
                    with f:
                        f.seek(pos)
                        for line in f:
                            yield line.rstrip("\n")
                        pos = f.tell()
                if finished:
                    return
                seen = pos
                poll_until(lambda: True if folder.size("replica.log") > seen
                           or self._poll(handle, folder).state.finished else None,
                           deadline=None, on_timeout=_never, policy=_WAIT)

    def cancel(self, handle: JobHandle) -> None:
        """SIGTERM the supervisor's group, SIGKILL it after :data:`CANCEL_GRACE_S`; record the cancel. Idempotent."""
        with _verified_dir(handle, self._run_uri(), self._records_key) as folder:
            self._cancel(handle, folder)

    def _cancel(self, handle: JobHandle, folder: JobFolder) -> None:
        d = folder.path
        folder.write_record("cancel", {"cancel": True, "time": time.time()})  # the supervisor also polls for it
        pgid = _supervisor_pgid(handle, d)
        if pgid is not None:
            os.killpg(pgid, signal.SIGTERM)
            try:
                poll_until(lambda: None if local_fork.alive(pgid) else True, deadline=time.monotonic() + CANCEL_GRACE_S,
                           on_timeout=_StillAlive, policy=_WAIT)
            except _StillAlive:
                pass  # killed below
            if _supervisor_pgid(handle, d) == pgid:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if folder.read_record("exit.json") is None:
            folder.write_record("exit.json", {"exit_code": None, "cancelled": True, "message": "cancelled"})


def _count(value: object) -> int:
    """A restart count read from a record (0 for anything that is not a small non-negative int)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1_000_000 else 0


class _StillAlive(Exception):
    """A cancelled process group outlived its grace period."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"still alive after {waited_s:.1f}s")


def _never(waited_s: float) -> BaseException:  # pragma: no cover - a wait without a deadline never times out
    return RuntimeError(f"a wait without a deadline timed out after {waited_s:.1f}s")


#: Below this much free space a supervisor that vanished is taken to have died of a full disk (it could not
#: even write its exit record).
DISK_FULL_BYTES = 1 << 20


def vanished_reason(folder: JobFolder) -> str:
    """Why the supervisor of job directory ``d`` may have died without its exit record, for ``status``.

    A full disk is the usual cause (the supervisor cannot write ``exit.json``): said as such when the
    replica's log names ENOSPC or the job directory's filesystem has under :data:`DISK_FULL_BYTES` free.
    """
    d = folder.path
    tail = _tail(folder)
    try:
        free: int | None = shutil.disk_usage(d).free
    except OSError:
        free = None
    if "No space left on device" in tail or (free is not None and free < DISK_FULL_BYTES):
        where = f"{free} bytes free" if free is not None else "the replica's log says so"
        return (f"no space left on device at {d} ({where}): the supervisor could not record the replica's exit; "
                "free some space, then `composer-cloud resume`" + tail)
    return "supervisor vanished without recording an exit code" + tail


def _tail(folder: JobFolder, lines: int = 5) -> str:
    try:
        f = folder.open_text("replica.log")
    except UnsafeJobFolder as exc:
        return f"\n({exc})"
    if f is None:
        return ""
    with f:
        text = f.read().splitlines()[-lines:]
    return ("\n" + "\n".join(text)) if text else ""


# ---------------------------------------------------------------- supervisor
def supervise(directory: Path, max_restarts: int, command: list[str], *, rank: int = 0,
              key: bytes | None = None, start: Callable[[list[str], BinaryIO], ReplicaProcess] | None = None) -> int:
    """Run ``command`` with output to ``replica.log``; restart on failure up to ``max_restarts``.

    ``directory`` (``<...>/<rank>``) is opened once without following links, and every file in it through that
    descriptor; ``key`` signs this job's records and verifies its cancel record (a signed run). ``start``
    starts the replica (default: a new interpreter; :func:`~composer_cloud.jobs.local_fork.fork_replica` forks
    this preloaded process instead).
    """
    start = start or _popen
    restarts = 0
    cancelled = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal cancelled
        cancelled = True

    signal.signal(signal.SIGTERM, on_term)
    folder = JobFolder.at(directory, rank=rank, key=key)
    with folder, folder.open_append("replica.log") as log:
        while True:
            proc = start(command, log)
            folder.write_record("supervisor.json",
                                {"supervisor_pid": os.getpid(), "replica_pid": proc.pid, "restarts": restarts})

            def stop_if_cancelled(_failed: int, proc: ReplicaProcess = proc) -> None:
                nonlocal cancelled
                if cancelled or (folder.size("cancel") and folder.read_record("cancel") is not None):
                    cancelled = True
                    proc.terminate()  # again on every probe until it exits

            code: int = poll_until(proc.poll, deadline=None, on_timeout=_never, policy=_WAIT,
                                   between=stop_if_cancelled)
            if cancelled:
                folder.write_record("exit.json", {"exit_code": code, "cancelled": True, "restarts": restarts})
                return code
            if code == 0 or restarts >= max_restarts:
                msg = "" if code == 0 else f"replica exited with code {code} after {restarts} restart(s)"
                folder.write_record("exit.json", {"exit_code": code, "restarts": restarts, "message": msg})
                return code
            restarts += 1
            log.write(f"\n[supervisor] replica exited with code {code}; restart {restarts}/{max_restarts}\n".encode())


class ReplicaProcess(Protocol):
    """What a supervisor needs of its replica's process (:class:`subprocess.Popen` or a fork)."""

    pid: int

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...


def _popen(command: list[str], log: BinaryIO) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def fork_supervise(run_uri: str, jobs: list[tuple[int, Path]], max_restarts: int, *,
                   key: bytes | None = None) -> int:
    """Preload the replicas' imports once, then fork one supervisor per ``(rank, directory)`` in ``jobs`` (its own
    session, named :func:`~composer_cloud.jobs.local_fork.supervisor_name`), each forking its replica from this
    memory. Prints ``RANK PID`` per supervisor on stdout, the launcher's handles; returns when all are forked.
    """
    failed = local_fork.preload()
    if failed:
        print("preload (left to the replicas): " + "; ".join(failed), file=sys.stderr, flush=True)
    for rank, directory in jobs:
        command = replica_command(run_uri, rank, python=sys.executable)

        def supervisor(rank: int = rank, directory: Path = directory, command: list[str] = command) -> int:
            return supervise(directory, max_restarts, command, rank=rank, key=key, start=local_fork.fork_replica)

        # The child is born with its rank's name and its folder open (what binds it to that rank's handle):
        # set here before the fork, not by the child, so a handle is never checked before they hold.
        local_fork.name_this_process(local_fork.supervisor_name(rank))
        held = local_fork.hold_directory(directory)
        with open(os.devnull, "wb") as devnull:  # its records are written: it ends without the exit handlers
            child = local_fork.fork_call(supervisor, stdout=devnull.fileno(), new_session=True, finalize=False)
        os.close(held)
        print(f"{rank} {child.pid}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="composer_cloud.jobs.local")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("supervise")
    sp.add_argument("--dir", required=True, type=Path)
    sp.add_argument("--max-restarts", type=int, default=0)
    sp.add_argument("--rank", type=int, default=None, help="default: the folder's name when it is a number, else 0")
    sp.add_argument("command", nargs=argparse.REMAINDER)
    fp = sub.add_parser("fork-supervise", help="supervise every --job's replica, forked from one preloaded process")
    fp.add_argument("--run", required=True)
    fp.add_argument("--max-restarts", type=int, default=0)
    fp.add_argument("--job", nargs=2, action="append", required=True, metavar=("RANK", "DIR"))
    xp = sub.add_parser("fork-server", help="preload once, then fork a fork-supervise per launch (local_forkserver)")
    xp.add_argument("--socket", required=True, type=Path)
    xp.add_argument("--idle-s", type=float, default=local_forkserver.IDLE_S)
    args = parser.parse_args(argv)
    if args.cmd == "fork-server":
        return local_forkserver.serve(args.socket, idle_s=args.idle_s, main=main)
    if args.cmd == "fork-supervise":
        code = fork_supervise(args.run, [(int(rank), Path(d)) for rank, d in args.job], args.max_restarts,
                              key=env.job_records_key())
        sys.stdout.flush()
        os._exit(code)  # it only imported and forked: nothing to finalise, and no exit handler may hold it up
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    rank = args.rank if args.rank is not None else int(args.dir.name) if args.dir.name.isdigit() else 0
    return supervise(args.dir, args.max_restarts, command, rank=rank, key=env.job_records_key())


if __name__ == "__main__":
    sys.exit(main())
