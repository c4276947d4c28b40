"""No single point of failure (issue 11), end to end: the round's leader lost while it uploads its slice of the
committed global state (the lost-state and forged-commit cases: test_failover_lost_state.py; store faults:
test_store_faults.py). Each compares the exported model with an uninterrupted run's, bitwise."""

from __future__ import annotations


import pytest

from support.cli import status_here
from support.failover import launch_and_kill_replica_at
from support.resume import export_weights, same_weights
from support.stores import store_uri_for


@pytest.mark.slow
# Both rounds on file://, the middle one on S3 too (the final round on S3 adds a run, not a code path).
@pytest.mark.parametrize(("kind", "round"), [("file", 1), ("file", 3), ("s3", 1)],
                         ids=["middle-round-file", "final-round-file", "middle-round-s3"])
def test_leader_killed_during_global_upload_run_completes_exactly(kind, round, tmp_path, baselines, request):
    """The round's leader dies while uploading its slice of the committed global state; with one
    restart the run completes (exit 0) and its model equals the uninterrupted run's, bitwise."""
    if kind == "s3":
        request.getfixturevalue("s3_endpoint")
    expected = baselines.get(tmp_path)
    store = store_uri_for(kind, tmp_path)
    run_id = f"leader-{round}"
    launcher = launch_and_kill_replica_at(tmp_path, store, run_id, "global_upload", round, "max_restarts = 1\n")
    out, _ = launcher.communicate(timeout=400)
    assert launcher.returncode == 0, out
    run_uri = f"{store}/{run_id}"
    st = status_here(run_uri, tmp_path)
    assert st["state"] == "completed" and st["latest_durable_round"] == 4, st  # 1-based (docs/metrics.md)
    assert st["replicas"][0]["restarts"] == 1, st
    assert same_weights(export_weights(tmp_path, run_uri, "model"), expected)
