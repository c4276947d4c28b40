"""The store calls of one decoupled merging boundary grow at most linearly in W, and no folder is listed twice.

The bounds are the ones docs/decoupled.md states ("Store calls of a boundary"). The boundary is the leader's
sequence in ``replica/decoupled.py`` (``after_step``): look for the run's end, publish, merge, adopt, read the
adopted record, all through one boundary's protocol (``DecoupledProtocol.boundary()``: one :class:`BoundaryView`).
The check that starts the next segment (the run's end, the fleet's budget) takes a look of its own: other replicas
publish meanwhile.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from composer_cloud.spec import spec_from_dict
from composer_cloud.storage.store import Store
from composer_cloud.sync.decoupled import protocol as dc
from composer_cloud.sync.decoupled.view import BoundaryView
from support.stores import CountingBackend

SHAPES = {"w": (3,), "b": (2,)}


def _delta() -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), 0.1), "b": torch.full((2,), -0.1)}


def _boundary_calls(tmp_path: Any, replicas: int) -> tuple[CountingBackend, CountingBackend]:
    """Replica 0's boundary at version 1 with every other replica's contribution pending: it merges all W."""
    cfg = dc.DecoupledConfig.from_spec(spec_from_dict({"run_id": "run", "replicas": replicas,
                                                       "sync": {"mode": "decoupled"}}))
    store = Store(f"file://{tmp_path}/run")
    protocol = dc.DecoupledProtocol(store, cfg)
    protocol.ensure_initial({"w": torch.ones(3), "b": torch.ones(2)}, rank=0)
    for r in range(replicas):
        protocol.publish(rank=r, seq=1, base_version=0, tokens=10, inner_steps=1, delta=_delta())
    assert protocol.try_merge(SHAPES, rank=0).merged == 1
    for r in range(1, replicas):
        protocol.publish(rank=r, seq=2, base_version=1, tokens=10, inner_steps=1, delta=_delta())
    counting = CountingBackend(store.backend)
    store.backend = counting
    at = protocol.boundary()
    assert isinstance(at.store, BoundaryView) and at.versions.store is at.store
    assert at.versions.final() is None
    at.publish(rank=0, seq=2, base_version=1, tokens=10, inner_steps=1, delta=_delta())
    assert at.try_merge(SHAPES, rank=0).merged == 2
    v = at.versions.newest(floor=1)
    assert v == 2
    at.versions.load(v, SHAPES)
    assert at.read_merge(v).ranks == list(range(replicas))
    store.backend = start = CountingBackend(counting.inner)
    at = protocol.boundary()
    assert at.versions.final() is None
    assert at.published_total() == 2 * replicas
    return counting, start


@pytest.mark.parametrize("replicas", [4, 16, 64])
def test_one_merging_boundary_lists_each_folder_once_and_reads_linearly_in_w(tmp_path, replicas):
    calls, start = _boundary_calls(tmp_path, replicas)
    assert max(calls.lists.values()) == 1, f"folders listed more than once: {calls.lists}"
    assert sum(calls.lists.values()) <= 3  # decoupled/contrib/ and checkpoints/ (recursive), decoupled/merge/
    # Each pending meta and blob once (2W), plus the newest record, two globals and their markers/manifests.
    assert sum(calls.gets.values()) <= 8 + 2 * replicas, calls.gets
    assert max(calls.gets.values()) == 1, f"objects read more than once: {calls.gets}"
    # The next segment's check: final.json, decoupled/contrib/ and decoupled/merge/, the newest record.
    assert sum(start.lists.values()) <= 2 and max(start.lists.values()) == 1, start.lists
    assert sum(start.gets.values()) <= 2 + replicas, start.gets


def test_a_lost_create_makes_the_view_look_again(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    store.put_json("decoupled/merge/00000001.json", {"a": 1})
    view = BoundaryView(store)
    assert view.list_dirs("decoupled/merge") == ["00000001.json"]
    store.put_json("decoupled/merge/00000002.json", {"b": 2})  # another replica, after the look
    assert view.list_dirs("decoupled/merge") == ["00000001.json"]  # the boundary's look
    assert not view.create_json("decoupled/merge/00000002.json", {"c": 3})
    assert view.list_dirs("decoupled/merge") == ["00000001.json", "00000002.json"]
    assert view.get_json("decoupled/merge/00000002.json") == {"b": 2}
