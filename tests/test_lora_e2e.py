"""LoRA and bf16 runs end to end through the CLI: complete, export, resume bitwise after kill -9, bytes per round.

Under ``[model.lora]`` DiLoCo syncs, checkpoints and restores the adapters alone (the frozen base is rebuilt
from the spec by every replica and by ``export``): the global state holds nothing else, the exported merged
model is a plain transformers model, and a run killed mid-round resumes to the uninterrupted run's weights.
"""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from composer_cloud import runs
from composer_cloud.lora import synced_parameters
from composer_cloud.runs import read_metrics
from composer_cloud.storage.run import open_run
from composer_cloud.storage.tensors import flatten
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore
from composer_cloud.sync.checkpoint.replica_state import ReplicaStateStore
from composer_cloud.sync.lockstep.diloco import params_digest
from support.cli import cli_here, status_here
from support.resume import export_weights, kill_run_at, launch_and_wait, launch_run, same_weights
from support.specs import CAUSAL_LM, RESUME_SPEC, with_sync
from support.stores import store_uri_for

LORA_TOML = """
[model.lora]
r = 8
alpha = 16.0
target_modules = ["q_proj", "v_proj"]
"""
LORA_SPEC = RESUME_SPEC + LORA_TOML
BF16_SPEC = RESUME_SPEC.replace("[model]\n", '[model]\nprecision = "bf16"\n', 1)


def _generate(model_dir) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("def add(a, b):", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 6
    return tok.decode(out[0, ids.shape[1]:])


def _kill_and_resume(tmp_path, spec: str, phase: str = "upload", *, cli_launch: bool = False):
    """Uninterrupted run vs a run SIGKILLed (launcher and replicas) at ``phase`` of round 2 and resumed. The
    uninterrupted run is launched in this process, or with ``cli_launch`` through the CLI (its output returned)."""
    store = store_uri_for("file", tmp_path)
    res_whole = None
    if cli_launch:
        res_whole = res = launch_run(tmp_path, store, "whole", spec)
        assert res.returncode == 0, res.stdout + res.stderr
    else:
        launch_and_wait(tmp_path, store, "whole", spec)
    expected = export_weights(tmp_path, f"{store}/whole", "whole-model")
    kill_run_at(tmp_path, store, "killed", phase, spec=spec)
    st = status_here(f"{store}/killed", tmp_path)
    assert st["rounds_committed"] < 4
    res = cli_here("resume", f"{store}/killed", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    assert same_weights(export_weights(tmp_path, f"{store}/killed", "resumed-model"), expected)
    _generate(tmp_path / "resumed-model")
    return store, res_whole


@pytest.mark.slow
def test_lora_run_syncs_adapters_only_exports_and_resumes_bitwise_after_kill(tmp_path):
    store, launched = _kill_and_resume(tmp_path, LORA_SPEC, cli_launch=True)
    run = open_run(f"{store}/whole")
    # The checkpoints hold the adapters alone: global parameters, outer momentum, inner AdamW state.
    from composer_cloud.model import load_spec_model
    from composer_cloud.sync.lockstep.diloco import load_global_parameters, split_fragments

    model, _ = load_spec_model(run.spec.model, seed=run.spec.seed)
    adapters = synced_parameters(model)
    states = GlobalStateStore(run.store)
    tree, _ = flatten(states.load(3, 0))
    params = {k.rsplit("/", 1)[-1] for k in tree if "/original_parameters/" in k}
    momenta = [k for k in tree if k.endswith("momentum_buffer")]
    assert params == {n.replace(".", "__") for n in adapters} and len(momenta) == len(params) == len(tree) // 2
    inner = ReplicaStateStore(run.store).load(3, 0, None)["trainer"]
    moments = sum(t.numel() for k, t in inner.items() if k.endswith(("exp_avg", "exp_avg_sq")))
    assert moments == 2 * sum(p.numel() for p in adapters.values())

    # The merged export is the replicas' model: the same base rebuilt, the synced adapters folded in.
    load_global_parameters(split_fragments(model, 1), states.load(3, 0))
    digests = {run.store.get_json(f"replicas/{r}.json")["params_sha256"] for r in range(2)}
    assert digests == {params_digest(model)}
    base, _ = load_spec_model(run.spec.model.model_copy(update={"lora": None}), seed=run.spec.seed)
    merged = load_file(tmp_path / "whole-model/model.safetensors")
    plain = dict(base.named_parameters())
    changed = {k for k, v in merged.items() if not torch.equal(v, plain[k].detach())}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed

    # --adapter: PEFT's format; PEFT over the rebuilt base merges to the exported model, bitwise.
    res = cli_here("export", f"{store}/whole", "--out", str(tmp_path / "adapter"), "--adapter", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    again = peft_model.merge_and_unload().state_dict()
    assert all(torch.equal(again[k], merged[k]) for k in merged)
    assert (tmp_path / "adapter/adapter_config.json").exists() and (tmp_path / "adapter/tokenizer.json").exists()

    # Status and metrics carry the synced share.
    rows = read_metrics(run.store, kind="round")
    assert {round(m["synced_fraction"], 6) for m in rows} == {round(rows[0]["synced_fraction"], 6)}
    assert 0 < rows[0]["synced_fraction"] < 0.1
    assert runs.summarize(run, runs.get_status(run)).synced_fraction == rows[0]["synced_fraction"]
    assert f"(LoRA: {100 * rows[0]['synced_fraction']:.2f}% of full)" in launched.stdout, launched.stdout


@pytest.mark.slow
def test_bf16_run_exports_and_resumes_bitwise_after_kill(tmp_path, baselines):
    store, _ = _kill_and_resume(tmp_path, BF16_SPEC)
    rows = read_metrics(open_run(f"{store}/whole").store, kind="round")
    assert rows and all(m["synced_fraction"] == 1.0 for m in rows)
    # bf16 computes: the run differs from the same run in fp32 (the shared RESUME_SPEC baseline), so the
    # setting is not ignored.
    assert not same_weights(baselines.get(tmp_path), export_weights(tmp_path, f"{store}/whole", "again"))
    # A full fine-tune has no adapter to export: refused, naming [model.lora], nothing written.
    res = cli_here("export", f"{store}/whole", "--out", str(tmp_path / "a"), "--adapter", cwd=tmp_path)
    assert res.exit_code == 1 and "[model.lora]" in res.stderr and "without --adapter" in res.stderr, res.output
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_lora_decoupled_run_completes_and_exports(tmp_path):
    store = store_uri_for("file", tmp_path)
    spec = with_sync(LORA_SPEC.replace("rounds = 4", "rounds = 3"), mode="decoupled")
    launch_and_wait(tmp_path, store, "dec", spec)
    run = open_run(f"{store}/dec")
    versions = GlobalStateStore(run.store)
    tree, _ = flatten(versions.load(max(versions.durable_rounds(lambda r: 0)), 0))
    assert all("lora_" in k for k in tree if "original_parameters" in k), sorted(tree)
    export_weights(tmp_path, f"{store}/dec", "dec-model")
    _generate(tmp_path / "dec-model")


# ---------------------------------------------------------------------- store bytes: LoRA vs full
DEMO_TOML = """
replicas = 2
min_replicas = 2
rounds = 2
inner_steps = 1
[sync]
quorum_timeout_s = 60
round_timeout_s = 120
[trainer]
name = "causal-lm"
batch_size = 2
seq_len = 32
"""


def _bytes_per_replica_round(store) -> float:
    rows = read_metrics(store, kind="round")
    assert len(rows) == 4 and all(m["committed"] for m in rows)
    return sum(m["bytes_read"] + m["bytes_written"] for m in rows) / len(rows)


@pytest.mark.slow
def test_lora_store_bytes_per_round_are_under_two_percent_of_a_full_fine_tune(tmp_path):
    """The demo model (``tiny``, 3.0 M) with r = 8 on q_proj, v_proj, measured by the store's byte counters."""
    store = store_uri_for("file", tmp_path)
    launch_and_wait(tmp_path, store, "full", DEMO_TOML)
    launch_and_wait(tmp_path, store, "lora", DEMO_TOML + "[model]\n" + LORA_TOML)
    full = _bytes_per_replica_round(open_run(f"{store}/full").store)
    lora = _bytes_per_replica_round(open_run(f"{store}/lora").store)
    print(f"store bytes per replica per round: full {full:.0f}, LoRA {lora:.0f}, ratio {lora / full:.4f}")
    assert lora / full <= 0.02


@pytest.mark.slow
def test_three_channel_bf16_lora_run_completes_and_exports(tmp_path):
    """The default trainer (three-channel) with bf16 autocast and LoRA: a bf16 base, fp32 adapters synced."""
    store = store_uri_for("file", tmp_path)
    spec = BF16_SPEC.replace(CAUSAL_LM + "\n", "num_generations = 2\nmax_completion_length = 6\n")
    spec = spec.replace("rounds = 4", "rounds = 2").replace("inner_steps = 4", "inner_steps = 2") + LORA_TOML
    res = launch_run(tmp_path, store, "tc", spec)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(LoRA: " in res.stdout and "% of full)" in res.stdout
    rows = read_metrics(open_run(f"{store}/tc").store, kind="round")
    assert len(rows) == 4 and all(0 < m["synced_fraction"] < 0.1 and "reward_mean" in m for m in rows)
    weights = export_weights(tmp_path, f"{store}/tc", "tc-model")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}  # merged into the bf16 base
    _generate(tmp_path / "tc-model")
