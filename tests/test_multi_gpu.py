"""Multi-GPU replicas (issue 24), the parts that need no processes: the batch split and its loss weight, the
settings a multi-GPU replica refuses, the shard payload keys, the local-rank stall (end to end:
test_multi_gpu_e2e.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from composer_cloud.errors import ConfigError, SpecError
from composer_cloud.replica.faults import EnvFaults, parse_stall
from composer_cloud.spec import RunSpec
from composer_cloud.storage import layout
from composer_cloud.trainer.parallel import check_local_ranks, local_rows, loss_weight


@pytest.mark.parametrize("rows,world", [(r, w) for r in (1, 4, 5, 7, 8) for w in (1, 2, 3, 4) if r >= w])
def test_local_rows_cover_the_batch_once_in_order(rows, world):
    parts = [list(range(rows))[local_rows(rows, k, world)] for k in range(world)]
    assert sum(parts, []) == list(range(rows))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("rows,world", [(4, 2), (5, 2), (7, 3)])
def test_weighted_rank_losses_average_to_the_full_batch_mean(rows, world):
    """DDP averages the ranks' gradients; with the weight the average is the full batch's token mean."""
    torch.manual_seed(0)
    per_row = torch.rand(rows, 31, dtype=torch.float64)  # a token-mean loss per row of 31 predicted tokens
    ranks = []
    for k in range(world):
        mine = per_row[local_rows(rows, k, world)]
        ranks.append(mine.mean() * loss_weight(len(mine), rows, world))
    assert torch.allclose(torch.stack(ranks).mean(), per_row.mean(), rtol=0, atol=1e-12)


def _spec(**fields) -> RunSpec:
    base = {"gpus_per_replica": 2, "trainer": {"name": "causal-lm"}}
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return RunSpec.model_validate(base)


@pytest.mark.parametrize("fields,named", [
    ({"parallelism": "fsdp", "model": {"lora": {"r": 4}}}, "parallelism"),
    ({"sync": {"mode": "decoupled"}, "parallelism": "fsdp"}, "sync.mode"),
    ({"sync": {"codec": "sparse"}}, "sync"),
    ({"sync": {"fragments": 2}}, "sync"),
    ({"trainer": {"name": "three-channel"}}, "trainer.name"),
    ({"trainer": {"batch_size": 1}}, "trainer.batch_size"),
])
def test_multi_gpu_replicas_refuse_what_they_cannot_run_naming_the_setting(fields, named):
    with pytest.raises(SpecError) as err:
        check_local_ranks(_spec(**fields))
    assert err.value.field == named and "gpus_per_replica = 2" in str(err.value)


def test_the_supported_multi_gpu_settings_and_every_one_rank_spec_pass():
    check_local_ranks(_spec())
    check_local_ranks(_spec(sync={"codec": "bf16"}, model={"precision": "bf16"}))
    check_local_ranks(_spec(model={"lora": {"r": 4}}))  # DDP over the adapters; the frozen base stays put
    check_local_ranks(_spec(parallelism="fsdp"))
    check_local_ranks(_spec(sync={"mode": "decoupled"}))  # local rank 0 contributes for the replica
    check_local_ranks(RunSpec.model_validate({"parallelism": "fsdp", "sync": {"codec": "sparse"}}))


def test_shard_payloads_have_their_own_keys_and_the_round_records_stay_the_replicas():
    assert layout.SlotKeys().grad(2, 0, 3, 4) == layout.grad_key(2, 0, 3, 4) == "rounds/00000002/0/grad/3/4"
    sharded = layout.SlotKeys(shard=1)
    assert sharded.grad(2, 0, 3, 4) == "rounds/00000002/0/shard/1/grad/3/4"
    assert sharded.reduced(2, 1, 0) == "rounds/00000002/1/shard/1/reduced/0"
    assert sharded.reduced_digest(2, 1, 0) == "rounds/00000002/1/shard/1/reduced/0.json"
    assert "shard" in layout.ATTEMPT_PAYLOADS  # cleaned up with the other payloads


def test_a_stall_names_one_local_rank(tmp_path):
    assert parse_stall("upload:1:0") == ("upload", 1, 0)
    assert parse_stall("upload:1:0:1") == ("upload", 1, 0, 1)
    with pytest.raises(ConfigError, match="local_rank"):
        parse_stall("upload:1:0:1:2")
    marker = tmp_path / "stalled"
    # Local rank 0 of replica 0 passes the point a stall of its local rank 1 names...
    EnvFaults(stall=("upload", 1, 0, 1), marker=str(marker), local_rank=0).at("upload", 1, 0)
    assert not marker.exists()
    # ...and local rank 1 stalls there, naming its pid.
    stalled = threading.Thread(target=EnvFaults(stall=("upload", 1, 0, 1), marker=str(marker), local_rank=1).at,
                               args=("upload", 1, 0), daemon=True)
    stalled.start()
    deadline = time.monotonic() + 10
    while len(marker.read_text().splitlines() if marker.exists() else []) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stalled.is_alive() and marker.read_text().splitlines()[0] == "upload:1:0"
    assert marker.read_text().splitlines()[1].startswith("pid ")


def test_the_documented_multi_gpu_spec_is_one_a_multi_gpu_replica_runs(tmp_path):
    """docs/multi-gpu.md's spec passes launch's checks (test_docs.py) and the multi-GPU replica's own."""
    import re
    from pathlib import Path

    from composer_cloud.spec import load_spec

    text = (Path(__file__).resolve().parents[1] / "docs" / "multi-gpu.md").read_text()
    (block,) = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
    (tmp_path / "spec.toml").write_text(block)
    spec = load_spec(tmp_path / "spec.toml", {})
    assert spec.gpus_per_replica == 2 and spec.parallelism == "ddp" and spec.max_restarts == 1
    check_local_ranks(spec)


def _fsdp_chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """FSDP2's dim-0 layout: ``torch.chunk``, padded with empty chunks up to ``n``."""
    chunks = list(torch.chunk(t, n))
    return chunks + [t.new_empty((0, *t.shape[1:]))] * (n - len(chunks))


def test_export_reassembles_fsdp_shards_into_the_full_parameters():
    from composer_cloud.errors import CorruptCheckpoint
    from composer_cloud.sync.lockstep.sharded import load_fsdp_shards
    from composer_cloud.sync.state_tree import fragment_key as shard_key

    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))  # uneven chunks, a 1-row weight
    target = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
    tree = {shard_key(k): {"original_parameters": {}} for k in range(3)}
    for name, p in source.named_parameters():
        for k, chunk in enumerate(_fsdp_chunks(p.detach(), 3)):
            tree[shard_key(k)]["original_parameters"][name] = chunk.clone()
    load_fsdp_shards(target, tree, 3)
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters()))
    with pytest.raises(CorruptCheckpoint, match="shards make"):
        load_fsdp_shards(target, tree, 2)  # a shard missing: the parameter comes out short
    del tree[shard_key(2)]["original_parameters"]["0.bias"]
    with pytest.raises(CorruptCheckpoint, match="0.bias"):
        load_fsdp_shards(target, tree, 3)


@pytest.fixture
def one_rank_group():
    """A one-process gloo group, so that FSDP2 and DTensors can be built in the test process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_outer_state_is_stored_as_local_tensors_and_loaded_back_as_shards(one_rank_group):
    """The global state of an FSDP rank holds plain tensors; loading it gives the outer momentum back as DTensors."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from composer_cloud.storage.tensors import decode_state, encode_state
    from composer_cloud.sync.lockstep.sharded import ShardedManager, _local_tensors

    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 3))
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    outer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    for p in params:
        p.grad = DTensor.from_local(torch.ones_like(p.to_local()), p.device_mesh, p.placements)
    outer.step()
    stored = decode_state(encode_state({"outer_optimizer": _local_tensors(outer.state_dict())}))
    assert not isinstance(stored["outer_optimizer"]["state"][0]["momentum_buffer"], DTensor)
    loaded = ShardedManager._as_params(SimpleNamespace(params=params), stored)
    fresh = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    fresh.load_state_dict(loaded["outer_optimizer"])
    for p in params:
        buf = fresh.state[p]["momentum_buffer"]
        assert isinstance(buf, DTensor) and torch.equal(buf.to_local(), outer.state[p]["momentum_buffer"].to_local())
    fresh.step()  # the loaded momentum works with DTensor gradients
