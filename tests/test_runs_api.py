"""The library API under the CLI: runs from Python, and one way to open a run from every command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import composer_cloud as cc
from composer_cloud import runs
from composer_cloud.runs import RunNotFound, open_run
from support.cli import cli, cli_here, status_here
from support.specs import SMALL_RUN_TOML

SMALL = """
replicas = 2
rounds = 2
inner_steps = 2
""" + SMALL_RUN_TOML


@pytest.mark.slow
def test_python_api_launches_waits_and_reads_status(tmp_path):
    cfg = tmp_path / "spec.toml"
    cfg.write_text(SMALL)
    run = cc.launch(config=cfg, overrides={"store": f"file://{tmp_path}/store", "run_id": "api"})
    assert run.uri == f"file://{tmp_path}/store/api" and run.spec.replicas == 2
    seen: list[str] = []
    final = cc.wait(run, timeout_s=300, interval_s=0.5, on_update=lambda st: seen.append(st.state))
    assert final.state == "completed" and final.rounds_committed == 2 and final.last_durable_round == 1
    assert seen and seen[-1] == "completed"
    again = cc.get_status(str(tmp_path / "store/api"))  # a plain path names the same run
    assert again.state == "completed" and [r.state for r in again.replicas] == ["succeeded"] * 2
    (tmp_path / "store/not-a-run").mkdir()
    listed = cc.runs.list_runs(str(tmp_path / "store"))
    assert [(r.run_id, r.state, r.rounds_committed) for r in listed] == [("api", "completed", 2)]
    assert 0 <= time.time() - listed[0].launched_at < 600  # the age `ls` shows
    res = cli("ls", str(tmp_path / "store"), "--json", cwd=tmp_path)
    assert res.returncode == 0 and json.loads(res.stdout)[0]["run_id"] == "api", res.stderr
    res = cli("ls", str(tmp_path / "store"), cwd=tmp_path)
    assert res.returncode == 0 and "age" in res.stdout and "completed" in res.stdout, res.stderr


def test_version_flag(tmp_path):
    res = cli("--version", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == f"composer-cloud {cc.__version__}"


def test_open_run_names_what_is_missing(tmp_path):
    with pytest.raises(RunNotFound, match="not a composer-cloud run"):
        open_run(f"file://{tmp_path}/nothing-here")


def test_opening_a_run_does_not_import_torch(tmp_path):
    code = ("import sys, composer_cloud.cli, composer_cloud.runs as r\n"
            "try:\n    r.open_run(sys.argv[1])\nexcept r.RunNotFound:\n    pass\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('composer_cloud.replica')))")
    res = subprocess.run([sys.executable, "-c", code, f"file://{tmp_path}/x"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


@pytest.mark.slow
def test_store_options_from_the_spec_reach_every_command(tmp_path, s3_endpoint, monkeypatch):
    """The store is reachable only with ``store_options.endpoint_url``: no AWS_ENDPOINT_URL anywhere."""
    for name in [k for k in os.environ if k.startswith("AWS_ENDPOINT_URL")]:
        monkeypatch.delenv(name)
    cfg = tmp_path / "spec.toml"
    # One replica: it reaches the store as every replica does (a second would only repeat it).
    one_replica = SMALL.replace("replicas = 2", "replicas = 1")
    cfg.write_text(f'store_options = {{ endpoint_url = "{s3_endpoint}" }}\n' + one_replica)
    run_uri = "s3://cc-test/opts/run"
    # The launch as a user runs it; the commands after it read the run in this process (same code, no imports).
    res = cli("launch", "--config", str(cfg), "--store", "s3://cc-test/opts", "--run-id", "run", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr  # the replicas reached the store too
    # Without the option the store cannot be found: a clear error (exit 2), no traceback.
    res = cli_here("status", run_uri, cwd=tmp_path)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    flag = ["--store-option", f"endpoint_url={s3_endpoint}"]
    assert status_here(run_uri, tmp_path, *flag)["state"] == "completed"
    with monkeypatch.context() as m:
        m.setenv("COMPOSER_CLOUD_STORE_OPTIONS", json.dumps({"endpoint_url": s3_endpoint}))
        assert status_here(run_uri, tmp_path)["state"] == "completed"
    logs = cli_here("logs", run_uri, "--replica", "0", *flag, cwd=tmp_path)
    assert logs.exit_code == 0 and "completed" in logs.stdout, logs.output
    res = cli_here("export", run_uri, "--out", str(tmp_path / "model"), *flag, cwd=tmp_path)
    assert res.exit_code == 0 and (tmp_path / "model/config.json").exists(), res.output
    # A finished run: cancel and resume are no-ops that say so (and do not turn it into "cancelled").
    res = cli_here("cancel", run_uri, *flag, cwd=tmp_path)
    assert res.exit_code == 0 and "already completed" in res.stdout, res.output
    res = cli_here("resume", run_uri, *flag, cwd=tmp_path)
    assert res.exit_code == 0 and "nothing to resume" in res.stdout, res.output
    assert status_here(run_uri, tmp_path, *flag)["state"] == "completed"


def test_a_bare_run_id_names_a_run_under_the_default_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert runs.normalize_run_uri("run-1") == f"file://{tmp_path}/runs/run-1"
    (tmp_path / "run-2").mkdir()  # an existing local folder is taken as it is
    assert runs.normalize_run_uri("run-2") == f"file://{tmp_path}/run-2"
    assert runs.normalize_run_uri("other/run-3") == f"file://{tmp_path}/other/run-3"
    assert runs.normalize_run_uri("s3://b/p/run-4") == "s3://b/p/run-4"
