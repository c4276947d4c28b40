"""`composer-cloud` with the hf-jobs executor (local Jobs server, real huggingface_hub client)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli import cli
from support.hf_jobs import NAMESPACE
from support.specs import SMALL_RUN_TOML

SPEC = SMALL_RUN_TOML + f"""
[hf_jobs]
namespace = "{NAMESPACE}"
flavor = "cpu-basic"
"""


def _cloud_cli(*args: str, cwd: Path, wheel_path: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """The CLI with the prebuilt wheel (jobs install it instead of one built per launch)."""
    return cli(*args, cwd=cwd, env={**os.environ, "COMPOSER_CLOUD_PREBUILT_WHEEL": str(wheel_path)}, timeout=timeout)


def _status(run_uri: str, cwd: Path, wheel_path: Path) -> dict:
    res = _cloud_cli("status", run_uri, "--json", cwd=cwd, wheel_path=wheel_path)
    st = json.loads(res.stdout)
    # `status` exits with the run's outcome: 1 for a failed or cancelled run, 0 otherwise.
    assert res.returncode == (1 if st["state"] in ("failed", "cancelled") else 0), res.stderr
    return st


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["hf-jobs", "local:1,hf-jobs:1"])
def test_launch_status_logs_through_hf_jobs(hf_env, wheel, tmp_path, executor):
    (tmp_path / "spec.toml").write_text(SPEC)
    store = f"file://{tmp_path}/store"
    res = _cloud_cli("launch", "--config", "spec.toml", "--executor", executor, "--replicas", "2", "--rounds", "2",
                     "--inner-steps", "3", "--store", store, "--run-id", "cloud", cwd=tmp_path, wheel_path=wheel)
    assert res.returncode == 0, res.stdout + res.stderr
    run_uri = f"{store}/cloud"
    st = _status(run_uri, tmp_path, wheel)
    assert st["state"] == "completed" and st["rounds_committed"] == 2
    assert [r["executor"] for r in st["replicas"]] == (["hf-jobs"] * 2 if executor == "hf-jobs"
                                                       else ["local", "hf-jobs"])
    logs = _cloud_cli("logs", run_uri, "--replica", "1", cwd=tmp_path, wheel_path=wheel)
    assert logs.returncode == 0 and "replica 1 completed" in logs.stdout, logs.stdout[-2000:]


@pytest.mark.slow
def test_cancel_through_hf_jobs(hf_env, wheel, tmp_path):
    (tmp_path / "spec.toml").write_text(SPEC)
    store = f"file://{tmp_path}/store"
    res = _cloud_cli("launch", "--config", "spec.toml", "--executor", "hf-jobs", "--replicas", "2", "--rounds", "500",
                     "--store", store, "--run-id", "long", "--detach", cwd=tmp_path, wheel_path=wheel)
    assert res.returncode == 0, res.stderr
    run_uri = f"{store}/long"
    deadline = time.monotonic() + 300
    while not any(r["state"] == "running" for r in _status(run_uri, tmp_path, wheel)["replicas"]):
        assert time.monotonic() < deadline
        time.sleep(1)
    assert _cloud_cli("cancel", run_uri, cwd=tmp_path, wheel_path=wheel).returncode == 0
    deadline = time.monotonic() + 120
    while True:
        st = _status(run_uri, tmp_path, wheel)
        if all(r["state"] in ("cancelled", "failed", "succeeded") for r in st["replicas"]):
            break
        assert time.monotonic() < deadline, st
        time.sleep(1)
    assert st["state"] == "cancelled"
    assert all(r["state"] == "cancelled" for r in st["replicas"]), st


@pytest.mark.jobs_hub
def test_dry_run_launches_nothing_and_names_no_secret_values(tmp_path, monkeypatch, s3_server_moto):
    # The dry run runs launch's own checks (the store probe included), so it gets a store it can reach.
    canary = "sk-canary-" + os.urandom(6).hex()
    for name, value in s3_server_moto.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", canary)
    monkeypatch.setenv("HF_TOKEN", canary)
    (tmp_path / "spec.toml").write_text(SPEC + 'secrets = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]\n')
    env = {**os.environ}
    res = subprocess.run([sys.executable, "-m", "composer_cloud.cli", "launch", "--config", "spec.toml",
                          "--executor", "hf-jobs", "--replicas", "8", "--flavor", "a10g-large", "--store",
                          f"s3://{s3_server_moto.bucket}/dry-run", "--dry-run"], cwd=tmp_path, capture_output=True,
                         text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert "a10g-large" in res.stdout and "AWS_SECRET_ACCESS_KEY" in res.stdout
    assert canary not in res.stdout + res.stderr
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- replicas larger than one GPU (issue 24)
def _row(output: str, label: str) -> str:
    """The value of a dry-run table row (rich box drawing: ``│ label │ value │``)."""
    import re

    m = re.search(rf"│ {re.escape(label)}\s*│ (\S+)", output)
    assert m, f"no row {label!r} in:\n{output}"
    return m.group(1)


def test_modal_dry_run_shows_n_gpus_per_replica_and_their_price(tmp_path, monkeypatch, s3_server_moto):
    from composer_cloud.cli import app
    from composer_cloud.jobs.modal_jobs import MODAL_GPU_PRICE_PER_S
    from typer.testing import CliRunner

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "250")  # one line per table row
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-not-real")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-not-real")
    (tmp_path / "spec.toml").write_text(SMALL_RUN_TOML + '[modal]\nsecrets = ["aws"]\ntimeout_s = 3600\n')
    args = ["launch", "--config", "spec.toml", "--executor", "modal", "--replicas", "2",
            "--store", f"s3://{s3_server_moto.bucket}/dry-run-modal", "--dry-run", "--set", "trainer.batch_size=8"]
    res = CliRunner().invoke(app, [*args, "--gpus-per-replica", "8", "--gpu", "H100"])
    assert res.exit_code == 0, res.output
    per_replica_hour = 8 * MODAL_GPU_PRICE_PER_S["H100"][0] * 3600
    assert "H100:8" in res.output and "GPUs per replica" in res.output and "8 (8 local ranks, ddp)" in res.output
    assert _row(res.output, "cost per replica-hour") == f"${per_replica_hour:,.2f}"
    assert _row(res.output, "cost per hour (2 replicas)") == f"${2 * per_replica_hour:,.2f}"
    # More GPUs than Modal puts in one container of that type: exit 2, the limit named, nothing launched.
    res = CliRunner().invoke(app, [*args, "--gpus-per-replica", "5", "--gpu", "A10"])
    assert res.exit_code == 2 and "at most 4 A10 GPUs" in res.output, res.output


@pytest.mark.jobs_hub
def test_hf_jobs_dry_run_shows_the_xn_flavor_and_its_price(hf_env, tmp_path, monkeypatch):
    from composer_cloud.cli import app
    from typer.testing import CliRunner

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "250")
    (tmp_path / "spec.toml").write_text(SPEC.replace('"cpu-basic"', '"a10g-large"') + "timeout_s = 3600\n")
    args = ["launch", "--config", "spec.toml", "--executor", "hf-jobs", "--replicas", "3", "--store",
            f"file://{tmp_path}/store", "--dry-run", "--set", "trainer.batch_size=8"]
    res = CliRunner().invoke(app, [*args, "--gpus-per-replica", "2"])
    assert res.exit_code == 0, res.output
    # a10g-largex2 is listed at 50000 micro-USD per minute by the test server: $3/h per replica, 3 replicas.
    assert "a10g-largex2 (2 GPUs)" in res.output and "2 (2 local ranks, ddp)" in res.output
    assert _row(res.output, "cost per replica-hour") == "$3.00"
    assert _row(res.output, "cost per hour (3 replicas)") == "$9.00"
    # A count the family does not offer: exit 2 naming the flavors that have it.
    res = CliRunner().invoke(app, [*args, "--gpus-per-replica", "8"])
    assert res.exit_code == 2, res.output
    assert "no a10g flavor with 8 GPUs" in res.output and "l40sx8, a100x8, h200x8" in res.output
    assert not (tmp_path / "store").exists()
