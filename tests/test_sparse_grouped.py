"""The sparse codec's two-level exchange: group sums re-sparsified, the residual fed back, faults survived."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from composer_cloud.errors import SpecError
from composer_cloud.spec import spec_from_dict
from composer_cloud.spec_sync import GATHER_MAX_REPLICAS
from composer_cloud.storage import layout
from composer_cloud.storage.store import Store
from composer_cloud.sync import sparse
from composer_cloud.sync.lockstep.gather import SparseGatherAllReduce
from composer_cloud.sync.lockstep.grouped import (TWO_LEVEL_FROM, GroupedSparseAllReduce, groups_of,
                                                  sparse_allreduce, uses_two_level)
from workers import allreduce_config, payload

SETTINGS = sparse.SparseSettings(density=1 / 16, chunk=256, value_bits=2, decay=0.95)
NUMEL = 5000


def _replicas(uri: str, world: int, *, group_size: int = 2, round_timeout_s: float = 60,
              hooks=None) -> list[GroupedSparseAllReduce]:
    cfg = allreduce_config(world, min_replicas=world, codec="sparse", quorum_timeout_s=min(30, round_timeout_s),
                           round_timeout_s=round_timeout_s)  # the spec refuses a quorum wait above the round's
    extra = {} if hooks is None else {"hooks": hooks}
    return [GroupedSparseAllReduce(Store(uri), r, cfg, settings=SETTINGS, group_size=group_size, **extra)
            for r in range(world)]


def _round(ars, round: int, flats: list[torch.Tensor]):
    with ThreadPoolExecutor(len(ars)) as pool:
        return list(pool.map(lambda i: ars[i].allreduce(round, flats[i]), range(len(ars))))


def _reference(deltas, accs, groups):
    """The two-level mean and every replica's next accumulator, from the codec's functions alone."""
    encs = [sparse.encode(d, a, SETTINGS) for d, a in zip(deltas, accs)]
    sums, new_accs = [], [e.accumulator.clone() for e in encs]
    for group in groups:
        exact = sparse.total([encs[p].sent for p in group])
        agg = sparse.decode(sparse.encode(exact, None, SETTINGS).payload, settings=SETTINGS)
        sums.append(agg)
        for p in group:
            dropped = ~torch.isin(encs[p].sent.indices, agg.indices)
            new_accs[p][encs[p].sent.indices[dropped]] += encs[p].sent.values[dropped]
        new_accs[group[0]][agg.indices] += exact[agg.indices] - agg.values
    return sparse.total(sums).div_(len(deltas)), new_accs, encs


def test_groups_cover_participants_in_order_and_auto_picks_by_size():
    assert groups_of(list(range(64))) == [list(range(i, i + 8)) for i in range(0, 64, 8)]
    assert groups_of([3, 5, 9, 11, 12], 2) == [[3, 5, 9], [11, 12]]
    for n in range(2, 300):
        groups = groups_of(list(range(n)))
        assert sum(groups, []) == list(range(n)) and min(map(len, groups)) >= 2
        assert max(map(len, groups)) - min(map(len, groups)) <= 1
    assert not uses_two_level("auto", TWO_LEVEL_FROM - 1) and uses_two_level("auto", TWO_LEVEL_FROM)
    assert uses_two_level("two_level", 2) and not uses_two_level("gather", 1024)
    cfg = allreduce_config(4, codec="sparse")
    assert type(sparse_allreduce(Store("memory://x"), 0, cfg, settings=SETTINGS)) is SparseGatherAllReduce
    assert isinstance(sparse_allreduce(Store("memory://x"), 0, cfg, settings=SETTINGS, exchange="two_level"),
                      GroupedSparseAllReduce)


def test_spec_lifts_the_limit_to_1024_with_the_two_level_exchange():
    spec = spec_from_dict({"replicas": 1024, "min_replicas": 2, "sync": {"codec": "sparse"}})
    assert spec.sync.sparse.exchange == "auto" and sparse.settings_of(spec).chunk == 4096
    with pytest.raises(SpecError, match="sync.sparse.exchange"):
        spec_from_dict({"replicas": GATHER_MAX_REPLICAS + 1, "min_replicas": 2,
                        "sync": {"codec": "sparse", "sparse": {"exchange": "gather"}}})
    with pytest.raises(SpecError, match="sync.sparse.group_size"):
        spec_from_dict({"sync": {"codec": "sparse", "sparse": {"group_size": 1}}})


def test_two_level_mean_is_the_reference_and_the_residual_is_conserved(store_uri):
    world = 5  # groups of 2 forced: [0, 1, 2], [3, 4]
    ars = _replicas(store_uri, world)
    accs: list[torch.Tensor | None] = [None] * world
    for round in range(2):
        deltas = [payload(r + 10 * round, NUMEL) for r in range(world)]
        flats = [d.clone() for d in deltas]
        results = _round(ars, round, flats)
        assert all(res.committed and res.participated for res in results)
        expected, new_accs, encs = _reference(deltas, accs, groups_of(list(range(world)), 2))
        for r in range(world):
            assert torch.equal(flats[r], expected)  # bitwise on every replica
            assert torch.equal(ars[r].codec_state()["fragment0"], new_accs[r])
        # Nothing is lost: what was not delivered is in the accumulators.
        before = sum(SETTINGS.decay * a + d if a is not None else d for a, d in zip(accs, deltas))
        after = sum(new_accs) + world * expected
        assert torch.allclose(after, before, atol=1e-4)
        assert sum(e.sent.values.abs().sum() for e in encs) > 0
        accs = new_accs
    keys = Store(store_uri).list(layout.attempt_prefix(1, 0))
    assert layout.sparse_group_key(1, 0, 0) in keys and layout.sparse_group_digest_key(1, 0, 1) in keys
    for ar in ars:
        ar.close()


class _StallAggregator:
    """Replica 0 (group 0's aggregator) stops after its upload until the others committed."""

    def __init__(self) -> None:
        self.others_done = threading.Event()

    def at(self, phase, round, rank):
        if phase == "upload" and rank == 0:
            assert self.others_done.wait(60)

    def after_step(self, rank, step_s):
        return 0.0


def test_a_stalled_aggregator_is_recomputed_by_a_member_with_the_same_bytes(store_uri):
    hooks = _StallAggregator()
    ars = _replicas(store_uri, 4, round_timeout_s=4, hooks=hooks)
    deltas = [payload(r, NUMEL) for r in range(4)]
    flats = [d.clone() for d in deltas]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ars[i].allreduce, 0, flats[i]) for i in range(4)]
        others = [f.result() for f in futures[1:]]
        hooks.others_done.set()
        late = futures[0].result()
    expected, new_accs, _ = _reference(deltas, [None] * 4, [[0, 1], [2, 3]])
    assert all(res.committed for res in others) and late.committed and late.attempts == 1
    digest = Store(store_uri).get_json(layout.sparse_group_digest_key(0, 0, 0))
    assert digest["by"] != 0  # a member recomputed group 0; the late aggregator found identical bytes
    for r in range(4):
        assert torch.equal(flats[r], expected)
    # The late aggregator still computed the exact sum: its value residual is fed back as in the reference.
    assert torch.equal(ars[0].codec_state()["fragment0"], new_accs[0])
    for ar in ars:
        ar.close()


def test_a_tampered_group_sum_is_rejected_and_the_round_retried(store_uri):
    ars = _replicas(store_uri, 4)
    store = ars[2].store  # group 1's aggregator
    real_put = store.put

    def tampering_put(key, data, **kw):
        if key == layout.sparse_group_key(0, 0, 1):
            data = bytes(data[:-1]) + bytes([data[-1] ^ 1])  # one bit flipped after the digest's crc was taken
        return real_put(key, data, **kw)

    store.put = tampering_put  # type: ignore[method-assign]
    deltas = [payload(r, NUMEL) for r in range(4)]
    flats = [d.clone() for d in deltas]
    results = _round(ars, 0, flats)
    outcome = Store(store_uri).get_json(layout.outcome_key(0, 0))
    assert not outcome["committed"] and outcome["check"] == "reduced"
    assert all(res.committed and res.attempt == 1 for res in results)
    expected, _, _ = _reference(deltas, [None] * 4, [[0, 1], [2, 3]])
    assert all(torch.equal(f, expected) for f in flats)  # the tampered bytes were never applied
    for ar in ars:
        ar.close()


def test_round_keys_spread_over_prefixes():
    def prefix(key: str) -> str:
        return key.rsplit("/", 1)[0]

    w = 1024
    groups = groups_of(list(range(w)))
    sums = {prefix(layout.sparse_group_key(3, 0, i)) for i in range(len(groups))}
    digests = {prefix(layout.sparse_group_digest_key(3, 0, i)) for i in range(len(groups))}
    contributions = {prefix(layout.sparse_key(3, 0, r, w)) for r in range(w)}
    assert len(groups) == 32 and len(sums) == 32 and sums == digests
    assert len(contributions) == 32 and not contributions & sums


def test_the_exchange_example_in_docs_parses_and_picks_two_level_from_235():
    import tomllib
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "sparse.md").read_text()
    block = text.split("```toml\n")[2].split("```", 1)[0]
    for replicas, two_level in ((TWO_LEVEL_FROM - 1, False), (TWO_LEVEL_FROM, True)):
        spec = spec_from_dict({"replicas": replicas, "min_replicas": 2,
                               "sync": {"codec": "sparse", **tomllib.loads(block)["sync"]}})
        assert (spec.sync.sparse.exchange, spec.sync.sparse.group_size) == ("auto", 2)
        assert uses_two_level(spec.sync.sparse.exchange, spec.replicas) is two_level
