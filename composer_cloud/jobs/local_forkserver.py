"""A per-user fork server for the local executor: the imports of many launches are paid once, not once each.

:mod:`~composer_cloud.jobs.local_fork` pays a launch's imports (torch, transformers, torchft: ~5 CPU-seconds) once
per launch. A machine that launches often (resumes, a notebook's reruns, a test suite) pays them once per launch
still. The first launch therefore starts ``python -m composer_cloud.jobs.local fork-server``, which imports them and
waits on a Unix socket; each launch asks it for a fork that runs ``fork-supervise`` with the launch's arguments,
environment, working directory and umask, its stdout and stderr the launch's own (passed as file descriptors), so
the launcher reads the same ``RANK PID`` lines either way. The server exits after ``idle_s`` without a request.

Invariants:

* **One server per key.** The key digests what a fork inherits from the server's imports and a fresh
  interpreter would take from the launch instead: the interpreter and ``sys.path``, the mtime and size of every
  file of this package and of the preloaded libraries' ``__init__``, and the environment names those libraries
  read at import (:data:`KEY_PREFIXES`, :data:`KEY_NAMES`: ``HF_HOME``, ``OMP_NUM_THREADS``, ``PYTHONPATH``...).
  Anything else differs freely between launches: the fork takes the launch's whole environment before it runs.
  Editing this package or upgrading torch starts a new server; the old one idles out.
* **Only this user reaches it.** The socket lives in a folder that must be this user's and mode 0700
  (:func:`runtime_dir`, else no server is used), and the server refuses a peer whose uid differs (``SO_PEERCRED``).
  The server's own environment holds only the key's names: no run key, no store credential, no token
  (:data:`SECRET_NAME`: ``HF_TOKEN`` matches the ``HF_`` prefix but is left out).
* **Nothing depends on it.** Any failure to reach or start a server (a folder with other permissions, a server
  that just idled out, a refused request) returns ``None`` from :func:`spawn`, and the launch preloads its own
  process as before. ``COMPOSER_CLOUD_LOCAL_FORK_SERVER_IDLE_S=0`` turns the server off.
* **The server only imports, accepts and forks**, single-threaded: a fork of it is the state ``fork-supervise``
  reaches after its imports. It reaps the children it forked; their own children (supervisors, in their own
  sessions) are reparented when those exit, as with a per-launch ``fork-supervise``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import select
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from composer_cloud import env
from composer_cloud.errors import ExecutorError
from composer_cloud.jobs import local_fork

logger = logging.getLogger(__name__)

#: Seconds a server waits for the next request before it exits (``COMPOSER_CLOUD_LOCAL_FORK_SERVER_IDLE_S``).
IDLE_S = 300.0
#: Environment name prefixes read at import time by the preloaded libraries (or by Python itself).
KEY_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "SAFETENSORS",
                "OMP_", "MKL_", "KMP_", "OPENBLAS", "CUDA", "NVIDIA", "LD_", "XDG_", "TRITON", "ACCELERATE", "TRL_")
#: Exact environment names that shape the imports (HOME: the Hugging Face cache's default; TMPDIR: tempfile's;
#: USE_*: which frameworks transformers and datasets look for).
KEY_NAMES = ("HOME", "PATH", "TMPDIR", "TEMP", "TMP", "LANG", "LC_ALL", "LC_CTYPE", "USE_TORCH", "USE_TF", "USE_JAX",
             "USE_FLAX")
#: Names a prefix above matches that are never in a server's environment or key: credentials (``HF_TOKEN``). The
#: libraries read them when used, from the fork's environment (the launch's), not at import.
SECRET_NAME = re.compile(r"(TOKEN|PASSWORD|PASSWD|CREDENTIALS?|API_KEY|ACCESS_KEY)$|SECRET", re.IGNORECASE)
#: Names a prefix above matches that are read only when used, and that torch writes into the launching process's
#: own environment the first time it asks for them (``torch._inductor``'s ``cache_dir()``): in the key, a launch
#: from a process that once compiled would start a second server. The fork still gets the launch's value.
RUNTIME_NAMES = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
#: Libraries whose ``__init__`` file's mtime and size are in the key (an upgrade starts a new server).
KEY_LIBRARIES = ("torch", "transformers", "torchft", "peft", "numpy", "trl", "datasets", "accelerate")
#: Seconds a launch waits for a server it started to listen (its imports; longer only on a very busy machine).
START_TIMEOUT_S = 600.0
_MODULE = "composer_cloud.jobs.local"
_HEADER = struct.Struct("!I")


class ForkServerError(ExecutorError):
    """A fork server could not be used or refused a request (the launch then preloads its own process)."""


def idle_seconds(environ: Mapping[str, str]) -> float:
    """``COMPOSER_CLOUD_LOCAL_FORK_SERVER_IDLE_S`` (default :data:`IDLE_S`); 0 turns the server off."""
    raw = environ.get(env.LOCAL_FORK_SERVER_IDLE_S, "")
    try:
        return max(0.0, float(raw)) if raw else IDLE_S
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; using %.0f", env.LOCAL_FORK_SERVER_IDLE_S, raw, IDLE_S)
        return IDLE_S


def key_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The names of ``environ`` that shape the server's imports: its whole environment, and part of its key."""
    return {k: v for k, v in sorted(environ.items())
            if (k in KEY_NAMES or k.startswith(KEY_PREFIXES)) and k not in RUNTIME_NAMES and not SECRET_NAME.search(k)}


def server_key(environ: Mapping[str, str]) -> str:
    """The digest naming the server whose forks a fresh ``fork-supervise`` with ``environ`` would equal."""
    digest = hashlib.sha256()
    digest.update(json.dumps([sys.executable, sys.prefix, sys.version, key_environment(environ)]).encode())
    package = Path(__file__).resolve().parents[1]
    files = sorted(package.rglob("*.py"))
    for name in KEY_LIBRARIES:
        spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
        if spec is not None and spec.origin:
            files.append(Path(spec.origin))
    for path in files:
        try:
            st = path.stat()
        except OSError:
            continue
        digest.update(f"{path}\0{st.st_mtime_ns}\0{st.st_size}\n".encode())
    return digest.hexdigest()[:20]


def runtime_dir(environ: Mapping[str, str]) -> Path:
    """This user's folder for server sockets, ``composer-cloud-<uid>`` in ``environ``'s ``$XDG_RUNTIME_DIR``, else
    its ``$TMPDIR``, else the temp folder; created 0700; raises :class:`ForkServerError` when it exists with
    another owner or wider access."""
    base = environ.get("XDG_RUNTIME_DIR") or environ.get("TMPDIR") or tempfile.gettempdir()
    path = Path(base) / f"composer-cloud-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ForkServerError(f"{path} is not a folder of this user with mode 0700; no fork server is used")
    return path


def address(environ: Mapping[str, str]) -> Path:
    """The socket of the server for ``environ`` (see :func:`server_key`)."""
    return runtime_dir(environ) / f"fs-{server_key(environ)}.sock"


def spawn(argv: Sequence[str], *, environ: Mapping[str, str], stdout: int, stderr: int,
          timeout_s: float = START_TIMEOUT_S) -> int | None:
    """Have the server for ``environ`` fork a process running ``python -m composer_cloud.jobs.local *argv``
    (in its own session, with ``environ``, this process's working directory and umask, ``stdout`` and ``stderr``
    as its fds 1 and 2), starting the server when none listens. Returns the process's pid, or None when no
    server can be used (the reason is logged)."""
    idle = idle_seconds(environ)
    if idle <= 0:
        return None
    try:
        sock_path = address(environ)
        with _locked(sock_path.with_suffix(".lock")):
            conn = _connect(sock_path)
            if conn is None:
                pid = _start_server(sock_path, environ, idle_s=idle)
                conn = _wait_listening(sock_path, pid, timeout_s)
        with conn:
            return _request(conn, list(argv), environ, fds=[stdout, stderr])
    except (OSError, ValueError, ForkServerError) as exc:
        logger.warning("local fork server not used (%s); this launch preloads its own process", exc)
        return None


@contextlib.contextmanager
def _locked(lock_path: Path):
    """Hold an exclusive lock on ``lock_path``: one launch at a time checks for, and starts, a server."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _try_connect(sock_path: Path) -> socket.socket | None:
    """A connection to a server listening at ``sock_path``, else None."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(sock_path))
        return conn
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None


def _connect(sock_path: Path) -> socket.socket | None:
    """A connection to the server at ``sock_path``; None (a stale socket file removed) when none listens."""
    conn = _try_connect(sock_path)
    if conn is None:
        with contextlib.suppress(FileNotFoundError):
            sock_path.unlink()  # a server that died without removing it (we hold the lock: nobody binds now)
    return conn


def _start_server(sock_path: Path, environ: Mapping[str, str], *, idle_s: float) -> int:
    """Start a server for ``sock_path``; returns its pid."""
    log = sock_path.with_suffix(".log")
    with open(os.devnull, "rb") as devnull, open(log, "ab") as err:
        os.chmod(log, 0o600)
        # Through a shell that starts it in the background, prints its pid and exits: the server is nobody's
        # child here, so a long-lived launcher (a notebook, a test session) never holds it as a zombie.
        started = subprocess.run(["/bin/sh", "-c", '"$@" >/dev/null & echo $!', "sh", sys.executable, "-m", _MODULE,
                                  "fork-server", "--socket", str(sock_path), "--idle-s", str(idle_s)],
                                 stdin=devnull, stdout=subprocess.PIPE, stderr=err, env=key_environment(environ),
                                 start_new_session=True, check=True)
    logger.info("started a local fork server at %s (its log: %s)", sock_path, log)
    return int(started.stdout)


def _wait_listening(sock_path: Path, pid: int, timeout_s: float) -> socket.socket:
    """A connection to the server ``pid`` started at ``sock_path``, once it listens (after its imports)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        conn = _try_connect(sock_path)
        if conn is not None:
            return conn
        if not local_fork.alive(pid):
            raise ForkServerError(f"the fork server for {sock_path} exited before it listened (its log: "
                                  f"{sock_path.with_suffix('.log')})")
        time.sleep(0.05)
    raise ForkServerError(f"the fork server at {sock_path} did not listen within {timeout_s:.0f}s "
                          f"(its log: {sock_path.with_suffix('.log')})")


def _request(conn: socket.socket, argv: list[str], environ: Mapping[str, str], *, fds: list[int]) -> int:
    body = json.dumps({"argv": argv, "env": dict(environ), "cwd": os.getcwd(), "umask": _umask()}).encode()
    socket.send_fds(conn, [_HEADER.pack(len(body)) + body], fds)
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            raise ForkServerError("the fork server closed the connection without an answer")
        reply += chunk
    answer = json.loads(reply)
    if "pid" not in answer:
        raise ForkServerError(f"the fork server refused the request: {answer.get('error')}")
    return int(answer["pid"])


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def serve(sock_path: Path, *, idle_s: float, main: Callable[[list[str]], int]) -> int:
    """The server: preload (:func:`~composer_cloud.jobs.local_fork.preload`), listen on ``sock_path``, fork one
    process per request that runs ``main(argv)`` (``composer_cloud.jobs.local``'s), exit after ``idle_s`` seconds
    without a request. Exits 0 at once when another server already listens there."""
    failed = local_fork.preload()
    if failed:
        print("preload (left to the replicas): " + "; ".join(failed), file=sys.stderr, flush=True)
    os.chdir("/")  # holds no launch's folder; each fork changes to its launch's
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(sock_path))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return 0
        raise
    os.chmod(sock_path, 0o600)
    inode = sock_path.stat().st_ino
    listener.listen(64)
    last = time.monotonic()
    try:
        while True:
            _reap()
            ready, _, _ = select.select([listener], [], [], 1.0)
            if ready:
                conn, _ = listener.accept()
                with conn:
                    _answer(conn, listener, main)
                last = time.monotonic()
            elif time.monotonic() - last > idle_s:
                return 0
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            if sock_path.stat().st_ino == inode:  # never remove a successor's socket
                sock_path.unlink()
                sock_path.with_suffix(".lock").unlink()  # a launch that holds it meanwhile starts a new server
                log = sock_path.with_suffix(".log")
                if log.stat().st_size == 0:
                    log.unlink()


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _answer(conn: socket.socket, listener: socket.socket, main: Callable[[list[str]], int]) -> None:
    fds: list[int] = []
    try:
        conn.settimeout(30)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        if uid != os.getuid():
            raise ForkServerError(f"peer uid {uid} is not this server's user")
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
        if len(data) < _HEADER.size or len(fds) != 2:
            raise ForkServerError("a request carries a length, a JSON body and two file descriptors")
        (size,) = _HEADER.unpack_from(data)
        body = data[_HEADER.size:]
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ForkServerError("the request ended early")
            body += chunk
        request = json.loads(body)
        close = [conn.fileno(), listener.fileno(), *fds]
        child = local_fork.fork_call(lambda: _as_the_launch(request, main, close=close), stdout=fds[0],
                                     stderr=fds[1], new_session=True, finalize=False)
        conn.sendall(json.dumps({"pid": child.pid}).encode() + b"\n")
    except (OSError, ValueError, KeyError, ForkServerError) as exc:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
    finally:
        for fd in fds:
            os.close(fd)


def _as_the_launch(request: dict, main: Callable[[list[str]], int], *, close: list[int]) -> int:
    """In the fork (its session, fds and signals set by :func:`~composer_cloud.jobs.local_fork.fork_call`):
    become the launch's process (umask, folder, environment), then run its command."""
    for fd in close:  # the server's socket and this request's connection; fds 1 and 2 hold copies of the rest
        os.close(fd)
    os.umask(int(request["umask"]))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # as `python -m` sets it in the launch's folder
    importlib.invalidate_caches()
    argv = [str(a) for a in request["argv"]]
    sys.argv = [sys.argv[0], *argv]  # the server's own script: `python -m composer_cloud.jobs.local`
    return main(argv)


__all__ = ["IDLE_S", "ForkServerError", "address", "idle_seconds", "key_environment", "serve", "server_key",
           "spawn"]
