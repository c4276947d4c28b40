"""Run untrusted Python (model completions) against unit tests in a child process.

Every program runs in a fresh ``python -I -S`` process, in its own session,
inside a new temporary directory that is deleted afterwards. What is enforced,
and by what:

* **Wall-clock timeout** (``timeout_s``): the parent kills the child's whole
  process group with SIGKILL when it expires. Each test additionally gets
  ``per_test_timeout_s`` (SIGALRM in the child), so one hanging test costs only
  that test, not the ones already passed.
* **CPU time** (``RLIMIT_CPU``), **address space** (``RLIMIT_AS``,
  ``memory_mb``), **file size** (``RLIMIT_FSIZE``), **open files**
  (``RLIMIT_NOFILE``) and **no core dumps** are set with ``resource.setrlimit``
  in the child before the untrusted code is compiled.
* **No network**: two layers. (1) Kernel: when ``unshare --net`` works on this
  host (root, or unprivileged user namespaces via ``--map-root-user``), the
  child runs in an empty network namespace, where every connect fails with
  ENETUNREACH whatever the code does. (2) Interpreter: a ``sys.addaudithook``
  hook (which Python code cannot remove) refuses every ``socket.*`` audit
  event and the import of ``socket``/``_socket``/``ssl``. Layer 2 is always on;
  :func:`network_isolation` says whether layer 1 is available.
* **No child processes, no native escape hatches**: the same hook refuses
  ``subprocess.Popen``, ``os.system``, ``os.exec*``, ``os.spawn*``,
  ``os.posix_spawn``, ``os.fork``, ``os.kill``/``killpg`` (a completion cannot
  signal the trainer), every ``ctypes`` event and the import of
  ``_posixsubprocess``/``_ctypes``/``ctypes``.
* **File writes only in the temporary directory**: the hook refuses ``open``
  for writing, and ``os.remove``/``rename``/``rmdir``/``mkdir``/``chmod``/...
  on paths outside it. Reads are allowed (the stdlib must import).
* **Clean environment**: the child gets only ``PATH``, ``HOME``/``TMPDIR``
  (the temporary directory) and ``LANG``; no variable of the trainer (cloud
  credentials, tokens) is inherited. ``-I -S``: no user site, no
  ``site-packages``, no ``PYTHON*`` variables; only the standard library
  is importable.
* **Results cannot be forged by printing**: the program's stdout/stderr go to
  a size-limited file; results travel on a private pipe prefixed with a
  random nonce the parent checks.

Limits (be honest about them): the audit hook is a policy layer inside the
same interpreter as the untrusted code, not a security boundary against a
determined attacker (for example one who finds a C-extension bug). Use it to
stop accidents and reward-hacking shortcuts of a policy model; run the trainer
itself in a container (as Modal and HF Jobs do) for a hard boundary. Without
``unshare`` the network block is the audit hook alone.

Scoring never raises: a crash, a timeout, a memory error or a failure to start
the child scores 0 with a ``status`` saying why.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Sequence

logger = logging.getLogger(__name__)

Status = Literal["ok", "timeout", "crash", "error"]

# The harness runs in the child. It reads {nonce, program, tests, limits} as
# JSON from stdin, then locks itself down in this order: rlimits, private
# result fd, stdout/stderr to a capped file, audit hook; only then does it
# compile the untrusted program. Everything it needs is imported before the
# hook is installed.
_HARNESS = r"""
import json, os, resource, signal, sys
cfg = json.loads(sys.stdin.read())
sys.stdin.close()
nonce = cfg["nonce"]; tests = cfg["tests"]; lim = cfg["limits"]; root = os.path.realpath(os.getcwd())
def _lim(which, value):
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):
        pass
_lim(resource.RLIMIT_AS, lim["memory_bytes"])
_lim(resource.RLIMIT_CPU, lim["cpu_s"])
_lim(resource.RLIMIT_FSIZE, lim["fsize_bytes"])
_lim(resource.RLIMIT_NOFILE, 64)
_lim(resource.RLIMIT_CORE, 0)
res = os.dup(1)
out = os.open(os.path.join(root, "output.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.dup2(out, 1); os.dup2(out, 2); os.close(out)
def emit(*parts, _n=nonce, _res=res, _w=os.write):
    _w(_res, (" ".join([_n, *map(str, parts)]) + "\n").encode())
del nonce, cfg["nonce"]
_DENY_PREFIX = ("socket.", "subprocess.", "ctypes.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
                "os.system", "os.kill", "os.killpg", "os.setuid", "os.setgid", "signal.pthread_kill",
                "pty.", "resource.setrlimit", "resource.prlimit", "sys.addaudithook", "shutil.", "webbrowser.")
_DENY_IMPORT = {"socket", "_socket", "ssl", "_ssl", "_posixsubprocess", "_ctypes", "ctypes", "subprocess",
                "multiprocessing", "_multiprocessing", "asyncio"}
# event -> (positions of path arguments, positions of dir_fd arguments)
_PATH_EVENTS = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
                "os.rename": ((0, 1), (2, 3)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
                "os.link": ((0, 1), (2, 3)), "os.symlink": ((1,), (2,)), "os.truncate": ((0,), ()),
                "os.utime": ((0,), (3,)), "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
                "os.chflags": ((0,), ())}
_realpath = os.path.realpath; _fspath = os.fspath; _isinstance = isinstance; _bytes = bytes; _sep = os.sep
def _inside(p):
    if _isinstance(p, int):
        return True
    try:
        p = _fspath(p)
        if _isinstance(p, _bytes):
            p = p.decode()
        p = _realpath(p)
    except Exception:
        return False
    return p == root or p.startswith(root + _sep)
class SandboxViolation(BaseException):
    pass
def _hook(event, args):
    if event.startswith(_DENY_PREFIX):
        raise SandboxViolation("sandbox: " + event + " is not allowed")
    if event == "import" and args[0] in _DENY_IMPORT:
        raise SandboxViolation("sandbox: import " + args[0] + " is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            flags is not None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
        if writing and not _inside(path):
            raise SandboxViolation("sandbox: writing outside the sandbox directory is not allowed")
    elif event in _PATH_EVENTS:
        paths, dir_fds = _PATH_EVENTS[event]
        bad = any(i < len(args) and args[i] is not None and args[i] != -1 for i in dir_fds) or any(
            i < len(args) and not _inside(args[i]) for i in paths)
        if bad:
            raise SandboxViolation("sandbox: " + event + " outside the sandbox directory is not allowed")
class TestTimeout(BaseException):
    pass
def _alarm(signum, frame):
    raise TestTimeout()
signal.signal(signal.SIGALRM, _alarm)
sys.addaudithook(_hook)
emit("start", len(tests))
ns = {"__name__": "__candidate__", "__builtins__": __builtins__}
signal.setitimer(signal.ITIMER_REAL, lim["load_timeout_s"])
try:
    exec(compile(cfg["program"], "<candidate>", "exec"), ns)
except BaseException as e:
    signal.setitimer(signal.ITIMER_REAL, 0)
    emit("load_error", type(e).__name__)
    os._exit(0)
signal.setitimer(signal.ITIMER_REAL, 0)
for i, test in enumerate(tests):
    signal.setitimer(signal.ITIMER_REAL, lim["per_test_timeout_s"])
    try:
        exec(compile(test, "<test %d>" % i, "exec"), ns)
        signal.setitimer(signal.ITIMER_REAL, 0)
        emit("pass", i)
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        emit("fail", i, type(e).__name__)
emit("done")
os._exit(0)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one program run.

    Attributes:
        timeout_s: wall-clock limit of the whole child (seconds); SIGKILL after.
        per_test_timeout_s: wall-clock limit of each test and of loading the
            program (seconds, SIGALRM inside the child).
        memory_mb: address-space limit (``RLIMIT_AS``, MiB). The interpreter
            itself needs ~30 MiB of it.
        cpu_s: CPU-time limit (``RLIMIT_CPU``, seconds); defaults to
            ``ceil(timeout_s) + 1``.
        output_mb: cap on what the program may write to stdout/stderr or any
            file (``RLIMIT_FSIZE``, MiB).
        network: ``"auto"`` uses a network namespace when available and the
            audit hook always; ``"namespace"`` refuses to run without a network
            namespace (raises at :class:`Sandbox` construction).
    """

    timeout_s: float = 5.0
    per_test_timeout_s: float = 1.0
    memory_mb: int = 256
    cpu_s: int | None = None
    output_mb: int = 4
    network: Literal["auto", "namespace"] = "auto"

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.per_test_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.memory_mb < 64:
            raise ValueError("memory_mb must be >= 64 (the interpreter alone needs ~30 MiB of address space)")
        if self.network not in ("auto", "namespace"):
            raise ValueError(f"network must be 'auto' or 'namespace', got {self.network!r}")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one program: ``score = passed / total`` (0 unless the child reported passes).

    ``status``: ``ok`` (all tests ran), ``timeout`` (killed at the wall-clock
    limit; passes reported before the kill still count), ``crash`` (the
    program did not load, or the child died), ``error`` (the sandbox itself
    failed, e.g. the child could not start).
    """

    passed: int
    total: int
    status: Status
    detail: str = ""
    duration_s: float = 0.0

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


@lru_cache(maxsize=1)
def network_isolation() -> list[str] | None:
    """The command prefix that runs a child in an empty network namespace, or ``None``.

    Probed once per process by running ``true`` under ``unshare --net`` (root)
    or ``unshare --net --map-root-user`` (unprivileged user namespaces).
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ([unshare, "--net"], [unshare, "--net", "--map-root-user"]):
        try:
            probe = subprocess.run(
                [*prefix, "true"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=10,
                env={"PATH": "/usr/bin:/bin"},
            )
            ok = probe.returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return prefix
    logger.info("sandbox: no network namespace available; the network is blocked by the audit hook only")
    return None


def run_tests(program: str, tests: Sequence[str], limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``program`` then each statement of ``tests`` (typically ``assert f(1) == 2``).

    A test passes when its statement runs without raising. Never raises.
    """
    limits = limits or SandboxLimits()
    start = time.perf_counter()
    try:
        return _run(program, list(tests), limits, start)
    except Exception as e:  # the trainer must never see a sandbox failure as an exception
        logger.warning("sandbox: internal error (%s: %s); scoring 0", type(e).__name__, e)
        return SandboxResult(0, len(tests), "error", f"{type(e).__name__}: {e}", time.perf_counter() - start)


def _run(program: str, tests: list[str], limits: SandboxLimits, start: float) -> SandboxResult:
    nonce = secrets.token_hex(16)
    cfg = {
        "nonce": nonce,
        "program": program,
        "tests": tests,
        "limits": {
            "memory_bytes": limits.memory_mb * 2**20,
            "cpu_s": limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s) + 2,
            "fsize_bytes": limits.output_mb * 2**20,
            "per_test_timeout_s": limits.per_test_timeout_s,
            "load_timeout_s": limits.per_test_timeout_s,
        },
    }
    prefix = network_isolation() or []
    if limits.network == "namespace" and not prefix:
        return SandboxResult(0, len(tests), "error", "no network namespace available", 0.0)
    with tempfile.TemporaryDirectory(prefix="cc-sandbox-") as tmp:
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        cmd = [*prefix, sys.executable, "-I", "-S", "-B", "-c", _HARNESS]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills everything it started
            close_fds=True,
        )
        timed_out = False
        try:
            out, err = proc.communicate(json.dumps(cfg).encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            out, err = proc.communicate()
        detail_tail = _tail(os.path.join(tmp, "output.txt")) or err.decode(errors="replace")[-400:]
    duration = time.perf_counter() - start

    passed: set[int] = set()
    started = done = False
    load_error = ""
    for line in out.decode(errors="replace").splitlines():
        parts = line.split(" ")
        if len(parts) < 2 or parts[0] != nonce:  # not from the harness
            continue
        kind = parts[1]
        if kind == "start":
            started = True
        elif kind == "pass" and len(parts) == 3 and parts[2].isdigit() and int(parts[2]) < len(tests):
            passed.add(int(parts[2]))
        elif kind == "load_error":
            load_error = parts[2] if len(parts) > 2 else "?"
        elif kind == "done":
            done = True

    if timed_out:
        status: Status = "timeout"
        detail = f"killed after {limits.timeout_s:g}s"
    elif load_error == "TestTimeout":
        status, detail = "timeout", f"loading the program took more than {limits.per_test_timeout_s:g}s"
    elif load_error:
        status, detail = "crash", f"program failed to load: {load_error}"
    elif not started or not done:
        status = "crash"
        detail = f"child exited with {proc.returncode} before finishing; {detail_tail.strip()[-200:]}"
    else:
        status, detail = "ok", ""
    return SandboxResult(len(passed), len(tests), status, detail, duration)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _tail(path: str, n: int = 400) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class Sandbox:
    """Scores many programs concurrently (one child process each).

    ``max_workers`` bounds the number of children alive at once; the threads
    only wait on pipes, so the cost is the children's CPU.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, max_workers: int = 2) -> None:
        self.limits = limits or SandboxLimits()
        if self.limits.network == "namespace" and network_isolation() is None:
            raise RuntimeError("sandbox network='namespace' requested but `unshare --net` does not work here")
        self.max_workers = max(1, int(max_workers))
        self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="sandbox")

    def run(self, program: str, tests: Sequence[str]) -> SandboxResult:
        return run_tests(program, tests, self.limits)

    def run_many(self, programs: Sequence[str], tests: Sequence[Sequence[str]]) -> list[SandboxResult]:
        """Results in input order; never raises."""
        if len(programs) != len(tests):
            raise ValueError(f"{len(programs)} programs but {len(tests)} test lists")
        futures = [self._pool.submit(run_tests, p, t, self.limits) for p, t in zip(programs, tests)]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __getstate__(self) -> dict:  # pools do not pickle; rebuild on the other side
        return {"limits": self.limits, "max_workers": self.max_workers}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["limits"], max_workers=state["max_workers"])


__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "network_isolation", "run_tests"]
