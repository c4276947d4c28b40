"""The three-channel GRPOTrainer subclass, the InnerTrainer around it, and trace-replay pairs."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from support.trainer import HashTask, hash_reward, roundtrip, shipped_pairs

from composer_cloud.model import TinyModelConfig, load_model
from composer_cloud.trainer import InnerTrainer, TrainerContext, build_trainer
from composer_cloud.trainer.three_channel import (
    TRL_SUPPORTED,
    ThreeChannelGRPOTrainer,
    ThreeChannelSettings,
    ThreeChannelTrainer,
    TRLCompatibilityError,
    check_trl_compatibility,
)
from composer_cloud.trainer.three_channel.replay import (
    Pair,
    ReplayBuffer,
    TraceStep,
    default_pairs_uri,
    load_pairs,
    make_pairs,
    write_pairs,
)
from composer_cloud.trainer.three_channel.tasks import build_demo_pairs

torch.set_num_threads(2)

SMALL = TinyModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)


def _model(seed: int = 0):
    return load_model("tiny", seed=seed, tiny=SMALL)


# --------------------------------------------------------------------------- TRL hook check
def test_installed_trl_passes_the_hook_check():
    check_trl_compatibility()
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert f"trl{TRL_SUPPORTED}" in pyproject["project"]["dependencies"]


def test_hook_check_names_the_supported_range_when_a_signature_changed():
    from trl import GRPOTrainer

    class Changed(GRPOTrainer):
        def _compute_loss(self, model, inputs, num_items):  # a new required parameter
            raise AssertionError

    with pytest.raises(TRLCompatibilityError, match=r"trl>=1\.16,<1\.17.*_compute_loss"):
        check_trl_compatibility(Changed, version="1.17.0")

    class Missing:
        pass

    with pytest.raises(TRLCompatibilityError, match="_generate_and_score_completions is missing"):
        check_trl_compatibility(Missing, version="2.0.0")

    class Extended(GRPOTrainer):
        def _compute_loss(self, model, inputs, extra=None):  # optional extras keep our calls valid
            raise AssertionError

    check_trl_compatibility(Extended, version="1.16.0")


# --------------------------------------------------------------------------- parity with stock GRPO
def _pair_settings(loss_type: str, **kw) -> ThreeChannelSettings:
    # 8 completions of at most 7 tokens, 4 per prompt; TRL's default for truncated completions
    return ThreeChannelSettings(
        loss_type=loss_type, batch_size=8, num_generations=4, max_completion_length=7, mask_truncated_completions=False, **kw
    )


def _grpo_args(loss_type: str, **kw):
    from trl import GRPOConfig

    from composer_cloud.compat_transformers import activation_checkpointing_args

    return GRPOConfig(
        output_dir="/tmp/composer-cloud-test-grpo",
        **_pair_settings(loss_type).grpo_kwargs(),  # per_device_train_batch_size=8, num_generations=4, ...
        use_cpu=True,
        bf16=False,
        **activation_checkpointing_args(False),  # the names this transformers knows (5.23 renamed them)
        report_to="none",
        seed=0,
        **kw,
    )


def _build_pair(loss_type: str, *, sdpo_weight=0.0, dpo_weight=0.0):
    """A stock GRPOTrainer and a three-channel one on two identical models."""
    from datasets import Dataset
    from trl import GRPOTrainer

    ds = Dataset.from_list([{"prompt": "def f(x):"}])
    (m1, tok), (m2, _) = _model(), _model()
    stock = GRPOTrainer(model=m1, reward_funcs=hash_reward, args=_grpo_args(loss_type), train_dataset=ds, processing_class=tok)
    ours = ThreeChannelGRPOTrainer(
        model=m2,
        reward_funcs=hash_reward,
        args=_grpo_args(loss_type),
        train_dataset=ds,
        processing_class=tok,
        settings=_pair_settings(loss_type, sdpo_weight=sdpo_weight, dpo_weight=dpo_weight),
    )
    stock.current_gradient_accumulation_steps = 1
    m1.train(), m2.train()
    return stock, ours, tok


def _inputs(vocab: int, *, old_noise: float | None, ref_noise: float | None, model, stock):
    g = torch.Generator().manual_seed(7)
    B, P, C = 8, 6, 7
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # some left padding
    prompt_ids[prompt_mask == 0] = 0
    lengths = torch.tensor([7, 5, 3, 7, 1, 6, 7, 2])
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, vocab, (B, C), generator=g).masked_fill(completion_mask == 0, 0)
    advantages = torch.randn(B, generator=g)
    inputs: dict[str, Any] = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }
    if old_noise is not None or ref_noise is not None:
        with torch.no_grad():
            logps, _, _ = stock._get_per_token_logps_and_entropies(
                model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), C
            )
        if old_noise is not None:
            inputs["old_per_token_logps"] = logps + old_noise * torch.randn(B, C, generator=g)
        if ref_noise is not None:
            inputs["ref_per_token_logps"] = logps + ref_noise * torch.randn(B, C, generator=g)
    return inputs


def _loss_and_grads(trainer, model, inputs):
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_equals_stock_grpo_when_sdpo_and_dpo_weights_are_zero(loss_type):
    stock, ours, tok = _build_pair(loss_type)
    cases = [
        ("on-policy", dict(old_noise=None, ref_noise=None), 0.0),
        ("off-policy (clipping active)", dict(old_noise=0.4, ref_noise=None), 0.0),
        ("with k3 KL", dict(old_noise=0.4, ref_noise=0.3), 0.04),
    ]
    for name, kw, kl in cases:
        inputs = _inputs(len(tok), model=stock.model, stock=stock, **kw)
        stock.beta = kl  # stock reads inputs["ref_per_token_logps"] when beta != 0
        ours.settings = dataclasses.replace(ours.settings, kl_coef=kl)
        # channel 2/3 inputs present but weights 0: they must be ignored
        ours_inputs = dict(inputs, has_hint=torch.ones(8, dtype=torch.bool), teacher_prompt_ids=inputs["prompt_ids"], teacher_prompt_mask=inputs["prompt_mask"])
        l_stock, g_stock = _loss_and_grads(stock, stock.model, inputs)
        l_ours, g_ours = _loss_and_grads(ours, ours.model, ours_inputs)
        assert abs(l_stock.item() - l_ours.item()) <= 1e-6, (loss_type, name, l_stock.item(), l_ours.item())
        assert l_stock.abs().item() > 1e-4 or name == "on-policy", name  # the comparison is not 0 == 0
        diff = max((a - b).abs().max().item() for a, b in zip(g_stock, g_ours))
        scale = max(a.abs().max().item() for a in g_stock)
        assert scale > 0 and diff <= 1e-6 * max(1.0, scale), (loss_type, name, diff)
        assert ours.last_loss_output is not None and ours.last_loss_output.active == ("pg",)


def test_channel_one_is_unchanged_when_channel_two_shares_the_forward():
    # With sdpo_weight > 0 the student forward goes through full logits instead of TRL's
    # fused head; the pg term must still equal stock GRPO's loss.
    stock, ours, tok = _build_pair("dapo", sdpo_weight=0.5)
    inputs = _inputs(len(tok), model=stock.model, stock=stock, old_noise=0.4, ref_noise=None)
    hinted = dict(inputs)
    hinted["teacher_prompt_ids"] = torch.cat([torch.full((8, 3), 5), inputs["prompt_ids"]], 1)
    hinted["teacher_prompt_mask"] = torch.cat([torch.ones(8, 3, dtype=torch.long), inputs["prompt_mask"]], 1)
    hinted["has_hint"] = torch.tensor([True, False] * 4)
    with torch.no_grad():
        want = stock.compute_loss(stock.model, inputs)
        out = ours.compute_three_channel_loss(ours.model, hinted)
    assert out.active == ("pg", "sdpo")
    assert abs(out.metrics["pg"].item() - want.item()) <= 1e-6
    assert out.metrics["sdpo"].item() > 0
    assert out.metrics["total"].item() == pytest.approx(out.metrics["pg"].item() + 0.5 * out.metrics["sdpo"].item(), rel=1e-6)


def test_channel_two_is_the_jsd_between_hinted_teacher_and_student_on_the_same_tokens():
    from composer_cloud.trainer.three_channel.loss import gjsd_loss

    _, ours, tok = _build_pair("dapo", sdpo_weight=1.0)
    model = ours.model
    g = torch.Generator().manual_seed(3)
    # two rows, unpadded, so the reference computation below needs no padding logic
    prompt = torch.randint(3, len(tok), (2, 5), generator=g)
    hint = torch.randint(3, len(tok), (2, 4), generator=g)
    completion = torch.randint(3, len(tok), (2, 6), generator=g)
    completion[:, -1] = tok.eos_token_id  # generations end with EOS
    ones = lambda t: torch.ones_like(t)  # noqa: E731
    teacher_prompt = torch.cat([hint, prompt], 1)
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": ones(prompt),
        "completion_ids": completion,
        "completion_mask": ones(completion),
        "advantages": torch.zeros(2),
        "num_items_in_batch": torch.tensor(12),
        "teacher_prompt_ids": teacher_prompt,
        "teacher_prompt_mask": ones(teacher_prompt),
        "has_hint": torch.tensor([True, True]),
    }
    with torch.no_grad():
        out = ours.compute_three_channel_loss(model, inputs)
        s_logits = model(input_ids=torch.cat([prompt, completion], 1)).logits[:, 4:-1]
        t_logits = model(input_ids=torch.cat([teacher_prompt, completion], 1)).logits[:, 8:-1]
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[:, -1] = False  # EOS positions are left out of channel 2 by default
    want = gjsd_loss(s_logits, t_logits, keep, beta=ours.settings.jsd_beta)
    assert out.metrics["sdpo"].item() == pytest.approx(want.item(), rel=1e-5)
    assert want.item() > 1e-4
    # with EOS included the value changes, and a row without a hint drops out
    ours.settings = dataclasses.replace(ours.settings, sdpo_exclude_eos=False)
    with torch.no_grad():
        out = ours.compute_three_channel_loss(model, dict(inputs, has_hint=torch.tensor([False, True])))
    want = gjsd_loss(s_logits[1:], t_logits[1:], torch.ones(1, 6), beta=ours.settings.jsd_beta)
    assert out.metrics["sdpo"].item() == pytest.approx(want.item(), rel=1e-5)


def test_unsupported_grpo_options_are_refused():
    from datasets import Dataset

    m, tok = _model()
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        ThreeChannelGRPOTrainer(
            model=m,
            reward_funcs=hash_reward,
            args=_grpo_args("dapo", top_entropy_quantile=0.5),
            train_dataset=Dataset.from_list([{"prompt": "x"}]),
            processing_class=tok,
        )


def test_settings_that_disagree_with_the_grpo_config_are_refused():
    # One settings object feeds the loss and the GRPOConfig; a config built apart from it must agree.
    from datasets import Dataset

    m, tok = _model()
    with pytest.raises(ValueError, match=r"GRPOConfig.loss_type = 'dapo', settings give 'grpo'.*settings.grpo_kwargs"):
        ThreeChannelGRPOTrainer(
            model=m,
            reward_funcs=hash_reward,
            args=_grpo_args("dapo"),
            train_dataset=Dataset.from_list([{"prompt": "x"}]),
            processing_class=tok,
            settings=_pair_settings("grpo"),
        )


def test_the_package_keeps_its_public_names():
    import composer_cloud.trainer.three_channel as tc
    from composer_cloud.trainer.three_channel.loss import ThreeChannelConfig

    assert set(tc.__all__) <= set(dir(tc))
    for name in tc.__all__:
        assert getattr(tc, name) is not None
    assert issubclass(ThreeChannelSettings, ThreeChannelConfig) and tc.ThreeChannelConfig is ThreeChannelConfig
    with pytest.raises(AttributeError):
        tc.ChannelArgs  # noqa: B018 - merged into ThreeChannelSettings


# --------------------------------------------------------------------------- the InnerTrainer
def _trainer(seed: int = 0, *, model=None, **overrides) -> ThreeChannelTrainer:
    if model is None:
        model, tok = _model()
    else:
        _, tok = _model()
    settings = ThreeChannelSettings(
        **{
            "batch_size": 8,
            "num_generations": 4,
            "max_completion_length": 8,
            "sdpo_weight": 0.5,
            "dpo_weight": 0.5,
            "replay_batch_size": 2,
            "eval_examples": 4,
            # a random model never emits EOS within 8 tokens: keep its completions in the loss
            "mask_truncated_completions": False,
            **overrides,
        }
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    task = HashTask()
    return ThreeChannelTrainer(
        model=model,
        tokenizer=tok,
        optimizer=optimizer,
        task=task,
        settings=settings,
        hint_source=task.default_hints(),
        pairs=shipped_pairs(),
        seed=seed,
        grad_clip=1.0,
    )


def test_tiny_cpu_run_all_three_channels_give_finite_nonzero_gradients():
    tr = _trainer()
    assert isinstance(tr, InnerTrainer)
    before = [p.detach().clone() for p in tr.model.parameters()]
    history = [tr.step() for _ in range(3)]
    for m in history:
        for key in ("loss", "pg", "sdpo", "dpo", "reward_mean", "grad_norm"):
            assert key in m and math.isfinite(m[key]), (key, m)
        assert m["sdpo"] > 0 and m["dpo"] > 0 and m["grad_norm"] > 0
        assert m["lr"] == 3e-3  # constant: no decay
        assert tr.grpo.last_loss_output.active == ("pg", "sdpo", "dpo")
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))

    # Gradient of each channel alone, on the batch of the last step.
    g = tr.grpo
    inputs = dict(g._buffered_inputs[0], replay=g.replay.sample(2))
    assert inputs["has_hint"].any() and not inputs["has_hint"].all()  # rows without a hint are masked out
    params = [p for p in tr.model.parameters()]
    norms = {}
    cfg = g.settings
    only = {
        "pg": dataclasses.replace(cfg, sdpo_weight=0.0, dpo_weight=0.0),
        "sdpo": dataclasses.replace(cfg, pg_weight=0.0, dpo_weight=0.0),
        "dpo": dataclasses.replace(cfg, pg_weight=0.0, sdpo_weight=0.0),
    }
    grads = {}
    for channel, c in only.items():
        out = g.compute_three_channel_loss(tr.model, inputs, config=c)
        assert out.active == (channel,)
        gs = torch.autograd.grad(out.total, params, allow_unused=True)
        flat = torch.cat([x.flatten() for x in gs if x is not None])
        assert torch.isfinite(flat).all(), channel
        norms[channel] = flat.norm().item()
        grads[channel] = flat
        assert norms[channel] > 1e-8, (channel, norms)
    # three different signals, not one gradient counted thrice
    assert not torch.allclose(grads["pg"], grads["sdpo"]) and not torch.allclose(grads["sdpo"], grads["dpo"])


def test_step_is_exactly_one_optimizer_step_and_leaves_global_rngs_alone():
    tr = _trainer(gradient_accumulation_steps=2)
    calls = []
    tr.optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(1))
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    tr.step()
    tr.step()
    assert len(calls) == 2
    assert torch.equal(states[0], torch.get_rng_state())
    assert states[1] == random.getstate()
    assert np.array_equal(states[2], np.random.get_state()[1])
    assert all(p.grad is None for p in tr.model.parameters())  # zero_grad at the end of the step


class EvenTask(HashTask):
    """Reward 1 for completions of even character length, else 0.25: some rows succeed."""

    name = "even-task"

    def reward(self, completions, rows):
        return [1.0 if len(c) % 2 == 0 else 0.25 for c in completions]


def test_successful_completions_are_left_out_of_channel_two():
    model, tok = _model()
    task = EvenTask()
    settings = ThreeChannelSettings(
        batch_size=8, num_generations=4, max_completion_length=8, sdpo_weight=0.5, dpo_weight=0.0, mask_truncated_completions=False
    )
    tr = ThreeChannelTrainer(
        model=model,
        tokenizer=tok,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        task=task,
        settings=settings,
        hint_source=task.default_hints(),
    )
    g = tr.grpo
    rows = [dict(r) for r in task.rows[:2] for _ in range(4)]  # k=0 has no hint, k=1 has one
    with tr.rng.scope():
        out = g._generate_and_score_completions(rows)
    rewards = g._local_rewards(len(rows))
    hinted = torch.tensor([r["hint"] is not None for r in rows])
    assert (rewards >= 1.0).any() and (rewards < 1.0).any()
    assert torch.equal(out["has_hint"], hinted & (rewards < 1.0))
    # and with the rule off, every hinted row takes part
    g.settings = dataclasses.replace(g.settings, sdpo_skip_successful=False)
    with tr.rng.scope():
        out = g._generate_and_score_completions(rows)
    assert torch.equal(out["has_hint"], hinted)


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_save_load_step_is_bitwise_identical_to_an_uninterrupted_run(num_iterations):
    k, n = 3, 3
    a = _trainer(num_iterations=num_iterations)
    for _ in range(k):
        a.step()
    params_at_k = {name: t.detach().clone() for name, t in a.model.state_dict().items()}
    tensors, meta = roundtrip(*a.state_dict())
    if num_iterations == 2:
        assert meta["grpo"]["buffer"] is not None  # the checkpoint lands mid-way through a reused generation
    metrics_a = [a.step() for _ in range(n)]

    # A new process: fresh model object with the checkpointed parameters, fresh trainer, load the state.
    model_b, _ = _model(seed=99)  # different init, overwritten below
    model_b.load_state_dict(params_at_k)
    b = _trainer(model=model_b, num_iterations=num_iterations)
    b.load_state_dict(tensors, meta)
    metrics_b = [b.step() for _ in range(n)]

    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    for ma, mb in zip(metrics_a, metrics_b):
        for key in ("loss", "pg", "sdpo", "dpo", "reward_mean", "grad_norm"):
            assert ma[key] == mb[key], key

    # Control: without the state the continuation differs (the test can fail).
    model_c, _ = _model(seed=99)
    model_c.load_state_dict(params_at_k)
    c = _trainer(model=model_c, num_iterations=num_iterations)
    for _ in range(n):
        c.step()
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.model.parameters(), c.model.parameters()))


def test_taid_schedule_is_restored_bitwise_after_a_resume():
    # The schedule's state is part of the trainer state the replica checkpoints.
    settings = dict(sdpo_variant="taid", taid_alpha=0.05, taid_beta=0.5, dpo_weight=0.0)
    a = _trainer(**settings)
    for _ in range(3):
        a.step()
    params = {name: t.detach().clone() for name, t in a.model.state_dict().items()}
    tensors, meta = roundtrip(*a.state_dict())
    assert meta["taid"]["step"] == 3 and meta["taid"]["t"] > 0.4  # the adaptive schedule moved t
    ts_a = [(a.step()["taid_t"], a.grpo.taid.t) for _ in range(3)]

    model_b, _ = _model(seed=99)
    model_b.load_state_dict(params)
    b = _trainer(model=model_b, **settings)
    b.load_state_dict(tensors, meta)
    ts_b = [(b.step()["taid_t"], b.grpo.taid.t) for _ in range(3)]
    assert ts_a == ts_b  # the t each step trained with, and the t after it: bit-for-bit
    assert all(x < y for (_, x), (_, y) in zip(ts_a, ts_a[1:]))
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    # Control: a restart without the schedule's state trains with a different t.
    model_c, _ = _model(seed=99)
    model_c.load_state_dict(params)
    del meta["taid"]
    c = _trainer(model=model_c, **settings)
    with pytest.raises(ValueError, match="no TAID schedule"):
        c.load_state_dict(tensors, meta)
    assert c.step()["taid_t"] != ts_a[0][0]


def test_kl_reference_is_the_starting_model_and_survives_a_restart():
    a = _trainer(kl_coef=0.04)
    start = {k: v.clone() for k, v in a.model.state_dict().items()}
    m = a.step()
    assert m["kl"] >= 0.0 and a.grpo.settings.kl_coef == 0.04
    for k, v in a.grpo.ref_model.state_dict().items():
        assert torch.equal(v, start[k]), k  # frozen copy of the model as the run started
    tensors, meta = roundtrip(*a.state_dict())
    # a restart builds the trainer on the checkpointed (trained) parameters...
    model_b, _ = _model()
    model_b.load_state_dict(a.model.state_dict())
    b = _trainer(model=model_b, kl_coef=0.04)
    assert any(not torch.equal(v, start[k]) for k, v in b.grpo.ref_model.state_dict().items())
    # ...and the checkpoint puts the original reference back
    b.load_state_dict(tensors, meta)
    for k, v in b.grpo.ref_model.state_dict().items():
        assert torch.equal(v, start[k]), k


def test_evaluate_changes_nothing():
    tr = _trainer()
    tr.step()
    params = [p.detach().clone() for p in tr.model.parameters()]
    tensors, meta = tr.state_dict()
    m1, m2 = tr.evaluate(), tr.evaluate()
    assert m1 == m2 and 0.0 <= m1["eval_reward_mean"] <= 1.0 and m1["eval_examples"] == 4
    assert all(torch.equal(a, b) for a, b in zip(params, tr.model.parameters()))
    t2, meta2 = tr.state_dict()
    assert meta2 == meta and all(torch.equal(tensors[k], t2[k]) for k in tensors)


def test_default_trainer_on_the_demo_task_through_the_registry():
    model, tok = _model()
    ctx = TrainerContext(
        model=model,
        tokenizer=tok,
        rank=1,
        world_size=2,
        seed=0,
        device=torch.device("cpu"),
        settings={"batch_size": 8, "seq_len": 64, "num_generations": 4, "max_completion_length": 8, "eval_examples": 4},
        inner_optimizer={"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "grad_clip": 1.0},
    )
    tr = build_trainer("three-channel", ctx)
    assert tr.grpo.settings.sdpo_active and tr.grpo.settings.dpo_active
    assert len(tr.grpo.replay) == len(load_pairs(default_pairs_uri()))
    assert tr.grpo.replay.has_reference  # computed at build with the initial model
    m = tr.step()
    assert {"loss", "pg", "sdpo", "dpo", "reward_mean"} <= set(m)
    assert 0.0 <= m["reward_mean"] <= 1.0
    assert m["dpo"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at the first step
    params = [p.detach().clone() for p in tr.model.parameters()]
    ev = tr.evaluate()
    assert 0.0 <= ev["eval_reward_mean"] <= 1.0
    # held-out NLL of the reference solutions (nats/token): a random 1k-token model is near log(1024) = 6.9
    assert 3.0 < ev["eval_loss"] < 10.0 and tr.evaluate() == ev
    assert all(torch.equal(a, b) for a, b in zip(params, tr.model.parameters()))
    # the two ranks see disjoint prompt shards
    ctx0 = dataclasses.replace(ctx, rank=0, model=_model()[0])
    tr0 = build_trainer("three-channel", ctx0)
    assert not {r["prompt"] for r in tr0.stream.rows} & {r["prompt"] for r in tr.stream.rows}
    with pytest.raises(ValueError, match="trainer.batch_sise is not a three-channel setting; did you mean trainer.batch_size"):
        build_trainer("three-channel", dataclasses.replace(ctx, settings={"batch_sise": 8}))


# --------------------------------------------------------------------------- trace replay
def test_shipped_pairs_file_is_valid_and_reproducible():
    shipped = load_pairs(default_pairs_uri())
    assert len(shipped) >= 32
    assert shipped == build_demo_pairs()
    for p in shipped:
        assert p.meta["agreement"] >= 2 / 3 and p.chosen.strip() != p.rejected.strip()


def test_pairs_load_from_any_fsspec_uri(tmp_path):
    pairs = [Pair("p1", " a", " b", -1.5, -2.0, {"k": 1}), Pair("p2", " c", " d")]
    for uri in (f"file://{tmp_path}/pairs.jsonl", "memory://composer-cloud-test/pairs.jsonl"):
        assert write_pairs(uri, pairs) == 2
        assert load_pairs(uri) == pairs


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "p", "chosen": "a"}', "'rejected' must be a string"),
        ('{"prompt": "p", "chosen": "a", "rejected": "a"}', "identical"),
        ('{"prompt": "p", "chosen": "a", "rejected": "b", "ref_chosen_logp": -1}', "both"),
        ('{"prompt": "p", "chosen": "a", "rejected": "b", "score": 3}', "unknown keys"),
        ('{"prompt": "p", "chosen": "a", "rejected": "b", "ref_chosen_logp": 1, "ref_rejected_logp": -1}', "<= 0"),
        ("not json", "invalid JSON"),
    ],
)
def test_pairs_validation_names_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        load_pairs(str(path))
    assert ":3:" in str(e.value)


def test_make_pairs_agreement_threshold():
    steps = [
        TraceStep("q1", "wrong"),  # 3/3 agree on "right"
        TraceStep("q2", "wrong"),  # 2/3 agree
        TraceStep("q3", "right"),  # teachers agree with the student: no pair
        TraceStep("q4", "wrong"),  # three different answers: no consensus
        TraceStep("q5", "wrong"),  # one teacher fails, 2/3 still agree
    ]
    answers = {
        "a": {"q1": "right", "q2": "right", "q3": "right", "q4": "x", "q5": "right "},
        "b": {"q1": "right", "q2": "right", "q3": "right", "q4": "y", "q5": "right"},
        "c": {"q1": "right", "q2": "other", "q3": "right", "q4": "z", "q5": None},
    }
    calls = []

    def teacher(name):
        def call(prompt: str) -> str:
            calls.append((name, prompt))
            out = answers[name][prompt]
            if out is None:
                raise RuntimeError("API timeout")
            return out

        return call

    teachers = {n: teacher(n) for n in answers}
    pairs = make_pairs(steps, teachers, threshold=2 / 3)
    assert [p.prompt for p in pairs] == ["q1", "q2", "q5"]
    assert all(p.rejected == "wrong" for p in pairs)
    assert pairs[0].meta["agreement"] == 1.0 and pairs[1].meta["agreement"] == pytest.approx(2 / 3)
    assert pairs[2].chosen == "right " and pairs[2].meta["teachers"] == ["a", "b"]
    assert len(calls) == 15  # every teacher asked once per step
    assert [p.prompt for p in make_pairs(steps, teachers, threshold=1.0)] == ["q1"]
    assert make_pairs(steps, teachers, threshold=2 / 3, max_workers=4) == pairs  # concurrency changes nothing


def test_replay_buffer_layout_sampling_and_state():
    _, tok = _model()
    pairs = shipped_pairs(5)
    buf = ReplayBuffer(pairs, tok, seed=3)
    b = buf.batch([0, 2])
    assert b.input_ids.shape[0] == 4 and b.response_mask.shape[0] == 4
    # chosen rows then rejected rows; responses end with EOS, prompts are left-padded
    for row, text in [(0, pairs[0].chosen), (1, pairs[2].chosen), (2, pairs[0].rejected), (3, pairs[2].rejected)]:
        resp = b.input_ids[row, -b.logits_to_keep :][b.response_mask[row].bool()].tolist()
        assert resp == tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert (b.attention_mask[:, 0] == 0).any() or len({len(tok(p.prompt)["input_ids"]) for p in pairs}) == 1
    # one epoch visits every pair once; state round-trips
    seen = [i for _ in range(5) for i in buf.sample(1).indices]
    assert sorted(seen) == list(range(5))
    buf.sample(2)
    t, m = buf.state_dict()
    nxt = buf.sample(3).indices
    buf2 = ReplayBuffer(pairs, tok, seed=3)
    buf2.load_state_dict(t, m)
    assert buf2.sample(3).indices == nxt
    with pytest.raises(ValueError, match="pairs file changed"):
        ReplayBuffer(pairs[:4], tok, seed=3).load_state_dict(t, m)
