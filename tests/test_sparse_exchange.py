"""The sparse codec in the lock-step all-reduce: the flat gather, error feedback as state, bad payloads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load, save

from composer_cloud.errors import SpecError
from composer_cloud.spec import spec_from_dict
from composer_cloud.spec_sync import GATHER_MAX_REPLICAS
from composer_cloud.storage import layout
from composer_cloud.storage.store import Store
from composer_cloud.sync import sparse
from composer_cloud.sync.decoupled import outer
from composer_cloud.sync.decoupled import protocol as dc
from composer_cloud.sync.decoupled.contributions import ContributionEncoder, decode_contribution
from composer_cloud.sync.lockstep.gather import SparseGatherAllReduce
from workers import allreduce_config, payload

SETTINGS = sparse.SparseSettings(density=1 / 16, chunk=256, value_bits=2, decay=0.95)
NUMEL = 5000  # 19 full chunks and a partial one


def _replicas(uri: str, world: int, **sync: object) -> list[SparseGatherAllReduce]:
    cfg = allreduce_config(world, min_replicas=sync.pop("min_replicas", world), codec="sparse",
                           quorum_timeout_s=30, round_timeout_s=60, **sync)
    return [SparseGatherAllReduce(Store(uri), r, cfg, settings=SETTINGS) for r in range(world)]


def _round(ars: list[SparseGatherAllReduce], round: int, flats: list[torch.Tensor]):
    with ThreadPoolExecutor(len(ars)) as pool:
        return list(pool.map(lambda i: ars[i].allreduce(round, flats[i]), range(len(ars))))


def test_gather_averages_the_decoded_contributions_and_keeps_the_residual(store_uri):
    world = 3
    ars = _replicas(store_uri, world)
    accs: list[torch.Tensor | None] = [None] * world
    for round in range(3):
        deltas = [payload(r + 10 * round, NUMEL) for r in range(world)]
        flats = [d.clone() for d in deltas]
        results = _round(ars, round, flats)
        assert all(res.committed and res.participated for res in results)
        encs = [sparse.encode(deltas[r], accs[r], SETTINGS) for r in range(world)]
        expected = sparse.mean([e.sent for e in encs])
        for r in range(world):
            assert torch.equal(flats[r], expected)  # bitwise on every replica, in participant order
            assert torch.equal(ars[r].codec_state()["fragment0"], encs[r].accumulator)
            assert results[r].payload_bytes == len(encs[r].payload)
        accs = [e.accumulator for e in encs]
    # One compressed contribution up, the others down: far below the fp32 scatter-reduce's (3 - 1/W) * 4N.
    per_round = results[0].bytes_read + results[0].bytes_written
    assert per_round < (3 - 1 / world) * 4 * NUMEL / 10
    keys = Store(store_uri).list(layout.attempt_prefix(2, 0))
    assert layout.sparse_key(2, 0, 1, world) in keys and not any("/grad/" in k for k in keys)
    for ar in ars:
        ar.close()


def test_a_malformed_contribution_excludes_its_writer_and_leaves_its_accumulator(store_uri):
    ars = _replicas(store_uri, 3, min_replicas=2)
    forged = ars[1]
    real_encode = forged._encode

    def bad_encode(round, flat):
        enc = real_encode(round, flat)
        return sparse.SparseEncoding(payload=enc.payload[: len(enc.payload) // 2], accumulator=enc.accumulator,
                                     sent=enc.sent)

    forged._encode = bad_encode  # type: ignore[method-assign]
    flats = [payload(r, NUMEL) for r in range(3)]
    deltas = [f.clone() for f in flats]
    results = _round(ars, 0, flats)
    assert [res.committed and res.participated for res in results] == [True, False, True]
    assert results[0].participants == [0, 2] and results[0].attempts == 2
    assert forged.codec_state() == {}  # its round did not commit: nothing of it counts as sent
    assert torch.equal(flats[1], deltas[1])
    encs = [sparse.encode(deltas[r], None, SETTINGS) for r in (0, 2)]
    assert torch.equal(flats[0], sparse.mean([e.sent for e in encs]))
    outcome = Store(store_uri).get_json(layout.outcome_key(0, 0))
    assert outcome["excluded"] == [1] and outcome["check"] == "malformed"
    for ar in ars:
        ar.close()


def test_error_feedback_state_round_trips_bitwise_and_checks_its_size(store_uri):
    (ar,) = _replicas(store_uri, 1)
    flat = payload(0, NUMEL)
    assert ar.allreduce(0, flat).committed
    state = ar.codec_state()
    restored = _replicas(store_uri, 1)[0]
    restored.load_codec_state(load(save(state)))
    assert torch.equal(restored.codec_state()["fragment0"], state["fragment0"])
    # Both continue identically from the restored accumulator.
    a, b = payload(1, NUMEL), payload(1, NUMEL)
    assert ar.allreduce(1, a).committed and restored.allreduce(2, b).committed
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not finite"):
        restored.load_codec_state({"fragment0": torch.full((NUMEL,), float("nan"))})
    restored.load_codec_state({"fragment0": torch.zeros(7)})
    with pytest.raises(ValueError, match="another model"):
        restored.allreduce(3, payload(2, NUMEL))
    ar.close()
    restored.close()


def test_spec_sparse_defaults_and_bounds():
    spec = spec_from_dict({"sync": {"codec": "sparse"}})
    settings = sparse.settings_of(spec)
    assert (settings.density, settings.value_bits, settings.decay, settings.chunk) == (3 / 64, 2, 0.95, 4096)
    # Decoupled mode's recipe is denser and forgets faster; a key the user sets wins over either recipe.
    dec = sparse.settings_of(spec_from_dict({"sync": {"mode": "decoupled", "codec": "sparse"}}))
    assert (dec.density, dec.decay, dec.value_bits, dec.chunk) == (11 / 128, 0.9, 2, 4096)
    mine = spec_from_dict({"sync": {"mode": "decoupled", "codec": "sparse", "sparse": {"decay": 0.95}}})
    assert (mine.sync.sparse.density, mine.sync.sparse.decay) == (11 / 128, 0.95)
    # The stored spec holds the values the run used, so a resumed run reads the same recipe back.
    assert spec_from_dict(mine.to_json_dict()).sync.sparse == mine.sync.sparse
    assert mine.to_json_dict()["sync"]["sparse"]["density"] == 11 / 128
    outer = spec.outer_optimizer
    assert (outer.lr, outer.momentum, outer.nesterov) == (1.0, 0.0, False)  # SparseLoCo's outer step
    assert spec_from_dict({}).outer_optimizer.momentum == 0.9  # dense codecs keep DiLoCo's
    assert sparse.settings_of(spec_from_dict({})) is None
    kept = spec_from_dict({"sync": {"codec": "sparse"}, "outer_optimizer": {"momentum": 0.5}}).outer_optimizer
    assert (kept.momentum, kept.nesterov) == (0.5, True)
    with pytest.raises(SpecError, match="sync.sparse.densty"):
        spec_from_dict({"sync": {"codec": "sparse", "sparse": {"densty": 0.1}}})
    with pytest.raises(SpecError, match="sync.sparse.density"):
        spec_from_dict({"sync": {"codec": "sparse", "sparse": {"density": 0}}})
    with pytest.raises(SpecError, match="sync.sparse.exchange"):
        spec_from_dict({"replicas": GATHER_MAX_REPLICAS + 1,
                        "sync": {"codec": "sparse", "sparse": {"exchange": "gather"}}})


# ------------------------------------------------------------------ decoupled contributions
DEC_SHAPES = {"w": (200, 20), "b": (40,)}
DEC_CFG = dc.DecoupledConfig.from_spec(spec_from_dict({
    "run_id": "run", "replicas": 2, "sync": {"mode": "decoupled", "min_quorum": 2, "codec": "sparse",
                                             "sparse": {"density": 0.125, "chunk": 64}}}))


def _dec_delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in DEC_SHAPES.items()}


def test_decoupled_contributions_are_sparse_and_merge_what_they_decode_to(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    protocol = dc.DecoupledProtocol(store, DEC_CFG)
    protocol.ensure_initial({n: torch.zeros(s) for n, s in DEC_SHAPES.items()}, rank=0)
    encoders = [ContributionEncoder(DEC_CFG.sparse) for _ in range(2)]
    blobs = []
    for r in range(2):
        protocol.publish(rank=r, seq=1, base_version=0, tokens=100, inner_steps=4, delta=_dec_delta(r),
                         encoder=encoders[r])
        blob = bytes(store.get(layout.contribution_key(r, 1, "safetensors")))
        assert len(blob) * 8 < 4 * 4040  # at least 8x below the dense fp32 blob, header included
        blobs.append(blob)
        assert encoders[r].state_dict()["model"].abs().sum() > 0  # the unsent residual is kept
    assert protocol.try_merge(DEC_SHAPES, rank=0).merged == 1
    rec = protocol.read_merge(1)
    assert [(c.rank, c.seq) for c in rec.contributions] == [(0, 1), (1, 1)]
    decoded = [decode_contribution(b, key="k", shapes=DEC_SHAPES, settings=DEC_CFG.sparse) for b in blobs]
    expected = outer.outer_step(protocol.versions.load(0, DEC_SHAPES), decoded, rec.weights, DEC_CFG.outer)
    got = protocol.versions.load(1, DEC_SHAPES)[outer.FRAGMENT_KEY]["original_parameters"]
    for name in DEC_SHAPES:
        assert torch.equal(got[name], expected[outer.FRAGMENT_KEY]["original_parameters"][name])
        assert 0 < int((decoded[0][name] != 0).sum()) < decoded[0][name].numel() // 4


def test_a_malformed_sparse_contribution_is_rejected_by_the_merge(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    protocol = dc.DecoupledProtocol(store, DEC_CFG)
    protocol.ensure_initial({n: torch.zeros(s) for n, s in DEC_SHAPES.items()}, rank=0)

    class Truncating(ContributionEncoder):
        def encode(self, delta, meta):
            data = super().encode(delta, meta)
            return data[: len(data) // 2]

    protocol.publish(rank=0, seq=1, base_version=0, tokens=100, inner_steps=4, delta=_dec_delta(0),
                     encoder=Truncating(DEC_CFG.sparse))
    protocol.publish(rank=1, seq=1, base_version=0, tokens=100, inner_steps=4, delta=_dec_delta(1),
                     encoder=ContributionEncoder(DEC_CFG.sparse))
    protocol.try_merge(DEC_SHAPES, rank=1, final=True)
    rec = protocol.read_merge(1)
    assert [(c.rank, c.seq) for c in rec.contributions] == [(1, 1)]
    assert [(r.rank, r.seq) for r in rec.rejected] == [(0, 1)]


def test_contribution_encoder_state_round_trips_and_refuses_foreign_state():
    enc = ContributionEncoder(DEC_CFG.sparse)
    enc.encode(_dec_delta(0), {})
    assert enc.state_dict() == {}  # not published yet: nothing committed
    enc.commit()
    state = enc.state_dict()
    again = ContributionEncoder(DEC_CFG.sparse)
    again.load_state_dict(load(save(state)))
    assert torch.equal(again.state_dict()["model"], state["model"])
    assert enc.encode(_dec_delta(1), {}) == again.encode(_dec_delta(1), {})  # same bytes from here on
    with pytest.raises(ValueError, match="codec state"):
        ContributionEncoder(None).load_state_dict(state)


def test_the_spec_example_in_docs_is_the_default():
    import tomllib
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "sparse.md").read_text()
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    spec = spec_from_dict(tomllib.loads(block))
    assert spec.sync.codec == "sparse" and spec.sync.sparse == spec_from_dict({}).sync.sparse


def test_streaming_fragments_keep_one_accumulator_each(store_uri):
    """torchft syncs fragment ``round % fragments``: each keeps its own residual, whatever its size."""
    cfg = allreduce_config(2, min_replicas=2, codec="sparse", quorum_timeout_s=30, round_timeout_s=60)
    ars = [SparseGatherAllReduce(Store(store_uri), r, cfg, settings=SETTINGS, fragments=2) for r in range(2)]
    sizes = [3000, 2000, 3000]
    accs: dict[str, torch.Tensor | None] = {"fragment0": None, "fragment1": None}
    for round, n in enumerate(sizes):
        deltas = [payload(r + 10 * round, n) for r in range(2)]
        assert all(res.committed for res in _round(ars, round, [d.clone() for d in deltas]))
        name = f"fragment{round % 2}"
        accs[name] = sparse.encode(deltas[0], accs[name], SETTINGS).accumulator
    state = ars[0].codec_state()
    assert {k: v.numel() for k, v in state.items()} == {"fragment0": 3000, "fragment1": 2000}
    assert all(torch.equal(state[k], accs[k]) for k in state)
    for ar in ars:
        ar.close()
