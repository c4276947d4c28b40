"""``[trainer] rollout = "hf-fast"``: the bf16 inference copy, its refresh points, and the loss it feeds.

What is real here: the three-channel trainer over TRL's GRPOTrainer, the copy and its static-cache sampler
(eager on CPU: transformers compiles the decode step on CUDA only), TRL's importance-sampling correction.
The speed is the GPU's to show (benchmarks/rollout_speed.py).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from composer_cloud.model import TinyModelConfig, load_model
from composer_cloud.trainer.three_channel import ThreeChannelSettings, ThreeChannelTrainer
from composer_cloud.trainer.three_channel.fast_rollout import InferenceCopy, cache_length
from composer_cloud.trainer.three_channel.settings import resolve_rollout
from support.trainer import HashTask

torch.set_num_threads(2)
SMALL = TinyModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64)


def _settings(**kw) -> ThreeChannelSettings:
    base = dict(batch_size=8, num_generations=4, max_completion_length=6, mask_truncated_completions=False,
                sdpo_weight=0.0, dpo_weight=0.0, rollout="hf-fast")
    return ThreeChannelSettings(**(base | kw))


def _trainer(*, lora: bool = False, **kw) -> ThreeChannelTrainer:
    model, tok = load_model("tiny", seed=0, tiny=SMALL)
    if lora:
        from composer_cloud.lora import apply_lora

        model = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear", seed=0)
    return ThreeChannelTrainer(
        model=model, tokenizer=tok, task=HashTask(), settings=_settings(**kw), seed=0,
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2))


# --------------------------------------------------------------------------- the default
def test_auto_is_hf_on_cpu_and_hf_fast_on_cuda():
    assert ThreeChannelSettings().rollout == "auto"
    assert resolve_rollout("auto", "cpu") == "hf" and resolve_rollout("auto", "cuda") == "hf-fast"
    assert [resolve_rollout(m, "cpu") for m in ("hf", "hf-fast", "vllm")] == ["hf", "hf-fast", "vllm"]
    with pytest.raises(ValueError, match="trainer.rollout"):
        ThreeChannelSettings.from_settings({"rollout": "fast"})
    # A CPU run samples with the trainer's own model, as before the fast mode existed.
    tr = _trainer(rollout="auto")
    assert tr.grpo.rollout == "hf" and tr.grpo.fast_sampler is None


# --------------------------------------------------------------------------- (a) same batch, same loss
def _fixed_completions(tok, n: int, width: int) -> list[list[int]]:
    """Random completions, some ended by EOS before ``width`` (what a sampler could have returned)."""
    gen = torch.Generator().manual_seed(7)
    rows = []
    for i in range(n):
        ids = torch.randint(10, tok.vocab_size - 10, (width,), generator=gen).tolist()
        if i % 3 == 0:
            ids = ids[: 2 + i % 4] + [tok.eos_token_id]
        rows.append(ids)
    return rows


def _loss_and_grads(trainer: ThreeChannelTrainer, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer.grpo.compute_loss(model, dict(inputs))
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("correction", [False, True], ids=["no-is-correction", "is-correction"])
def test_a_fixed_generation_batch_gives_hf_loss_and_gradients(monkeypatch, correction):
    """Given the same completions, "hf-fast" trains on the same tokens and old log-probs as "hf"."""
    settings = dict(loss_type="dapo", vllm_importance_sampling_correction=correction,
                    vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=1.02)
    hf, fast = _trainer(rollout="hf", **settings), _trainer(**settings)
    assert fast.grpo.rollout == "hf-fast" and hf.grpo.fast_sampler is None
    rows = [{"prompt": f"def g{i}(x):\n    return", "k": i} for i in range(2) for _ in range(4)]
    fixed = _fixed_completions(hf.tokenizer, len(rows), 6)
    sampling: list[list[float]] = [[-1.0] * len(c) for c in fixed]
    monkeypatch.setattr(hf.grpo, "_generate_single_turn", lambda prompt_ids, *a, **k: ([*map(list, fixed)], None))
    monkeypatch.setattr(fast.grpo.fast_sampler, "generate", lambda prompt_ids, **k: ([*map(list, fixed)], sampling))
    for tr in (hf, fast):
        tr.model.train()
    want = hf.grpo._generate_and_score_completions(rows)
    got = fast.grpo._generate_and_score_completions(rows)
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"):
        assert torch.equal(want[key], got[key]), key
    assert "old_per_token_logps" not in want  # hf: the loss's own log-probs, detached, are the old ones
    l_hf, g_hf = _loss_and_grads(hf, want)
    assert l_hf.abs().item() > 1e-6

    if not correction:  # nothing of the sampler reaches the loss: bitwise the same step
        assert "old_per_token_logps" not in got and "importance_sampling_ratio" not in got
        l_fast, g_fast = _loss_and_grads(fast, got)
        assert torch.equal(l_hf, l_fast) and all(torch.equal(a, b) for a, b in zip(g_hf, g_fast))
        return

    # The old log-probs are the trainer's model's (what "hf" uses), not the sampler's.
    mask = got["completion_mask"].float()
    ids = torch.cat([got["prompt_ids"], got["completion_ids"]], 1)
    attn = torch.cat([got["prompt_mask"], got["completion_mask"]], 1)
    with torch.no_grad():
        own, _, _ = hf.grpo._get_per_token_logps_and_entropies(hf.model, ids, attn, got["completion_ids"].size(1))
    old = got["old_per_token_logps"]
    assert torch.allclose(old * mask, own * mask, atol=1e-6, rtol=0)
    # TRL's sequence_mask correction of the sampler's log-probs: exp(sum of differences), 0 beyond the cap.
    # A sampler that is off by -0.05 per token on even rows (masked out), +0.001 on odd rows (kept).
    sampling[:] = [[v + (-0.05 if i % 2 == 0 else 0.001) for v in old[i, : len(c)].tolist()]
                   for i, c in enumerate(fixed)]
    off = fast.grpo._generate_and_score_completions(rows)
    assert torch.equal(off["old_per_token_logps"], old)
    s = torch.tensor([row + [0.0] * (mask.size(1) - len(row)) for row in sampling])
    ratio = torch.exp(((old - s) * mask).sum(-1, keepdim=True))
    expected = ratio.masked_fill(ratio > 1.02, 0.0)
    assert torch.allclose(off["importance_sampling_ratio"], expected, rtol=1e-5)
    assert (expected[0::2] == 0).all() and (expected[1::2] > 0.9).all()
    # An exact sampler (its log-probs are the trainer's): ratio 1, the loss and gradients of "hf".
    sampling[:] = [old[i, : len(c)].tolist() for i, c in enumerate(fixed)]
    exact = fast.grpo._generate_and_score_completions(rows)
    assert torch.allclose(exact["importance_sampling_ratio"], torch.ones(len(rows), 1), atol=1e-6)
    l_fast, g_fast = _loss_and_grads(fast, exact)
    assert torch.allclose(l_hf, l_fast, atol=1e-6, rtol=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(g_hf, g_fast)) <= 1e-6
    # ... and the sampler's log-probs do reach the loss: the masked rows' share is gone.
    l_masked, _ = _loss_and_grads(fast, off)
    assert abs(l_masked.item() - l_hf.item()) > 1e-6


# --------------------------------------------------------------------------- (c), (d) refresh, master weights
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_copy_is_the_policy_in_bf16_at_every_generation_and_after_replacement(monkeypatch, lora):
    tr = _trainer(lora=lora)
    g = tr.grpo
    copy = g.fast_sampler.copy
    assert {p.dtype for p in copy.model.parameters()} == {torch.bfloat16}
    if lora:  # the merged weights: plain linears, no adapter modules
        assert not any("lora_" in n for n, _ in copy.model.named_parameters())
    master = {n: (p.dtype, p.data_ptr()) for n, p in tr.model.named_parameters() if p.requires_grad}
    assert {d for d, _ in master.values()} == {torch.float32}

    checks: list[bool] = []
    generate = g.fast_sampler.generate

    def checked(*a, **k):
        checks.append(copy.matches_policy())
        return generate(*a, **k)

    monkeypatch.setattr(g.fast_sampler, "generate", checked)
    for _ in range(3):
        tr.step()
    assert checks == [True, True, True]  # refreshed after every optimizer step, before sampling
    assert not copy.matches_policy()  # the last step moved the policy: the check can fail
    # (d) generation never cast or moved the master weights.
    assert {n: (p.dtype, p.data_ptr()) for n, p in tr.model.named_parameters() if p.requires_grad} == master

    # Parameters replaced outside the optimizer (outer step, heal, adopt): pushed at once.
    tr.on_params_replaced()
    assert copy.matches_policy() and tr.engine_refreshes == 1
    tensors, meta = tr.state_dict()
    with torch.no_grad():
        for p in (p for p in tr.model.parameters() if p.requires_grad):
            p.add_(0.05 * torch.randn_like(p))
    assert not copy.matches_policy()
    tr.on_params_replaced()
    assert copy.matches_policy() and tr.engine_refreshes == 2

    # A restored checkpoint: the next generation refreshes first, even at the global_step the copy was
    # last refreshed at (the checkpoint was taken after 3 steps; the copy was refreshed at step 3's start).
    tr.step()
    assert checks[-1] is True and g._copy_step == g.state.global_step == 3
    with torch.no_grad():
        for p in (p for p in tr.model.parameters() if p.requires_grad):
            p.add_(0.05 * torch.randn_like(p))
    tr.load_state_dict(tensors, meta)
    tr.step()
    assert g.state.global_step == 3 and checks == [True] * 5


def test_without_the_refresh_the_check_fails(monkeypatch):
    """Control for the test above: a copy that is never refreshed is caught at the second generation."""
    tr = _trainer()
    copy = tr.grpo.fast_sampler.copy
    monkeypatch.setattr(InferenceCopy, "refresh", lambda self: None)
    checks: list[bool] = []
    generate = tr.grpo.fast_sampler.generate
    monkeypatch.setattr(tr.grpo.fast_sampler, "generate", lambda *a, **k: (checks.append(copy.matches_policy()),
                                                                            generate(*a, **k))[1])
    tr.step(), tr.step()
    assert checks == [True, False]


@pytest.mark.parametrize(("lora", "hook"), [(False, True), (True, True), (False, False)],
                         ids=["full", "lora", "control-without-the-hook"])
def test_every_lockstep_sync_reaches_the_copy(monkeypatch, tmp_path, lora, hook):
    """The real boundaries and inner loop (tests/test_engine_refresh.py's, for the vLLM engine): right after
    every lock-step sync, before the next inner step, the copy is the policy in bf16. Control: with the
    boundary's ``params_replaced`` a no-op the copy lags every sync."""
    from composer_cloud.hooks import NO_HOOKS
    from composer_cloud.model import compute_precision, load_spec_model
    from composer_cloud.replica import runtime
    from composer_cloud.replica.boundary import ReplicaContext
    from composer_cloud.replica.lockstep import LockstepBoundary
    from composer_cloud.replica.telemetry import Telemetry
    from composer_cloud.spec import spec_from_dict
    from composer_cloud.storage.run import Run
    from composer_cloud.storage.store import Store

    if not hook:
        from composer_cloud.replica import lockstep

        monkeypatch.setattr(lockstep, "params_replaced", lambda trainer: None)
    uri = f"file://{tmp_path}/store/run"
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=64)
    spec = spec_from_dict({
        "replicas": 1, "min_replicas": 1, "rounds": 2, "inner_steps": 2,
        "sync": {"mode": "lockstep", "quorum_timeout_s": 5, "round_timeout_s": 30},
        "model": shape | ({"lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}} if lora else {})})
    model, tok = load_spec_model(spec.model, seed=spec.seed)
    trainer = ThreeChannelTrainer(
        model=model, tokenizer=tok, task=HashTask(), seed=spec.seed, precision=compute_precision(model),
        settings=_settings(batch_size=4, num_generations=2, max_completion_length=4),
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2))
    store = Store(uri)
    ctx = ReplicaContext(run=Run(uri=uri, store=store, spec=spec), rank=0, model=model, trainer=trainer,
                         device=torch.device("cpu"), hooks=NO_HOOKS,
                         telemetry=Telemetry(store, 0, rounds=2, inner_steps=2, progress_every_s=60))
    copy = trainer.grpo.fast_sampler.copy
    boundary = LockstepBoundary(ctx)
    checks: list[bool] = []
    after_step = boundary.after_step

    def checked(segment):
        row = after_step(segment)
        if row is not None:
            checks.append(copy.matches_policy())
        return row

    boundary.after_step = checked
    boundary.start()
    runtime._inner_loop(ctx, boundary)
    boundary.finish(0)
    assert checks == ([True, True] if hook else [False, False])
    assert trainer.engine_refreshes == (2 if hook else 0)


# --------------------------------------------------------------------------- the sampler
def test_sampler_log_probs_are_the_copys_and_completions_stop_at_eos():
    tr = _trainer(temperature=0.7, max_completion_length=8)
    g = tr.grpo
    sampler = g.fast_sampler
    prompts = [list(tr.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in ("def f(x):", "x = 1 +")]
    torch.manual_seed(0)
    completions, logprobs = sampler.generate(prompts, pad_token_id=tr.tokenizer.pad_token_id,
                                             eos_token_ids=g.eos_token_ids)
    assert [len(c) for c in completions] == [len(lp) for lp in logprobs]
    for c in completions:
        assert len(c) == 8 or c[-1] in g.eos_token_ids
        assert not any(t in g.eos_token_ids for t in c[:-1])
    # Each log-prob is the copy's log_softmax(logits / T) at the sampled token (one forward, bf16 numerics).
    model = sampler.copy.model
    for p, c, lp in zip(prompts, completions, logprobs):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float() / 0.7
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lp), want, atol=0.05), (lp, want)
    # One static cache, reset between generations (CUDA graphs keep its addresses): the same draws give the
    # same completions as the first call, which had a fresh cache.
    torch.manual_seed(0)
    again = sampler.generate(prompts, pad_token_id=tr.tokenizer.pad_token_id, eos_token_ids=g.eos_token_ids)
    assert again == (completions, logprobs) and sampler.cache_allocations == 1
    assert cache_length(5, 8) == 256 and cache_length(250, 8) == 512
    assert cache_length(250, 8, limit=300) == 300 and cache_length(400, 8, limit=300) == 408


# --------------------------------------------------------------------------- the benchmark's CPU rehearsal
def test_rollout_speed_benchmark_writes_its_json(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "rollout_speed.py"
    spec = importlib.util.spec_from_file_location("rollout_speed", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "speed.json"
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--completions", "4", "--tokens", "8",
                       "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["rollout"]: r for r in report["rows"]}
    assert set(rows) == {"hf", "hf-fast"}
    for r in rows.values():
        assert r["tokens"] == 4 * 8 and r["tokens_per_s"] > 0 and math.isfinite(r["seconds"])
    assert report["speedup"] == pytest.approx(rows["hf-fast"]["tokens_per_s"] / rows["hf"]["tokens_per_s"])


# --------------------------------------------------------------------------- (b) kill -9 and resume
def _fast_rollout_spec() -> str:
    from support.specs import CAUSAL_LM, SMALL_RUN_TOML

    head = ("replicas = 2\nmin_replicas = 2\nrounds = 3\ninner_steps = 2\nkeep_checkpoints = 10\n"
            "[sync]\nquorum_timeout_s = 60\nround_timeout_s = 120\n")
    body = SMALL_RUN_TOML.replace(CAUSAL_LM, (
        'name = "three-channel"\ndataset = "qa.jsonl"\nreward = "exact_match"\nnum_generations = 2\n'
        'max_completion_length = 4\neval_examples = 2\nmask_truncated_completions = false\nrollout = "hf-fast"'))
    return head + body + '[trainer.columns]\nprompt = "question"\nanswer = "solution"\n'


@pytest.mark.slow
def test_a_hf_fast_run_resumes_bitwise_after_kill(tmp_path):
    """Sampling from the copy is part of the replayed state: a run killed mid-round 2 and resumed ends on the
    uninterrupted run's weights (channel 2 gives the fresh model a gradient on this data)."""
    from composer_cloud.runs import read_metrics
    from composer_cloud.storage.run import open_run
    from support.cli import cli_here, status_here
    from support.local_jobs import replica_log
    from support.resume import export_weights, kill_run_at, launch_and_wait, same_weights
    from support.stores import store_uri_for

    (tmp_path / "qa.jsonl").write_text("".join(
        json.dumps({"question": f"What is {a} plus {b}?", "solution": str(a + b)}) + "\n"
        for a in range(6) for b in range(4)))
    spec = _fast_rollout_spec()
    store = store_uri_for("file", tmp_path)
    launch_and_wait(tmp_path, store, "whole", spec)
    assert "rollout = 'hf-fast'" in replica_log(f"{store}/whole", 0)
    steps = read_metrics(open_run(f"{store}/whole").store, kind="step")
    assert steps and all(r["grad_norm"] > 0 for r in steps)
    expected = export_weights(tmp_path, f"{store}/whole", "whole-model")
    kill_run_at(tmp_path, store, "killed", "upload", spec=spec)
    st = status_here(f"{store}/killed", tmp_path)
    assert st["rounds_committed"] < 3
    res = cli_here("resume", f"{store}/killed", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    assert same_weights(export_weights(tmp_path, f"{store}/killed", "resumed-model"), expected)
