"""A trainer's fallback batch equals the batch a rollout worker would have written for that position (issue 36).

Two runs of one trainer replica over the same published policy chain, in process: in one a worker answers every
request; in the other no worker ever answers, so every step falls back after the deadline. Both train on the
same batches, bitwise (completion token ids and the sampler's log-probs), and the fallbacks are recorded under
``rollouts/fallbacks/`` with the version they were sampled from.
"""

from __future__ import annotations

import pytest
import torch

from composer_cloud.model import load_spec_model
from composer_cloud.rollouts.batches import Position, RolloutBatches, policy_version_for
from composer_cloud.rollouts.fallback import WorkerFallback, worker_policy
from composer_cloud.rollouts.policy import publish_policy
from composer_cloud.rollouts.source import StoreCompletionSource
from composer_cloud.rollouts.worker import RolloutWorker, WorkerConfig
from composer_cloud.spec import load_spec
from composer_cloud.storage.store import Store
from composer_cloud.trainer.three_channel.sourced import RolloutKey, SourcedRollouts

PROMPTS = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
ROUNDS, STEPS = 3, 2
CPU = torch.device("cpu")


def _spec(max_staleness: int):
    return load_spec(None, {"replicas": 1, "seed": 3, "rollouts.workers": 1, "rollouts.max_staleness": max_staleness,
                            "rollouts.deadline_s": 0.05, "model.hidden_size": 32, "model.num_hidden_layers": 1,
                            "model.num_attention_heads": 2, "model.num_key_value_heads": 1,
                            "model.intermediate_size": 64, "trainer.max_completion_length": 6})


def _store_with_chain(uri: str, spec) -> Store:
    """Versions 0 .. ROUNDS - 1 of a policy that moves every round, published as the replicas publish them."""
    store = Store(uri)
    model, _ = load_spec_model(spec.model, seed=spec.seed)
    gen = torch.Generator().manual_seed(11)
    for version in range(ROUNDS):
        publish_policy(store, version=version, model=model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return store


def _keys():
    return [RolloutKey(t, 0, t * STEPS + k) for t in range(ROUNDS) for k in range(1, STEPS + 1)]


def _live_weights_generate():
    raise AssertionError("the trainer sampled from its live weights; a worker-equal fallback was expected")


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_run_whose_workers_never_answer_trains_on_the_batches_the_workers_would_have_written(tmp_path, max_staleness):
    spec = _spec(max_staleness)
    # The run whose worker answers: each request is served before the trainer asks for its batch.
    answered = _store_with_chain(f"file://{tmp_path}/answered", spec)
    sampler, versions = worker_policy(answered, spec, CPU)
    worker = RolloutWorker(answered, config=WorkerConfig(index=0, workers=1, seed=spec.seed, max_staleness=max_staleness,
                                                         deadline_s=spec.rollouts.deadline_s),
                           sampler=sampler, versions=versions)
    source = StoreCompletionSource(answered, replica=0, max_staleness=max_staleness, deadline_s=5.0)
    trainer = SourcedRollouts(source, max_staleness=max_staleness, seed=spec.seed)
    from_workers = {}
    for key in _keys():
        RolloutBatches(answered, max_staleness=max_staleness).request(Position(key.round, 0, key.step), PROMPTS)
        assert worker.serve_once() == 1
        from_workers[key] = trainer.generation(key, PROMPTS, _live_weights_generate, max_completion_length=6,
                                               vocab_size=10**6, device=CPU)
    assert trainer.totals["used"] == len(_keys()) and trainer.totals["fallback"] == 0

    # The run whose workers never answer: every step falls back after the deadline, sampled as a worker would.
    silent = _store_with_chain(f"file://{tmp_path}/silent", spec)
    fallback = WorkerFallback.for_spec(silent, spec, CPU)
    source = StoreCompletionSource(silent, replica=0, max_staleness=max_staleness, deadline_s=0.05, fallback=fallback)
    trainer = SourcedRollouts(source, max_staleness=max_staleness, seed=spec.seed)
    torch.manual_seed(5)
    rng = torch.random.get_rng_state()
    fell_back = {key: trainer.generation(key, PROMPTS, _live_weights_generate, max_completion_length=6,
                                         vocab_size=10**6, device=CPU) for key in _keys()}
    assert torch.equal(torch.random.get_rng_state(), rng)  # building and sampling left the trainer's RNG alone
    assert trainer.totals["fallback"] == len(_keys()) and fallback.sampled == len(_keys())
    metrics = source.take_metrics()
    assert metrics["rollouts/timed_out"] == len(_keys()) and metrics["rollouts/fallback_live"] == 0
    assert fell_back == from_workers  # bitwise: the same completion ids, the same sampler log-probs
    assert len({tuple(map(tuple, ids)) for ids, _, _ in fell_back.values()}) > 1  # positions differ (a real check)
    # Recorded under rollouts/fallbacks/ with the version a worker samples from; a resumed run reads them first.
    batches = RolloutBatches(silent, max_staleness=max_staleness)
    for key, (ids, logps, _) in fell_back.items():
        record = batches.read_batch(Position(key.round, 0, key.step), fallback=True)
        assert record.fallback and record.completion_ids == ids and record.sampler_logps == logps
        assert record.policy_version == policy_version_for(key.round, max_staleness)


def test_a_fallback_whose_policy_version_is_not_published_samples_from_the_live_weights(tmp_path):
    spec = _spec(0)
    store = Store(f"file://{tmp_path}/run")  # no policy chain at all
    fallback = WorkerFallback.for_spec(store, spec, CPU)
    fallback.wait_s = 0.0
    source = StoreCompletionSource(store, replica=0, max_staleness=0, deadline_s=0.05, fallback=fallback)
    trainer = SourcedRollouts(source, max_staleness=0, seed=spec.seed)
    live = ([[1], [2], [3], [4]], None)
    got = trainer.generation(RolloutKey(1, 0, 3), PROMPTS, lambda: live, max_completion_length=6, vocab_size=100,
                             device=CPU)
    assert got == ([[1], [2], [3], [4]], None, None) and fallback.unavailable == 1
    assert source.take_metrics()["rollouts/fallback_live"] == 1.0  # counted in the step's metrics
    record = RolloutBatches(store, max_staleness=0).read_batch(Position(1, 0, 3), fallback=True)
    assert record.policy_version == 1 and record.completion_ids == [[1], [2], [3], [4]]


def test_a_trainer_that_falls_back_trains_bitwise_as_the_trainer_a_worker_answered():
    """Through the three-channel trainer itself (TRL's generation, scoring and importance-sampling correction): the
    step whose worker never answered has the same batch, loss and gradients as the step a worker answered."""
    import tempfile

    from composer_cloud.model import TinyModelConfig, load_model
    from composer_cloud.rollouts.sampler import BatchSampler
    from composer_cloud.rollouts.versions import PolicyVersions
    from composer_cloud.trainer.three_channel import ThreeChannelSettings, ThreeChannelTrainer
    from support.trainer import HashTask

    small = TinyModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=64)
    settings = ThreeChannelSettings(batch_size=8, num_generations=4, max_completion_length=6,
                                    mask_truncated_completions=False, sdpo_weight=0.0, dpo_weight=0.0,
                                    loss_type="dapo", rollout="hf")
    rows = [{"prompt": f"def g{i}(x):\n    return", "k": i} for i in range(2) for _ in range(4)]
    key = RolloutKey(round=1, replica=0, step=3)  # max_staleness = 0: version 1, not the trainer's live weights

    def stack(store: Store):
        model, tok = load_model("tiny", seed=0, tiny=small)
        model.eval().requires_grad_(False)
        return BatchSampler(model, tok, settings), PolicyVersions(store, model, fragments=1, chain=True)

    def run(store: Store, *, answered: bool):
        model, tok = load_model("tiny", seed=0, tiny=small)
        publish_policy(store, version=0, model=model)
        moved, _ = load_model("tiny", seed=0, tiny=small)
        with torch.no_grad():
            for p in moved.parameters():
                p.mul_(1.5)
        publish_policy(store, version=1, model=moved)
        if answered:  # a worker already answered the request the trainer is about to make
            prompts = tok([r["prompt"] for r in rows]).input_ids
            RolloutBatches(store, max_staleness=0).request(Position(1, 0, 3), [list(p) for p in prompts])
            sampler, versions = stack(store)
            worker = RolloutWorker(store, config=WorkerConfig(index=0, workers=1, seed=0, max_staleness=0,
                                                              deadline_s=60.0), sampler=sampler, versions=versions)
            assert worker.serve_once() == 1
        tr = ThreeChannelTrainer(model=model, tokenizer=tok, task=HashTask(), settings=settings, seed=0,
                                 optimizer=torch.optim.AdamW(model.parameters(), lr=3e-2))
        source = StoreCompletionSource(store, replica=0, max_staleness=0, deadline_s=0.05,
                                       fallback=WorkerFallback(lambda: stack(store), seed=0, max_staleness=0, wait_s=1.0))
        tr.set_completion_source(source, max_staleness=0)
        tr.model.train()
        tr.grpo.rollout_key = key
        out = tr.grpo._generate_and_score_completions([dict(r) for r in rows])
        tr.model.zero_grad(set_to_none=True)
        loss = tr.grpo.compute_loss(tr.model, dict(out))
        loss.backward()
        metrics = tr.grpo.sourced.take_metrics()
        return out, loss.detach(), [p.grad.clone() for p in tr.model.parameters()], metrics

    with tempfile.TemporaryDirectory() as tmp:
        want, l_want, g_want, m_want = run(Store(f"file://{tmp}/answered"), answered=True)
        got, l_got, g_got, m_got = run(Store(f"file://{tmp}/silent"), answered=False)
    assert m_want["rollouts/used"] == 1 and m_got["rollouts/fallback"] == 1
    assert "importance_sampling_ratio" in got  # the fallback carries the sampler's log-probs, as a worker's batch
    for name in ("prompt_ids", "completion_ids", "completion_mask", "advantages", "old_per_token_logps",
                 "importance_sampling_ratio"):
        assert torch.equal(want[name], got[name]), name
    assert torch.equal(l_want, l_got) and all(torch.equal(a, b) for a, b in zip(g_want, g_got))
