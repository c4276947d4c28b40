"""``[trainer] rollout = "vllm"`` through its seam: TRL's ``VLLMGeneration`` over a recording engine (tests/vllm_engine.py).

What is real here: TRL's GRPOTrainer with ``use_vllm=True, vllm_mode="colocate"`` (its weight pushes, its
importance-sampling ratio), our loss and trainer. What is not: vLLM's kernels (the engine samples with a
transformers model loaded from ``model.name_or_path``, as vLLM would load it). The real path runs on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import vllm_engine
from composer_cloud.model import TinyModelConfig, load_model
from composer_cloud.spec import SpecError, spec_from_dict
from composer_cloud.trainer.three_channel import ThreeChannelGRPOTrainer, ThreeChannelSettings, ThreeChannelTrainer
from composer_cloud.trainer.three_channel import rollout
from support.trainer import HashTask, hash_reward

torch.set_num_threads(2)
SMALL = TinyModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64)
MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def _settings(**kw) -> ThreeChannelSettings:
    base = dict(batch_size=8, num_generations=4, max_completion_length=7, mask_truncated_completions=False,
                sdpo_weight=0.0, dpo_weight=0.0, rollout="vllm")
    return ThreeChannelSettings(**(base | kw))


# --------------------------------------------------------------------------- importance sampling
@pytest.mark.parametrize("mode", MODES)
def test_importance_sampling_correction_equals_stock_grpo(monkeypatch, tmp_path, mode):
    """Same generation batch (vLLM log-probs off by noise), same tensors: our loss and gradients are TRL's."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    vllm_engine.install(monkeypatch, logprob_noise=0.3)
    # Tight bounds so that truncation / masking is active in every mode.
    settings = _settings(loss_type="dapo", vllm_importance_sampling_mode=mode,
                         vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.25)
    ds = Dataset.from_list([{"prompt": "def f(x):"}])
    trainers = []
    for _ in range(2):
        model, tok = load_model("tiny", seed=0, tiny=SMALL)
        rollout.ensure_engine_model_dir(model, tok, directory=str(tmp_path / f"engine{len(trainers)}"))
        args = GRPOConfig(output_dir=str(tmp_path), **settings.grpo_kwargs(), use_cpu=True, report_to="none", seed=0)
        cls, extra = (GRPOTrainer, {}) if not trainers else (ThreeChannelGRPOTrainer, {"settings": settings})
        trainers.append(cls(model=model, reward_funcs=hash_reward, args=args, train_dataset=ds, processing_class=tok,
                            **extra))
    stock, ours = trainers
    stock.current_gradient_accumulation_steps = 1
    rows = [{"prompt": f"def g{i}(x):\n    return"} for i in range(2) for _ in range(4)]
    torch.manual_seed(0)
    stock.model.train(), ours.model.train()
    inputs = stock._generate_and_score_completions(rows)
    ratio = inputs["importance_sampling_ratio"]
    assert ratio.shape == ((8, 1) if mode.startswith("sequence") else inputs["completion_ids"].shape)
    masked = inputs["completion_mask"].bool() if ratio.shape[1] > 1 else torch.ones(8, 1, dtype=torch.bool)
    if mode.endswith("_mask"):
        assert (ratio[masked] == 0).any() and (ratio[masked] > 0).any()  # some tokens/sequences masked out
    else:
        assert ((ratio[masked] - 1.25).abs() < 1e-6).any() or ((ratio[masked] - 0.8).abs() < 1e-6).any()

    def loss_and_grads(trainer, batch):
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        grads = [p.grad.detach().clone() for p in trainer.model.parameters()]
        return loss.detach(), grads

    l_stock, g_stock = loss_and_grads(stock, inputs)
    l_ours, g_ours = loss_and_grads(ours, dict(inputs))
    assert abs(l_stock.item() - l_ours.item()) <= 1e-6 and l_stock.abs().item() > 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(g_stock, g_ours)) <= 1e-6
    # The ratio is used: without it our loss differs.
    l_plain, _ = loss_and_grads(ours, {k: v for k, v in inputs.items() if k != "importance_sampling_ratio"})
    assert abs(l_plain.item() - l_ours.item()) > 1e-6


# --------------------------------------------------------------------------- weight refresh
def _trainer(monkeypatch, tmp_path, *, lora: bool = False, **kw) -> tuple[ThreeChannelTrainer, object]:
    cls = vllm_engine.install(monkeypatch)
    model, tok = load_model("tiny", seed=0, tiny=SMALL)
    if lora:
        from composer_cloud.lora import apply_lora

        model = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear", seed=0)
    task = HashTask()
    tr = ThreeChannelTrainer(
        model=model, tokenizer=tok, task=task, settings=_settings(max_completion_length=6, **kw), seed=0,
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2),
    )
    (engine,) = cls.instances
    return tr, engine


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_engine_holds_the_policy_after_inner_steps_and_outer_steps(monkeypatch, tmp_path, lora):
    tr, engine = _trainer(monkeypatch, tmp_path, lora=lora)
    assert engine.engine_matches_policy()  # built from the directory the trainer wrote (LoRA: B = 0 adds nothing)
    for _ in range(3):
        tr.step()
    assert engine.log.generations == [True, True, True]  # TRL pushed before each step's generation
    assert engine.log.loads == 3
    assert not engine.engine_matches_policy()  # the last step moved the policy: the check can fail

    # An outer step: DiLoCo writes new parameters between two inner steps.
    trainable = [p for p in tr.model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in trainable:
            p.add_(0.05 * torch.randn_like(p))
    tr.on_params_replaced()
    assert engine.engine_matches_policy() and tr.engine_refreshes == 1
    tr.step()
    assert engine.log.generations[-1]


def test_heal_to_the_same_step_reaches_the_engine(monkeypatch, tmp_path):
    """A heal restores another replica's parameters at the step count this one already pushed at.

    TRL pushes only when ``global_step`` changed, which it did not: without our refresh the engine would keep
    sampling from the parameters the heal replaced.
    """
    tr, engine = _trainer(monkeypatch, tmp_path)
    tr.step()
    tensors, meta = tr.state_dict()  # steps = 1
    tr.step()  # pushed at global_step 1
    healed = {k: v + 0.05 * torch.randn_like(v) for k, v in tr.model.state_dict().items()}

    tr.model.load_state_dict(healed)
    tr.load_state_dict(tensors, meta)  # steps = 1 again
    tr.step()
    assert engine.log.generations[-1]  # pushed again before generating

    # Control: TRL's own bookkeeping alone would have skipped the push.
    tr.model.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in healed.items()})
    tr.load_state_dict(tensors, meta)
    tr.grpo._last_loaded_step = 1
    tr.step()
    assert engine.log.generations[-1] is False


def test_hf_rollout_has_no_engine_and_imports_nothing_of_vllm():
    code = (
        "import sys, torch\n"
        "from composer_cloud.model import TinyModelConfig, load_model\n"
        "from composer_cloud.trainer.three_channel import ThreeChannelSettings, ThreeChannelTrainer\n"
        "from support.trainer import HashTask\n"
        "m, tok = load_model('tiny', seed=0, tiny=TinyModelConfig(hidden_size=32, num_hidden_layers=1, "
        "num_attention_heads=2, num_key_value_heads=1, intermediate_size=64))\n"
        "s = ThreeChannelSettings(batch_size=4, num_generations=2, max_completion_length=4, sdpo_weight=0.0, "
        "dpo_weight=0.0)\n"
        "tr = ThreeChannelTrainer(model=m, tokenizer=tok, optimizer=torch.optim.AdamW(m.parameters()), "
        "task=HashTask(), settings=s)\n"
        "tr.step(); tr.on_params_replaced()\n"
        "assert not tr.grpo.use_vllm and tr.engine_refreshes == 0\n"
        "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.') or m.endswith('three_channel.rollout')]\n"
        "assert not bad, bad\n"
    )
    import os
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# --------------------------------------------------------------------------- refusals
def test_vllm_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match=r"trainer.rollout.*CUDA GPU"):
        rollout.check_vllm_rollout("cpu")
    monkeypatch.setattr(rollout, "vllm_installed", lambda: False)
    with pytest.raises(ValueError, match=r"trainer.rollout.*pip install 'composer-cloud\[vllm\]'"):
        rollout.check_vllm_rollout("cuda")
    monkeypatch.setattr(rollout, "vllm_installed", lambda: True)
    rollout.check_vllm_rollout("cuda")  # a GPU with vLLM installed: fine

    # At launch: the spec refuses device = "cpu" by itself; a local replica on a machine without CUDA too.
    with pytest.raises(SpecError) as err:
        spec_from_dict({"device": "cpu", "trainer": {"rollout": "vllm"}})
    assert err.value.field == "trainer.rollout"
    spec = spec_from_dict({"executor": "local", "trainer": {"rollout": "vllm"}})
    with pytest.raises(ValueError, match="trainer.rollout.*CUDA"):
        rollout.check_rollout_before_launch(spec, cuda_available=False)
    rollout.check_rollout_before_launch(spec, cuda_available=True)
    rollout.check_rollout_before_launch(spec_from_dict({"executor": "modal", "trainer": {"rollout": "vllm"}}),
                                        cuda_available=False)  # checked where modal's replicas run
    mixed = spec_from_dict({"replicas": 2, "executor": "local:1,modal:1", "trainer": {"rollout": "vllm"}})
    with pytest.raises(ValueError, match="trainer.rollout.*CUDA"):
        rollout.check_rollout_before_launch(mixed, cuda_available=False)  # rank 0 runs here


@pytest.mark.skipif(rollout.vllm_installed(), reason="vLLM is installed here: nothing to refuse for lack of it")
def test_launch_refuses_vllm_without_the_extra_with_the_install_command(tmp_path):
    """``composer-cloud launch`` runs the check with its others: nothing is written, exit code 2."""
    from support.cli import cli

    (tmp_path / "spec.toml").write_text('[trainer]\nrollout = "vllm"\n')
    res = cli("launch", "--config", "spec.toml", "--store", f"file://{tmp_path}/store", "--run-id", "v",
              cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "trainer.rollout" in res.stderr and "pip install 'composer-cloud[vllm]'" in res.stderr, res.stderr
    assert not (tmp_path / "store" / "v").exists()


def test_factory_refuses_vllm_without_a_gpu():
    from composer_cloud.trainer import TrainerContext, build_trainer

    model, tok = load_model("tiny", seed=0, tiny=SMALL)
    ctx = TrainerContext(model=model, tokenizer=tok, rank=0, world_size=1, seed=0, device=torch.device("cpu"),
                         settings={"rollout": "vllm", "batch_size": 4, "num_generations": 2})
    with pytest.raises(ValueError, match="trainer.rollout"):
        build_trainer("three-channel", ctx)


def test_engine_model_dir_is_written_for_a_model_without_one(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer_cloud.lora import apply_lora

    model, tok = load_model("tiny", seed=0, tiny=SMALL)
    model = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear", seed=0)
    where = rollout.ensure_engine_model_dir(model, tok, directory=str(tmp_path / "engine"))
    assert model.name_or_path == where
    loaded = AutoModelForCausalLM.from_pretrained(where)  # plain names: no LoRA keys, no base_layer
    assert AutoTokenizer.from_pretrained(where).eos_token == tok.eos_token
    probe = torch.arange(3, 11)[None]
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=probe).logits, model(input_ids=probe).logits, atol=1e-5)
    assert rollout.ensure_engine_model_dir(model, tok) == where  # already has one: unchanged
    assert rollout.ensure_engine_model_dir(type("M", (), {"name_or_path": "Qwen/Qwen2.5-0.5B"})(), tok) == \
        "Qwen/Qwen2.5-0.5B"  # a hub id: vLLM downloads it itself


def test_a_temporary_engine_model_dir_goes_with_its_model(tmp_path, monkeypatch):
    """Every replica start of a config-built model writes its weights: the temporary copy must not outlive it."""
    import gc

    monkeypatch.setattr(rollout.tempfile, "tempdir", str(tmp_path))
    model, tok = load_model("tiny", seed=0, tiny=SMALL)
    where = rollout.ensure_engine_model_dir(model, tok)
    assert os.path.dirname(where) == str(tmp_path) and os.path.isfile(os.path.join(where, "config.json"))
    kept = rollout.ensure_engine_model_dir(*load_model("tiny", seed=0, tiny=SMALL), directory=str(tmp_path / "mine"))
    del model
    gc.collect()
    assert not os.path.exists(where)
    assert os.path.isfile(os.path.join(kept, "config.json"))  # a directory the caller named is the caller's
