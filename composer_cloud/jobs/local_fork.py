"""Local replicas forked from one preloaded process: the imports of a launch are paid once, not once per replica.

A replica process spends most of its CPU importing torch and transformers before it trains (measured on the
tiny model: 6.5 CPU-seconds per replica, 0.6 s of them training). The local executor therefore starts the
jobs of one launch from a single process, ``python -m composer_cloud.jobs.local fork-supervise ...``, that
imports them once (:func:`preload`) and forks, per rank, the supervisor ``supervise`` would have been (its
own session, the same loop, the same records), which forks the replica from that memory at every (re)start.
Nothing else changes: each supervisor is its own process group, ``cancel`` kills that group, the exit code
is the replica's (``-9`` when it was killed), ``replica.log`` holds the replica's output.

Invariants:

* The preloading process only imports. It starts no thread, creates no CUDA context, no store client and no
  torch thread pool, so a fork of it is the state a fresh ``python -m composer_cloud.replica`` reaches after
  its imports (Python reseeds :mod:`random` in every child; the replica seeds torch and numpy itself).
* Forking is used on Linux, and only where the replicas cannot use a CUDA GPU (``device = "cpu"``, or
  ``"auto"`` on a machine without NVIDIA devices): CUDA does not survive a fork. ``COMPOSER_CLOUD_LOCAL_FORK=0``
  turns it off; the supervisors are then separate interpreters, as before.
* Every supervisor forked for rank ``r`` names itself :func:`supervisor_name` (``/proc/<pid>/comm``): the
  command line it shares names every rank's folder, so the name is what binds a process to one rank when a
  handle from the store is checked before a signal is sent.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

from composer_cloud import env, forking
from composer_cloud.jobs.base import ExecutorError

logger = logging.getLogger(__name__)

#: What a replica imports before it trains, in import order (best effort: one that fails is left to the
#: replica, which reports it in its own log). ``transformers.modeling_utils`` carries most of the cost
#: (torch.distributed.tensor, torch._dynamo, the model registry scan); the Qwen2 classes are the built-in model's.
#: Both built-in trainers are here: the three-channel one (the default) brings trl, peft and datasets, 1.1 CPU-s
#: that each of its replicas paid at every (re)start while only the causal-LM trainer was preloaded.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.qwen2.modeling_qwen2",
    "torchft",
    "composer_cloud.replica.runtime",
    "composer_cloud.replica.lockstep",
    "composer_cloud.replica.decoupled",
    "composer_cloud.model",
    "composer_cloud.trainer.causal_lm",
    "composer_cloud.trainer.three_channel.adapter",
)
#: The replica command this module knows how to run in a fork (``replica_command``'s module).
REPLICA_MODULE = "composer_cloud.replica"
_PR_SET_NAME = 15


def preload(modules: tuple[str, ...] = PRELOAD) -> list[str]:
    """Import ``modules``; returns the ones that failed (the replica meets the same error and logs it)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a missing extra is the replica's to report
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    return failed


def supervisor_name(rank: int) -> str:
    """The process name (comm, at most 15 bytes) of the supervisor forked for ``rank``."""
    return f"ccsup-{rank}"[:15]


def name_this_process(name: str) -> None:
    """Set ``/proc/self/comm`` to ``name`` (Linux ``prctl(PR_SET_NAME)``; the command line stays as it is)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_NAME, {name!r}) failed")


def process_name(pid: int) -> str | None:
    """``/proc/<pid>/comm``, or None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def hold_directory(path: Path) -> int:
    """Open ``path`` as a directory fd. A supervisor forked while it is open keeps it for its lifetime, so that
    :func:`open_paths` shows which job folder it owns: its command line is shared with other ranks, or is the
    fork server's. The caller closes its own copy after the fork."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def open_paths(pid: int) -> list[Path]:
    """The paths process ``pid`` holds open (``/proc/<pid>/fd``; empty when it is gone or not ours to read)."""
    paths = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        with contextlib.suppress(OSError):
            paths.append(Path(os.readlink(f"/proc/{pid}/fd/{fd}")))
    return paths


def alive(pid: int) -> bool:
    """Process ``pid`` exists and has not exited (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


class ForkedProcess:
    """A forked child, as much of :class:`subprocess.Popen` as a supervisor uses (``pid``, ``poll``,
    ``terminate``, ``returncode``: negative for the signal that killed it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def terminate(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def fork_call(main: Callable[[], int | None], *, stdout: int, stderr: int | None = None, new_session: bool = False,
              finalize: bool = True) -> ForkedProcess:
    """Run ``main()`` in a forked child with fd 1 on ``stdout``, fd 2 on ``stderr`` (default: ``stdout``), stdin
    on /dev/null; its return value is the child's exit code, an exception exits 1 with the traceback on fd 2.

    With ``finalize``, the child ends as an interpreter does (non-daemon threads joined, ``atexit`` handlers
    run; never the parent's ``weakref.finalize`` clean-ups, such as its temporary directories); always, its
    output is flushed and it leaves by ``os._exit``: it never returns into the parent's stack, whose ``finally``
    blocks (the supervisor's records) belong to the parent alone. Signal handlers the
    parent installed are reset to the defaults a new interpreter has.

    With ``new_session`` the child leads its own session and process group *before* this returns: callers
    hand the pid out at once, and a handle's check (``getpgid(pid) == pid``) must never see the child still
    in the parent's group (on a loaded machine the child may not have run a line yet).
    """
    session_read, session_written = os.pipe() if new_session else (-1, -1)
    pid = os.fork()
    if pid:
        if new_session:
            os.close(session_written)
            os.read(session_read, 1)  # b"" when the child died first: nothing left to wait for
            os.close(session_read)
        return ForkedProcess(pid)
    code = 1
    try:
        if new_session:
            os.close(session_read)
            os.setsid()
            os.write(session_written, b"s")
            os.close(session_written)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(stdout, 1)
        os.dup2(stdout if stderr is None else stderr, 2)
        forking.start_as_new_interpreter()
        code = _exit_code(main)
    except BaseException:  # noqa: BLE001 - nothing may escape into the parent's stack
        traceback.print_exc()
    finally:
        _end(code, finalize=finalize)
    raise AssertionError("unreachable")  # pragma: no cover


def _exit_code(main: Callable[[], int | None]) -> int:
    try:
        result = main()
    except SystemExit as exc:
        result = exc.code if isinstance(exc.code, int) or exc.code is None else 1
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as a Python process reports it
        traceback.print_exc()
        return 1
    return 0 if result is None else int(result)


def _end(code: int, *, finalize: bool) -> None:
    """With ``finalize``, what ``Py_Finalize`` does that a replica may rely on; then ``os._exit(code)``."""
    try:
        if finalize:
            shutdown = getattr(threading, "_shutdown", None)  # joins non-daemon threads, as interpreter exit does
            if shutdown is not None:
                shutdown()
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
    finally:
        os._exit(code & 0xFF if code >= 0 else 1)


def fork_replica(command: list[str], log: BinaryIO) -> ForkedProcess:
    """Start ``command`` (a :func:`~composer_cloud.jobs.base.replica_command`) as a fork of this process, its
    output appended to ``log``."""
    if command[1:3] != ["-m", REPLICA_MODULE]:
        raise ValueError(f"fork_replica runs `python -m {REPLICA_MODULE} ...`, not {command[:3]}")
    argv = command[3:]

    def replica_main() -> int:
        from composer_cloud.replica import __main__ as entry

        sys.argv = [entry.__file__ or REPLICA_MODULE, *argv]  # as `python -m` sets it
        return entry.main(argv)

    log.flush()
    return fork_call(replica_main, stdout=log.fileno())


class ForkStartError(ExecutorError):
    """The preloading process did not fork every job's supervisor (its output says why)."""


#: Seconds the launcher waits for the preloading process to fork every supervisor (its imports; minutes only
#: on a machine that is very busy).
START_TIMEOUT_S = 600.0


#: Starts ``python -m composer_cloud.jobs.local ARGV`` elsewhere (the fork server's
#: :func:`~composer_cloud.jobs.local_forkserver.spawn`): its pid, or None when it cannot.
Spawn = Callable[..., int | None]


def start_forked(command: list[str], ranks: list[int], *, environ: Mapping[str, str],
                 timeout_s: float = START_TIMEOUT_S, spawn: Spawn | None = None) -> dict[int, int]:
    """Run ``command`` (``python -m composer_cloud.jobs.local fork-supervise ...``) in its own session and return
    the supervisors' pids by rank, read from its ``RANK PID`` lines as it forks them.

    The process comes from ``spawn(argv, environ=, stdout=, stderr=)`` where given and it can (a fork of the
    fork server, the imports already paid), else it is a new interpreter. Either way the launcher waits on
    nothing but those lines: not on the process's exit (it ends by ``os._exit`` at once), not on its stderr (a
    file, so warnings can never fill a pipe and block it).
    """
    read_end, write_end = os.pipe()
    with tempfile.TemporaryFile() as err, open(read_end, "rb", buffering=0) as out:
        proc: subprocess.Popen | None = None
        try:
            pid = spawn(command[3:], environ=environ, stdout=write_end, stderr=err.fileno()) if spawn else None
            if pid is None:
                with open(os.devnull, "rb") as devnull:
                    proc = subprocess.Popen(command, stdin=devnull, stdout=write_end, stderr=err,
                                            env=dict(environ), start_new_session=True)
                pid = proc.pid
        finally:
            os.close(write_end)  # the process holds its copy: end of file here means it ended
        pids = _read_pids(out, ranks, deadline=time.monotonic() + timeout_s)
        if len(pids) < len(ranks):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # its own session: the supervisors forked so far have theirs
            code = proc.wait() if proc is not None else "unknown: a fork of the fork server"
            err.seek(0)
            tail = err.read().decode(errors="replace").strip()[-2000:]
            raise ForkStartError(f"local: the preloading supervisor process forked ranks {sorted(pids)} of {ranks} "
                                 f"(exit code {code}, {timeout_s:.0f}s allowed): {tail}; set "
                                 f"{env.LOCAL_FORK}=0 to start every supervisor as its own interpreter")
        if proc is not None:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                logger.warning("the preloading supervisor process %d did not exit after forking; killed", proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return pids


def _read_pids(out: BinaryIO, ranks: list[int], *, deadline: float) -> dict[int, int]:
    """Pids by rank from ``RANK PID`` lines on ``out``, read until every rank has one, ``out`` ends, or
    ``deadline``."""
    pids: dict[int, int] = {}
    buffer = b""
    with selectors.DefaultSelector() as sel:
        sel.register(out, selectors.EVENT_READ)
        while len(pids) < len(ranks) and (left := deadline - time.monotonic()) > 0:
            if not sel.select(timeout=min(left, 1.0)):
                continue
            chunk = os.read(out.fileno(), 4096)
            if not chunk:
                break  # it ended
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                rank, pid = line.split()
                pids[int(rank)] = int(pid)
    return pids
