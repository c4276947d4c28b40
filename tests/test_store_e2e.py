"""Runs end to end on a second real S3 implementation (SeaweedFS), and a launch that refuses a store
that does not enforce write-once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_cloud.storage.store import Store
from conftest import SMALL_RUN_TOML
from storeproxy import StoreProxy


def _cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "composer_cloud.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.mark.parametrize("kind", ["moto", "seaweedfs"])
def test_launch_refuses_a_store_that_ignores_if_none_match(kind, tmp_path, request):
    server = request.getfixturevalue(f"s3_server_{kind}")
    with StoreProxy(server.endpoint) as proxy:
        proxy.set_mode("strip-if-none-match")
        env = {**os.environ, **server.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        res = _cli(["launch", "--store", f"s3://{server.bucket}/split", "--run-id", "r"], tmp_path, env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "conditional_create" in res.stderr and f"s3://{server.bucket}/split" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    direct = Store(f"s3://{server.bucket}/split", storage_options={"endpoint_url": server.endpoint})
    assert direct.list("r") == [] and direct.list(".composer-cloud-probe") == []  # nothing written
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_three_replicas_complete_on_seaweedfs(tmp_path, s3_server_seaweedfs, monkeypatch):
    server = s3_server_seaweedfs
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    cfg = tmp_path / "spec.toml"
    cfg.write_text(SMALL_RUN_TOML)
    res = _cli(["doctor", f"s3://{server.bucket}/e2e"], tmp_path)
    assert res.returncode == 0 and "conforms" in res.stdout, res.stdout + res.stderr
    res = _cli(["launch", "--config", str(cfg), "--replicas", "3", "--rounds", "3", "--inner-steps", "4",
                "--run-id", "sw", "--store", f"s3://{server.bucket}/e2e"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    st = json.loads(_cli(["status", f"s3://{server.bucket}/e2e/sw", "--json"], tmp_path).stdout)
    assert st["state"] == "completed" and st["rounds_committed"] == 3, st
    run = Store(f"s3://{server.bucket}/e2e/sw")
    digests = {run.get_json(f"replicas/{r}.json")["params_sha256"] for r in range(3)}
    assert len(digests) == 1  # bitwise-identical global parameters on every replica


@pytest.mark.slow
def test_a_run_signed_with_a_run_key_rejects_unsigned_objects(tmp_path):
    """With COMPOSER_CLOUD_RUN_KEY every object is signed: the run completes, the spec records it, a process
    without the key is refused naming the secret, and an object written without the key is not accepted."""
    cfg = tmp_path / "spec.toml"
    cfg.write_text("replicas = 2\nrounds = 2\ninner_steps = 2\n" + SMALL_RUN_TOML)
    key = "k" * 48
    env = {**os.environ, "COMPOSER_CLOUD_RUN_KEY": key}
    store = f"file://{tmp_path}/store"
    res = _cli(["launch", "--config", str(cfg), "--store", store, "--run-id", "signed"], tmp_path, env)
    assert res.returncode == 0, res.stdout + res.stderr
    st = _cli(["status", f"{store}/signed", "--json"], tmp_path, env)
    assert st.returncode == 0 and json.loads(st.stdout)["state"] == "completed", st.stderr
    assert Store(f"{store}/signed").get_json("spec.json")["signed"] is True
    # Without the key a process cannot tell forged objects from real ones: it refuses the run, naming the secret.
    unsigned = {k: v for k, v in os.environ.items() if k != "COMPOSER_CLOUD_RUN_KEY"}
    res = _cli(["status", f"{store}/signed"], tmp_path, unsigned)
    assert res.returncode == 2 and "COMPOSER_CLOUD_RUN_KEY" in res.stderr, res.stderr
    # A bucket writer without the key replaces the spec: with the key, the run is refused by name.
    Store(f"{store}/signed").put_json("spec.json", {"replicas": 1})
    res = _cli(["status", f"{store}/signed"], tmp_path, env)
    assert res.returncode == 2 and "spec.json" in res.stderr and key not in res.stderr + res.stdout, res.stderr
