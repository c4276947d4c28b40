"""A local server that speaks the Hugging Face Jobs REST API and runs jobs as processes.

It implements the routes ``huggingface_hub.HfApi`` calls (huggingface_hub 2.x):

=======  ==========================================  ==============================================
method   path                                        client method
=======  ==========================================  ==============================================
GET      /api/whoami-v2                              ``whoami``
GET      /api/jobs/hardware                          ``list_jobs_hardware`` (prices: :data:`HARDWARE`)
POST     /api/jobs/{namespace}                       ``run_job``
GET      /api/jobs/{namespace}[?label=k=v&stage=S]   ``list_jobs``
GET      /api/jobs/{namespace}/{id}                  ``inspect_job``
GET      /api/jobs/{namespace}/{id}/logs[?tail=N]    ``fetch_job_logs`` (server-sent events)
POST     /api/jobs/{namespace}/{id}/cancel           ``cancel_job``
=======  ==========================================  ==============================================

Each job's ``command + arguments`` runs as a local process in its own session
(the Docker image is ignored) with a *clean* environment: ``PATH`` (with
``python_bin_dir`` first, so ``python`` is the interpreter you choose),
``HOME``, ``LANG``, ``base_env``, then the job's ``environment`` and ``secrets``. Nothing of
the test process's environment leaks into a job, so a job sees a secret only
if it was sent as one.

Stages follow the real service: SCHEDULING -> RUNNING -> COMPLETED | ERROR |
CANCELED. A failed job's status message is ``"Job failed with exit code: N"``
(the wording Hugging Face's Spaces/Jobs infrastructure uses), a job past its
``timeoutSeconds`` is killed with message ``"Job timed out"``, and a job with
``attempts > 1`` is re-run after a failure. Log events are
``data: {"data": LINE, "timestamp": ISO}``; the stream starts with a
``===== Job started ... =====`` event, replays history, follows live output
(with ``: keep-alive`` comments) and closes once the job has ended and every
line was sent. Terminal stages are set only after the job's output was fully
read, so a client that sees a terminal stage has all log lines available.

Secrets are returned by the API as names only (values ``null``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import secrets as _secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

TERMINAL = ("COMPLETED", "CANCELED", "ERROR", "DELETED")


def hardware(name: str, pretty: str, micro_usd_per_minute: int, gpu: tuple[str, int, str] | None = None) -> dict:
    """One ``/api/jobs/hardware`` entry in the service's JSON shape (camelCase keys, price per minute)."""
    entry: dict[str, Any] = {"name": name, "prettyName": pretty, "cpu": "8 vCPU", "ram": "32 GB",
                             "ephemeralStorage": "100 GB", "unitCostMicroUSD": micro_usd_per_minute,
                             "unitCostUSD": micro_usd_per_minute / 1e6, "unitLabel": "minute"}
    if gpu is not None:
        model, count, vram = gpu
        entry["accelerator"] = {"type": "gpu", "model": model, "quantity": str(count), "vram": vram,
                                "manufacturer": "Nvidia"}
    return entry


#: Test prices served at ``/api/jobs/hardware`` (test data in the service's format, not a price list).
HARDWARE = [
    hardware("cpu-basic", "CPU Basic", 167),
    hardware("a10g-small", "Nvidia A10G - small", 16667, ("A10G", 1, "24 GB")),
    hardware("a10g-largex2", "2x Nvidia A10G - large", 50000, ("A10G", 2, "48 GB")),
    hardware("h200", "Nvidia H200", 83333, ("H200", 1, "141 GB")),
]


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class _Job:
    id: str
    namespace: str
    body: dict[str, Any]
    created_at: str
    workdir: Path
    stage: str = "SCHEDULING"
    message: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    events: list[dict[str, str]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    proc: subprocess.Popen | None = None
    cancel_requested: bool = False
    timed_out: bool = False
    exit_codes: list[int] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)

    def add_line(self, line: str) -> None:
        with self.cond:
            self.events.append({"data": line, "timestamp": _now()})
            self.cond.notify_all()

    def set_stage(self, stage: str, message: str | None = None) -> None:
        with self.cond:
            self.stage = stage
            self.message = message
            if stage == "RUNNING" and self.started_at is None:
                self.started_at = _now()
            if stage in TERMINAL:
                self.finished_at = _now()
            self.cond.notify_all()

    def info(self, owner: dict[str, str]) -> dict[str, Any]:
        b = self.body
        out: dict[str, Any] = {
            "id": self.id,
            "createdAt": self.created_at,
            "command": b.get("command"),
            "arguments": b.get("arguments", []),
            "environment": b.get("environment", {}),
            "secrets": {k: None for k in (b.get("secrets") or {})},
            "flavor": b.get("flavor"),
            "labels": b.get("labels"),
            "status": {"stage": self.stage, "message": self.message},
            "owner": owner,
            "retry": max(0, int(b.get("attempts", 1)) - 1),
        }
        if "dockerImage" in b:
            out["dockerImage"] = b["dockerImage"]
        if "spaceId" in b:
            out["spaceId"] = b["spaceId"]
        if b.get("timeoutSeconds"):
            out["timeoutSeconds"] = b["timeoutSeconds"]
        if self.started_at:
            out["startedAt"] = self.started_at
        if self.finished_at:
            out["finishedAt"] = self.finished_at
        return out


class HFJobsServer:
    """The server. Use as a context manager, or :meth:`start` / :meth:`stop`.

    Args:
        namespace: the only namespace (user) this server knows; other namespaces get 403.
        token: if set, requests must carry ``Authorization: Bearer <token>`` (else 401).
        python_bin_dir: put first on each job's ``PATH``. Default: a fresh environment from
            :func:`make_job_python` under ``workdir``, so a job's bootstrap installs the wheel
            there and never into the interpreter running the tests.
        workdir: parent of the per-job working directories (default: a temporary directory).
        base_env: extra variables every job starts with (like an image's ``ENV``),
            e.g. ``{"PIP_NO_INDEX": "1"}`` so a job's ``pip`` never reaches the network.
        start_delay_s: time a job spends in SCHEDULING.
        keepalive_s: interval of ``: keep-alive`` comments on an idle log stream.
    """

    def __init__(self, *, namespace: str = "tester", token: str | None = None,
                 python_bin_dir: str | os.PathLike[str] | None = None, workdir: str | os.PathLike[str] | None = None,
                 base_env: dict[str, str] | None = None, start_delay_s: float = 0.05,
                 keepalive_s: float = 15.0) -> None:
        self.namespace = namespace
        self.token = token
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hf-jobs-server-"))
        self.python_bin_dir = str(python_bin_dir or make_job_python(self.workdir / "_python"))
        self.base_env = dict(base_env or {})
        self.start_delay_s = start_delay_s
        #: Test hook: ``reject_create(body) -> str | None``; a string fails the create with HTTP 500.
        self.reject_create: Any = None
        self.keepalive_s = keepalive_s
        self.jobs: dict[str, _Job] = {}
        self.requests: list[dict[str, Any]] = []  # every request: method, path, body (as received)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.owner = {"id": "0" * 24, "name": namespace, "type": "user"}
        #: Served at ``GET /api/jobs/hardware``; tests may replace it.
        self.hardware: list[dict[str, Any]] = [dict(h) for h in HARDWARE]

    # ------------------------------------------------------------------ lifecycle
    @property
    def endpoint(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HFJobsServer":
        server = self

        class Handler(_Handler):
            srv = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hf-jobs-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        for job in list(self.jobs.values()):
            self._kill(job)
            with job.cond:
                job.cond.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "HFJobsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ jobs
    def create(self, namespace: str, body: dict[str, Any]) -> _Job:
        job_id = _secrets.token_hex(12)
        workdir = self.workdir / job_id
        workdir.mkdir(parents=True)
        job = _Job(id=job_id, namespace=namespace, body=body, created_at=_now(), workdir=workdir)
        with self._lock:
            self.jobs[job_id] = job
        threading.Thread(target=self._run, args=(job,), name=f"job-{job_id}", daemon=True).start()
        return job

    def _env(self, job: _Job) -> dict[str, str]:
        env = {
            "PATH": os.pathsep.join([self.python_bin_dir, "/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": str(job.workdir),
            "LANG": "C.UTF-8",
            "JOB_ID": job.id,
            **self.base_env,
        }
        env.update({k: str(v) for k, v in (job.body.get("environment") or {}).items()})
        env.update({k: str(v) for k, v in (job.body.get("secrets") or {}).items()})
        return env

    def _run(self, job: _Job) -> None:
        time.sleep(self.start_delay_s)
        attempts = max(1, int(job.body.get("attempts", 1)))
        argv = list(job.body.get("command") or []) + list(job.body.get("arguments") or [])
        job.argv = argv
        timeout = job.body.get("timeoutSeconds")
        for attempt in range(attempts):
            with job.cond:
                if job.cancel_requested or self._stopping.is_set():
                    job.set_stage("CANCELED")
                    return
                job.set_stage("RUNNING")
            job.add_line(f"===== Job started at {_now()} =====")
            try:
                proc = subprocess.Popen(argv, cwd=job.workdir, env=self._env(job), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                job.add_line(f"failed to start {argv[:1]}: {exc}")
                job.exit_codes.append(127)
                job.set_stage("ERROR", "Job failed with exit code: 127")
                return
            with job.cond:
                job.proc = proc
            timer = None
            if timeout:
                timer = threading.Timer(float(timeout), self._time_out, args=(job,))
                timer.daemon = True
                timer.start()
            assert proc.stdout is not None
            for raw in proc.stdout:  # until EOF: every line is in before the stage changes
                job.add_line(raw.decode("utf-8", "replace").rstrip("\n"))
            rc = proc.wait()
            if timer is not None:
                timer.cancel()
            job.exit_codes.append(rc)
            if job.cancel_requested or self._stopping.is_set():
                job.set_stage("CANCELED")
                return
            if job.timed_out:
                job.set_stage("ERROR", "Job timed out")
                return
            if rc == 0:
                job.set_stage("COMPLETED")
                return
            if attempt < attempts - 1:
                job.add_line(f"===== Job failed with exit code {rc}; retrying ({attempt + 2}/{attempts}) =====")
                continue
            job.set_stage("ERROR", f"Job failed with exit code: {rc}")

    def _time_out(self, job: _Job) -> None:
        job.timed_out = True
        self._kill(job)

    def _kill(self, job: _Job) -> None:
        proc = job.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self, job: _Job) -> None:
        with job.cond:
            if job.stage in TERMINAL:
                return
            job.cancel_requested = True
        self._kill(job)
        # A job still in SCHEDULING has no process; its runner sees the flag and ends CANCELED.


class _Handler(BaseHTTPRequestHandler):
    srv: HFJobsServer
    server_version = "hf-jobs-test-server/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # ------------------------------------------------------------------ helpers
    def _send_json(self, code: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str) -> None:
        self._send_json(code, {"error": message}, {"X-Error-Message": message})

    def _authorized(self) -> bool:
        token = self.srv.token
        if token is None or self.headers.get("Authorization") == f"Bearer {token}":
            return True
        self._error(401, "Invalid credentials in Authorization header")
        return False

    def _route(self) -> tuple[list[str], dict[str, list[str]]]:
        url = urlparse(self.path)
        return [p for p in url.path.split("/") if p], parse_qs(url.query)

    def _job(self, namespace: str, job_id: str) -> _Job | None:
        job = self.srv.jobs.get(job_id)
        if job is None or job.namespace != namespace:
            self._error(404, f"Job {job_id} not found")
            return None
        return job

    def _record(self, body: Any = None) -> None:
        with self.srv._lock:
            self.srv.requests.append({"method": self.command, "path": self.path, "body": body,
                                      "authorization": self.headers.get("Authorization")})

    # ------------------------------------------------------------------ routes
    def do_GET(self) -> None:  # noqa: N802 - http.server API
        self._record()
        if not self._authorized():
            return
        parts, query = self._route()
        if parts == ["api", "whoami-v2"]:
            return self._send_json(200, {"name": self.srv.namespace, "type": "user", "id": self.srv.owner["id"]})
        if parts == ["api", "jobs", "hardware"]:
            return self._send_json(200, self.srv.hardware)
        if len(parts) >= 3 and parts[:2] == ["api", "jobs"]:
            namespace = parts[2]
            if namespace != self.srv.namespace:
                return self._error(403, f"You cannot access jobs of namespace {namespace}")
            if len(parts) == 3:
                return self._list(query)
            job = self._job(namespace, parts[3])
            if job is None:
                return
            if len(parts) == 4:
                return self._send_json(200, job.info(self.srv.owner))
            if len(parts) == 5 and parts[4] == "logs":
                return self._logs(job, query)
        self._error(404, f"no route GET {self.path}")

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            self._record(raw.decode("utf-8", "replace"))
            return self._error(400, "body is not JSON")
        self._record(body)
        if not self._authorized():
            return
        parts, _ = self._route()
        if len(parts) >= 3 and parts[:2] == ["api", "jobs"]:
            namespace = parts[2]
            if namespace != self.srv.namespace:
                return self._error(403, f"You cannot create jobs in namespace {namespace}")
            if len(parts) == 3:
                return self._create(namespace, body)
            job = self._job(namespace, parts[3])
            if job is None:
                return
            if len(parts) == 5 and parts[4] == "cancel":
                self.srv.cancel(job)
                return self._send_json(200, {})
        self._error(404, f"no route POST {self.path}")

    def _create(self, namespace: str, body: Any) -> None:
        if not isinstance(body, dict):
            return self._error(400, "expected a JSON object")
        command = body.get("command")
        if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
            return self._error(400, "command must be a non-empty list of strings")
        if not (body.get("dockerImage") or body.get("spaceId")):
            return self._error(400, "dockerImage or spaceId is required")
        for key in ("environment", "secrets", "labels"):
            if key in body and not isinstance(body[key], dict):
                return self._error(400, f"{key} must be an object")
        if self.srv.reject_create is not None:
            reason = self.srv.reject_create(body)
            if reason:
                return self._error(500, reason)
        job = self.srv.create(namespace, body)
        self._send_json(200, job.info(self.srv.owner))

    def _list(self, query: dict[str, list[str]]) -> None:
        stages = {s.upper() for s in query.get("stage", [])}
        labels = dict(lbl.split("=", 1) for lbl in query.get("label", []) if "=" in lbl)
        out = []
        for job in list(self.srv.jobs.values()):
            if stages and job.stage not in stages:
                continue
            job_labels = job.body.get("labels") or {}
            if any(job_labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(job.info(self.srv.owner))
        self._send_json(200, out)

    def _logs(self, job: _Job, query: dict[str, list[str]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
        with job.cond:
            start = 0
            if query.get("tail"):
                start = max(0, len(job.events) - int(query["tail"][0]))
        sent = start
        try:
            while True:
                with job.cond:
                    if sent >= len(job.events) and job.stage not in TERMINAL and not self.srv._stopping.is_set():
                        job.cond.wait(timeout=self.srv.keepalive_s)
                    batch = job.events[sent:]
                    done = job.stage in TERMINAL or self.srv._stopping.is_set()
                if batch:
                    for event in batch:
                        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    sent += len(batch)
                elif not done:
                    self.wfile.write(b": keep-alive\n\n")
                self.wfile.flush()
                if done and sent >= len(job.events):
                    return
        except (BrokenPipeError, ConnectionResetError):
            return


# ---------------------------------------------------------------------- job interpreter
def make_job_python(root: str | os.PathLike[str]) -> Path:
    """A fresh virtual environment for jobs, seeing this interpreter's packages *except* composer-cloud.

    Returns its ``bin`` directory (pass as ``python_bin_dir``). Jobs then really
    install composer-cloud from the staged wheel (``pip install`` resolves every
    dependency from the shared packages, offline) and nothing is installed into
    the test's own environment. ``pip`` itself is one of the shared packages; it
    installs into the job environment's own site-packages (no network).
    """
    import site
    import venv

    root = Path(root)
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(root / "venv")
    # Inside the venv: dill (datasets' fingerprinting) pickles modules from outside sys.prefix by value, which
    # fails for pyarrow's types; a real image has them under its prefix.
    shared = root / "venv" / "shared-site"
    shared.mkdir(exist_ok=True)
    skip = ("composer_cloud", "composer-cloud", "__editable__", "_composer_cloud", "distutils-precedence.pth")
    for sp in site.getsitepackages():
        for entry in Path(sp).iterdir():
            name = entry.name
            if name.startswith(skip) or name.lower().startswith("composer_cloud") or name.endswith(".pth"):
                continue
            target = shared / name
            if not target.exists():
                target.symlink_to(entry)
    bin_dir = root / "venv" / "bin"
    out = subprocess.run([str(bin_dir / "python"), "-c", "import site,sys; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True)
    (Path(out.stdout.strip()) / "composer_cloud_shared.pth").write_text(str(shared) + "\n")
    return bin_dir


if __name__ == "__main__":  # manual use: python tests/hf_jobs_server.py [--token T] [--namespace N]
    import argparse

    parser = argparse.ArgumentParser(description="local Hugging Face Jobs API server for tests")
    parser.add_argument("--token", default=None)
    parser.add_argument("--namespace", default="tester")
    args = parser.parse_args()
    # SIGTERM (and SIGINT, which a shell may ignore for background jobs) stop the server cleanly.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with HFJobsServer(namespace=args.namespace, token=args.token, base_env={"PIP_NO_INDEX": "1"}) as s:
        print(f"HF Jobs test server on {s.endpoint} (namespace {s.namespace}); Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
