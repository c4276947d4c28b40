"""Issue 33: objects a bucket writer plants (no run key) neither hang a run nor mislabel it.

The two reproductions of the issue first (they failed on a669e7c), then the rules that close their classes:
an object that fails verification is absent (never committed, behind, voided or complete), every re-sync
loop has a budget, and status and export share one answer to "which round is the run's durable model".
The planted-object matrix itself is in ``test_planted_matrix.py``.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import torch

from composer_cloud import env
from composer_cloud.errors import ChecksumMismatch
from composer_cloud.runs import lifecycle, signing, sync_state
from composer_cloud.runs.export import latest_model_state
from composer_cloud.spec import spec_from_dict
from composer_cloud.storage import layout
from composer_cloud.storage.records import Outcome, Quorum
from composer_cloud.storage.records.limits import ROUND_RECORD_MAX_BYTES
from composer_cloud.storage.store import Store
from composer_cloud.sync.checkpoint import manifests
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore
from composer_cloud.sync.checkpoint.replica_state import ReplicaStateStore
from composer_cloud.sync.lockstep import rounds
from composer_cloud.sync.lockstep.allreduce import ObjectStoreAllReduce, RoundResult, RoundTimeout
from composer_cloud.sync.lockstep.manager import ObjectStoreManager, SyncStalled
from workers import allreduce_config, payload

NUMEL = 64


@pytest.fixture(params=["file", "s3"])
def any_store_uri(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    request.getfixturevalue("s3_endpoint")
    return f"s3://cc-test/planted-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True)
def launcher_env(tmp_path, monkeypatch):
    monkeypatch.setenv(env.KEYS, str(tmp_path / "run-keys"))
    monkeypatch.delenv(env.RUN_KEY, raising=False)
    monkeypatch.delenv(env.UNSIGNED, raising=False)


def signed_run(uri: str, *, rounds_: int = 4, replicas: int = 2) -> Store:
    """A signed lock-step run as ``launch`` leaves it (spec written, key kept on this machine)."""
    base, run_id = uri.rsplit("/", 1)
    s = spec_from_dict({"run_id": run_id, "store": base, "executor": "local", "replicas": replicas,
                        "rounds": rounds_, "signed": True})
    s, run_key = signing.launch_key(s)
    store = Store(f"{s.store}/{s.run_id}", signing_key=signing.signing_key(s, run_key))
    assert store.create_json(layout.SPEC, s.to_json_dict())
    signing.remember(store.uri, s, run_key)
    return store


def run_round(stores: list[Store], round: int, **kw: Any) -> list[RoundResult | Exception]:
    """One round with one thread per replica (rank = index); what each got."""
    out: list[Any] = [None] * len(stores)

    def replica(rank: int) -> None:
        ar = ObjectStoreAllReduce(stores[rank], rank, allreduce_config(
            len(stores), **{"min_replicas": len(stores), "quorum_timeout_s": 20, "round_timeout_s": 20, **kw}))
        try:
            out[rank] = ar.allreduce(round, payload(rank + 10 * round, NUMEL))
        except Exception as exc:  # noqa: BLE001 - asserted on
            out[rank] = exc
        finally:
            ar.close()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(len(stores))]
    [t.start() for t in threads]
    [t.join(timeout=90) for t in threads]
    assert not any(t.is_alive() for t in threads), "a replica hung"
    return out


# ------------------------------------------------------------------ reproduction 1: the livelock
def test_garbage_outcome_and_a_name_under_the_next_round_do_not_make_replicas_behind(any_store_uri):
    """Issue 33, case 1: ``b"x"`` at round 2's outcome and any name under round 3, before the replicas get
    there. They used to go behind -> heal -> "nothing to heal" forever; now round 2 commits as attempt 1."""
    stores = [Store(any_store_uri), Store(any_store_uri)]
    for r in (0, 1):
        assert all(isinstance(x, RoundResult) and x.committed for x in run_round(stores, r))
    bucket = Store(any_store_uri)
    bucket.put_plain(layout.outcome_key(2, 0), b"x")
    bucket.put_plain(layout.quorum_key(3, 0), b"x")
    bucket.put_plain("rounds/00000003/anything", b"x")
    out = run_round(stores, 2)
    for res in out:
        assert isinstance(res, RoundResult) and res.committed and res.participated and res.attempt == 1, res
    assert rounds.latest_committed_round(bucket) == 2
    assert not rounds.moved_past(bucket, 2)


class _Params:
    """A replica's global state for the manager: one tensor (what DiLoCo registers, reduced to its core)."""

    def __init__(self) -> None:
        self.w = torch.zeros(NUMEL)

    def register(self, manager: ObjectStoreManager) -> None:
        manager.register_state_dict_fn("w", lambda t: self.w.copy_(t["w"]), lambda: {"w": self.w})


def _manager(store: Store, *, start: int = 0, sync: dict[str, Any] | None = None,
             **kw: Any) -> tuple[ObjectStoreManager, _Params]:
    ar = ObjectStoreAllReduce(store, 0, allreduce_config(1, quorum_timeout_s=5, round_timeout_s=5, **(sync or {})))
    m = ObjectStoreManager(ar, GlobalStateStore(store), heal_timeout_s=5, takeover_after_s=0, void_after_s=2,
                           start_step=start, **kw)
    p = _Params()
    p.register(m)
    return m, p


def _sync(m: ObjectStoreManager, t: torch.Tensor) -> bool:
    m.start_quorum()
    m.allreduce(t).wait()
    return m.should_commit()


def test_the_manager_commits_past_the_planted_livelock_in_one_sync(store_uri):
    """Case 1 at the manager: the sync at round 2 commits (it used to heal to nothing and retry, forever)."""
    store = Store(store_uri)
    m, p = _manager(store)
    for _ in range(2):
        assert _sync(m, torch.ones(NUMEL))
    m.flush_state()
    Store(store_uri).put_plain(layout.outcome_key(2, 0), b"x")
    Store(store_uri).put_plain("rounds/00000003/0/join/0.json", b"x")
    assert _sync(m, torch.ones(NUMEL)) and m.current_step() == 3
    assert rounds.committed_attempt(store, 2) == 1
    m.close()


def test_a_replica_whose_syncs_never_advance_it_fails_naming_the_blocking_object(store_uri):
    """The re-sync budget: a replica aborted at every sync (its payload is NaN, alone; no immediate retries)
    stops with a reason instead of syncing forever."""
    m, _ = _manager(Store(store_uri), stall_s=0.0, stall_syncs=3, sync={"max_attempts": 1})
    bad = torch.ones(NUMEL)
    bad[3] = float("nan")
    with pytest.raises(SyncStalled) as err:
        for _ in range(10):
            assert not _sync(m, bad.clone())
    msg = str(err.value)
    assert "round 1 made no progress in 3 syncs" in msg and "rounds/00000000" in msg
    m.close()


def test_an_excluded_replica_whose_peers_are_gone_exits_within_the_deadlines(store_uri):
    """Issue 37, item 3: rank 2, excluded from round 0 by attempt 0's check, arrives at attempt 1 whose
    participants failed. It used to return at once and sync again, forever; now it waits for attempt 1's
    outcome for quorum_timeout_s + round_timeout_s and raises naming the outcome key."""
    store = Store(store_uri)
    store.create_json(layout.quorum_key(0, 0), Quorum(0, 0, [0, 1, 2]).to_json())
    store.create_json(layout.outcome_key(0, 0), Outcome(0, 0, False, reason="replica 2: non-finite",
                                                         excluded=[2], check="nonfinite", retry=True).to_json())
    ar = ObjectStoreAllReduce(store, 2, allreduce_config(3, min_replicas=2, quorum_timeout_s=0.5,
                                                         round_timeout_s=0.5))
    with pytest.raises(RoundTimeout) as err:
        ar.allreduce(0, payload(2, NUMEL))
    assert "excluded from attempt 1" in str(err.value) and layout.outcome_key(0, 1) in str(err.value)
    # The peers committed attempt 1 without it: the same wait ends in "committed, not participated" (heal).
    store.create_json(layout.quorum_key(0, 1), Quorum(0, 1, [0, 1], excluded=[2]).to_json())
    store.create_json(layout.outcome_key(0, 1), Outcome(0, 1, True, participants=[0, 1]).to_json())
    with pytest.raises(Exception) as behind:
        ar.allreduce(0, payload(2, NUMEL))
    assert type(behind.value).__name__ == "BehindError"
    ar.close()


# ------------------------------------------------------------------ reproduction 2: status vs export
def _commit(store: Store, round: int, attempt: int, value: float, *, participants: tuple[int, ...] = (0, 1)) -> None:
    """What the run's replicas leave for a committed round: records, global state, inner states, manifest."""
    parts = list(participants)
    assert store.create_json(layout.quorum_key(round, attempt), Quorum(round, attempt, parts).to_json())
    assert store.create_json(layout.outcome_key(round, attempt),
                             Outcome(round, attempt, True, participants=parts).to_json())
    states, replicas = GlobalStateStore(store), ReplicaStateStore(store)
    tree = {"w": torch.full((NUMEL,), value)}
    for rank in parts:
        states.publish(round, attempt, tree, participants=parts, rank=rank, takeover_after_s=0)
        replicas.write(round, rank, {"inner": torch.full((4,), value)}, world_size=len(parts))
    manifests.write_manifest(states, replicas, round, attempt, parts, deadline_s=5,
                             committed=lambda: rounds.committed_attempt(store, round) == attempt)


def _exported(store: Store, spec: Any) -> tuple[int, int, float]:
    """What ``export`` without ``--round`` exports: (round, attempt, the model's value)."""
    round, tree = latest_model_state(store, spec)
    found = sync_state.latest_checkpoint(store, spec, verify=False)
    assert found is not None and found.round == round
    return round, found.manifest.attempt, float(tree["w"][0])


def test_unsigned_records_over_the_final_round_leave_status_and_export_on_the_same_model(tmp_path):
    """Issue 33, case 2: the final round's quorum and outcome overwritten with unsigned records after it
    committed. Status said "completed" while export gave round 3's model; now both name round 4's model, and
    once round 4 is committed again (attempt 1) its manifest replaces the stale one and that is exported."""
    store = signed_run(f"file://{tmp_path}/store/case2")
    run = lifecycle._as_run(store.uri, None)
    for r in range(4):
        _commit(store, r, 0, float(r))
    bucket = Store(store.uri)
    bucket.put_json(layout.quorum_key(3, 0), Quorum(3, 0, [0, 1]).to_json())
    bucket.put_json(layout.outcome_key(3, 0), Outcome(3, 0, True, participants=[0, 1]).to_json())
    assert rounds.committed_attempt(store, 3) is None  # the records are absent: unsigned
    st = lifecycle.get_status(store.uri, poll_executors=False)
    assert st.state == "completed" and st.rounds_committed == 4, st
    assert _exported(store, run.spec) == (3, 0, 3.0)
    # The supervisors restarted the replicas and they committed round 4 again as attempt 1 (same model).
    _commit(store, 3, 1, 3.0)
    assert manifests.read_manifest(GlobalStateStore(store), 3).attempt == 1
    st = lifecycle.get_status(store.uri, poll_executors=False)
    assert st.state == "completed" and _exported(store, run.spec) == (3, 1, 3.0)


def test_a_completed_run_stays_completed_whatever_happens_to_older_round_records(tmp_path):
    """Issue 37, item 5: deleting round 2's quorum (or garbling any older record) after completion made status
    say "failed" forever and resume exit 1. The final checkpoint is verified: completed; resume says so."""
    store = signed_run(f"file://{tmp_path}/store/deleted")
    for r in range(4):
        _commit(store, r, 0, float(r))
    bucket = Store(store.uri)
    bucket.delete(layout.quorum_key(1, 0))
    bucket.put_plain(layout.outcome_key(0, 0), b"x")
    bucket.delete(layout.outcome_key(2, 0))
    st = lifecycle.get_status(store.uri, poll_executors=False)
    assert st.state == "completed" and st.rounds_committed == 4 and not st.problems, st
    res = lifecycle.resume(store.uri)
    assert res.noop and "completed" in res.noop
    # A verified abort of the final attempt does deny it: then the run is not completed.
    bucket.delete(layout.outcome_key(3, 0))
    bucket.delete(layout.quorum_key(3, 0))
    store.create_json(layout.outcome_key(3, 0), Outcome(3, 0, False, reason="aborted").to_json())
    st = lifecycle.get_status(store.uri, poll_executors=False)
    assert st.state != "completed" and st.last_durable_round == 2, st
    assert _exported(store, lifecycle._as_run(store.uri, None).spec)[0] == 2


# ------------------------------------------------------------------ size limits
def test_a_huge_object_at_a_record_key_is_refused_before_it_is_read_whole(any_store_uri):
    store = Store(any_store_uri)
    huge = b"{" + b" " * (8 * ROUND_RECORD_MAX_BYTES)
    store.put(layout.outcome_key(0, 0), huge)
    before = store.bytes_read
    with pytest.raises(ChecksumMismatch, match="limit"):
        store.get_json(layout.outcome_key(0, 0), max_bytes=ROUND_RECORD_MAX_BYTES)
    assert store.bytes_read - before <= ROUND_RECORD_MAX_BYTES + 1024
    out = rounds.read_outcome(store, 0, 0, replicas=2)
    assert out is not None and not out.committed and out.unreadable


# ------------------------------------------------------------------ end to end: torchft DiLoCo, real processes
def _diloco(q, index, uri, rank, world):
    from workers import diloco_worker

    diloco_worker(q, index, uri, rank, world, rounds=4, sync_every=2)


@pytest.mark.slow
def test_diloco_replicas_run_through_the_planted_livelock_and_match_plain_torch(store_uri):
    """Case 1 with torchft's DiLoCo in two processes: the run completes all 4 rounds (it used to sync behind ->
    nothing to heal at round 3 for every remaining step) with the uninterrupted run's parameters."""
    import numpy as np

    from support.processes import run_processes
    from workers import reference_diloco

    bucket = Store(store_uri)
    bucket.put_plain(layout.outcome_key(2, 0), b"x")
    bucket.put_plain("rounds/00000003/junk", b"x")
    outs = run_processes(_diloco, [(store_uri, r, 2) for r in range(2)], timeout=180)
    ref = reference_diloco(2, rounds=4, sync_every=2)
    for o in outs:
        assert "error" not in o, o.get("error")
        assert o["step"] == 4 and [h[1] for h in o["history"]] == [True] * 4, o["history"]
        for sync in range(4):
            for a, b in zip(o["snapshots"][sync], ref[sync]):
                np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert rounds.committed_attempt(bucket, 2) == 1


@pytest.mark.parametrize("forgery", ["garbage", "unsigned", "oversized"])
def test_a_forged_void_does_not_block_the_runs_own_void(tmp_path, forgery):
    """A commit whose state can never become durable is voided by a healer; an object planted at the void key
    first (which does not void anything) used to make that create fail, so the healer waited out its deadline."""
    store = signed_run(f"file://{tmp_path}/store/void")
    store.create_json(layout.quorum_key(0, 0), Quorum(0, 0, [0, 1]).to_json())
    store.create_json(layout.outcome_key(0, 0), Outcome(0, 0, True, participants=[0, 1]).to_json())
    bucket = Store(store.uri)
    if forgery == "garbage":
        bucket.put_plain(layout.void_key(0, 0), b"x")
    elif forgery == "unsigned":
        bucket.put_json(layout.void_key(0, 0), {"round": 0, "attempt": 0, "by": 0, "reason": "forged"})
    else:
        bucket.put_plain(layout.void_key(0, 0), b" " * (2 << 20))
    assert rounds.committed_attempt(store, 0) == 0  # the planted object voids nothing
    assert rounds.declare_void(store, 0, 0, by=1, reason="never durable")
    assert rounds.committed_attempt(store, 0) is None
