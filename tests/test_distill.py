"""Channel 2's variants: TAID and entropy-aware on-policy distillation, against their formulas computed by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from composer_cloud.trainer.three_channel.distill import TAIDSchedule, entropy_opd_loss, taid_loss
from composer_cloud.trainer.three_channel.loss import SDPOInputs, three_channel_loss
from composer_cloud.trainer.three_channel.settings import ThreeChannelConfig, ThreeChannelSettings

B, T, V = 3, 5, 11


def _logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mask() -> torch.Tensor:
    m = torch.ones(B, T)
    m[0, 3:] = 0
    m[2, 1] = 0
    return m


def _by_token(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked tokens, written out."""
    total, count = 0.0, 0
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                total, count = total + x[b, t], count + 1
    return total / count


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per token from logits, by the definition."""
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    return (p * (p.log() - q.log())).sum(-1)


def _grad(fn, logits: torch.Tensor) -> torch.Tensor:
    x = logits.clone().requires_grad_(True)
    fn(x).backward()
    return x.grad


# --------------------------------------------------------------------------- TAID
def test_taid_at_t0_gives_no_teacher_signal():
    s, mask = _logits(0), _mask()
    t1, t2 = _logits(1), _logits(2, scale=5.0)
    a, b = taid_loss(s, t1, mask, t=0.0), taid_loss(s, t2, mask, t=0.0)
    assert a.kl.item() == b.kl.item() == pytest.approx(0.0, abs=1e-12)
    assert a.cross_entropy.item() == b.cross_entropy.item()
    g1 = _grad(lambda x: taid_loss(x, t1, mask, t=0.0).kl, s)
    g2 = _grad(lambda x: taid_loss(x, t2, mask, t=0.0).kl, s)
    assert torch.equal(g1, g2) and g1.abs().max().item() < 1e-12
    assert taid_loss(s, t1, mask, t=0.5).kl.item() != pytest.approx(taid_loss(s, t2, mask, t=0.5).kl.item())


def test_taid_at_t1_is_the_forward_kl_to_the_teacher():
    s, teacher, mask = _logits(0), _logits(1), _mask()
    out = taid_loss(s, teacher, mask, t=1.0)
    assert out.kl.item() == pytest.approx(_by_token(_kl(teacher, s), mask).item(), rel=1e-12)
    want = _grad(lambda x: _by_token(_kl(teacher, x), mask), s)
    assert torch.allclose(_grad(lambda x: taid_loss(x, teacher, mask, t=1.0).kl, s), want, atol=1e-12)
    # TAID's own objective is the cross-entropy -sum p_teacher log p_student
    ce = -(teacher.softmax(-1) * s.log_softmax(-1)).sum(-1)
    assert out.cross_entropy.item() == pytest.approx(_by_token(ce, mask).item(), rel=1e-12)


def test_taid_in_between_is_kl_to_the_interpolated_target_with_the_seed_gradient():
    s, teacher, mask, t = _logits(0), _logits(1), _mask(), 0.3
    target = (1 - t) * s + t * teacher
    out = taid_loss(s, teacher, mask, t=t)
    assert out.kl.item() == pytest.approx(_by_token(_kl(target, s), mask).item(), rel=1e-12)
    # The seed's loss, -mean sum_v p_t log softmax(s) with p_t from stopgrad(s): the same gradient.
    p_t = target.softmax(-1)
    want = _grad(lambda x: _by_token(-(p_t * x.log_softmax(-1)).sum(-1), mask), s)
    assert torch.allclose(_grad(lambda x: taid_loss(x, teacher, mask, t=t).kl, s), want, atol=1e-12)


def test_taid_schedules_follow_their_formulas():
    linear = TAIDSchedule(t_start=0.4, t_end=1.0, steps=4, adaptive=False)
    ts = [linear.update(1.0) for _ in range(6)]
    # the first step only records the objective (TAID's update_t), then t is the linear target
    assert ts == [0.4, 0.4 + 0.6 * 1 / 4, 0.4 + 0.6 * 2 / 4, 0.4 + 0.6 * 3 / 4, 1.0, 1.0]

    adaptive = TAIDSchedule(t_start=0.4, t_end=1.0, alpha=0.1, beta=0.5, steps=1000)
    objectives = [2.0, 1.0, 1.0, 0.5]
    got = [adaptive.update(j) for j in objectives]
    t, m, want = 0.4, 0.0, [0.4]
    for step, (prev, j) in enumerate(zip(objectives, objectives[1:]), start=1):
        m = 0.5 * m + 0.5 * (prev - j) / prev
        t = min(1.0, max(0.4 + 0.6 * step / 1000, t + 0.1 / (1 + math.exp(-m)) * (1 - t)))
        want.append(t)
    assert got == pytest.approx(want, rel=1e-15) and got[1] > got[0] + 0.03
    # a step without channel-2 tokens keeps t (but never behind the linear floor)
    assert adaptive.update(None) == got[-1]


def test_taid_schedule_state_roundtrips_bitwise_through_json():
    a = TAIDSchedule(alpha=0.05, beta=0.9)
    for j in (3.0, 2.5, 2.7, 1.9):
        a.update(j)
    b = TAIDSchedule(alpha=0.05, beta=0.9)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a.update(j) for j in (1.5, 1.6, 1.1)] == [b.update(j) for j in (1.5, 1.6, 1.1)]
    assert a.state_dict() == b.state_dict()


# --------------------------------------------------------------------------- entropy-aware OPD
def test_entropy_opd_equals_its_formula():
    s, teacher, mask = _logits(0), _logits(1), _mask()
    p = teacher.softmax(-1)
    w = (-(p * p.log()).sum(-1) / math.log(V)).clamp(0, 1)
    want = _by_token(w * _kl(teacher, s) + (1 - w) * _kl(s, teacher), mask)
    assert entropy_opd_loss(s, teacher, mask).item() == pytest.approx(want.item(), rel=1e-12)
    assert 0 < w.min() < w.max() < 1  # the mix is exercised, not one end
    # a smaller h_max saturates w at 1 where the teacher's entropy exceeds it
    w2 = (-(p * p.log()).sum(-1) / 0.5).clamp(0, 1)
    want2 = _by_token(w2 * _kl(teacher, s) + (1 - w2) * _kl(s, teacher), mask)
    assert entropy_opd_loss(s, teacher, mask, h_max=0.5).item() == pytest.approx(want2.item(), rel=1e-12)
    # the teacher takes no gradient
    t = teacher.clone().requires_grad_(True)
    entropy_opd_loss(s.clone().requires_grad_(True), t, mask).backward()
    assert t.grad is None


def test_entropy_opd_reduces_to_forward_kl_at_h_max_and_to_reverse_kl_at_zero_entropy():
    s, mask = _logits(0), _mask()
    uniform = torch.zeros(B, T, V, dtype=torch.float64)  # entropy log V = h_max: w = 1
    assert entropy_opd_loss(s, uniform, mask).item() == pytest.approx(_by_token(_kl(uniform, s), mask).item(),
                                                                      rel=1e-12)
    peaked = torch.zeros(B, T, V, dtype=torch.float64)
    peaked[..., 3] = 80.0  # entropy ~1e-32: w = 0
    assert entropy_opd_loss(s, peaked, mask).item() == pytest.approx(_by_token(_kl(s, peaked), mask).item(),
                                                                     rel=1e-10)


# --------------------------------------------------------------------------- in the three-channel loss
def test_three_channel_loss_runs_the_configured_variant():
    s, teacher, mask = _logits(0), _logits(1), _mask()
    only = dict(pg_weight=0.0, dpo_weight=0.0, sdpo_weight=2.0)
    out = three_channel_loss(ThreeChannelConfig(sdpo_variant="taid", **only),
                             sdpo=SDPOInputs(s, teacher, mask, taid_t=0.7))
    assert out.metrics["sdpo"].item() == pytest.approx(taid_loss(s, teacher, mask, t=0.7).kl.item(), rel=1e-12)
    assert out.metrics["taid_t"].item() == pytest.approx(0.7) and out.total.item() == pytest.approx(
        2.0 * out.metrics["sdpo"].item())
    with pytest.raises(ValueError, match="taid_t"):
        three_channel_loss(ThreeChannelConfig(sdpo_variant="taid", **only), sdpo=SDPOInputs(s, teacher, mask))
    out = three_channel_loss(ThreeChannelConfig(sdpo_variant="entropy_opd", opd_h_max=1.0, **only),
                             sdpo=SDPOInputs(s, teacher, mask))
    assert out.metrics["sdpo"].item() == pytest.approx(entropy_opd_loss(s, teacher, mask, h_max=1.0).item())


@pytest.mark.parametrize("settings, match", [
    ({"sdpo_variant": "kd"}, r"trainer\.sdpo_variant"),
    ({"taid_t_start": 0.9, "taid_t_end": 0.5}, r"trainer\.taid_t_start \(0\.9\) must not exceed trainer\.taid_t_end"),
    ({"taid_beta": 1.0}, r"trainer\.taid_beta"),
    ({"taid_schedule": "cosine"}, r"trainer\.taid_schedule"),
    ({"opd_h_max": 0.0}, r"trainer\.opd_h_max"),
])
def test_variant_settings_are_checked(settings, match):
    with pytest.raises(ValueError, match=match):
        ThreeChannelSettings.from_settings(settings)
