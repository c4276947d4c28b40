"""One abort rule: a lock-step run whose attempt aborts on an integrity check ends bitwise where it ends
without the fault, whichever phase the other participants are in when the abort is decided.

Replicas are threads running torchft's DiLoCo over one ``file://`` store. Each replica gets a store
subclass that damages one chosen read (as a torn or corrupt GET does) and holds a chosen write or read
until the attempt's outcome exists, so every phase is reached deterministically, not by timing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from composer_cloud.errors import ChecksumMismatch
from composer_cloud.storage import layout
from composer_cloud.storage.store import Store
from composer_cloud.sync.lockstep.diloco import LockstepConfig, build_diloco
from composer_cloud.sync.lockstep.rounds import committed_attempt, read_outcome
from workers import INNER_LR, OUTER, inner_step, make_model, run_spec

WORLD, ROUNDS, SYNC_EVERY = 2, 3, 2
FAULT_ROUND = 1


class FaultyStore(Store):
    """A replica's store that damages reads of ``tear`` and holds ``hold_*`` keys until round 1 attempt 0 is decided.

    ``persistent``: every read of ``tear`` after the outcome exists is damaged (a bad object, not a bad read).
    """

    def __init__(self, uri: str, *, tear: str | None = None, persistent: bool = False, hold_get: str | None = None,
                 hold_put: str | None = None, hold_create: str | None = None) -> None:
        super().__init__(uri)
        self.tear, self.persistent = tear, persistent
        self.hold_get, self.hold_put, self.hold_create = hold_get, hold_put, hold_create
        self.damaged = 0

    def _until_decided(self) -> None:
        deadline = time.monotonic() + 20
        while not self.exists(layout.outcome_key(FAULT_ROUND, 0)) and time.monotonic() < deadline:
            time.sleep(0.02)

    def get(self, key: str) -> memoryview:
        if key == self.hold_get:
            self._until_decided()
        if key == self.tear and (self.persistent or not self.damaged):
            self.damaged += 1
            raise ChecksumMismatch(key, "damaged read (injected)")
        return super().get(key)

    def put(self, key: str, payload: Any, **kw: Any) -> int:
        if key == self.hold_put:
            self._until_decided()
        return super().put(key, payload, **kw)

    def create(self, key: str, payload: Any) -> bool:
        if key == self.hold_create:
            self._until_decided()
        return super().create(key, payload)


def run_threads(uri: str, stores: dict[int, Store]) -> dict[int, dict[str, Any]]:
    """A lock-step DiLoCo run (``min_replicas = replicas``), one thread per replica; final params + syncs."""
    models = [make_model() for _ in range(WORLD)]  # built here: make_model seeds torch's global RNG
    spec = run_spec(WORLD, min_replicas=WORLD, inner_steps=SYNC_EVERY, outer=OUTER, quorum_timeout_s=4,
                    round_timeout_s=30, heal_timeout_s=60)
    out: dict[int, dict[str, Any]] = {}

    def replica(rank: int) -> None:
        model = models[rank]
        inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        syncs: list[Any] = []
        try:
            loop = build_diloco(store=stores.get(rank) or Store(uri), rank=rank, model=model, inner_optimizer=inner,
                                config=LockstepConfig.from_spec(spec), fragments=[model], on_sync=syncs.append)
            with loop:
                for step in range(ROUNDS * SYNC_EVERY):
                    inner_step(model, inner, rank, step)
            loop.close()
            out[rank] = {"params": [p.detach().numpy().copy() for p in model.parameters()], "syncs": syncs}
        except Exception as exc:  # noqa: BLE001 - asserted on below
            out[rank] = {"error": exc}

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(WORLD)]
    [t.start() for t in threads]
    [t.join(timeout=180) for t in threads]
    assert not any(t.is_alive() for t in threads), "a replica hung"
    return out


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
