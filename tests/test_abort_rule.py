"""One abort rule: a lock-step run whose attempt aborts on an integrity check ends bitwise where it ends
without the fault, whichever phase the other participants are in when the abort is decided.

Replicas are threads running torchft's DiLoCo over one ``file://`` store (``support.threads``). Each
replica gets a store that damages one chosen read (as a torn or corrupt GET does) and holds a chosen write
or read until the attempt's outcome exists, so every phase is reached deterministically, not by timing.
``benchmarks/abort_matrix.py`` runs the same harness over every fault point.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from composer_cloud.storage import layout
from composer_cloud.storage.store import Store
from composer_cloud.sync.lockstep.rounds import committed_attempt, read_outcome
from support.threads import FAULT_ROUND, FaultyStore, run_threads

WORLD, ROUNDS, SYNC_EVERY = 2, 3, 2


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict[int, dict[str, Any]]:
    out = run_threads(f"file://{tmp_path_factory.mktemp('baseline')}/store", {})
    for rank in range(WORLD):
        assert "error" not in out[rank], out[rank]
    return out


def grad(rank: int, slot: int) -> str:
    return layout.grad_key(FAULT_ROUND, 0, rank, slot)


# Replica 0 detects the damage; replica 1 is in the named phase when the abort (or commit) is decided.
CASES = {
    "peer still writing its slots": ({"tear": grad(1, 0)}, {"hold_put": grad(1, 1)}),
    "peer reducing": ({"tear": grad(1, 0)}, {"hold_get": grad(0, 1)}),
    "peer gathering": ({"tear": grad(1, 0)}, {}),
    "peer committing": ({"tear": layout.reduced_key(FAULT_ROUND, 0, 1)},
                        {"hold_create": layout.outcome_key(FAULT_ROUND, 0)}),
    "peer committed first, damaged read": ({"tear": layout.reduced_key(FAULT_ROUND, 0, 1),
                                            "hold_get": layout.reduced_key(FAULT_ROUND, 0, 1)}, {}),
    "peer committed first, damaged object": ({"tear": layout.reduced_key(FAULT_ROUND, 0, 1), "persistent": True,
                                              "hold_get": layout.reduced_key(FAULT_ROUND, 0, 1)}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_integrity_abort_ends_bitwise_where_the_run_without_it_ends(tmp_path, baseline, case):
    uri = f"file://{tmp_path}/store"
    detector_kw, peer_kw = CASES[case]
    stores = {0: FaultyStore(uri, **detector_kw), 1: FaultyStore(uri, **peer_kw)}
    out = run_threads(uri, stores)

    assert stores[0].damaged >= 1, "the fault was not injected"
    for rank in range(WORLD):
        assert "error" not in out[rank], out[rank]
        for mine, ref in zip(out[rank]["params"], baseline[rank]["params"]):
            assert np.array_equal(mine, ref), f"replica {rank} differs from the run without the fault ({case})"
    store = Store(uri)
    first = read_outcome(store, FAULT_ROUND, 0, replicas=WORLD)
    if case.startswith("peer committed first"):
        # The commit won the race: nobody retries; the detector applies it after a fresh read or heals.
        assert first is not None and first.committed
        assert committed_attempt(store, FAULT_ROUND) == 0
        detector = [s for s in out[0]["syncs"] if s.round == FAULT_ROUND]
        assert len(detector) == 1
        assert detector[0].committed or detector[0].healed_to == FAULT_ROUND
        assert detector[0].committed == (case.endswith("damaged read"))
    else:
        # Every participant retried attempt 1 at once with the payload it had sent.
        assert first is not None and not first.committed and first.retry and first.by == 0
        assert committed_attempt(store, FAULT_ROUND) == 1
        for rank in range(WORLD):
            syncs = [s for s in out[rank]["syncs"] if s.round == FAULT_ROUND]
            assert [(s.committed, s.result.attempt, s.result.attempts) for s in syncs] == [(True, 1, 2)], syncs
    # Every round committed once per replica: no replica recomputed a round on new data.
    for rank in range(WORLD):
        assert [s.round for s in out[rank]["syncs"]] == list(range(ROUNDS))
