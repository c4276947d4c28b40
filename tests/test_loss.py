"""Formula tests of the pure three-channel loss functions, and GKD parity."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from composer_cloud.trainer.three_channel.loss import (
    DPOInputs,
    PGInputs,
    SDPOInputs,
    ThreeChannelConfig,
    dpo_loss,
    gjsd_loss,
    pg_loss,
    simpo_loss,
    three_channel_loss,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(B=3, T=5, V=11, seed=0, scale=2.0) -> torch.Tensor:
    return torch.randn(B, T, V, generator=_gen(seed), dtype=torch.float64) * scale


def _mask(B=3, T=5) -> torch.Tensor:
    lengths = torch.tensor([T, T - 2, 1])[:B]
    return (torch.arange(T)[None, :] < lengths[:, None]).long()


# --------------------------------------------------------------------------- gjsd
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_gjsd_is_zero_when_teacher_equals_student(beta):
    s = _logits()
    assert gjsd_loss(s, s.clone(), _mask(), beta=beta).item() == pytest.approx(0.0, abs=1e-12)
    # and strictly positive when they differ
    assert gjsd_loss(s, _logits(seed=1), _mask(), beta=beta).item() > 1e-3


def _manual_kl(p_logits, q_logits, mask, temperature=1.0):
    """sum_v p (log p - log q), averaged over masked tokens."""
    logp = torch.log_softmax(p_logits / temperature, -1)
    logq = torch.log_softmax(q_logits / temperature, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return (kl * mask).sum() / mask.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gjsd_endpoints_are_the_two_kl_directions(temperature):
    s, t, m = _logits(seed=2), _logits(seed=3), _mask()
    keep = m.bool()
    ls, lt = torch.log_softmax(s / temperature, -1), torch.log_softmax(t / temperature, -1)
    # beta = 0: forward KL(teacher || student); beta = 1: reverse KL(student || teacher)
    fwd = F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)[keep].mean()
    rev = F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)[keep].mean()
    assert gjsd_loss(s, t, m, beta=0.0, temperature=temperature).item() == pytest.approx(fwd.item(), rel=1e-12)
    assert gjsd_loss(s, t, m, beta=1.0, temperature=temperature).item() == pytest.approx(rev.item(), rel=1e-12)
    # the same numbers from the textbook formula, independent of F.kl_div's argument order
    assert fwd.item() == pytest.approx(_manual_kl(t, s, m, temperature).item(), rel=1e-10)
    assert rev.item() == pytest.approx(_manual_kl(s, t, m, temperature).item(), rel=1e-10)
    assert fwd.item() != pytest.approx(rev.item(), rel=1e-3)  # the directions really differ here


def test_gjsd_mid_beta_is_the_mixture_formula():
    s, t, m, beta = _logits(seed=4), _logits(seed=5), _mask(), 0.3
    P, S = torch.softmax(t, -1), torch.softmax(s, -1)
    M = (1 - beta) * S + beta * P
    jsd = beta * (P * (P / M).log()).sum(-1) + (1 - beta) * (S * (S / M).log()).sum(-1)
    expected = (jsd * m).sum() / m.sum()
    assert gjsd_loss(s, t, m, beta=beta).item() == pytest.approx(expected.item(), rel=1e-10)


def test_gjsd_no_gradient_reaches_the_teacher():
    s = _logits().requires_grad_(True)
    t = _logits(seed=9).requires_grad_(True)
    loss = gjsd_loss(s, t, _mask(), beta=0.5)
    loss.backward()
    assert t.grad is None
    assert s.grad is not None and s.grad.abs().sum() > 0
    # masked-out positions get no gradient
    m = _mask().bool()
    assert s.grad[~m].abs().max().item() == 0.0


def test_gjsd_ignores_masked_positions():
    s, t, m = _logits(seed=6), _logits(seed=7), _mask()
    t2 = t.clone()
    t2[~m.bool()] = 100.0  # garbage where the mask is 0
    assert gjsd_loss(s, t, m).item() == pytest.approx(gjsd_loss(s, t2, m).item(), rel=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_gjsd_matches_trl_gkd(beta, temperature):
    from trl.experimental.gkd import GKDTrainer

    B, T, V = 4, 7, 37
    s = torch.randn(B, T, V, generator=_gen(int(beta * 100 + temperature * 10))) * 3
    t = torch.randn(B, T, V, generator=_gen(int(beta * 100 + temperature * 10) + 1)) * 3
    lengths = torch.tensor([7, 3, 1, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    labels = torch.randint(0, V, (B, T), generator=_gen(3)).masked_fill(~mask, -100)
    ours = gjsd_loss(s, t, mask, beta=beta, temperature=temperature)
    theirs = GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta, temperature=temperature, reduction="batchmean")
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item()))


# --------------------------------------------------------------------------- pg
def test_pg_gradient_is_zero_above_clip_high_for_positive_advantage():
    eps, eps_high = 0.2, 0.28
    old = torch.zeros(1, 4, dtype=torch.float64)
    # ratios 1.5 and 1.3 exceed 1 + eps_high; 1.1 and 0.9 are inside the trust region
    logp = torch.log(torch.tensor([[1.5, 1.3, 1.1, 0.9]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(1, 4)
    loss = pg_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, epsilon=eps, epsilon_high=eps_high, loss_type="bnpo")
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0].item() == 0.0 and grad[0, 1].item() == 0.0
    assert grad[0, 2].item() < 0 and grad[0, 3].item() < 0  # unclipped tokens are pushed up
    # with A < 0 the same high ratios are NOT clipped (pessimistic min): gradient flows
    loss = pg_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), mask, epsilon=eps, epsilon_high=eps_high, loss_type="bnpo")
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0].item() > 0 and grad[0, 1].item() > 0


def test_pg_gradient_is_zero_below_clip_low_for_negative_advantage():
    logp = torch.log(torch.tensor([[0.5, 0.95]], dtype=torch.float64)).requires_grad_(True)
    loss = pg_loss(logp, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([-2.0], dtype=torch.float64), torch.ones(1, 2), loss_type="bnpo")
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0].item() == 0.0 and grad[0, 1].item() > 0


def _reference_pg(logp, old, adv, mask, eps, eps_high, loss_type, ref=None, kl_coef=0.0, L=None, num_items=None, bias_correction=True):
    """Independent loop-based implementation of the four aggregations."""
    B, T = logp.shape
    per = torch.zeros(B, T, dtype=logp.dtype)
    for i in range(B):
        for t in range(T):
            r = math.exp(logp[i, t] - old[i, t])
            a = float(adv[i])
            val = -min(r * a, min(max(r, 1 - eps), 1 + eps_high) * a)
            if kl_coef:
                d = float(ref[i, t] - logp[i, t])
                val += kl_coef * (math.exp(d) - d - 1) * (r if bias_correction else 1.0)
            per[i, t] = val
    m = mask.to(per.dtype)
    if loss_type == "grpo":
        return sum((per[i] * m[i]).sum() / max(m[i].sum(), 1) for i in range(B)) / B
    if loss_type == "bnpo":
        return (per * m).sum() / m.sum()
    if loss_type == "dr_grpo":
        return (per * m).sum() / (B * L)
    return (per * m).sum() / (num_items if num_items is not None else m.sum())


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_pg_loss_aggregations(loss_type, kl_coef):
    g = _gen(11)
    B, T = 4, 6
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)  # some ratios clip
    ref = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.tensor([6, 4, 2, 5])[:, None]).long()
    kwargs = dict(epsilon=0.2, epsilon_high=0.28, loss_type=loss_type, ref_logp=ref, kl_coef=kl_coef, max_completion_length=8)
    got = pg_loss(logp, old, adv, mask, **kwargs)
    want = _reference_pg(logp, old, adv, mask, 0.2, 0.28, loss_type, ref, kl_coef, L=8)
    assert got.item() == pytest.approx(float(want), rel=1e-10)
    got = pg_loss(logp, old, adv, mask, kl_bias_correction=False, **kwargs)
    want = _reference_pg(logp, old, adv, mask, 0.2, 0.28, loss_type, ref, kl_coef, L=8, bias_correction=False)
    assert got.item() == pytest.approx(float(want), rel=1e-10)
    if loss_type == "dapo":
        got = pg_loss(logp, old, adv, mask, num_items=40.0, **kwargs)
        want = _reference_pg(logp, old, adv, mask, 0.2, 0.28, loss_type, ref, kl_coef, num_items=40.0)
        assert got.item() == pytest.approx(float(want), rel=1e-10)


def test_pg_on_policy_default_and_errors():
    logp = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3)
    # old_logp=None is on-policy: ratio 1, loss = -mean(A) over tokens, gradient = -A / N per token
    loss = pg_loss(logp, None, adv, mask, loss_type="bnpo")
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -adv[:, None].expand(2, 3) / 6)
    with pytest.raises(ValueError, match="max_completion_length"):
        pg_loss(logp, None, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_logp"):
        pg_loss(logp, None, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        pg_loss(logp, None, adv, mask, loss_type="ppo")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- dpo
def test_dpo_is_log2_when_policy_equals_reference():
    g = _gen(5)
    pc, pr = -torch.rand(8, generator=g) * 20, -torch.rand(8, generator=g) * 20
    assert dpo_loss(pc, pr, pc.clone(), pr.clone(), beta=0.1).item() == pytest.approx(math.log(2), rel=1e-6)
    assert dpo_loss(pc, pr, pc.clone(), pr.clone(), beta=3.0).item() == pytest.approx(math.log(2), rel=1e-6)


def test_dpo_sigmoid_formula_and_direction():
    pc, pr = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    rc, rr = torch.tensor([-3.5, -5.5]), torch.tensor([-3.0, -2.5])
    beta = 0.5
    z = beta * ((pc - rc) - (pr - rr))
    expected = torch.log1p(torch.exp(-z)).mean()
    assert dpo_loss(pc, pr, rc, rr, beta=beta).item() == pytest.approx(expected.item(), rel=1e-6)
    # raising the chosen log-prob lowers the loss: the gradient on chosen is negative, on rejected positive
    pc = pc.clone().requires_grad_(True)
    pr = pr.clone().requires_grad_(True)
    gc, gr = torch.autograd.grad(dpo_loss(pc, pr, rc, rr, beta=beta), (pc, pr))
    assert (gc < 0).all() and (gr > 0).all()


def test_simpo_prefers_wider_separation():
    lc, lr = torch.tensor([4.0]), torch.tensor([6.0])
    losses = []
    for gap in [0.0, 0.5, 1.0, 2.0]:
        pc = torch.tensor([-1.0]) * lc  # avg log-prob -1 for chosen
        pr = torch.tensor([-1.0 - gap]) * lr  # rejected avg log-prob lower by `gap`
        losses.append(dpo_loss(pc, pr, None, None, beta=2.0, variant="simpo", gamma=0.5, chosen_length=lc, rejected_length=lr).item())
    assert all(a > b for a, b in zip(losses, losses[1:]))
    # and it is length-normalised: scaling both sums by their lengths gives the per-token formula
    assert losses[2] == pytest.approx(simpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), beta=2.0, gamma=0.5).item())
    assert losses[2] == pytest.approx(-F.logsigmoid(torch.tensor(2.0 * 1.0 - 0.5)).item())
    with pytest.raises(ValueError, match="chosen_length"):
        dpo_loss(pc, pr, None, None, variant="simpo")
    with pytest.raises(ValueError, match="ref_chosen_logp"):
        dpo_loss(pc, pr, None, None, variant="sigmoid")


# --------------------------------------------------------------------------- combined
def _channel_inputs(requires_grad=True):
    g = _gen(21)
    logp = (-torch.rand(3, 5, generator=g, dtype=torch.float64)).requires_grad_(requires_grad)
    pg = PGInputs(logp=logp, advantages=torch.tensor([1.0, -0.5, 0.2], dtype=torch.float64), mask=_mask())
    s = _logits(seed=22).requires_grad_(requires_grad)
    sd = SDPOInputs(student_logits=s, teacher_logits=_logits(seed=23), mask=_mask())
    pc = (-torch.rand(2, generator=g, dtype=torch.float64) * 10).requires_grad_(requires_grad)
    pr = (-torch.rand(2, generator=g, dtype=torch.float64) * 10).requires_grad_(requires_grad)
    dp = DPOInputs(pc, pr, pc.detach() + 0.3, pr.detach() - 0.2, torch.tensor([3, 4]), torch.tensor([5, 2]))
    return pg, sd, dp


def test_three_channel_total_is_the_weighted_sum():
    pg, sd, dp = _channel_inputs()
    cfg = ThreeChannelConfig(pg_weight=1.0, sdpo_weight=0.7, dpo_weight=0.3, loss_type="bnpo", jsd_beta=0.4, dpo_beta=0.2)
    out = three_channel_loss(cfg, pg=pg, sdpo=sd, dpo=dp)
    p = pg_loss(pg.logp, None, pg.advantages, pg.mask, loss_type="bnpo")
    s = gjsd_loss(sd.student_logits, sd.teacher_logits, sd.mask, beta=0.4)
    d = dpo_loss(dp.policy_chosen_logp, dp.policy_rejected_logp, dp.ref_chosen_logp, dp.ref_rejected_logp, beta=0.2)
    assert out.total.item() == pytest.approx((p + 0.7 * s + 0.3 * d).item(), rel=1e-12)
    assert out.active == ("pg", "sdpo", "dpo")
    for name, value in [("pg", p), ("sdpo", s), ("dpo", d)]:
        assert out.metrics[name].item() == pytest.approx(value.item(), rel=1e-12)
        assert not out.metrics[name].requires_grad
    assert out.total.requires_grad
    assert 0.0 <= out.metrics["dpo_accuracy"].item() <= 1.0


def test_three_channel_skips_zero_weight_and_absent_channels():
    pg, sd, dp = _channel_inputs()
    # zero weight: the channel's inputs get no gradient at all (not computed)
    out = three_channel_loss(ThreeChannelConfig(sdpo_weight=0.0, dpo_weight=0.5), pg=pg, sdpo=sd, dpo=dp)
    assert out.active == ("pg", "dpo") and "sdpo" not in out.metrics
    out.total.backward()
    assert sd.student_logits.grad is None
    assert dp.policy_chosen_logp.grad is not None
    # absent inputs: skipped even with a non-zero weight
    out = three_channel_loss(ThreeChannelConfig(sdpo_weight=1.0, dpo_weight=1.0), pg=pg)
    assert out.active == ("pg",) and set(out.metrics) >= {"pg", "total"} and "dpo" not in out.metrics
    with pytest.raises(ValueError, match="every channel is skipped"):
        three_channel_loss(ThreeChannelConfig(pg_weight=0.0, sdpo_weight=1.0), pg=pg)


def test_config_validation():
    with pytest.raises(ValueError):
        ThreeChannelConfig(loss_type="dr_grpo")  # needs max_completion_length
    with pytest.raises(ValueError):
        ThreeChannelConfig(jsd_beta=1.5)
    with pytest.raises(ValueError):
        ThreeChannelConfig(sdpo_weight=-1.0)
    with pytest.raises(ValueError):
        ThreeChannelConfig(dpo_variant="ipo")  # type: ignore[arg-type]
