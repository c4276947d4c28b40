"""The replica's boundaries push replaced parameters into the vLLM engine (through the seam of tests/vllm_engine.py).

DiLoCo changes the parameters outside the inner optimizer: every lock-step sync (torchft restores the global
backup, then applies the outer step), a decoupled adopt, a resume. The boundaries call the trainer's
``on_params_replaced()`` each time; here the real boundaries and the real inner loop drive a three-channel
trainer whose engine records what it holds, and right after every boundary the engine must compute what the
policy computes (before the next inner step, so a generation can never sample from the replaced weights).
"""

from __future__ import annotations

import pytest
import torch

import vllm_engine
from composer_cloud.hooks import NO_HOOKS
from composer_cloud.lora import synced_parameters
from composer_cloud.model import compute_precision, load_spec_model
from composer_cloud.replica import boundary as boundary_module
from composer_cloud.replica import runtime
from composer_cloud.replica.boundary import ReplicaContext
from composer_cloud.replica.decoupled import DecoupledBoundary
from composer_cloud.replica.lockstep import LockstepBoundary
from composer_cloud.replica.telemetry import Telemetry
from composer_cloud.spec import spec_from_dict
from composer_cloud.storage.run import Run
from composer_cloud.storage.store import Store
from composer_cloud.sync.decoupled.versions import GlobalVersions
from composer_cloud.sync.decoupled.outer import FRAGMENT_KEY
from composer_cloud.trainer.three_channel import ThreeChannelSettings, ThreeChannelTrainer
from support.trainer import HashTask

torch.set_num_threads(2)
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


class EngineProbe:
    """The boundary, plus a check of the engine after every boundary (a row) the loop sees."""

    def __init__(self, inner, engine) -> None:
        self.inner, self.engine, self.checks = inner, engine, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def after_step(self, segment):
        row = self.inner.after_step(segment)
        if row is not None:
            self.checks.append(self.engine.engine_matches_policy())
        return row


def _context(monkeypatch, store_uri: str, *, mode: str, rounds: int, lora: bool):
    cls = vllm_engine.install(monkeypatch)
    spec = spec_from_dict({
        "replicas": 1, "min_replicas": 1, "rounds": rounds, "inner_steps": 2,
        "sync": {"mode": mode, "quorum_timeout_s": 5, "round_timeout_s": 30},
        "model": SHAPE | ({"lora": LORA} if lora else {})})
    model, tok = load_spec_model(spec.model, seed=spec.seed)
    task = HashTask()
    trainer = ThreeChannelTrainer(
        model=model, tokenizer=tok, task=task, seed=spec.seed, precision=compute_precision(model),
        settings=ThreeChannelSettings(batch_size=4, num_generations=2, max_completion_length=4, sdpo_weight=0.0,
                                      dpo_weight=0.0, rollout="vllm", mask_truncated_completions=False),
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2))
    store = Store(store_uri)
    ctx = ReplicaContext(run=Run(uri=store_uri, store=store, spec=spec), rank=0, model=model, trainer=trainer,
                         device=torch.device("cpu"), hooks=NO_HOOKS,
                         telemetry=Telemetry(store, 0, rounds=rounds, inner_steps=2, progress_every_s=60))
    return ctx, cls.instances[-1]


def _run(ctx, engine, boundary_cls) -> EngineProbe:
    probe = EngineProbe(boundary_cls(ctx), engine)
    probe.inner.start()
    probe.start_check = engine.engine_matches_policy()
    runtime._inner_loop(ctx, probe)
    probe.inner.finish(0)
    return probe


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_lockstep_sync_and_a_resume_reach_the_engine(monkeypatch, tmp_path, lora):
    uri = f"file://{tmp_path}/store/run"
    ctx, engine = _context(monkeypatch, uri, mode="lockstep", rounds=2, lora=lora)
    probe = _run(ctx, engine, LockstepBoundary)
    assert probe.checks == [True, True] and ctx.trainer.engine_refreshes == 2
    if lora:  # DiLoCo synced the adapters alone: the global state holds nothing else
        names = {n.replace(".", "__") for n in synced_parameters(ctx.model)}
        assert set(probe.inner.loop.fragments[0].state_dict()) == names

    # A restart resumes round 1's checkpoint: the restored parameters reach the new engine before any step.
    monkeypatch.setattr(vllm_engine.RecordingVLLMGeneration, "instances", [])
    ctx2, engine2 = _context(monkeypatch, uri, mode="lockstep", rounds=3, lora=lora)
    probe2 = _run(ctx2, engine2, LockstepBoundary)
    assert probe2.start_check and probe2.checks == [True] and ctx2.trainer.engine_refreshes == 2
    assert engine2.log.generations and all(engine2.log.generations)


def test_every_decoupled_adopt_reaches_the_engine(monkeypatch, tmp_path):
    ctx, engine = _context(monkeypatch, f"file://{tmp_path}/store/run", mode="decoupled", rounds=2, lora=True)
    probe = _run(ctx, engine, DecoupledBoundary)
    assert probe.start_check and probe.checks == [True, True]
    assert ctx.trainer.engine_refreshes == 3  # the start (version 0) and the adopt at each boundary
    assert all(engine.log.generations)
    # The contributions and globals hold the adapters alone.
    versions = GlobalVersions(ctx.run.store)
    tree = versions.load(versions.newest(floor=0), probe.inner.shapes)
    assert set(tree[FRAGMENT_KEY]["original_parameters"]) == set(synced_parameters(ctx.model))
    assert all(".lora_" in name for name in synced_parameters(ctx.model))

    # A restart resumes the adapters, their AdamW state and the RNGs from the replica's inner state.
    adapters = {n: p.detach().clone() for n, p in synced_parameters(ctx.model).items()}
    optim, _ = ctx.trainer.state_dict()
    rng = torch.get_rng_state()
    torch.manual_seed(1234)
    monkeypatch.setattr(vllm_engine.RecordingVLLMGeneration, "instances", [])
    ctx2, engine2 = _context(monkeypatch, ctx.run.uri, mode="decoupled", rounds=3, lora=True)
    DecoupledBoundary(ctx2).start()
    assert all(torch.equal(p, adapters[n]) for n, p in synced_parameters(ctx2.model).items())
    optim2, _ = ctx2.trainer.state_dict()
    moments = [k for k in optim if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert len(moments) == 2 * len(adapters) and all(torch.equal(optim2[k], optim[k]) for k in moments)
    assert torch.equal(torch.get_rng_state(), rng) and engine2.engine_matches_policy()


def test_without_the_boundarys_call_the_engine_is_stale(monkeypatch, tmp_path):
    """Control: the check above can fail. With ``params_replaced`` a no-op the engine lags every sync."""
    from composer_cloud.replica import lockstep

    monkeypatch.setattr(lockstep, "params_replaced", lambda trainer: None)
    assert boundary_module.params_replaced is not lockstep.params_replaced
    ctx, engine = _context(monkeypatch, f"file://{tmp_path}/store/run", mode="lockstep", rounds=2, lora=False)
    probe = _run(ctx, engine, LockstepBoundary)
    assert probe.checks == [False, False] and ctx.trainer.engine_refreshes == 0


def test_a_heal_and_an_aborted_round_reach_the_engine(monkeypatch, tmp_path):
    """The syncs that change the parameters without an outer step: a heal (the manager copied a committed
    global state into the model) and a round that was not committed (torchft restored the global backup).
    Each is reported as a sync record; the boundary pushes the parameters before the next inner step."""
    from composer_cloud.replica.boundary import Segment
    from composer_cloud.sync.lockstep.manager import SyncRecord

    ctx, engine = _context(monkeypatch, f"file://{tmp_path}/store/run", mode="lockstep", rounds=2, lora=True)
    boundary = LockstepBoundary(ctx)
    boundary.start()
    try:
        for record in (SyncRecord(0, None, committed=False, healed_to=0), SyncRecord(0, None, committed=False)):
            with torch.no_grad():  # what the manager's heal / torchft's restore does to the synced parameters
                for p in synced_parameters(ctx.model).values():
                    p.add_(0.05 * torch.randn_like(p))
            assert not engine.engine_matches_policy()
            boundary._syncs.append(record)  # the manager's on_sync
            row = boundary.after_step(Segment())
            assert row.committed is False and engine.engine_matches_policy()
        assert ctx.trainer.engine_refreshes == 2
    finally:
        boundary.loop.close()
