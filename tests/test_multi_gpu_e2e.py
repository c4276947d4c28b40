"""Multi-GPU replicas end to end on CPU (issue 24): 2 replicas x 2 local ranks (gloo), real replica processes (the
runs compared launched in-process; the kill and resume through the CLI).

* the run matches the same run with one local rank per replica (same global batch) to 1e-6, exports a model
  ``transformers`` loads, and moves about half the store bytes per local rank: with DDP, with FSDP2
  (``parallelism = "fsdp"``) and with LoRA (over DDP);
* ``kill -9`` of everything, then ``resume``: the exported model equals the uninterrupted run's, bitwise (DDP and
  FSDP).

One local rank killed mid-round, and decoupled mode: test_multi_gpu_local_ranks.py (a module apart, so
pytest-xdist's loadscope runs it on another worker).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer_cloud.runs import open_run
from composer_cloud.runs.metrics import read_metrics
from support.cli import cli_here
from support.local_jobs import kill_run, launch_stalled
from support.resume import export_weights, launch_and_wait, same_weights
from support.specs import MULTI_GPU_LORA_TOML, multi_gpu_spec
from support.stores import store_uri_for

pytestmark = pytest.mark.slow


def _round_bytes(run_uri: str) -> float:
    """Mean store bytes (read + written) of one replica's sync per round, from its round rows."""
    rows = read_metrics(open_run(run_uri).store, kind="round")
    assert rows and all(r["committed"] for r in rows)
    return sum(r["bytes_read"] + r["bytes_written"] for r in rows) / len(rows)


def _launched(tmp_path_factory, name: str, spec: str) -> tuple[Path, str]:
    cwd = tmp_path_factory.mktemp(name)
    store = store_uri_for("file", cwd)
    launch_and_wait(cwd, store, name, spec)  # in-process; the kill tests below launch through the CLI
    return cwd, f"{store}/{name}"


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory, baselines) -> tuple[Path, str]:
    """An uninterrupted 2 x 2 run (the baseline of the resume test too), and a folder of this module's to export
    it into. The run is the session's one (``baselines.shared_run``): test_multi_gpu_local_ranks.py's killed runs
    end on it too."""
    return tmp_path_factory.mktemp("sharded"), baselines.shared_run(multi_gpu_spec(2), "sharded")


@pytest.fixture(scope="module")
def two_by_two_fsdp(tmp_path_factory) -> tuple[Path, str]:
    """The same run with FSDP2 inside each replica: every parameter sharded over the 2 local ranks."""
    return _launched(tmp_path_factory, "fsdp", multi_gpu_spec(2, 'parallelism = "fsdp"'))


@pytest.fixture(scope="module")
def two_by_one(tmp_path_factory) -> tuple[Path, str]:
    """The same run with one local rank per replica (same global batch): what both 2 x 2 runs must match."""
    return _launched(tmp_path_factory, "whole", multi_gpu_spec(1))


def _match(sharded: tuple[Path, str], whole: tuple[Path, str], what: str) -> tuple[float, float]:
    """Max abs difference of the two runs' exported weights, and their store bytes per local rank per round."""
    got = export_weights(sharded[0], sharded[1], f"{what}-model")
    want = export_weights(whole[0], whole[1], f"whole-model-{what}")
    assert got.keys() == want.keys()
    diff = max(float((got[k] - want[k]).abs().max()) for k in got)
    ratio = _round_bytes(sharded[1]) / _round_bytes(whole[1])
    print(f"{what}: max abs diff 2x2 vs 2x1 {diff:.3g}; store bytes per local rank per round: ratio {ratio:.3f}")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sharded[0] / f"{what}-model")
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in got.values())
    # Local rank 0 reports for its replica: one round row per replica and round, with shard 0's bytes.
    rows = read_metrics(open_run(sharded[1]).store, kind="round")
    rounds = open_run(sharded[1]).spec.rounds
    assert sorted((r["round"], r["rank"]) for r in rows) == [(r, k) for r in range(rounds) for k in range(2)]
    return diff, ratio


def test_two_local_ranks_match_one_and_halve_the_bytes_per_rank(two_by_two, two_by_one):
    diff, ratio = _match(two_by_two, two_by_one, "ddp")
    assert diff <= 1e-6 and 0.4 <= ratio <= 0.65


def test_fsdp_local_ranks_match_one_and_halve_the_bytes_per_rank(two_by_two_fsdp, two_by_one):
    """FSDP: rank k syncs its chunk of every parameter; export reassembles the full Hugging Face model."""
    diff, ratio = _match(two_by_two_fsdp, two_by_one, "fsdp")
    assert diff <= 1e-6 and 0.4 <= ratio <= 0.6


def test_lora_local_ranks_match_one_and_export_merged_and_adapter(tmp_path_factory):
    """LoRA over DDP: the shards are the adapters' (2 rounds); merged and adapter exports as one-rank LoRA runs."""
    def lora_spec(n: int) -> str:
        return multi_gpu_spec(n).replace("\nrounds = 3\n", "\nrounds = 2\n", 1) + MULTI_GPU_LORA_TOML

    sharded = _launched(tmp_path_factory, "lora-sharded", lora_spec(2))
    whole = _launched(tmp_path_factory, "lora-whole", lora_spec(1))
    diff, ratio = _match(sharded, whole, "lora")
    assert diff <= 1e-6 and 0.4 <= ratio <= 0.65
    cwd, run_uri = sharded
    from peft import PeftModel
    from safetensors.torch import load_file

    from composer_cloud.model import load_spec_model
    from composer_cloud.runs.export import export_model

    # `export --adapter` in this process (the CLI's own is test_lora_e2e.py's): the library call the command makes.
    export_model(open_run(run_uri), cwd / "adapter", adapter=True)

    spec = open_run(run_uri).spec
    base, _ = load_spec_model(spec.model.model_copy(update={"lora": None}), seed=spec.seed)
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    merged = load_file(cwd / "lora-model/model.safetensors")
    # PEFT over the rebuilt base merges to the exported model, bitwise; only the adapted weights changed.
    again = PeftModel.from_pretrained(base, cwd / "adapter").merge_and_unload().state_dict()
    assert all(torch.equal(again[k], merged[k]) for k in merged)
    changed = [k for k in merged if not torch.equal(merged[k], plain[k])]
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_kill_everything_then_resume_is_bitwise(parallelism, tmp_path, request):
    """FSDP: the inner optimizer's state is stored whole and the outer momentum per shard; both come back."""
    cwd, sharded = request.getfixturevalue("two_by_two" if parallelism == "ddp" else "two_by_two_fsdp")
    expected = export_weights(cwd, sharded, "baseline")
    store = store_uri_for("file", tmp_path)
    cfg = tmp_path / "spec.toml"
    cfg.write_text(multi_gpu_spec(2, f'parallelism = "{parallelism}"'))
    launcher = launch_stalled(tmp_path, cfg, store, "resumed", phase="upload", round=1, rank=0, local_rank=1,
                              capture=False)
    kill_run(f"{store}/resumed", launcher)
    res = cli_here("resume", f"{store}/resumed", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    got = export_weights(tmp_path, f"{store}/resumed", "resumed")
    assert same_weights(got, expected)
    assert not any(torch.equal(got[k], torch.zeros_like(got[k])) for k in got)
