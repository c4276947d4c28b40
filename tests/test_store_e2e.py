"""Runs end to end on a second real S3 implementation (SeaweedFS), and a launch that refuses a store
that does not enforce write-once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_cloud import env
from composer_cloud.env import JobEnv
from composer_cloud.errors import RunKeyError
from composer_cloud.spec import spec_from_dict
from composer_cloud.storage import layout
from composer_cloud.storage.run import open_run, run_signing_key
from composer_cloud.storage.store import Store
from support.cli import cli, status_here
from support.specs import SMALL_RUN_TOML
from storeproxy import StoreProxy


@pytest.mark.parametrize("kind", ["moto", "seaweedfs"])
def test_launch_refuses_a_store_that_ignores_if_none_match(kind, tmp_path, request):
    server = request.getfixturevalue(f"s3_server_{kind}")
    with StoreProxy(server.endpoint) as proxy:
        proxy.set_mode("strip-if-none-match")
        env = {**os.environ, **server.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        res = cli("launch", "--store", f"s3://{server.bucket}/split", "--run-id", "r", cwd=tmp_path, env=env,
                  timeout=600)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "conditional_create" in res.stderr and f"s3://{server.bucket}/split" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    direct = Store(f"s3://{server.bucket}/split", storage_options={"endpoint_url": server.endpoint})
    assert direct.list("r") == [] and direct.list(".composer-cloud-probe") == []  # nothing written
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("mode,missing", [("strip-if-none-match", "conditional_create"),
                                          ("serve-partial", "no_partial_reads")])
def test_resume_refuses_a_run_copied_onto_a_non_conforming_store(mode, missing, tmp_path, s3_server_moto):
    server = s3_server_moto
    run_uri = f"s3://{server.bucket}/copied-{mode}/r"
    direct = Store(run_uri, storage_options={"endpoint_url": server.endpoint})
    spec = spec_from_dict({"run_id": "r", "store": f"s3://{server.bucket}/copied-{mode}", "rounds": 2})
    direct.put_json(layout.SPEC, spec.to_json_dict())  # a run copied here from another store
    before = {k: bytes(direct.get_plain(k)) for k in direct.list()}
    with StoreProxy(server.endpoint) as proxy:
        proxy.set_mode(mode, delay_s=1.0)
        env = {**os.environ, **server.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        res = cli("resume", run_uri, cwd=tmp_path, env=env, timeout=600)
    assert res.returncode == 2, res.stdout + res.stderr
    assert missing in res.stderr and f"s3://{server.bucket}/copied-{mode}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert {k: bytes(direct.get_plain(k)) for k in direct.list()} == before  # nothing written
    assert Store(f"s3://{server.bucket}/copied-{mode}", storage_options={"endpoint_url": server.endpoint}).list(
        ".composer-cloud-probe") == []


@pytest.mark.slow
def test_three_replicas_complete_on_seaweedfs(tmp_path, s3_server_seaweedfs, monkeypatch):
    server = s3_server_seaweedfs
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    cfg = tmp_path / "spec.toml"
    cfg.write_text(SMALL_RUN_TOML)
    res = cli("doctor", f"s3://{server.bucket}/e2e", cwd=tmp_path)
    assert res.returncode == 0 and "conforms" in res.stdout, res.stdout + res.stderr
    res = cli("launch", "--config", str(cfg), "--replicas", "3", "--rounds", "3", "--inner-steps", "4", "--run-id",
              "sw", "--store", f"s3://{server.bucket}/e2e", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    st = status_here(f"s3://{server.bucket}/e2e/sw", tmp_path)
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
    res = cli("launch", "--config", str(cfg), "--store", store, "--run-id", "signed", cwd=tmp_path, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    st = cli("status", f"{store}/signed", "--json", cwd=tmp_path, env=env)
    assert st.returncode == 0 and json.loads(st.stdout)["state"] == "completed", st.stderr
    assert Store(f"{store}/signed").get_json("spec.json")["signed"] is True
    # Without the key a process cannot tell forged objects from real ones: it refuses the run, naming the secret.
    unsigned = {k: v for k, v in os.environ.items() if k != "COMPOSER_CLOUD_RUN_KEY"}
    res = cli("status", f"{store}/signed", cwd=tmp_path, env=unsigned)
    assert res.returncode == 2 and "COMPOSER_CLOUD_RUN_KEY" in res.stderr, res.stderr
    # A bucket writer without the key replaces the spec: with the key, the run is refused by name.
    Store(f"{store}/signed").put_json("spec.json", {"replicas": 1})
    res = cli("status", f"{store}/signed", cwd=tmp_path, env=env)
    assert res.returncode == 2 and "spec.json" in res.stderr and key not in res.stderr + res.stdout, res.stderr


KEY = "k" * 48


def _run_with_spec(tmp_path: Path, *, signed: bool) -> Store:
    """A run with only its spec: signed (and recorded as signed) with ``KEY``, or unsigned."""
    uri = f"file://{tmp_path}/store/{'signed' if signed else 'plain'}"
    spec = spec_from_dict({"run_id": uri.rsplit("/", 1)[1], "signed": signed})
    store = Store(uri, signing_key=run_signing_key(spec.run_id, KEY if signed else None))
    assert store.create_json(layout.SPEC, spec.to_json_dict())
    return store


def test_a_replica_without_the_run_key_refuses_a_signed_run_and_writes_nothing(tmp_path):
    store = _run_with_spec(tmp_path, signed=True)
    before = {k: store.get_plain(k) for k in store.list()}
    keyless = {k: v for k, v in os.environ.items() if k != env.RUN_KEY}
    res = subprocess.run([sys.executable, "-m", "composer_cloud.replica", "--run", store.uri, "--rank", "0"],
                         env=keyless, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and f"is signed: set {env.RUN_KEY}" in out, out[-2000:]
    assert {k: store.get_plain(k) for k in store.list()} == before  # no heartbeat, no metrics, nothing
    with pytest.raises(RunKeyError, match=env.RUN_KEY):
        open_run(store.uri, job_env=JobEnv())  # the library refuses too (status, cancel, resume, export)


def test_a_keyed_process_refuses_an_unsigned_run_and_a_wrong_key(tmp_path):
    plain = _run_with_spec(tmp_path, signed=False)
    with pytest.raises(RunKeyError, match=r"not signed, but a run key is set \(COMPOSER_CLOUD_RUN_KEY\)"):
        open_run(plain.uri, job_env=JobEnv(run_key=KEY))
    assert open_run(plain.uri, job_env=JobEnv()).spec.signed is False
    signed = _run_with_spec(tmp_path, signed=True)
    assert open_run(signed.uri, job_env=JobEnv(run_key=KEY)).store.signed
    with pytest.raises(RunKeyError, match="does not verify") as err:
        open_run(signed.uri, job_env=JobEnv(run_key="another-key-" * 3))
    assert KEY not in str(err.value) and "another-key" not in str(err.value)
