"""Outlier rules built on update norms, when honest replicas have (almost) no gradient.

Measured (issue: a 4-replica run of a no-reward task): three replicas' updates were weight decay only (norm 5e-4),
the one with a real gradient (0.034, ~0.2 % of the parameters' norm, ~20 for that model as built) was a 70x
"outlier" of that median, was excluded, and with ``min_replicas = 4`` the retry could not form ("only 3 of
min_replicas=4 replicas joined ...; missing replicas: []"). In decoupled mode a replica whose first merged
contributions carried almost no gradient (reference 0.0047) had every later real one refused, for the rest of the
run. Both rules now measure against ``max(median or reference, no-gradient floor)``, the floor being 0.1 % of the
parameters' norm (``checks.norm_floor_rms``); these tests replay both cases at the same ratios, and the attacks the
rules exist for.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import pytest
import torch

from composer_cloud.storage.store import Store
from composer_cloud.sync.checks import NO_GRADIENT_REL, norm_floor_rms, outliers
from composer_cloud.sync.decoupled import guard
from composer_cloud.sync.decoupled import protocol as dc
from composer_cloud.sync.lockstep.allreduce import ObjectStoreAllReduce, RoundResult
from composer_cloud.sync.lockstep.results import RoundTimeout
from workers import allreduce_config, run_spec

NUMEL = 4000  # 4 slots of 1000 with 4 replicas
PARAMS = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7)) * 0.05
FLOOR = NO_GRADIENT_REL * float(PARAMS.norm())  # the whole payload's floor (0.1 % of the parameters' norm)
# The measured norms relative to the parameters' norm (19.1 for that model as built with a 300-token vocabulary):
# weight decay only 5e-4, a real gradient 0.034.
TINY, REAL = 5e-4 / 19.1 * 1000 * FLOOR, 0.034 / 19.1 * 1000 * FLOOR


def weight_decay_only(rank: int) -> torch.Tensor:
    """The pseudo-gradient of a replica with no gradient: lr x wd x H x params (plus float noise)."""
    noise = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank)) * 1e-3
    x = PARAMS * (1 + noise)
    return x * (TINY / float(x.norm()))


def real_update(rank: int, norm: float = REAL) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + rank))
    return x * (norm / float(x.norm()))


def run_round(uri: str, payloads: dict[int, torch.Tensor], *, floor_rms: float, min_replicas: int,
              ranks: list[int] | None = None, round: int = 0, **kw: Any) -> dict[int, Any]:
    """One all-reduce call per rank in ``ranks`` (threads); ``{rank: RoundResult or exception}``, payloads in place."""
    out: dict[int, Any] = {}

    def replica(rank: int) -> None:
        config = dataclasses.replace(allreduce_config(len(payloads), **{
            "min_replicas": min_replicas, "quorum_timeout_s": 20, "round_timeout_s": 20, "io_threads": 2, **kw}),
            norm_floor_rms=floor_rms)
        ar = ObjectStoreAllReduce(Store(uri), rank, config)
        try:
            out[rank] = ar.allreduce(round, payloads[rank])
        except Exception as exc:  # noqa: BLE001 - asserted on
            out[rank] = exc
        finally:
            ar.close()

    threads = [threading.Thread(target=replica, args=(r,)) for r in (ranks if ranks is not None else payloads)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not any(t.is_alive() for t in threads), "a replica hung"
    return out


# ------------------------------------------------------------------ lock-step: the measured case
def test_a_real_update_among_no_gradient_ones_commits_with_every_replica(tmp_path):
    """Measured case 1, same ratios: before the floor, replica 3 was excluded and the round never formed."""
    uri = f"file://{tmp_path}/store"
    payloads = {0: weight_decay_only(0), 1: weight_decay_only(1), 2: weight_decay_only(2), 3: real_update(3)}
    expected = torch.stack(list(payloads.values())).mean(0)
    out = run_round(uri, payloads, floor_rms=norm_floor_rms([PARAMS]), min_replicas=4)
    for rank, res in out.items():
        assert isinstance(res, RoundResult) and res.committed and res.attempt == 0, (rank, res)
        assert res.participants == [0, 1, 2, 3]
        torch.testing.assert_close(payloads[rank], expected, atol=1e-9, rtol=1e-5)


# ------------------------------------------------------------------ lock-step: the protection still holds
@pytest.mark.parametrize("honest", ["no_gradient", "zero", "real"])
def test_a_forged_huge_update_is_still_excluded(tmp_path, honest):
    """Rank 3 sends 20x the floor (no_gradient / zero honest updates: the floor is the scale; a zero median
    let anything through before) or 20x the honest real updates' median (the plain median rule)."""
    uri = f"file://{tmp_path}/store"
    make = {"no_gradient": weight_decay_only, "zero": lambda r: torch.zeros(NUMEL), "real": real_update}[honest]
    honest_norm = {"no_gradient": FLOOR, "zero": FLOOR, "real": REAL}[honest]
    payloads = {r: make(r) for r in range(3)} | {3: real_update(3, norm=20 * honest_norm)}
    expected = torch.stack([payloads[r] for r in range(3)]).mean(0)
    out = run_round(uri, payloads, floor_rms=norm_floor_rms([PARAMS]), min_replicas=3)
    for rank in range(3):
        res = out[rank]
        assert isinstance(res, RoundResult) and res.committed and res.attempt == 1, (rank, res)
        assert res.participants == [0, 1, 2]
        torch.testing.assert_close(payloads[rank], expected, atol=1e-9, rtol=1e-5)
    assert isinstance(out[3], RoundResult) and not out[3].committed and out[3].excluded == [3], out[3]
    reason = Store(uri).get_json("rounds/00000000/0/outcome.json")["reason"]
    assert "replica 3" in reason and ("no-gradient floor" in reason) == (honest != "real"), reason


def test_a_retry_short_of_min_replicas_says_who_was_excluded_and_what_to_do(tmp_path):
    """A real outlier with min_replicas = replicas: the next sync's retry cannot form. The error names the
    excluded replica, its norm, the scale and the factor, and the settings to change (it said "missing: []")."""
    uri = f"file://{tmp_path}/store"
    payloads = {r: real_update(r) for r in range(3)} | {3: real_update(3, norm=50 * REAL)}
    first = run_round(uri, payloads, floor_rms=norm_floor_rms([PARAMS]), min_replicas=4)
    assert all(isinstance(res, RoundResult) and not res.committed for res in first.values()), first
    again = run_round(uri, payloads, floor_rms=norm_floor_rms([PARAMS]), min_replicas=4, ranks=[0, 1, 2],
                      quorum_timeout_s=1)
    for rank in range(3):
        exc = again[rank]
        assert isinstance(exc, RoundTimeout), (rank, exc)
        text = str(exc)
        assert "excluded replicas [3]" in text and "outlier" in text, text
        assert "replica 3 has norm" in text and "outlier_factor=10.0 x median" in text, text
        assert any(f"norm {float(payloads[3][j * 1000:(j + 1) * 1000].norm()):.4g}" in text for j in range(4)), text
        assert "sync.outlier_factor" in text and "min_replicas" in text, text


# ------------------------------------------------------------------ the rule itself
def test_the_floor_is_the_scale_only_below_it():
    assert outliers([1e-4, 1e-4, 1e-4, 0.05], 10.0, floor=0.01) == (1e-4, [])
    assert outliers([1e-4, 1e-4, 1e-4, 0.2], 10.0, floor=0.01) == (1e-4, [3])
    assert outliers([0.0, 0.0, 0.0, 0.2], 10.0, floor=0.01) == (0.0, [3])
    assert outliers([1.0, 1.0, 1.0, 10.5], 10.0, floor=0.01) == (1.0, [3])  # the median rule, unchanged
    assert outliers([1e-4, 1e-4, 0.05], None, floor=0.01) == (0.0, [])


def test_the_floor_is_a_thousandth_of_the_parameters_norm():
    params = [torch.full((3, 4), 2.0), torch.full((4,), -2.0)]
    assert math.isclose(norm_floor_rms(params), 2e-3)
    assert math.isclose(norm_floor_rms(params) * math.sqrt(16), 1e-3 * math.sqrt(16 * 4.0))
    assert norm_floor_rms([]) == 0.0


# ------------------------------------------------------------------ decoupled: the guard
def test_a_reference_built_from_no_gradient_contributions_does_not_refuse_real_ones():
    """Measured case 2: reference 0.0047 from masked contributions; later real ones (10x+) were refused forever."""
    refs = guard.updated({}, [(0, 0.0047, 64)], floor=0.02)
    assert refs[0].norm == 0.02  # below the floor counts as the floor
    assert guard.refusal(0, 0.06, 64, refs, 10.0, floor=0.02) is None
    assert guard.refusal(0, 0.06, 64, guard.updated({}, [(0, 0.0047, 64)]), 10.0) is not None  # without: refused
    # A newcomer measured against the others' references gets the same floor.
    assert guard.refusal(1, 0.06, 64, {0: guard.Reference(0.0047, 64.0)}, 10.0, floor=0.02) is None


def test_the_guard_still_refuses_forged_updates_and_bounds_growth():
    floor, factor = 0.02, 10.0
    tiny = {0: guard.Reference(0.0047, 64.0)}
    reason = guard.refusal(0, 0.21, 64, tiny, factor, floor=floor)
    assert reason is not None and "no-gradient floor 0.02" in reason and "history" in reason
    real = {0: guard.Reference(0.5, 64.0)}
    assert guard.refusal(0, 5.1, 64, real, factor, floor=floor) is not None  # the reference, not the floor
    assert guard.refusal(0, 5.0, 64, real, factor, floor=floor) is None
    assert guard.refusal(0, 0.1, 641, real, factor, floor=floor) is not None  # tokens unchanged
    for ref in (0.0047, 0.02, 0.5):  # a contribution at the bar raises the reference by at most 3.7x max(ref, floor)
        bar = factor * max(ref, floor)
        grown = guard.updated({0: guard.Reference(ref, 64.0)}, [(0, bar, 64)], floor=floor)[0].norm
        assert grown <= (guard.DECAY + (1 - guard.DECAY) * factor) * max(ref, floor) + 1e-12


SHAPES = {"w": (64,)}


def _merge_once(store: Store, cfg: dc.DecoupledConfig, seq: int, norms: dict[int, float]) -> Any:
    protocol = dc.DecoupledProtocol(store, cfg)
    for rank, norm in norms.items():
        delta = torch.randn(64, generator=torch.Generator().manual_seed(10 * seq + rank))
        protocol.publish(rank=rank, seq=seq, base_version=protocol.versions.newest(), tokens=64, inner_steps=2,
                         delta={"w": delta * (norm / float(delta.norm()))})
    return protocol.read_merge(protocol.try_merge(SHAPES, rank=0).merged)


@pytest.mark.parametrize("first_floor, floor", [(0.02, 0.02), (0.0, 0.02), (0.0, 0.0)],
                         ids=["floor", "resumed-with-floor", "no-floor"])
def test_decoupled_merges_take_real_contributions_after_masked_ones(tmp_path, first_floor, floor):
    """The protocol end to end (file:// store): merge 1 takes two near-empty contributions (0.0047), merge 2 the
    same replicas' real ones (0.06). With the floor (0.1 % of a parameter norm of 20) both merge, also when merge
    1's record was written without it (a run resumed after the fix: references 0.0047 in the record); without it
    (the code before the fix) merge 2 refuses both and the global version advances with 0 contributions."""
    spec = run_spec(2, mode="decoupled", min_quorum=2)
    cfg = dataclasses.replace(dc.DecoupledConfig.from_spec(spec), norm_floor=first_floor)
    store = Store(f"file://{tmp_path}/store")
    dc.DecoupledProtocol(store, cfg).ensure_initial({"w": torch.zeros(64)}, rank=0)
    assert len(_merge_once(store, cfg, 1, {0: 0.0047, 1: 0.0047}).contributions) == 2
    cfg = dataclasses.replace(cfg, norm_floor=floor)
    second = _merge_once(store, cfg, 2, {0: 0.06, 1: 0.06})
    assert len(second.contributions) == (2 if floor else 0), second.rejected
    if floor:  # and a forged huge one is still refused
        third = _merge_once(store, cfg, 3, {0: 0.06, 1: 1e3})
        assert [c.rank for c in third.contributions] == [0] and "history" in third.rejected[0].reason


@pytest.mark.parametrize("forged", [False, True])
def test_decoupled_median_rule_measures_against_the_floor(tmp_path, forged):
    """A first merge of 3 (no references yet: only the median rule): two masked contributions and a real one
    (13x their median, under 10x the floor) merge; a forged 1e3 one in its place is still rejected."""
    cfg = dataclasses.replace(dc.DecoupledConfig.from_spec(run_spec(3, mode="decoupled", min_quorum=3)),
                              norm_floor=0.02)
    store = Store(f"file://{tmp_path}/store")
    dc.DecoupledProtocol(store, cfg).ensure_initial({"w": torch.zeros(64)}, rank=0)
    record = _merge_once(store, cfg, 1, {0: 0.0047, 1: 0.0047, 2: 1e3 if forged else 0.06})
    assert [c.rank for c in record.contributions] == ([0, 1] if forged else [0, 1, 2]), record.rejected
    if forged:
        assert "no-gradient floor 0.02" in record.rejected[0].reason


# ------------------------------------------------------------------ wiring: both modes take the floor from the model
def test_both_modes_take_the_floor_from_the_synced_parameters(tmp_path):
    from types import SimpleNamespace

    from composer_cloud.hooks import NO_HOOKS
    from composer_cloud.replica.decoupled import DecoupledBoundary
    from composer_cloud.sync.lockstep.diloco import LockstepConfig, build_diloco
    from workers import make_model

    model = make_model()
    expected = norm_floor_rms(model.parameters())
    assert expected > 0
    loop = build_diloco(store=Store(f"file://{tmp_path}/a"), rank=0, model=model,
                        inner_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        config=LockstepConfig.from_spec(run_spec(2)))
    try:
        assert loop.manager.exchange.config.norm_floor_rms == expected
    finally:
        loop.close()
    spec = run_spec(2, mode="decoupled")
    ctx = SimpleNamespace(run=SimpleNamespace(store=Store(f"file://{tmp_path}/b"), spec=spec), spec=spec, rank=0,
                          model=model, hooks=NO_HOOKS, leader=True, shard=None)
    numel = sum(p.numel() for p in model.parameters())
    assert math.isclose(DecoupledBoundary(ctx).cfg.norm_floor, expected * math.sqrt(numel))
