"""Lock-step DiLoCo runs with one thread per replica over one store, and a store that damages chosen reads.

What the abort-rule test and ``benchmarks/abort_matrix.py`` share: :class:`FaultyStore` damages reads of one
key (as a torn or corrupt GET does) and holds chosen writes or reads until an attempt's outcome exists,
so every phase of the other participants is reached deterministically, not by timing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from composer_cloud.errors import ChecksumMismatch
from composer_cloud.hooks import NO_HOOKS, Hooks
from composer_cloud.storage import layout
from composer_cloud.storage.store import Store
from composer_cloud.sync.lockstep.diloco import LockstepConfig, build_diloco
from workers import INNER_LR, OUTER, inner_step, make_model, run_spec

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

    def get(self, key: str, **kw: Any) -> memoryview:
        if key == self.hold_get:
            self._until_decided()
        if key == self.tear and (self.persistent or not self.damaged):
            self.damaged += 1
            raise ChecksumMismatch(key, "damaged read (injected)")
        return super().get(key, **kw)

    def put(self, key: str, payload: Any, **kw: Any) -> int:
        if key == self.hold_put:
            self._until_decided()
        return super().put(key, payload, **kw)

    def create(self, key: str, payload: Any, **kw: Any) -> bool:
        if key == self.hold_create:
            self._until_decided()
        return super().create(key, payload, **kw)


def run_threads(uri: str, stores: dict[int, Store], *, world: int = 2, rounds: int = 3,
                sync_every: int = 2, hooks: Hooks = NO_HOOKS) -> dict[int, dict[str, Any]]:
    """A lock-step DiLoCo run (``min_replicas = replicas``), one thread per replica: ``{rank: {"params",
    "syncs"} or {"error"}}``."""
    models = [make_model() for _ in range(world)]  # built here: make_model seeds torch's global RNG
    spec = run_spec(world, min_replicas=world, inner_steps=sync_every, outer=OUTER, quorum_timeout_s=4,
                    round_timeout_s=30, heal_timeout_s=60)
    out: dict[int, dict[str, Any]] = {}

    def replica(rank: int) -> None:
        model = models[rank]
        inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        syncs: list[Any] = []
        try:
            loop = build_diloco(store=stores.get(rank) or Store(uri), rank=rank, model=model, inner_optimizer=inner,
                                config=LockstepConfig.from_spec(spec), fragments=[model], on_sync=syncs.append,
                                hooks=hooks)
            with loop:
                for step in range(rounds * sync_every):
                    inner_step(model, inner, rank, step)
            loop.close()
            out[rank] = {"params": [p.detach().numpy().copy() for p in model.parameters()], "syncs": syncs}
        except Exception as exc:  # noqa: BLE001 - asserted on below
            out[rank] = {"error": exc}

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    deadline = time.monotonic() + 180
    for rank, t in enumerate(threads):
        t.join(timeout=max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            out[rank] = {"error": "hung: still running after 180 s", "hung": True}
    return out
