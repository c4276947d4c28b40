"""Store faults end to end (issues 10 and 11): kill -9 + resume on a second S3 implementation, and a
90-s outage of every store request during a round. Each compares the exported model with an
uninterrupted run's, bitwise. (Separate from test_failover.py so the two long modules run in parallel.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from composer_cloud.storage.store import Store
from test_resume import (  # noqa: F401 - baselines is a fixture
    SPEC,
    _baseline,
    _cli,
    _export,
    _kill_run_at,
    _same_weights,
    _store_uri,
    _use_seaweedfs,
    baselines,
)


@pytest.mark.slow
def test_resume_after_sigkill_on_seaweedfs_is_bitwise_exact(tmp_path, baselines, request, monkeypatch):
    """The same kill -9 + resume on a second S3 implementation (412 without <Condition>, other listing)."""
    _use_seaweedfs(request, monkeypatch)
    expected = _baseline("seaweedfs", tmp_path, baselines)
    store = _store_uri("s3", tmp_path)
    _kill_run_at(tmp_path, store, "killed-sw", "reduce")
    res = _cli(["resume", f"{store}/killed-sw"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _same_weights(_export(tmp_path, f"{store}/killed-sw", "resumed-sw"), expected)


@pytest.mark.slow
def test_store_outage_of_90s_in_round_2_is_ridden_out(tmp_path, baselines, s3_endpoint):
    """Every store request of the replicas and the launcher is refused for 90 s during round 2 (a
    loopback proxy): the run completes, exit 0, with the uninterrupted run's model."""
    from storeproxy import StoreProxy

    expected = _baseline("s3", tmp_path, baselines)
    store = _store_uri("s3", tmp_path)
    cfg = tmp_path / "outage.toml"
    # Deadlines count wall time, outages included: above the outage we mean to survive.
    cfg.write_text("max_restarts = 1\n" + SPEC.replace("quorum_timeout_s = 60\nround_timeout_s = 120",
                                                        "quorum_timeout_s = 150\nround_timeout_s = 300"))
    with StoreProxy(s3_endpoint) as proxy:
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint}
        launcher = subprocess.Popen([sys.executable, "-m", "composer_cloud.cli", "launch", "--config", str(cfg),
                                     "--store", store, "--run-id", "outage"], cwd=tmp_path, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run = Store(f"{store}/outage")  # direct, not through the proxy
        deadline = time.monotonic() + 300
        while not run.exists("rounds/00000001/0/outcome.json"):
            assert launcher.poll() is None and time.monotonic() < deadline, "round 1 never committed"
            time.sleep(0.1)
        proxy.set_mode("refuse", for_s=90)
        out, _ = launcher.communicate(timeout=600)
        refused = proxy.counts["refuse"]
    assert launcher.returncode == 0, out
    st = json.loads(_cli(["status", f"{store}/outage", "--json"], tmp_path).stdout)
    assert st["state"] == "completed" and all(r["restarts"] == 0 for r in st["replicas"]), st
    assert _same_weights(_export(tmp_path, f"{store}/outage", "model"), expected)
    print(f"connections refused during the outage: {refused}")
