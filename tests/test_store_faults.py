"""Store faults end to end (issues 10 and 11): kill -9 + resume on a second S3 implementation, and a
90-s outage of every store request during a round. Each compares the exported model with an
uninterrupted run's, bitwise. (Separate from test_failover.py so the two long modules run in parallel.)"""

from __future__ import annotations

import os
import time

import pytest

from composer_cloud.storage.store import Store
from support.cli import cli_here, start_cli, status_here
from support.resume import export_weights, kill_run_at, same_weights
from support.specs import RESUME_SPEC, with_sync
from support.stores import store_uri_for, use_s3_server


@pytest.mark.slow
def test_resume_after_sigkill_on_seaweedfs_is_bitwise_exact(tmp_path, baselines, request, monkeypatch):
    """The same kill -9 + resume on a second S3 implementation (412 without <Condition>, other listing)."""
    use_s3_server(request, monkeypatch, "seaweedfs")
    expected = baselines.get(tmp_path)
    store = store_uri_for("seaweedfs", tmp_path)
    kill_run_at(tmp_path, store, "killed-sw", "reduce")
    res = cli_here("resume", f"{store}/killed-sw", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    assert same_weights(export_weights(tmp_path, f"{store}/killed-sw", "resumed-sw"), expected)


@pytest.mark.slow
def test_store_outage_of_90s_in_round_2_is_ridden_out(tmp_path, baselines, s3_endpoint):
    """Every store request of the replicas and the launcher is refused for 90 s during round 2 (a
    loopback proxy): the run completes, exit 0, with the uninterrupted run's model."""
    from storeproxy import StoreProxy

    expected = baselines.get(tmp_path)
    store = store_uri_for("s3", tmp_path)
    cfg = tmp_path / "outage.toml"
    # Deadlines count wall time, outages included: above the outage we mean to survive.
    cfg.write_text("max_restarts = 1\n" + with_sync(RESUME_SPEC, quorum_timeout_s=150, round_timeout_s=300))
    with StoreProxy(s3_endpoint) as proxy:
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint}
        launcher = start_cli("launch", "--config", str(cfg), "--store", store, "--run-id", "outage", cwd=tmp_path,
                             env=env)
        run = Store(f"{store}/outage")  # direct, not through the proxy
        deadline = time.monotonic() + 300
        while not run.exists("rounds/00000001/0/outcome.json"):
            assert launcher.poll() is None and time.monotonic() < deadline, "round 1 never committed"
            time.sleep(0.1)
        proxy.set_mode("refuse", for_s=90)
        out, _ = launcher.communicate(timeout=600)
        refused = proxy.counts["refuse"]
    assert launcher.returncode == 0, out
    st = status_here(f"{store}/outage", tmp_path)
    assert st["state"] == "completed" and all(r["restarts"] == 0 for r in st["replicas"]), st
    assert same_weights(export_weights(tmp_path, f"{store}/outage", "model"), expected)
    print(f"connections refused during the outage: {refused}")
