"""The policy chain (issue 36, part 3): anchors and lossless bf16 patches rebuild the policy bitwise, and a
missing, damaged or forged link is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from composer_cloud.errors import BadObject
from composer_cloud.lora import apply_lora, synced_parameters
from composer_cloud.model import TinyModelConfig, load_model
from composer_cloud.rollouts.patch_codec import (
    BITMAP,
    DENSE,
    GAPS,
    PatchError,
    apply_patch,
    decode_positions,
    encode_anchor,
    encode_patch,
    encode_positions,
    state_digest,
    varint_decode,
    varint_encode,
)
from composer_cloud.rollouts.policy import (
    PolicyChainError,
    PolicyPublisher,
    PolicyReader,
    apply_policy,
    policy_state,
    prune_policy,
    publish_policy,
    should_publish,
)
from composer_cloud.storage import layout
from composer_cloud.storage.records.policy import PolicyRecord
from composer_cloud.storage.store import Store

KEY = b"k" * 32
SHAPE = TinyModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64)


def _model(seed: int = 0) -> torch.nn.Module:
    return load_model("tiny", seed=seed, tiny=SHAPE)[0]


def _bits(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {n: t.reshape(-1).view(torch.int16).tolist() for n, t in sorted(state.items())}


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.bfloat16 and got[name].shape == want[name].shape, name
        assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), name


def _changed_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> int:
    return sum(int((a[n].view(torch.int16) != b[n].view(torch.int16)).sum()) for n in a)


# --------------------------------------------------------------------------- the codec
@pytest.mark.parametrize("density,encoding", [(0.004, GAPS), (0.3, BITMAP), (1.0, DENSE)])
def test_positions_round_trip_in_the_smallest_encoding(density, encoding):
    rng = np.random.default_rng(1)
    numel = 5000
    positions = np.flatnonzero(rng.random(numel) < density) if density < 1 else np.arange(numel)
    chosen, data = encode_positions(positions, numel)
    assert chosen == encoding
    back = decode_positions(chosen, data, len(positions), numel, key="k", name="t")
    assert back is None if encoding == DENSE else back.tolist() == positions.tolist()


def test_varints_round_trip_large_gaps_and_refuse_torn_input():
    values = np.array([0, 1, 127, 128, 16383, 16384, 2**35 + 7, 2**62], dtype=np.int64)
    data = varint_encode(values)
    assert len(data) == 1 + 1 + 1 + 2 + 2 + 3 + 6 + 9
    assert varint_decode(data, len(values), key="k", name="t").tolist() == values.tolist()
    with pytest.raises(PatchError, match="torn"):
        varint_decode(data[:-1], len(values), key="k", name="t")
    with pytest.raises(PatchError, match="says 9"):
        varint_decode(data, 9, key="k", name="t")


def test_patches_are_exact_for_negative_zero_and_deterministic_bytes():
    base = {"a": torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.bfloat16), "b": torch.ones(3, dtype=torch.bfloat16)}
    new = {"a": torch.tensor([-0.0, 1.0, 2.015625, 3.0], dtype=torch.bfloat16), "b": base["b"].clone()}
    blob, changed = encode_patch(base, new, version=1)
    assert changed == 2  # -0.0 == 0.0 as floats, but its bits changed
    assert encode_patch(base, new, version=1)[0] == blob  # a function of the states alone
    out, _ = apply_patch(base, blob, key="p", version=1)
    _assert_bitwise(out, new)
    assert out["b"] is base["b"]  # unchanged tensors are shared, the base is untouched
    assert base["a"][0].view(torch.int16).item() == 0
    with pytest.raises(PatchError, match="not a patch of version 2"):
        apply_patch(base, blob, key="p", version=2)
    assert encode_anchor(new, version=3) == encode_anchor(dict(reversed(list(new.items()))), version=3)
    # 31 of 32 elements changed: dense (every value stored) is smallest, and the unchanged one stays exact.
    c = torch.arange(32, dtype=torch.bfloat16)
    c2 = c + 1
    c2[5] = c[5]
    blob, changed = encode_patch({"c": c}, {"c": c2}, version=1)
    assert changed == 31
    out, stored = apply_patch({"c": c}, blob, key="p", version=1)
    assert stored == 32
    _assert_bitwise(out, {"c": c2})


# --------------------------------------------------------------------------- (a) random sparse perturbations
def test_the_chain_rebuilds_random_sparse_perturbations_bitwise(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    model = _model()
    publisher = PolicyPublisher(store, anchor_every=4)
    reader = PolicyReader(store)
    gen = torch.Generator().manual_seed(0)
    published = [policy_state(model)]
    assert publisher.publish(0, model).kind == "anchor"
    for version in range(1, 7):
        before = policy_state(model)
        with torch.no_grad():
            for p in model.parameters():
                flat = p.view(-1)
                n = flat.numel()
                hit = torch.randperm(n, generator=gen)[: max(1, n // 50)]
                bump, quiet = hit[: len(hit) // 2], hit[len(hit) // 2:]
                # Changes that alter the bf16 bits (a relative 2^-5 is several bf16 ulps)...
                flat[bump] = flat[bump] * (1 + 2.0 ** -5) + 1e-3
                # ...and fp32 changes that do not: the bf16 value moved by far less than half an ulp.
                flat[quiet] = flat[quiet].to(torch.bfloat16).float() * (1 + 2.0 ** -12)
        after = policy_state(model)
        out = publisher.publish(version, model)
        assert out.created and out.kind == ("anchor" if version % 4 == 0 else "patch")
        if out.kind == "patch":
            assert out.record.changed == _changed_bits(before, after) > 0
            assert out.record.blob_bytes < 0.2 * out.record.state_bytes
        published.append(after)
        _assert_bitwise(reader.load(version), after)  # the cached reader applies one patch
    for version, state in enumerate(published):  # a fresh reader for each: from the nearest anchor
        _assert_bitwise(PolicyReader(store).load(version), state)
        assert PolicyReader(store).record(version).digest == state_digest(state)
    assert reader.latest_version() == 6


# --------------------------------------------------------------------------- (b) real optimizer steps
@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_the_chain_rebuilds_adamw_steps_at_rl_learning_rates(tmp_path, lr):
    store = Store(f"file://{tmp_path}/run")
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    tokens = torch.randint(2, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    publisher = PolicyPublisher(store)
    reader = PolicyReader(store)
    publisher.publish(0, model)
    changed = []
    for version in range(1, 5):
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
        out = publisher.publish(version, model)
        direct = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
        assert out.kind == "patch" and out.record.digest == state_digest(direct)
        _assert_bitwise(reader.load(version), direct)
        changed.append(out.record.changed)
        assert out.ratio < 0.5, f"a patch at lr {lr} is {out.ratio:.1%} of the bf16 model"
    assert all(c > 0 for c in changed)  # every step changed some bf16 weights: the patches are not vacuous
    worker = _model(seed=1)
    apply_policy(worker, reader.load(4))
    for name, p in worker.named_parameters():
        assert torch.equal(p.detach(), dict(model.named_parameters())[name].detach().to(torch.bfloat16).float())


# --------------------------------------------------------------------------- (c) LoRA: the adapter alone
def _lora_model() -> torch.nn.Module:
    pytest.importorskip("peft")
    return apply_lora(_model(), r=4, alpha=8, dropout=0.0, target_modules="all-linear", seed=0)


def test_under_lora_only_the_adapter_is_published_and_rebuilt(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    model = _lora_model()
    adapters = synced_parameters(model)
    assert adapters and all("lora_" in n for n in adapters)
    opt = torch.optim.AdamW(adapters.values(), lr=1e-5)
    tokens = torch.randint(2, 200, (2, 12), generator=torch.Generator().manual_seed(2))
    reader = PolicyReader(store)
    for version in range(3):
        if version:
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
        out = publish_policy(store, version=version, model=model, lora=True)
        assert out.record.lora and out.record.tensors == len(adapters)
        assert out.record.numel == sum(p.numel() for p in adapters.values())
        assert out.kind == ("anchor" if version == 0 else "patch")
        state = reader.load(version)
        assert sorted(state) == sorted(adapters)
        _assert_bitwise(state, policy_state(model, lora=True))
    worker = _lora_model()
    apply_policy(worker, reader.load(2))
    for name, p in synced_parameters(worker).items():
        assert torch.equal(p.detach(), adapters[name].detach().to(torch.bfloat16).to(p.dtype)), name
    with pytest.raises(ValueError, match="does not fit the model"):
        apply_policy(_model(), state)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        publish_policy(store, version=3, model=_model(), lora=True)


# --------------------------------------------------------------------------- refusals
def _chain(store: Store, versions: int) -> list[dict[str, torch.Tensor]]:
    model = _model()
    publisher = PolicyPublisher(store)
    states = []
    for version in range(versions):
        if version:
            with torch.no_grad():
                for p in model.parameters():
                    p.view(-1)[::7] += 1e-2
        publisher.publish(version, model)
        states.append(policy_state(model))
    return states


def test_a_forged_or_tampered_link_is_refused_in_a_signed_run(tmp_path):
    uri = f"file://{tmp_path}/run"
    signed = Store(uri, signing_key=KEY)
    _chain(signed, 3)
    forger = Store(uri)  # can write the bucket, holds no run key
    blob_key = layout.policy_blob_key(2, "patch")
    real = json.loads(bytes(signed.get(layout.policy_record_key(2))))

    # A patch rewritten by the forger, and its record updated to match: both are unsigned.
    fake, _ = encode_patch(PolicyReader(signed).load(1), PolicyReader(signed).load(1), version=2)
    forger.put(blob_key, fake)
    with pytest.raises(PolicyChainError, match="not usable") as err:
        PolicyReader(signed).load(2)
    assert err.value.key == blob_key and isinstance(err.value, BadObject)
    forger.put(layout.policy_record_key(2), json.dumps({**real, "blob_bytes": len(fake)}).encode())
    with pytest.raises(PolicyChainError, match="record is not usable"):
        PolicyReader(signed).load(2)
    assert PolicyReader(signed).latest_version() == 1  # the forged newest version is skipped

    # Bytes flipped on disk: the frame's checksum fails.
    _chain(Store(f"file://{tmp_path}/run2", signing_key=KEY), 3)
    path = Path(tmp_path, "run2", blob_key)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(PolicyChainError, match=blob_key):
        PolicyReader(Store(f"file://{tmp_path}/run2", signing_key=KEY)).load(2)

    # Signed, well-formed, but naming another state: the digest check refuses the rebuilt policy.
    third = Store(f"file://{tmp_path}/run3", signing_key=KEY)
    _chain(third, 3)
    rec = json.loads(bytes(third.get(layout.policy_record_key(2))))
    third.put(layout.policy_record_key(2), json.dumps({**rec, "digest": "0" * 64}).encode())
    with pytest.raises(PolicyChainError, match="digest"):
        PolicyReader(third).load(2)


def test_a_missing_middle_patch_is_refused_and_the_next_publish_re_anchors(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    states = _chain(store, 4)
    store.delete(layout.policy_record_key(2))
    with pytest.raises(PolicyChainError, match=layout.policy_record_key(2)):
        PolicyReader(store).load(3)
    store.delete(layout.policy_blob_key(1, "patch"))
    with pytest.raises(PolicyChainError, match="missing"):
        PolicyReader(store).load(1)
    model = _model()
    apply_policy(model, states[3])
    out = publish_policy(store, version=3, model=model)  # already published: nothing is written
    assert not out.created and out.matches
    store.delete(layout.policy_record_key(3))
    out = publish_policy(store, version=3, model=model)  # its base (version 2) is gone: a new anchor
    assert out.created and out.kind == "anchor"
    _assert_bitwise(PolicyReader(store).load(3), states[3])


def test_two_replicas_publish_the_same_version_once(tmp_path):
    uri = f"file://{tmp_path}/run"
    a, b = PolicyPublisher(Store(uri, signing_key=KEY)), PolicyPublisher(Store(uri, signing_key=KEY))
    model = _model()
    first = a.publish(0, model)
    stored = Path(tmp_path, "run", layout.policy_record_key(0)).read_bytes()
    second = b.publish(0, model)
    assert first.created and not second.created and second.matches and second.record == first.record
    assert Path(tmp_path, "run", layout.policy_record_key(0)).read_bytes() == stored
    with torch.no_grad():
        next(model.parameters()).view(-1)[:5] += 0.5
    one, two = b.publish(1, model), a.publish(1, model)  # b now first; both patch against version 0
    assert one.created and not two.created and one.kind == two.kind == "patch" and two.matches
    other = _model(seed=3)  # a replica out of step: its state is not the published one
    assert not PolicyPublisher(Store(uri, signing_key=KEY)).publish(1, other).matches
    _assert_bitwise(PolicyReader(Store(uri, signing_key=KEY)).load(1), policy_state(model))


# --------------------------------------------------------------------------- records, keys, the switch
def test_policy_keys_and_records_parse_only_what_they_write():
    assert layout.parse_policy_key(layout.policy_record_key(12)) == (12, "record")
    assert layout.parse_policy_key(layout.policy_blob_key(3, "patch")) == (3, "patch")
    assert layout.parse_policy_key(layout.policy_blob_key(0, "anchor")) == (0, "anchor")
    for stray in ("policy/12.json", "policy/00000001.diff.safetensors", "rounds/00000001.json", "policy/x/00000001.json"):
        assert layout.parse_policy_key(stray) is None
    record = PolicyRecord(version=4, kind="patch", base=3, lora=False, tensors=2, numel=10, changed=3,
                          state_bytes=20, blob_bytes=99, blob_sha256="a" * 64, digest="b" * 64)
    assert PolicyRecord.from_json(record.to_json(), key="k", version=4) == record
    with pytest.raises(BadObject, match="'version'"):
        PolicyRecord.from_json(record.to_json(), key="k", version=5)
    with pytest.raises(BadObject, match="applies to version 3"):
        PolicyRecord.from_json({**record.to_json(), "base": 1}, key="k", version=4)
    with pytest.raises(BadObject, match="state_bytes"):
        PolicyRecord.from_json({**record.to_json(), "state_bytes": 40}, key="k", version=4)


def test_should_publish_only_with_rollout_workers():
    assert should_publish(SimpleNamespace(rollouts=SimpleNamespace(workers=2)))
    assert not should_publish(SimpleNamespace(rollouts=SimpleNamespace(workers=0)))
    assert not should_publish(SimpleNamespace(rollouts=None))
    assert not should_publish(SimpleNamespace())


def test_prune_keeps_the_newest_anchor_at_or_below_the_oldest_version_still_read(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    model = _model()
    publisher = PolicyPublisher(store, anchor_every=3)
    for version in range(8):  # anchors at 0, 3, 6
        with torch.no_grad():
            next(model.parameters()).view(-1)[version] += 1.0
        publisher.publish(version, model)
    kept = policy_state(model)
    assert prune_policy(store, keep_from=2) == []  # version 2 still needs the anchor of version 0
    assert prune_policy(store, keep_from=5) == [0, 1, 2]
    assert {layout.parse_policy_key(k)[0] for k in store.list(layout.POLICY)} == {3, 4, 5, 6, 7}
    _assert_bitwise(PolicyReader(store).load(7), kept)
    PolicyReader(store).load(4)
    with pytest.raises(PolicyChainError, match="never published or was pruned"):
        PolicyReader(store).load(2)


def test_the_lockstep_boundary_publishes_version_0_and_each_committed_round(monkeypatch, tmp_path):
    """With rollout workers configured, a replica publishes the initial model as version 0 and the global model
    after round r's commit as version r + 1 (the model round r + 1 starts from)."""
    from composer_cloud.hooks import NO_HOOKS
    from composer_cloud.model import load_spec_model
    from composer_cloud.replica import lockstep, runtime
    from composer_cloud.replica.boundary import ReplicaContext
    from composer_cloud.replica.telemetry import Telemetry
    from composer_cloud.spec import spec_from_dict
    from composer_cloud.storage.run import Run
    from composer_cloud.trainer import build_trainer
    from support.trainer import tiny_context

    uri = f"file://{tmp_path}/store/run"
    spec = spec_from_dict({"replicas": 1, "min_replicas": 1, "rounds": 2, "inner_steps": 2,
                           "sync": {"quorum_timeout_s": 5, "round_timeout_s": 30},
                           "model": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                     "num_key_value_heads": 1, "intermediate_size": 64}})
    model, tok = load_spec_model(spec.model, seed=spec.seed)
    initial = policy_state(model)
    trainer = build_trainer("causal-lm", tiny_context({"batch_size": 2, "seq_len": 16}, lr=1e-2, model=model,
                                                      tokenizer=tok))
    store = Store(uri)
    ctx = ReplicaContext(run=Run(uri=uri, store=store, spec=spec), rank=0, model=model, trainer=trainer,
                         device=torch.device("cpu"), hooks=NO_HOOKS,
                         telemetry=Telemetry(store, 0, rounds=2, inner_steps=2, progress_every_s=60))
    assert not should_publish(spec)  # no [rollouts] workers: a replica publishes nothing
    monkeypatch.setattr(lockstep, "should_publish", lambda spec: True)
    boundary = lockstep.LockstepBoundary(ctx)
    boundary.start()
    runtime._inner_loop(ctx, boundary)
    boundary.finish(0)
    reader = PolicyReader(store)
    assert reader.latest_version() == 2
    _assert_bitwise(reader.load(0), initial)
    _assert_bitwise(reader.load(2), policy_state(model))
    assert [reader.record(v).kind for v in range(3)] == ["anchor", "patch", "patch"]
