"""Completions from rollout workers (issue 36): the trainer's seam, ``composer_cloud.trainer.three_channel.sourced``.

What is real here: the three-channel trainer over TRL's GRPOTrainer on a tiny model built from a config, its
own samplers (``"hf"`` and the ``"hf-fast"`` copy, eager on CPU), TRL's importance-sampling correction, the
real lock-step boundary and inner loop of a replica. The source is :class:`InMemorySource`, the reference
implementation of the contract a store-backed source implements.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from composer_cloud.model import TinyModelConfig, load_model
from composer_cloud.trainer.three_channel import ThreeChannelSettings, ThreeChannelTrainer
from composer_cloud.trainer.three_channel.sourced import (
    ROLLOUT_METRICS,
    InMemorySource,
    RolloutKey,
    SourcedCompletions,
    fallback_seed,
)
from support.trainer import HashTask

torch.set_num_threads(2)
SMALL = TinyModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64)
ROWS = [{"prompt": f"def g{i}(x):\n    return", "k": i} for i in range(2) for _ in range(4)]


def _settings(**kw) -> ThreeChannelSettings:
    base = dict(batch_size=8, num_generations=4, max_completion_length=6, mask_truncated_completions=False,
                sdpo_weight=0.0, dpo_weight=0.0, loss_type="dapo", rollout="hf")
    return ThreeChannelSettings(**(base | kw))


def _trainer(**kw) -> ThreeChannelTrainer:
    model, tok = load_model("tiny", seed=0, tiny=SMALL)
    return ThreeChannelTrainer(
        model=model, tokenizer=tok, task=HashTask(), settings=_settings(**kw), seed=0,
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2))


def _sourced(source: InMemorySource, *, max_staleness: int = 0, trust_rewards: bool = False, **kw):
    tr = _trainer(**kw)
    tr.set_completion_source(source, max_staleness=max_staleness, trust_rewards=trust_rewards)
    tr.model.train()
    return tr


def _generate(tr: ThreeChannelTrainer, key: RolloutKey | None):
    """One training generation of ``ROWS`` (what ``training_step`` does first), for ``key``."""
    tr.model.train()
    tr.grpo.rollout_key = key
    return tr.grpo._generate_and_score_completions([dict(r) for r in ROWS])


def _loss_and_grads(tr: ThreeChannelTrainer, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    tr.model.zero_grad(set_to_none=True)
    loss = tr.grpo.compute_loss(tr.model, dict(inputs))
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in tr.model.parameters() if p.requires_grad]


def _rows(t: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(t, mask)]


def _rng() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def _same_rng(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


# --------------------------------------------------------------------------- parity with the colocated trainer
def test_a_batch_served_as_the_colocated_sampler_made_it_trains_bitwise_the_same():
    """max_staleness = 0, one source serving exactly what the colocated "hf-fast" sampler produced (same tokens,
    same sampler log-probs): the same generation batch, channel-1 loss and gradients, bit for bit. The sourced
    trainer samples with "hf" itself; the served log-probs alone raise TRL's correction."""
    colo = _trainer(rollout="hf-fast", vllm_importance_sampling_mode="sequence_truncate")
    sampler = colo.grpo.fast_sampler
    produced: list = []
    generate = sampler.generate

    def recording(prompt_ids, **kw):
        out = generate(prompt_ids, **kw)
        produced.append(([list(p) for p in prompt_ids], *out))
        return out

    sampler.generate = recording
    colo.model.train()
    torch.manual_seed(3)
    want = colo.grpo._generate_and_score_completions([dict(r) for r in ROWS])
    (prompt_ids, completion_ids, logprobs), = produced

    source = InMemorySource()
    key = RolloutKey(round=0, replica=0, step=1)
    source.put(key, SourcedCompletions(completion_ids=completion_ids, logprobs=logprobs, policy_version=0,
                                       prompt_ids=prompt_ids))
    tr = _sourced(source, vllm_importance_sampling_mode="sequence_truncate")
    assert tr.grpo.fast_sampler is None and tr.grpo.rollout == "hf"
    before = _rng()
    got = _generate(tr, key)
    assert _same_rng(before, _rng())  # nothing sampled here
    assert source.asked == [key] and source.recorded == []
    assert "importance_sampling_ratio" in got and "old_per_token_logps" in got  # TRL's correction is on
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                 "old_per_token_logps", "importance_sampling_ratio"):
        assert torch.equal(want[name], got[name]), name
    l_colo, g_colo = _loss_and_grads(colo, want)
    l_src, g_src = _loss_and_grads(tr, got)
    assert any(g.abs().max() > 0 for g in g_colo)
    assert torch.equal(l_colo, l_src)
    assert all(torch.equal(a, b) for a, b in zip(g_colo, g_src))
    metrics = tr.grpo.sourced.take_metrics()
    assert metrics["rollouts/used"] == 1 and metrics["rollouts/fallback"] == 0 and metrics["rollouts/staleness"] == 0


# --------------------------------------------------------------------------- importance sampling on a sourced batch
def test_sampler_log_probs_of_a_sourced_batch_weight_channel_1_as_trls_truncated_correction_says():
    """token_truncate: every token's weight is min(exp(old - sampler), clip_max). Served log-probs uniformly
    ``d`` below the trainer's own scale the on-policy gradient by ``exp(d)``, and by ``clip_max`` once
    ``exp(d)`` passes it."""
    source = InMemorySource()
    tr = _sourced(source, vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=3.0)
    fixed = _generate(_trainer(), None)  # completions of the trainer's own sampler, to serve back
    ids = _rows(fixed["completion_ids"], fixed["completion_mask"])

    def serve(step: int, logprobs) -> dict:
        key = RolloutKey(0, 0, step)
        source.put(key, SourcedCompletions(completion_ids=ids, logprobs=logprobs, policy_version=0))
        return _generate(tr, key)

    probe = serve(1, [[-1.0] * len(c) for c in ids])
    old = probe["old_per_token_logps"]
    exact = serve(2, [old[i, : len(c)].tolist() for i, c in enumerate(ids)])
    mask = exact["completion_mask"].bool()
    assert torch.allclose(exact["importance_sampling_ratio"][mask], torch.ones(int(mask.sum())), atol=1e-6)
    _, g_exact = _loss_and_grads(tr, exact)
    for step, d, weight in ((3, 0.5, np.exp(0.5)), (4, 2.0, 3.0)):
        off = serve(step, [(old[i, : len(c)] - d).tolist() for i, c in enumerate(ids)])
        assert torch.allclose(off["importance_sampling_ratio"][mask], torch.full((int(mask.sum()),), weight),
                              rtol=1e-5)
        _, g_off = _loss_and_grads(tr, off)
        got_g, want_g = torch.cat([g.flatten() for g in g_off]), weight * torch.cat([g.flatten() for g in g_exact])
        assert want_g.norm() > 0 and (got_g - want_g).norm() <= 1e-4 * want_g.norm()
    assert tr.grpo.sourced.totals["used"] == 4


# --------------------------------------------------------------------------- staleness, missing batches, fallback
@pytest.mark.parametrize("rollout", ["hf", "hf-fast"])
def test_no_batch_falls_back_seeded_by_the_key_and_records_what_it_generated(rollout):
    """None from the source: the trainer generates with its own rollout path, from a generator seeded by the key
    (the global RNG untouched), and hands the result to record_fallback. A resumed trainer reads that record
    back and trains on the same batch without generating."""
    source = InMemorySource()
    tr = _sourced(source, rollout=rollout)
    key = RolloutKey(round=2, replica=0, step=5)
    before = _rng()
    got = _generate(tr, key)
    assert _same_rng(before, _rng())
    (recorded_key, record), = source.recorded
    assert recorded_key == key and record.fallback and record.policy_version == 2
    assert record.completion_ids == _rows(got["completion_ids"], got["completion_mask"])
    assert (record.logprobs is not None) == (rollout == "hf-fast")
    assert ("importance_sampling_ratio" in got) == (rollout == "hf-fast")  # as the colocated trainer of that mode
    m = tr.grpo.sourced.take_metrics()
    assert (m["rollouts/missing"], m["rollouts/fallback"], m["rollouts/used"]) == (1, 1, 0)
    assert "rollouts/staleness" not in m

    # The same key on a fresh trainer with nothing served: the same completions (seeded by the key) ...
    again = _generate(_sourced(InMemorySource(), rollout=rollout), key)
    assert torch.equal(again["completion_ids"], got["completion_ids"])
    # ... another key: other completions.
    other = _generate(_sourced(InMemorySource(), rollout=rollout), RolloutKey(2, 0, 6))
    assert not torch.equal(other["completion_ids"], got["completion_ids"])
    assert fallback_seed(key, 0) != fallback_seed(key, 1)
    # A resumed run: the source serves the record; nothing is generated or recorded again, the batch is the same.
    resumed = _sourced(source, rollout=rollout)
    resumed.grpo._own_generate = lambda *a, **k: pytest.fail("a recorded fallback was generated again")
    replay = _generate(resumed, key)
    assert len(source.recorded) == 1
    for name in ("completion_ids", "completion_mask", "advantages"):
        assert torch.equal(replay[name], got[name]), name
    if rollout == "hf-fast":
        assert torch.equal(replay["importance_sampling_ratio"], got["importance_sampling_ratio"])
    assert resumed.grpo.sourced.take_metrics()["rollouts/fallback"] == 1


def test_a_stale_batch_is_refused_counted_and_the_step_falls_back_leaving_the_rng_as_a_used_batch_does():
    """Through step(): a batch 2 rounds behind with max_staleness = 1 is refused and counted; the fallback runs
    and is recorded; the trainer's RNG streams after the step equal those of a trainer that trained on a served
    batch (no generation drew from them), and differ from a trainer that sampled itself (the check can fail)."""
    def run(source: InMemorySource | None, **kw) -> ThreeChannelTrainer:
        tr = _trainer()
        if source is not None:
            tr.set_completion_source(source, max_staleness=1)
        tr.set_rollout_position(3, 7)
        tr.out = tr.step()
        return tr

    key = RolloutKey(round=3, replica=0, step=7)
    own = _generate(_trainer(), None)
    served = SourcedCompletions(completion_ids=_rows(own["completion_ids"], own["completion_mask"]),
                                logprobs=[[-1.0] * int(m.sum()) for m in own["completion_mask"]], policy_version=2)
    stale_source, fresh_source = InMemorySource(), InMemorySource()
    stale_source.put(key, dataclasses.replace(served, policy_version=1))
    fresh_source.put(key, served)
    stale, fresh, colocated = run(stale_source), run(fresh_source), run(None)

    out = stale.out
    assert (out["rollouts/stale"], out["rollouts/fallback"], out["rollouts/used"]) == (1, 1, 0)
    assert out["rollouts/staleness"] == 2
    assert [k for k, _ in stale_source.recorded] == [key]
    assert (fresh.out["rollouts/used"], fresh.out["rollouts/stale"], fresh.out["rollouts/staleness"]) == (1, 0, 1)
    assert fresh_source.recorded == []
    assert not any(name in colocated.out for name in ROLLOUT_METRICS)
    assert torch.equal(stale.rng.torch_cpu, fresh.rng.torch_cpu)
    assert stale.rng.python == fresh.rng.python
    assert not torch.equal(stale.rng.torch_cpu, colocated.rng.torch_cpu)


@pytest.mark.parametrize("rollout", ["hf", "hf-fast"])
def test_a_run_that_reads_back_its_fallbacks_trains_bitwise_as_the_run_that_generated_them(rollout):
    """Two steps that fall back (nothing served), then the same two steps on a fresh trainer whose source serves
    the recorded fallbacks (a resumed run): the same parameters, optimizer state and RNG streams, bit for bit."""
    source = InMemorySource()

    def run() -> ThreeChannelTrainer:
        tr = _trainer(rollout=rollout)
        tr.set_completion_source(source)
        for step in (1, 2):
            tr.set_rollout_position(0, step)
            tr.out = tr.step()
        return tr

    first = run()
    assert [k.step for k, _ in source.recorded] == [1, 2]
    second = run()
    assert len(source.recorded) == 2  # read back, not generated again
    assert second.out["rollouts/fallback"] == 1 and second.out["rollouts/missing"] == 0
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters()))
    assert torch.equal(first.rng.torch_cpu, second.rng.torch_cpu)
    state_a, state_b = first.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert all(torch.equal(state_a[i]["exp_avg"], state_b[i]["exp_avg"]) for i in state_a)


MALFORMED = [
    ({"completion_ids": [[1]] * 7}, "7 completions for 8 prompts"),
    ({"logprobs": None}, "no sampler log-probs"),
    ({"policy_version": 4}, "ahead of this trainer's round"),
    ({"prompt_ids": [[5]] * 8}, "other prompts"),
    ({"completion_ids": [[10**9]] * 8}, "outside"),
    ({"completion_ids": [[1] * 7] * 8, "logprobs": [[-1.0] * 7] * 8}, "max_completion_length = 6"),
    ({"logprobs": [[float("-inf")]] * 8}, "infinite log-prob"),
    ({"rewards": [1.0] * 3}, "3 rewards for 8 completions"),
]


def test_a_malformed_batch_is_refused_counted_and_falls_back(caplog):
    """Each malformed batch costs its step's generation (refused, logged with the reason, counted, replaced by a
    recorded fallback), never the run; the well-formed one they all derive from passes the same checks."""
    good = dict(completion_ids=[[7]] * 8, logprobs=[[-1.0]] * 8, policy_version=3)
    assert SourcedCompletions(**good).problem([[1]] * 8, max_completion_length=6, vocab_size=100) is None
    source = InMemorySource()
    tr = _sourced(source)
    for step, (change, why) in enumerate(MALFORMED, start=1):
        key = RolloutKey(3, 0, step)
        source.put(key, SourcedCompletions(**(good | change)))
        caplog.clear()
        with caplog.at_level("WARNING", logger="composer_cloud.trainer.three_channel.sourced"):
            got = _generate(tr, key)
        assert why in caplog.text, (change, caplog.text)
        m = tr.grpo.sourced.take_metrics()
        assert (m["rollouts/invalid"], m["rollouts/fallback"], m["rollouts/used"]) == (1, 1, 0), change
        assert source.recorded[-1][0] == key and got["completion_ids"].size(0) == 8
    assert len(source.recorded) == len(MALFORMED)


# --------------------------------------------------------------------------- rewards
def test_the_trainer_scores_sourced_completions_itself_unless_told_to_trust_the_batch():
    own = _generate(_trainer(), None)
    ids = _rows(own["completion_ids"], own["completion_mask"])
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    key = RolloutKey(0, 0, 1)
    source = InMemorySource()
    source.put(key, SourcedCompletions(completion_ids=ids, logprobs=[[-1.0] * len(c) for c in ids],
                                       policy_version=0, rewards=rewards))
    scored = _generate(_sourced(source), key)
    assert torch.equal(scored["advantages"], own["advantages"])  # the task's reward, as if sampled here
    trusted = _generate(_sourced(source, trust_rewards=True), key)
    adv = trusted["advantages"]
    assert adv[0] > 0 and adv[7] > 0 and (adv[1:7] < 0).all()
    assert not torch.equal(adv, own["advantages"])


# --------------------------------------------------------------------------- settings and misuse
def test_refusals_name_what_to_do():
    tr = _trainer()
    tr.set_completion_source(InMemorySource())
    with pytest.raises(RuntimeError, match="set_rollout_position"):
        tr.step()  # no position: no key for the generation
    with pytest.raises(ValueError, match="max_staleness"):
        tr.set_completion_source(InMemorySource(), max_staleness=-1)
    with pytest.raises(TypeError, match="CompletionSource"):
        tr.set_completion_source(object())
    accumulating = _trainer(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="trainer.gradient_accumulation_steps"):
        accumulating.set_completion_source(InMemorySource())
    with pytest.raises(ValueError, match="RolloutKey.step"):
        RolloutKey(0, 0, -1)
    source = InMemorySource()
    source.put(RolloutKey(0, 0, 1), SourcedCompletions([[1]], [[-1.0]], 0))
    with pytest.raises(ValueError, match="write-once"):
        source.put(RolloutKey(0, 0, 1), SourcedCompletions([[2]], [[-1.0]], 0))


# --------------------------------------------------------------------------- the replica names the steps
def test_the_replica_loop_names_each_steps_batch_by_round_and_metrics_step(tmp_path):
    """The real lock-step boundary and inner loop, 2 rounds × 2 steps, nothing served: every step falls back,
    its key is (round, rank, the step of its metrics row), and its metrics row carries the counters."""
    from composer_cloud.hooks import NO_HOOKS
    from composer_cloud.model import compute_precision, load_spec_model
    from composer_cloud.replica import runtime
    from composer_cloud.replica.boundary import ReplicaContext
    from composer_cloud.replica.lockstep import LockstepBoundary
    from composer_cloud.replica.telemetry import Telemetry
    from composer_cloud.spec import spec_from_dict
    from composer_cloud.storage.run import Run
    from composer_cloud.storage.store import Store

    uri = f"file://{tmp_path}/store/run"
    spec = spec_from_dict({
        "replicas": 1, "min_replicas": 1, "rounds": 2, "inner_steps": 2,
        "sync": {"mode": "lockstep", "quorum_timeout_s": 5, "round_timeout_s": 30},
        "model": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=64)})
    model, tok = load_spec_model(spec.model, seed=spec.seed)
    source = InMemorySource()
    trainer = ThreeChannelTrainer(
        model=model, tokenizer=tok, task=HashTask(), seed=spec.seed, precision=compute_precision(model),
        settings=_settings(batch_size=4, num_generations=2, max_completion_length=4),
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2),
        completion_source=source)
    store = Store(uri)
    telemetry = Telemetry(store, 0, rounds=2, inner_steps=2, progress_every_s=60)
    rows: list[dict] = []
    write = telemetry.metrics.step
    telemetry.metrics.step = lambda row: (rows.append(row), write(row))
    ctx = ReplicaContext(run=Run(uri=uri, store=store, spec=spec), rank=0, model=model, trainer=trainer,
                         device=torch.device("cpu"), hooks=NO_HOOKS, telemetry=telemetry)
    boundary = LockstepBoundary(ctx)
    boundary.start()
    runtime._inner_loop(ctx, boundary)
    boundary.finish(0)
    keys = [k for k, _ in source.recorded]
    assert keys == [RolloutKey(0, 0, 1), RolloutKey(0, 0, 2), RolloutKey(1, 0, 3), RolloutKey(1, 0, 4)]
    assert [(r["round"], r["step"]) for r in rows] == [(k.round, k.step) for k in keys]
    assert all(r["rollouts/fallback"] == 1 and r["rollouts/missing"] == 1 for r in rows)
