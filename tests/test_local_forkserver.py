"""The local executor's fork server: launches share one preloaded process per key, each fork takes its launch's
environment, folder and umask, only this user's private folder is used, and any failure falls back to a
per-launch preload."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from composer_cloud import env
from composer_cloud.jobs import local_fork, local_forkserver
from composer_cloud.jobs.local import LocalProcessExecutor
from composer_cloud.spec import RunSpec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is Linux-only")

_REPORT = 'echo "cwd=$(pwd) umask=$(umask) canary=$CC_CANARY ppid=$PPID"'


@pytest.fixture
def runtime(monkeypatch) -> Path:
    """A private runtime folder for this test's servers (they idle out 20 s after its last request); short, as
    a socket's path must be (pytest's tmp_path can exceed the 107 bytes AF_UNIX allows)."""
    xdg = Path(tempfile.mkdtemp(prefix="ccfs-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    monkeypatch.setenv(env.LOCAL_FORK_SERVER_IDLE_S, "20")
    yield xdg / f"composer-cloud-{os.getuid()}"
    shutil.rmtree(xdg, ignore_errors=True)


def _servers(sock: Path) -> list[int]:
    """Pids of fork servers listening at ``sock``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"fork-server" in args and str(sock).encode() in args:
                found.append(int(entry.name))
    return found


def _supervise_through_server(folder: Path, environ: dict[str, str]) -> dict[str, str]:
    """``supervise`` a shell command through the fork server; returns what the command reported."""
    folder.mkdir()
    with open(folder.parent / f"{folder.name}.out", "wb") as out:
        pid = local_forkserver.spawn(["supervise", "--dir", str(folder), "--", "/bin/sh", "-c", _REPORT],
                                     environ=environ, stdout=out.fileno(), stderr=out.fileno())
    assert pid is not None, (folder.parent / f"{folder.name}.out").read_text()
    deadline = time.monotonic() + 60
    while not (folder / "exit.json").exists():
        assert time.monotonic() < deadline, (folder.parent / f"{folder.name}.out").read_text()
        time.sleep(0.05)
    line = next(line for line in (folder / "replica.log").read_text().splitlines() if line.startswith("cwd="))
    return dict(part.split("=", 1) for part in line.split()) | {"pid": str(pid)}


def test_two_launches_share_one_server_and_each_fork_is_its_launchs_process(runtime, tmp_path, monkeypatch):
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    first_dir.mkdir()
    second_dir.mkdir()
    monkeypatch.chdir(first_dir)
    old_mask = os.umask(0o027)
    try:
        first = _supervise_through_server(tmp_path / "job1", {**os.environ, "CC_CANARY": "one"})
        monkeypatch.chdir(second_dir)
        os.umask(0o002)
        second = _supervise_through_server(tmp_path / "job2", {**os.environ, "CC_CANARY": "two"})
    finally:
        os.umask(old_mask)
    # Each fork runs in its launch's folder, with its umask and its whole environment (not the server's)...
    assert (first["cwd"], first["umask"], first["canary"]) == (str(first_dir), "0027", "one")
    assert (second["cwd"], second["umask"], second["canary"]) == (str(second_dir), "0002", "two")
    # ...and both came from one server: variables outside the key do not start another.
    sock = local_forkserver.address(os.environ)
    assert len(_servers(sock)) == 1
    assert {p.suffix for p in runtime.iterdir()} >= {".sock", ".lock"}
    assert oct(runtime.stat().st_mode & 0o777) == "0o700" and oct(sock.stat().st_mode & 0o777) == "0o600"


def test_the_key_follows_what_the_imports_read_and_the_server_keeps_no_secret(monkeypatch):
    base = {"HOME": "/home/u", "PATH": "/usr/bin", "AWS_SECRET_ACCESS_KEY": "s3cret", env.RUN_KEY: "k" * 64,
            "HF_TOKEN": "hf_s3cret", "HUGGING_FACE_HUB_TOKEN": "hf_s3cret", "TOKENIZERS_PARALLELISM": "false"}
    # HF_TOKEN has a prefix the imports read (HF_), but it is a credential: never in the server's environment.
    assert local_forkserver.key_environment(base) == {"HOME": "/home/u", "PATH": "/usr/bin",
                                                      "TOKENIZERS_PARALLELISM": "false"}
    key = local_forkserver.server_key(base)
    # A credential, the run key, a run's own variables: the same server.
    assert local_forkserver.server_key({**base, "AWS_SECRET_ACCESS_KEY": "other", env.THREADS: "3",
                                        "HF_TOKEN": "hf_other"}) == key
    # What torch writes into a process's environment once it compiled (read when used): the same server.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # recorded, so the value torch writes is undone
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    cache_dir()
    assert local_forkserver.server_key({**base, "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]}) \
        == key
    # What torch, transformers or huggingface_hub read at import: another server.
    for name, value in (("HF_HOME", "/elsewhere"), ("OMP_NUM_THREADS", "1"), ("PYTHONPATH", "/x"), ("HOME", "/h")):
        assert local_forkserver.server_key({**base, name: value}) != key, name


def test_a_folder_others_can_read_is_not_used_and_the_launch_preloads_its_own(runtime, tmp_path, caplog):
    shared = runtime
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with open(tmp_path / "out", "wb") as out:
        assert local_forkserver.spawn(["supervise", "--dir", str(tmp_path)], environ=dict(os.environ),
                                      stdout=out.fileno(), stderr=out.fileno()) is None
    assert "not a folder of this user with mode 0700" in caplog.text
    assert not list(shared.iterdir())
    # The launch itself goes on, through a per-launch preloading process.
    spec = RunSpec.model_validate({"run_id": "nospec", "store": f"file://{tmp_path}/store", "replicas": 1,
                                   "device": "cpu"})
    (tmp_path / "store").mkdir()
    handle, = LocalProcessExecutor(spec).launch(f"file://{tmp_path}/store/nospec", [0])
    deadline = time.monotonic() + 120
    while not (Path(handle.data["dir"]) / "exit.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "is not a composer-cloud run" in (Path(handle.data["dir"]) / "replica.log").read_text()


def test_a_stale_socket_is_replaced_and_an_idle_server_exits_and_cleans_up(runtime, tmp_path, monkeypatch):
    monkeypatch.setenv(env.LOCAL_FORK_SERVER_IDLE_S, "2")
    runtime.mkdir(mode=0o700)
    sock = local_forkserver.address(os.environ)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock))  # a socket file nobody listens on: a server killed with -9
    dead.close()
    report = _supervise_through_server(tmp_path / "job", dict(os.environ))
    assert report["cwd"] == os.getcwd()
    servers = _servers(sock)
    assert len(servers) == 1
    deadline = time.monotonic() + 60
    while local_fork.alive(servers[0]) or sock.exists():
        assert time.monotonic() < deadline, "the idle server did not exit"
        time.sleep(0.2)
    assert not sock.with_suffix(".lock").exists()


def test_a_refused_request_is_an_error_not_a_hang(runtime, monkeypatch):
    runtime.mkdir(mode=0o700)
    sock = local_forkserver.address(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(1)
    try:
        import threading

        def refuse() -> None:
            conn, _ = listener.accept()
            with conn:
                for fd in socket.recv_fds(conn, 1 << 16, 2)[1]:
                    os.close(fd)
                conn.sendall(json.dumps({"error": "no"}).encode() + b"\n")

        threading.Thread(target=refuse, daemon=True).start()
        r, w = os.pipe()
        try:
            assert local_forkserver.spawn(["supervise"], environ=dict(os.environ), stdout=w, stderr=w) is None
        finally:
            os.close(r)
            os.close(w)
    finally:
        listener.close()


def test_a_server_that_dies_before_it_listens_is_not_waited_for(runtime, monkeypatch, caplog):
    monkeypatch.setattr(local_forkserver, "_MODULE", "composer_cloud.no_such_module")  # the server's start fails
    r, w = os.pipe()
    started = time.monotonic()
    try:
        assert local_forkserver.spawn(["supervise"], environ=dict(os.environ), stdout=w, stderr=w) is None
    finally:
        os.close(r)
        os.close(w)
    assert time.monotonic() - started < 60  # not the 600 s a slow server's imports are allowed
    assert "exited before it listened" in caplog.text
    assert "No module named composer_cloud.no_such_module" in next(runtime.glob("fs-*.log")).read_text()
