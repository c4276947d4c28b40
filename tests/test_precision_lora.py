"""[model] precision / gradient_checkpointing / attention / lora: the spec, the model, the trainer, the exports."""

from __future__ import annotations

import math

import pytest
import torch

from composer_cloud.lora import (
    apply_lora,
    export_adapter,
    export_merged,
    sync_footprint,
    synced_parameters,
)
from composer_cloud.model import compute_precision, load_spec_model, resolve_attention
from composer_cloud.spec import SpecError, spec_from_dict
from composer_cloud.trainer import TrainerContext, build_trainer
from composer_cloud.trainer.three_channel import ThreeChannelSettings, ThreeChannelTrainer
from support.trainer import HashTask, roundtrip, shipped_pairs

torch.set_num_threads(2)
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)


def _model_spec(**model):
    return spec_from_dict({"model": SHAPE | model}).model


def _trainer(model, tok, **overrides) -> ThreeChannelTrainer:
    settings = ThreeChannelSettings(**{
        "batch_size": 8, "num_generations": 4, "max_completion_length": 8, "sdpo_weight": 0.5, "dpo_weight": 0.5,
        "replay_batch_size": 2, "eval_examples": 4, "mask_truncated_completions": False, **overrides})
    task = HashTask()
    return ThreeChannelTrainer(
        model=model, tokenizer=tok, task=task, settings=settings, hint_source=task.default_hints(), pairs=shipped_pairs(),
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1),
        precision=compute_precision(model),
    )


def _grads_at_step(tr: ThreeChannelTrainer) -> dict[str, torch.Tensor | None]:
    """The gradients ``optimizer.step()`` sees in the next ``tr.step()`` (zero_grad clears them afterwards)."""
    seen: dict[str, torch.Tensor | None] = {}

    def hook(opt, args, kwargs):
        seen.update({n: None if p.grad is None else p.grad.detach().clone() for n, p in tr.model.named_parameters()})

    handle = tr.optimizer.register_step_pre_hook(hook)
    try:
        tr.step()
    finally:
        handle.remove()
    return seen


def _assert_bitwise_resume(make, k: int = 2, n: int = 2) -> None:
    """``make()`` builds (model, tok, trainer) from the spec; a trainer restored from state + synced params continues bitwise."""
    model_a, _, a = make()
    for _ in range(k):
        a.step()
    synced = {name: p.detach().clone() for name, p in synced_parameters(model_a).items()}
    tensors, meta = roundtrip(*a.state_dict())
    after_a = [a.step() for _ in range(n)]

    model_b, _, b = make()
    with torch.no_grad():
        for name, p in synced_parameters(model_b).items():
            p.copy_(synced[name])
    b.load_state_dict(tensors, meta)
    after_b = [b.step() for _ in range(n)]
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), name
    for ma, mb in zip(after_a, after_b):
        for key in ("loss", "pg", "sdpo", "dpo", "grad_norm"):
            assert ma[key] == mb[key], key


# --------------------------------------------------------------------------- bf16
def test_bf16_computes_in_bf16_and_keeps_fp32_parameters_gradients_and_optimizer_state():
    model, tok = load_spec_model(_model_spec(precision="bf16"), seed=0)
    assert compute_precision(model) == "bf16" and model.config._attn_implementation == "sdpa"
    tr = _trainer(model, tok)
    dtypes: set[torch.dtype] = set()
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    grads = _grads_at_step(tr)
    handle.remove()
    assert dtypes == {torch.bfloat16}  # every forward of the step (sampling, loss, teacher, replay) under autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())
    flat = torch.cat([g.flatten() for g in grads.values() if g is not None])
    assert flat.dtype == torch.float32 and torch.isfinite(flat).all() and flat.norm() > 0
    assert all(g is not None for g in grads.values())
    assert all(v.dtype == torch.float32 for st in tr.optimizer.state.values() for v in st.values() if v.dim() > 0)
    out = tr.evaluate()
    assert math.isfinite(out["eval_reward_mean"])

    # The control: fp32 computes in fp32.
    model32, tok32 = load_spec_model(_model_spec(), seed=0)
    fp32_dtypes: set[torch.dtype] = set()
    model32.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: fp32_dtypes.add(o.dtype))
    _trainer(model32, tok32).step()
    assert fp32_dtypes == {torch.float32}


def test_bf16_trainer_state_roundtrip_is_bitwise():
    def make():
        model, tok = load_spec_model(_model_spec(precision="bf16"), seed=0)
        return model, tok, _trainer(model, tok)

    _assert_bitwise_resume(make)


def test_gradient_checkpointing_is_on_and_gives_the_same_gradients():
    from composer_cloud.compat_transformers import is_activation_checkpointing

    grads = {}
    for ckpt in (False, True):
        model, tok = load_spec_model(_model_spec(gradient_checkpointing=ckpt), seed=0)
        assert is_activation_checkpointing(model) is ckpt
        tr = _trainer(model, tok, sdpo_weight=0.0)
        assert tr.grpo.args.gradient_checkpointing is ckpt  # the old name: before 5.23 the only one, after an alias
        grads[ckpt] = _grads_at_step(tr)
    for name, g in grads[False].items():
        assert torch.allclose(g, grads[True][name], atol=1e-6), name


# --------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lora_trains_only_the_adapters(precision):
    model, tok = load_spec_model(_model_spec(precision=precision, lora={"r": 4, "alpha": 8}), seed=0)
    synced = synced_parameters(model)
    assert synced and all(".lora_" in name for name in synced)
    assert all(p.dtype == torch.float32 for p in synced.values())  # fp32 master weights of what trains
    base_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {p.dtype for n, p in model.named_parameters() if n not in synced} == {base_dtype}
    tr = _trainer(model, tok, kl_coef=0.04)
    assert {id(p) for p in tr.optimizer.param_groups[0]["params"]} == {id(p) for p in synced.values()}
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if n not in synced}
    grads = _grads_at_step(tr)
    for name, g in grads.items():
        if name in synced:
            assert g is not None and torch.isfinite(g).all(), name
        else:
            assert g is None, name
    # Every adapter matrix moves: A from the first step on, B (initialised to 0) once A's gradient flowed.
    assert torch.cat([grads[n].flatten() for n in synced]).norm() > 0
    assert any(grads[n].abs().sum() > 0 for n in synced if "lora_B" in n)
    assert all(torch.equal(p, frozen_before[n]) for n, p in model.named_parameters() if n not in synced)
    tensors, _ = tr.state_dict()
    assert not any(k.startswith("kl_ref.") for k in tensors)  # the reference is the base: adapters disabled


def test_lora_trainer_state_roundtrip_is_bitwise():
    def make():
        model, tok = load_spec_model(_model_spec(precision="bf16", lora={"r": 4}), seed=0)
        return model, tok, _trainer(model, tok, kl_coef=0.04)

    _assert_bitwise_resume(make)


def test_lora_dropout_and_unmatched_targets_are_refused_by_name():
    with pytest.raises(ValueError, match=r"model.lora.target_modules.*matches no module.*q_proj"):
        load_spec_model(_model_spec(lora={"target_modules": ["query_key_value"]}), seed=0)
    model, tok = load_spec_model(_model_spec(lora={"dropout": 0.1}), seed=0)
    ctx = TrainerContext(model=model, tokenizer=tok, rank=0, world_size=1, seed=0, device=torch.device("cpu"),
                         settings={"batch_size": 4, "num_generations": 2})
    with pytest.raises(ValueError, match="model.lora.dropout"):
        build_trainer("three-channel", ctx)


def test_the_launchers_list_of_the_tiny_models_linear_layers_is_the_built_models():
    """``TINY_LINEAR_MODULES`` lets the launcher accept LoRA targets without building the model: it must be the
    linear layers (by short name) of the model a replica builds, with this transformers, at any shape."""
    from composer_cloud.model import TINY_LINEAR_MODULES
    from composer_cloud.runs.preflight import check_replica_build

    for shape in (SHAPE, {}):
        model, _ = load_spec_model(spec_from_dict({"model": shape}).model, seed=0)
        linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        assert linear - {"lm_head"} == TINY_LINEAR_MODULES, linear
    # A name outside the list still meets the real check (the meta-device model and peft), not the shortcut.
    spec = spec_from_dict({"model": SHAPE | {"lora": {"target_modules": ["q_prj"]}}})
    with pytest.raises(SpecError, match=r"model.lora.target_modules.*matches no module") as err:
        check_replica_build(spec, {"local": "cpu"}, None)
    assert "q_proj" in str(err.value)


def test_adapters_are_identical_for_a_seed_and_leave_the_callers_rng_alone():
    torch.manual_seed(5)
    state = torch.get_rng_state()
    a, _ = load_spec_model(_model_spec(lora={"r": 4}), seed=3)
    assert torch.equal(state, torch.get_rng_state())
    b, _ = load_spec_model(_model_spec(lora={"r": 4}), seed=3)
    c, _ = load_spec_model(_model_spec(lora={"r": 4}), seed=4)
    sa, sb, sc = (synced_parameters(m) for m in (a, b, c))
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert any(not torch.equal(sa[n], sc[n]) for n in sa)


def test_merged_and_adapter_exports_load_and_generate(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, tok = load_spec_model(_model_spec(lora={"r": 4}), seed=0)
    with torch.no_grad():
        for p in synced_parameters(model).values():
            p.add_(0.05 * torch.randn_like(p))  # a trained adapter: B != 0
    probe = tok("def f(x):\n    return", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=probe).logits
        base_only = model.get_base_model()
        with model.disable_adapter():
            assert not torch.allclose(base_only(input_ids=probe).logits, expected, atol=1e-4)  # the adapter matters

    export_adapter(model, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    export_merged(model, tok, tmp_path / "merged")

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=probe).logits, expected, atol=1e-5)
    out = merged.generate(input_ids=probe, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == probe.shape[1] + 5 or tok.eos_token_id in out[0, probe.shape[1]:].tolist()

    base, _ = load_spec_model(_model_spec(), seed=0)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=probe).logits, expected, atol=1e-6)


def test_synced_bytes_of_lora_are_under_two_percent_of_a_full_fine_tune():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    full, _ = load_spec_model(spec_from_dict({}).model, seed=0)  # the demo model
    fp = sync_footprint(full)
    assert fp.synced_bytes == fp.full_bytes == 4 * sum(p.numel() for p in full.parameters())
    for cfg in QWEN25_SHAPES.values():
        with torch.device("meta"):
            model = apply_lora(Qwen2ForCausalLM(Qwen2Config(**cfg)), r=16, alpha=32, dropout=0.0,
                               target_modules="all-linear", seed=0)
        fp = sync_footprint(model)
        assert 0 < fp.ratio <= 0.02, (cfg, fp)


# Qwen2.5-0.5B / 1.5B shapes (their config.json; random weights, nothing downloaded). Also benchmarks/gpu.py.
QWEN25_SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True),
}


# --------------------------------------------------------------------------- spec and attention
def test_spec_refuses_what_cannot_run_by_field_name():
    cases = [
        ({"model": {"precision": "fp16"}}, "model.precision", "loss scaling"),
        ({"device": "cpu", "model": {"attention": "flash_attention_2", "precision": "bf16"}}, "model.attention", "CUDA"),
        ({"model": {"attention": "flash_attention_2"}}, "model.attention", "bf16"),
        ({"model": {"lora": {"rank": 8}}}, "model.lora.rank", "unknown key"),
        ({"model": {"lora": {"target_modules": []}}}, "model.lora.target_modules", "at least one"),
        ({"model": {"lora": {"dropout": 1.0}}}, "model.lora.dropout", "less than 1"),
    ]
    for data, field, message in cases:
        with pytest.raises(SpecError) as err:
            spec_from_dict(data)
        assert err.value.field == field and message in str(err.value), (data, str(err.value))
    spec = spec_from_dict({"model": {"precision": "bf16", "gradient_checkpointing": True,
                                     "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}})
    assert spec.model.lora is not None and spec.model.lora.target_modules == ["q_proj", "v_proj"]
    assert spec_from_dict(spec.to_json_dict()) == spec  # what a replica reads back from spec.json


def test_attention_resolution():
    assert resolve_attention("auto", device="cpu", precision="bf16") == "sdpa"
    assert resolve_attention("eager", device="cpu", precision="fp32") == "eager"
    with pytest.raises(ValueError, match="model.attention.*CUDA"):
        resolve_attention("flash_attention_2", device="cpu", precision="bf16")
    model, _ = load_spec_model(_model_spec(attention="eager"), seed=0)
    assert model.config._attn_implementation == "eager"


def test_the_spec_shown_in_docs_gpu_md_loads(tmp_path):
    import re
    from pathlib import Path

    from composer_cloud.spec import load_spec

    text = (Path(__file__).resolve().parent.parent / "docs" / "gpu.md").read_text()
    block, *others = re.findall(r"```toml\n(.*?)```", text, re.S)
    for i, other in enumerate(others):  # every other block the page shows loads too
        (tmp_path / f"other{i}.toml").write_text(other)
        ThreeChannelSettings.from_settings(load_spec(tmp_path / f"other{i}.toml").trainer.settings())
    (tmp_path / "gpu.toml").write_text(block)
    spec = load_spec(tmp_path / "gpu.toml")
    assert spec.model.precision == "bf16" and spec.model.gradient_checkpointing
    assert spec.model.lora is not None and spec.model.lora.r == 16
    settings = ThreeChannelSettings.from_settings(spec.trainer.settings())
    assert settings.rollout == "vllm" and settings.grpo_kwargs()["use_vllm"]
