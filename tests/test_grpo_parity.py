"""Channel 1 of the three-channel trainer against stock TRL ``GRPOTrainer``, where they used to differ.

Each test builds a stock ``GRPOTrainer`` and a ``ThreeChannelGRPOTrainer`` used as a drop-in (no settings, so
channels 2 and 3 have neither hints nor pairs) on identical models and compares what a user of TRL sees:
construction, the KL reference, loss and gradients, and the logged metric names.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_cloud.model import TinyModelConfig, load_model
from composer_cloud.trainer.three_channel import ThreeChannelGRPOTrainer, ThreeChannelSettings

torch.set_num_threads(2)

SMALL = TinyModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64)


def _reward(prompts, completions, **kw):
    return [float(hashlib.sha256(c.encode()).digest()[0]) / 255 for c in completions]


def _dataset():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"def f{i}(x):"} for i in range(8)])


def _config(tmp_path: Path, **kw: Any):
    from trl import GRPOConfig

    base = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", seed=0,
                per_device_train_batch_size=4, num_generations=4, max_completion_length=6, logging_steps=1,
                save_strategy="no", learning_rate=1e-2)
    return GRPOConfig(**(base | kw))


def _pair(tmp_path: Path, model: Any = None, **kw: Any):
    """(stock, ours) on two equal copies of the tiny model (or ``model()``'s result, called twice)."""
    from trl import GRPOTrainer

    make = model or (lambda: load_model("tiny", seed=0, tiny=SMALL))
    (m1, tok), (m2, _) = make(), make()
    common = dict(reward_funcs=_reward, train_dataset=_dataset(), processing_class=tok)
    stock = GRPOTrainer(model=m1, args=_config(tmp_path, **kw), **common)
    ours = ThreeChannelGRPOTrainer(model=m2, args=_config(tmp_path, **kw), **common)
    for t in (stock, ours):
        t.current_gradient_accumulation_steps = t.args.gradient_accumulation_steps
        t.model.train()
    return stock, ours


def _saved_model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny"
    model, tok = load_model("tiny", seed=0, tiny=SMALL)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _inputs(trainer, *, lengths: list[int], old_noise: float = 0.4, ref_noise: float | None = None,
            num_items: int | None = None) -> dict[str, Any]:
    """A micro-batch as TRL's ``_prepare_inputs`` hands it to the loss; off-policy so that clipping is active."""
    g = torch.Generator().manual_seed(7)
    B, P, C = len(lengths), 5, max(lengths) or 1
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    completion_mask = (torch.arange(C)[None] < torch.tensor(lengths)[:, None]).long()
    completion_ids = torch.randint(3, vocab, (B, C), generator=g).masked_fill(completion_mask == 0, 0)
    inputs: dict[str, Any] = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": torch.tensor(completion_mask.sum().item() if num_items is None else num_items),
    }
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([inputs["prompt_mask"], completion_mask], 1), C)
    inputs["old_per_token_logps"] = logps + old_noise * torch.randn(B, C, generator=g)
    if ref_noise is not None:
        inputs["ref_per_token_logps"] = logps + ref_noise * torch.randn(B, C, generator=g)
    return inputs


def _loss_and_grads(trainer, inputs) -> tuple[float, list[torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    if loss.requires_grad:
        loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in trainer.model.parameters()]
    trainer.model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _assert_same(stock, ours, inputs) -> float:
    l_stock, g_stock = _loss_and_grads(stock, inputs)
    l_ours, g_ours = _loss_and_grads(ours, inputs)
    assert l_ours == pytest.approx(l_stock, rel=1e-6, abs=1e-7)
    scale = max(g.abs().max().item() for g in g_stock)
    assert max((a - b).abs().max().item() for a, b in zip(g_stock, g_ours)) <= 1e-6 * max(scale, 1.0)
    return l_stock


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- the four faults
def test_constructed_without_args_as_trl_is(monkeypatch, tmp_path):
    # TRL builds GRPOConfig("<model name>-GRPO") when args is None. Its default asks for bf16, which this CPU
    # box cannot do; pretend it can, for both trainers alike.
    from trl import GRPOTrainer

    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    (m1, tok), (m2, _) = load_model("tiny", seed=0, tiny=SMALL), load_model("tiny", seed=0, tiny=SMALL)
    stock = GRPOTrainer(model=m1, reward_funcs=_reward, train_dataset=_dataset(), processing_class=tok)
    ours = ThreeChannelGRPOTrainer(m2, _reward, train_dataset=_dataset(), processing_class=tok)
    assert ours.args.output_dir == stock.args.output_dir and ours.args.output_dir.endswith("-GRPO")
    fields = ("loss_type", "beta", "num_generations", "per_device_train_batch_size", "max_completion_length",
              "epsilon", "epsilon_high", "steps_per_generation", "temperature")
    assert {f: getattr(ours.args, f) for f in fields} == {f: getattr(stock.args, f) for f in fields}
    assert ours.settings.loss_type == stock.loss_type and ours.settings.kl_coef == stock.beta


@pytest.mark.parametrize("form", ["name", "instance"])
def test_kl_reference_and_sync_ref_model_train_as_stock(tmp_path, form):
    # beta != 0 with the model given by name (TRL's documented form) used to deepcopy the string; with
    # sync_ref_model=True the subclass hid beta from TRL, which then refused. Two steps with the reference
    # mixed into the policy after each: policy and reference end where stock TRL's end.
    from transformers import AutoModelForCausalLM, set_seed

    path = _saved_model(tmp_path)
    model = (lambda: str(path)) if form == "name" else (lambda: AutoModelForCausalLM.from_pretrained(path))
    kw = dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, max_steps=2)
    from trl import GRPOTrainer

    tok = load_model("tiny", seed=0, tiny=SMALL)[1]
    common = dict(reward_funcs=_reward, train_dataset=_dataset(), processing_class=tok)
    stock = GRPOTrainer(model=model(), args=_config(tmp_path, **kw), **common)
    ours = ThreeChannelGRPOTrainer(model=model(), args=_config(tmp_path, **kw), **common)
    start = _params(ours.ref_model)
    assert ours.beta == 0.1 and ours.ref_model is not None and ours.ref_model is not ours.model
    for trainer in (stock, ours):
        set_seed(0)  # sampling draws from the global generators
        trainer.train()
    for name, p in _params(stock.model).items():
        assert torch.allclose(ours.model.get_parameter(name), p, atol=1e-6), name
    moved = 0
    for name, p in _params(stock.ref_model).items():
        assert torch.allclose(ours.ref_model.get_parameter(name), p, atol=1e-6), name
        moved += not torch.equal(p, start[name])
    assert moved > 0  # the reference was synced towards the policy
    assert [k for k in stock.state.log_history[0] if k.startswith("kl")] == ["kl"]
    assert ours.state.log_history[0]["kl"] == pytest.approx(stock.state.log_history[0]["kl"], rel=1e-5, abs=1e-9)


def test_dapo_eval_loss_is_not_divided_by_steps_per_generation(tmp_path):
    stock, ours = _pair(tmp_path, loss_type="dapo", steps_per_generation=2, gradient_accumulation_steps=2)
    inputs = _inputs(stock, lengths=[6, 3, 5, 1])
    for t in (stock, ours):
        t.model.eval()
    with torch.no_grad():
        want = stock.compute_loss(stock.model, inputs).item()
        got = ours.compute_loss(ours.model, inputs).item()
    assert got == pytest.approx(want, rel=1e-6) and abs(want) > 1e-4
    for t in (stock, ours):
        t.model.train()
    _assert_same(stock, ours, inputs)  # training divides, as TRL does


def test_dapo_clamps_the_token_count_before_dividing(tmp_path):
    # One completion token in the whole generation batch, split into two micro-batches: TRL's normaliser is
    # max(1, 1) / 2 = 0.5; clamping after the division gave 1, half of TRL's loss and gradient.
    stock, ours = _pair(tmp_path, loss_type="dapo", steps_per_generation=2, gradient_accumulation_steps=1)
    inputs = _inputs(stock, lengths=[1, 0, 0, 0], num_items=1)
    loss = _assert_same(stock, ours, inputs)
    assert abs(loss) > 1e-4


# --------------------------------------------------------------------------- metrics, settings, MoE
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_metrics_carry_trls_names_and_values(tmp_path, loss_type):
    stock, ours = _pair(tmp_path, loss_type=loss_type)
    # KL on, with the reference log-probs in the inputs (stock cannot reload a model built from a config by name)
    stock.beta = ours.beta = 0.04
    ours.settings = dataclasses.replace(ours.settings, kl_coef=0.04)
    inputs = _inputs(stock, lengths=[6, 2, 4, 5], ref_noise=0.3)
    _assert_same(stock, ours, inputs)
    theirs, mine = stock._metrics["train"], ours._metrics["train"]
    assert {"kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_max"} <= set(theirs)
    for key, values in theirs.items():
        assert key in mine, key
        assert mine[key] == pytest.approx(values, rel=1e-5, abs=1e-7, nan_ok=True), key
    assert {"pg", "total"} <= set(mine)  # ours, in addition


def test_settings_are_no_stricter_than_trl_about_group_sizes(tmp_path):
    # TRL needs whole groups per generation batch, not per micro-batch.
    from trl import GRPOConfig

    GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=2,
               num_generations=4, steps_per_generation=2)
    s = ThreeChannelSettings(batch_size=2, num_generations=4, steps_per_generation=2)
    assert s.grpo_kwargs()["per_device_train_batch_size"] == 2
    with pytest.raises(ValueError, match="num_generations"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=2,
                   num_generations=4, steps_per_generation=1)
    with pytest.raises(ValueError, match=r"trainer\.batch_size × trainer\.steps_per_generation"):
        ThreeChannelSettings.from_settings({"batch_size": 2, "num_generations": 4})


def _moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _, tok = load_model("tiny", seed=0, tiny=SMALL)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.05,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg), tok


def test_moe_router_aux_loss_is_added_as_trl_adds_it(tmp_path):
    stock, ours = _pair(tmp_path, model=_moe, loss_type="dapo")
    assert stock.aux_loss_enabled and ours.aux_loss_enabled and ours.router_aux_loss_coef == 0.05
    inputs = _inputs(stock, lengths=[6, 2, 4, 5])
    _assert_same(stock, ours, inputs)
    aux = ours._metrics["train"]["aux_loss"]
    assert aux == pytest.approx(stock._metrics["train"]["aux_loss"], rel=1e-6) and aux[0] > 0
    # With channel 2 on, the student forward returns full logits; the router loss is the same.
    hinted = dict(inputs, has_hint=torch.tensor([True, False, True, False]),
                  teacher_prompt_ids=inputs["prompt_ids"], teacher_prompt_mask=inputs["prompt_mask"])
    ours.settings = ThreeChannelSettings(batch_size=4, num_generations=4, max_completion_length=6,
                                         sdpo_weight=0.5, dpo_weight=0.0)
    with torch.no_grad():
        out = ours.compute_three_channel_loss(ours.model, hinted)
    assert out.active == ("pg", "sdpo")
    assert out.metrics["aux_loss"].item() == pytest.approx(aux[0], rel=1e-5)
    assert out.metrics["total"].item() == pytest.approx(
        out.metrics["pg"].item() + 0.5 * out.metrics["sdpo"].item() + 0.05 * aux[0], rel=1e-5)


def test_refused_options_say_why(tmp_path):
    m, tok = load_model("tiny", seed=0, tiny=SMALL)
    for kw, match in [(dict(loss_type="cispo"), r"loss_type 'cispo' is not implemented.*docs/trainer\.md"),
                      (dict(importance_sampling_level="sequence"), "importance_sampling_level must be 'token'")]:
        with pytest.raises(ValueError, match=match):
            ThreeChannelGRPOTrainer(model=m, reward_funcs=_reward, args=_config(tmp_path, **kw),
                                    train_dataset=_dataset(), processing_class=tok)
