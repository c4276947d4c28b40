"""The sparse error-feedback codec (composer_cloud/sync/sparse.py): exactness, strictness, state."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from composer_cloud.sync import sparse as sp

S = sp.SparseSettings(density=4 / 64, chunk=64, value_bits=2, decay=0.9)


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_settings_defaults_are_sparseloco_and_validated() -> None:
    d = sp.SparseSettings()
    assert (d.chunk, d.topk, d.value_bits, d.decay, d.index_bits) == (4096, 64, 2, 0.95, 12)
    assert sp.SparseSettings(density=0.03, chunk=256).topk == 8
    assert sp.SparseSettings(density=1e-9, chunk=64).topk == 1
    for bad in ({"density": 0}, {"value_bits": 9}, {"chunk": 1}, {"decay": 1.5}, {"densty": 0.1}):
        with pytest.raises(ValidationError):
            sp.SparseSettings(**bad)


@pytest.mark.parametrize("bits", [1, 3, 7, 12, 16])
def test_pack_bits_round_trips(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (1001,), generator=torch.Generator().manual_seed(bits))
    packed = sp.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-1001 * bits // 8)
    out, clean = sp.unpack_bits(packed, bits, 1001)
    assert clean and torch.equal(out, codes)


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 4096 + 5])
def test_round_trip_feedback_and_size(numel: int) -> None:
    x, prev = _x(numel), _x(numel, 1)
    enc = sp.encode(x, prev, S)
    got = sp.decode(enc.payload, key="k", numel=numel, settings=S)
    assert torch.equal(got.indices, enc.sent.indices) and torch.equal(got.values, enc.sent.values)
    assert got.indices.numel() == sp.nnz_of(numel, S)
    # The residual is exactly what was not sent: untouched elements keep decay * prev + x bit for bit.
    folded = prev * S.decay + x
    unsent = torch.ones(numel, dtype=torch.bool)
    unsent[got.indices] = False
    assert torch.equal(enc.accumulator[unsent], folded[unsent])
    assert torch.equal(enc.accumulator[got.indices], folded[got.indices] - got.values)
    # Positions: the k largest magnitudes of every chunk.
    for start in range(0, numel, S.chunk):
        chunk = folded[start:start + S.chunk].abs()
        k = min(S.topk, chunk.numel())
        mine = got.indices[(got.indices >= start) & (got.indices < start + S.chunk)] - start
        assert mine.numel() == k
        assert chunk[mine].min() >= torch.topk(chunk, k).values.min()
    # The size is bounded by the shape and settings alone, whatever the data (+ a header under 512 bytes).
    for payload in (enc.payload, sp.encode(torch.zeros(numel), None, S).payload,
                    sp.encode(torch.arange(numel, dtype=torch.float32), None, S).payload):
        header = 8 + struct.unpack_from("<Q", payload)[0]
        assert header < 512 and len(payload) - header <= sp.estimate_bytes(numel, S)


def test_gap_code_costs_about_rice_bits_plus_two_per_position() -> None:
    d = sp.SparseSettings()  # 64 of 4096: r = 6, against 12 bits for a plain position
    payload = sp.encode(_x(8 * 4096), None, d).payload
    tensors, _ = _parts(payload)
    gap_bits = 8 * (tensors["index_high"].numel() + tensors["index_low"].numel()) / (8 * 64)
    assert d.rice_bits == 6 and gap_bits <= d.rice_bits + 2 < d.index_bits


def test_values_keep_sign_and_lie_in_their_chunks_range() -> None:
    x = _x(4096)
    dense = S.model_copy(update={"density": 32 / 64})  # 32 values per chunk: more than 8-bit's 128 levels
    for bits in (1, 2, 4, 8):
        s = dense.model_copy(update={"value_bits": bits})
        got = sp.decode(sp.encode(x, None, s).payload, settings=s)
        true = x[got.indices]
        assert torch.equal(torch.sign(got.values), torch.sign(true))
        for c in range(0, 4096, 64):
            sel = (got.indices >= c) & (got.indices < c + 64)
            lo, hi = true[sel].abs().min(), true[sel].abs().max()
            mags = got.values[sel].abs()
            assert bool((mags >= lo * (1 - 2 ** -8)).all()) and bool((mags <= hi * (1 + 2 ** -8)).all())
    err = {b: float((sp.decode(sp.encode(x, None, dense.model_copy(update={"value_bits": b})).payload).values
                     - x[got.indices]).norm()) for b in (1, 2, 4)}
    assert err[1] > err[2] > err[4]  # more bits, less error


def test_encoding_is_deterministic() -> None:
    x, prev = _x(5000), _x(5000, 3)
    a, b = sp.encode(x, prev, S), sp.encode(x.clone(), prev.clone(), S)
    assert a.payload == b.payload and torch.equal(a.accumulator, b.accumulator)


def test_error_feedback_delivers_what_top_k_alone_drops() -> None:
    """A constant delta sent for T syncs: with feedback (decay 1) the sum sent tracks T * delta; without, not."""
    delta = _x(2048, 5)
    totals = {}
    for decay in (1.0, 0.0):
        ef = sp.ErrorFeedback(S.model_copy(update={"decay": decay}))
        sent = torch.zeros(2048)
        for _ in range(160):
            sent += ef.encode("b", delta).sent.to_dense()
        totals[decay] = float((sent / 160 - delta).norm() / delta.norm())
    # Feedback: the error is the accumulator / T (bounded, so it shrinks like 1/T); without: the unsent 15/16.
    assert totals[1.0] < 0.08 and totals[0.0] > 0.7


def test_encode_rejects_bad_inputs_and_keeps_state() -> None:
    ef = sp.ErrorFeedback(S)
    ef.encode("b", _x(100))
    before = ef.state_dict()
    bad = _x(100)
    bad[7] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        ef.encode("b", bad)
    assert torch.equal(ef.state_dict()["b"], before["b"])
    with pytest.raises(ValueError, match="does not match"):
        sp.encode(_x(100), torch.zeros(99), S)
    with pytest.raises(ValueError, match="1-D"):
        sp.encode(torch.zeros(2, 3), None, S)


def test_state_round_trips_bitwise_through_safetensors() -> None:
    ef = sp.ErrorFeedback(S)
    for t in range(3):
        ef.encode("0", _x(3000, t))
        ef.encode("1", _x(70, 10 + t))
    restored = sp.ErrorFeedback(S)
    restored.load_state_dict(st_load(st_save(ef.state_dict())))
    for t in range(3, 6):  # the resumed replica sends exactly the same bytes as the uninterrupted one
        assert restored.encode("0", _x(3000, t)).payload == ef.encode("0", _x(3000, t)).payload
    assert all(torch.equal(a, b) for a, b in zip(ef.state_dict().values(), restored.state_dict().values()))
    with pytest.raises(ValueError, match="'x'.*float32"):
        restored.load_state_dict({"x": torch.zeros(3, dtype=torch.float64)})
    with pytest.raises(ValueError, match="'y'.*not finite"):
        restored.load_state_dict({"y": torch.tensor([1.0, float("inf")])})


def test_mean_total_and_merge_are_exact_and_ordered() -> None:
    ups = [sp.decode(sp.encode(_x(1000, r), None, S).payload) for r in range(4)]
    dense = [u.to_dense() for u in ups]
    expected = ((dense[0] + dense[1]) + dense[2]) + dense[3]
    assert torch.equal(sp.total(ups), expected)
    assert torch.equal(sp.mean(ups), expected / 4)
    merged = sp.merge(ups)
    assert torch.equal(merged.to_dense(), expected)
    assert merged.indices.numel() == int((expected != 0).sum()) or merged.indices.numel() >= ups[0].indices.numel()
    with pytest.raises(ValueError, match="different lengths"):
        sp.merge([ups[0], sp.decode(sp.encode(_x(999), None, S).payload)])


# --------------------------------------------------------------------------- forged payloads
def _parts(payload: bytes) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    header_len = struct.unpack_from("<Q", payload)[0]
    meta = json.loads(json.loads(payload[8:8 + header_len])["__metadata__"][sp.METADATA_KEY])
    return dict(st_load(payload)), meta


def _forge(payload: bytes, *, tensors: dict | None = None, meta: dict | None = None) -> bytes:
    t, m = _parts(payload)
    return sp._save({**t, **(tensors or {})}, {**m, **(meta or {})})


GOOD = sp.encode(_x(130), None, S).payload  # chunks of 64, 64 and 2 elements


def _index(positions: list[int]) -> dict[str, torch.Tensor]:
    """The two index tensors of GOOD's layout (4, 4 and 2 positions) holding ``positions``."""
    chunk_of = torch.tensor([0] * 4 + [1] * 4 + [2] * 2)
    high, low = sp._gap_code(torch.tensor(positions), chunk_of, S.rice_bits)
    return {"index_high": high, "index_low": low}


FORGED = {
    "truncated": (GOOD[:5], "header"),
    "garbage": (b"\xff" * 64, "header"),
    "cut tensors": (GOOD[:-3], "tensors"),
    "other codec": (_forge(GOOD, meta={"codec": "fp32"}), "codec"),
    "future version": (_forge(GOOD, meta={"version": 9}), "version"),
    "numel as string": (_forge(GOOD, meta={"numel": "130"}), "numel"),
    "numel mismatch": (_forge(GOOD, meta={"numel": 131}), "numel"),
    "denser than the run": (_forge(GOOD, meta={"topk": 8}), "settings"),
    "short index_low": (_forge(GOOD, tensors={"index_low": _parts(GOOD)[0]["index_low"][:-1]}), "index_low"),
    "missing terminators": (_forge(GOOD, tensors={"index_high": torch.tensor([0, 0xFF], dtype=torch.uint8)}),
                            "index_high: 8 gap terminators"),
    "extra terminators": (_forge(GOOD, tensors={"index_high": torch.zeros(2, dtype=torch.uint8)}),
                          "index_high: 16 gap terminators"),
    "padding byte": (_forge(GOOD, tensors={"index_high": torch.cat([_parts(GOOD)[0]["index_high"],
                                                                    torch.tensor([0xFF], dtype=torch.uint8)])}),
                     "index_high"),
    "huge unary stream": (_forge(GOOD, tensors={"index_high": torch.full((999,), 0xFF, dtype=torch.uint8)}),
                          "index_high: 999 bytes"),
    "long values": (_forge(GOOD, tensors={"values": torch.zeros(99, dtype=torch.uint8)}), "values"),
    "nan level": (_forge(GOOD, tensors={"levels": torch.full((3, 2), float("nan"), dtype=torch.bfloat16)}),
                  "levels"),
    "negative level": (_forge(GOOD, tensors={"levels": torch.full((3, 2), -1.0, dtype=torch.bfloat16)}), "levels"),
    "levels shape": (_forge(GOOD, tensors={"levels": torch.ones(2, 2, dtype=torch.bfloat16)}), "levels"),
    "float32 levels": (_forge(GOOD, tensors={"levels": torch.ones(3, 2)}), "tensors"),
    "extra tensor": (_forge(GOOD, tensors={"more": torch.zeros(1)}), "tensors"),
    "index past last chunk": (_forge(GOOD, tensors=_index([0, 1, 2, 3, 0, 1, 2, 3, 0, 2])),
                              "index: position 2 outside chunk 2"),
    "index past a full chunk": (_forge(GOOD, tensors=_index([0, 1, 2, 64, 0, 1, 2, 3, 0, 1])),
                                "index: position 64 outside chunk 0"),
    "dirty padding": (_forge(GOOD, tensors={"values": torch.cat([_parts(GOOD)[0]["values"][:-1],
                                                                 torch.tensor([0xFF], dtype=torch.uint8)])}),
                      "padding"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_decode_rejects_forged_payloads_naming_key_and_field(case: str) -> None:
    data, field = FORGED[case]
    with pytest.raises(sp.SparsePayloadError) as err:
        sp.decode(data, key="rounds/3/grad/1", numel=130, settings=S)
    assert "rounds/3/grad/1" in str(err.value) and field in err.value.problem


def test_decode_without_expectations_accepts_any_honest_settings() -> None:
    other = sp.SparseSettings(density=0.5, chunk=16, value_bits=3)
    got = sp.decode(sp.encode(_x(50), None, other).payload)
    assert got.numel == 50 and got.indices.numel() == sp.nnz_of(50, other)
    with pytest.raises(sp.SparsePayloadError, match="settings"):
        sp.decode(sp.encode(_x(50), None, other).payload, settings=S)


def test_the_api_example_in_docs_runs() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "sparse.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "docs/sparse.md", "exec"), {})
