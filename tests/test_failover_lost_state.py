"""No single point of failure (issue 11), end to end: every participant lost before the state is durable, the
leader lost in the last round's state upload, and forged commits for later rounds. Each compares the exported
model with an uninterrupted run's, bitwise, or checks the run never says "completed". (A module apart from
test_failover.py so pytest-xdist's loadscope runs the two on separate workers.)"""

from __future__ import annotations

import time

import pytest

from composer_cloud.storage import layout
from composer_cloud.storage.records import Outcome, Quorum
from composer_cloud.storage.store import Store
from support.cli import cli, status_here
from support.failover import launch_and_kill_replica_at
from support.local_jobs import kill_replica
from support.resume import export_weights, same_weights
from support.stores import store_uri_for


@pytest.mark.slow
def test_forged_future_commits_never_yield_completed(tmp_path):
    """Committed records forged for every later round, then every replica dies: not "completed"."""
    store = store_uri_for("file", tmp_path)
    launcher = launch_and_kill_replica_at(tmp_path, store, "forged", "inner_step", 1, "", round_timeout_s=20)
    run = Store(f"{store}/forged")
    for r in range(1, 4):  # well-formed records: only the missing durable state gives them away
        run.create_json(layout.quorum_key(r, 0), Quorum(round=r, attempt=0, participants=[0, 1], decided_by=1,
                                                        time=time.time(), reason="all joined").to_json())
        run.create_json(layout.outcome_key(r, 0), Outcome(round=r, attempt=0, committed=True, participants=[0, 1],
                                                          by=1, time=time.time()).to_json())
    out, _ = launcher.communicate(timeout=400)
    assert launcher.returncode != 0, out
    st = status_here(f"{store}/forged", tmp_path)
    assert st["state"] != "completed", st
    # Forged commits are either rejected by round discovery or counted; counted ones are reported as not durable.
    assert st["rounds_committed"] < 4 or st["problems"], st
    # `status` exits with the run's outcome (README: 1 for a failed or cancelled run), and still shows the table.
    shown = cli("status", f"{store}/forged", cwd=tmp_path)
    assert shown.returncode == (1 if st["state"] in ("failed", "cancelled") else 0), shown


@pytest.mark.slow
def test_every_participant_lost_before_the_state_is_durable_voids_and_reruns_the_round(tmp_path, baselines):
    """Both replicas die while round 1's global state is incomplete: nobody can finish it. With one
    restart each, the commit is voided, round 1 runs again, and the model equals the uninterrupted one."""
    expected = baselines.get(tmp_path)
    store = store_uri_for("file", tmp_path)
    launcher = launch_and_kill_replica_at(tmp_path, store, "void", "global_upload", 1, "max_restarts = 1\n",
                                           round_timeout_s=20, heal_timeout_s=60)
    kill_replica(f"{store}/void", 1)
    out, _ = launcher.communicate(timeout=500)
    assert launcher.returncode == 0, out
    assert Store(f"{store}/void").exists(layout.void_key(1, 0))
    assert same_weights(export_weights(tmp_path, f"{store}/void", "model"), expected)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["checkpoint", "global_upload"], ids=["inner-state-upload", "global-upload"])
def test_the_survivor_exits_promptly_when_the_leader_dies_in_the_last_rounds_state_upload(phase, tmp_path,
                                                                                          baselines):
    """replicas = min_replicas = 2, max_restarts = 1, the leader SIGKILLed while it uploads the final
    round's state: the survivor makes the state durable (taking over the leader's slice after
    quorum_timeout_s) and exits; nothing waits out round_timeout_s for a writer that is gone."""
    expected = baselines.get(tmp_path)
    store = store_uri_for("file", tmp_path)
    round_timeout_s, quorum_timeout_s = 120, 15
    launcher = launch_and_kill_replica_at(tmp_path, store, "exit", phase, 3, "max_restarts = 1\n",
                                           round_timeout_s=round_timeout_s)
    killed_at = time.time()
    out, _ = launcher.communicate(timeout=400)
    assert launcher.returncode == 0, out
    run_uri = f"{store}/exit"
    st = status_here(run_uri, tmp_path)
    assert st["state"] == "completed" and st["latest_durable_round"] == 4, st  # 1-based (docs/metrics.md)
    assert st["replicas"][0]["restarts"] == 1 and st["replicas"][1]["restarts"] == 0, st
    survivor = Store(run_uri).get_json(layout.heartbeat_key(1))
    assert survivor["state"] == "completed"
    # Its only wait was the slice takeover (quorum_timeout_s); a generous bound, half the round deadline.
    assert survivor["time"] - killed_at < round_timeout_s / 2, (survivor["time"] - killed_at, quorum_timeout_s)
    assert same_weights(export_weights(tmp_path, run_uri, "model"), expected)
