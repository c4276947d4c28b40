"""Checkpoints, exact resume after SIGKILL at every phase, fallback, export (file:// and S3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from composer_cloud import env
from composer_cloud.hooks import PHASES
from composer_cloud.runs.sync_state import latest_checkpoint
from composer_cloud.storage.run import open_run
from composer_cloud.storage.store import Store
from conftest import SMALL_RUN_TOML

SPEC = """
replicas = 2
min_replicas = 2
rounds = 4
inner_steps = 4
keep_checkpoints = 10
[sync]
quorum_timeout_s = 60
round_timeout_s = 120
""" + SMALL_RUN_TOML


def _cli(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "composer_cloud.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _store_uri(kind: str, tmp_path: Path) -> str:
    return f"file://{tmp_path}/store" if kind == "file" else f"s3://cc-test/{tmp_path.name}"


def _use_seaweedfs(request, monkeypatch) -> None:
    """Point this test (and the processes it starts) at the session's SeaweedFS server."""
    server = request.getfixturevalue("s3_server_seaweedfs")
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)


def _launch(tmp_path: Path, store: str, run_id: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "spec.toml"
    cfg.write_text(SPEC)
    return _cli(["launch", "--config", str(cfg), "--store", store, "--run-id", run_id], tmp_path)


def _export(tmp_path: Path, run_uri: str, name: str) -> dict:
    out = tmp_path / name
    res = _cli(["export", run_uri, "--out", str(out)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    return load_file(out / "model.safetensors")


def _kill_run_at(tmp_path: Path, store: str, run_id: str, phase: str) -> None:
    """Launch, wait until rank 0 stalls at ``phase`` of round 2, SIGKILL launcher and every replica."""
    cfg = tmp_path / "spec.toml"
    cfg.write_text(SPEC)
    marker = tmp_path / f"stalled-{run_id}"
    environ = {**os.environ, env.STALL_AT: f"{phase}:2:0", env.STALL_MARKER: str(marker)}
    launcher = subprocess.Popen([sys.executable, "-m", "composer_cloud.cli", "launch", "--config", str(cfg),
                                 "--store", store, "--run-id", run_id], cwd=tmp_path, env=environ,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not marker.exists():
        assert launcher.poll() is None, "launcher exited before the stall point"
        assert time.monotonic() < deadline, f"never reached {phase}"
        time.sleep(0.2)
    time.sleep(0.5)  # let the other replica get deep into its own waits
    os.killpg(launcher.pid, signal.SIGKILL)
    run = Store(f"{store}/{run_id}")
    for key in run.list("executor"):
        pgid = run.get_json(key)["data"]["pgid"]
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait()


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, request):
    """Uninterrupted 4-round runs (one per store kind): their exported weights."""
    return {}


def _baseline(kind: str, tmp_path: Path, cache: dict) -> dict:
    if kind not in cache:
        store = _store_uri(kind, tmp_path)
        res = _launch(tmp_path, store, "baseline")
        assert res.returncode == 0, res.stdout + res.stderr
        cache[kind] = _export(tmp_path, f"{store}/baseline", "baseline-model")
    return cache[kind]


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_resume_after_sigkill_is_bitwise_exact(phase, tmp_path, baselines):
    check_resume_after_sigkill("file", phase, tmp_path, baselines)


def check_resume_after_sigkill(kind: str, phase: str, tmp_path: Path, baselines: dict) -> None:
    """Kill launcher and every replica at ``phase`` of round 2, resume: the model equals the uninterrupted one.
    (The same matrix on S3 is in test_resume_s3.py, its own module so the two run on separate workers.)"""
    expected = _baseline(kind, tmp_path, baselines)
    store = _store_uri(kind, tmp_path)
    run_id = f"killed-{phase}"
    _kill_run_at(tmp_path, store, run_id, phase)
    run_uri = f"{store}/{run_id}"
    st = json.loads(_cli(["status", run_uri, "--json"], tmp_path).stdout)
    if phase == "checkpoint":
        # Checkpoint writes run in the background: training may have gone on,
        # but the stalled round-2 checkpoint is torn (no manifest).
        assert not Store(run_uri).exists("checkpoints/00000002/manifest.json")
    else:
        assert st["rounds_committed"] < 4
    res = _cli(["resume", run_uri], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    got = _export(tmp_path, run_uri, f"resumed-{phase}")
    assert _same_weights(got, expected), f"resume after a kill at {phase} diverged"


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back(tmp_path, baselines):
    expected = _baseline("file", tmp_path, baselines)
    store = _store_uri("file", tmp_path)
    res = _launch(tmp_path, store, "corrupt")
    assert res.returncode == 0, res.stderr
    run = open_run(f"{store}/corrupt")
    assert latest_checkpoint(run.store, run.spec).round == 3
    path = tmp_path / "store/corrupt/checkpoints/00000003/replica-1.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert latest_checkpoint(run.store, run.spec).round == 2
    res = _cli(["resume", f"{store}/corrupt"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    # The warning names the skipped checkpoint, and redoing round 3 gives the same model.
    assert "checkpoints/00000003" in res.stderr and "corrupt" in res.stderr, res.stderr
    assert _same_weights(_export(tmp_path, f"{store}/corrupt", "corrupt-model"), expected)


def test_launch_with_missing_bucket_fails_before_any_replica(tmp_path, s3_endpoint):
    res = _cli(["launch", "--store", "s3://no-such-bucket/x", "--run-id", "r"], tmp_path)
    assert res.returncode == 2
    assert "no-such-bucket" in res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_resume_with_more_replicas(tmp_path):
    store = _store_uri("file", tmp_path)
    _kill_run_at(tmp_path, store, "grow", "inner_step")
    res = _cli(["resume", f"{store}/grow", "--replicas", "3"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    st = json.loads(_cli(["status", f"{store}/grow", "--json"], tmp_path).stdout)
    assert st["state"] == "completed" and st["rounds_committed"] == 4 and len(st["replicas"]) == 3
    log = (tmp_path / "store/grow/jobs/2/replica.log").read_text()
    assert "fresh inner state" in log
    digests = {json.loads((tmp_path / f"store/grow/replicas/{r}.json").read_bytes()[16:])["params_sha256"]
               for r in range(3)}
    assert len(digests) == 1
