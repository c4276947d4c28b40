"""The PRIME-RL loss adapter against its formula, with PRIME-RL's per-sequence input shapes."""

from __future__ import annotations

import importlib
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from composer_cloud.trainer.three_channel.prime_rl import prime_rl_loss

ROOT = Path(__file__).parents[1]


@dataclass
class LossInputs:
    """PRIME-RL's ``LossInputs`` fields (prime_rl/trainer/rl/loss.py): one sequence, 1-D tensors."""

    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    loss_weights: torch.Tensor | None = None


def _inputs(n: int = 64, seed: int = 0, weights: bool = False) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    inference = -torch.rand(n, generator=g, dtype=torch.float64) * 2  # log-probs in (-2, 0]
    trainer = (inference + 0.6 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[::7] = 0.0
    mask = torch.rand(n, generator=g) > 0.2
    w = torch.rand(n, generator=g, dtype=torch.float64) if weights else None
    return LossInputs(trainer, inference, None, adv, mask, w)


def _by_hand(x: LossInputs, *, low=0.2, high=0.2, adv_tau=1.0, kl_tau=1e-3, pg_weight=1.0) -> float:
    total = 0.0
    for i in range(len(x.trainer_logprobs)):
        if not x.loss_mask[i]:
            continue
        lt, li, a = float(x.trainer_logprobs[i]), float(x.inference_logprobs[i]), float(x.advantages[i])
        diff = math.exp(lt) - math.exp(li)
        # the trust region is conditioned on the advantage's sign
        masked = diff > high if a > 0 else diff < -low
        pg = 0.0 if masked else adv_tau * a * math.exp(lt - li)
        token = -pg + kl_tau * (lt - li) ** 2
        total += token * (1.0 if x.loss_weights is None else float(x.loss_weights[i]))
    return pg_weight * total


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("kw", [{}, dict(low=0.05, high=0.3, adv_tau=0.5, kl_tau=0.1, pg_weight=2.0)])
def test_equals_the_formula_on_random_tensors(weights, kw):
    x = _inputs(weights=weights)
    args = {"dppo_mask_low": kw.get("low", 0.2), "dppo_mask_high": kw.get("high", 0.2),
            **{k: v for k, v in kw.items() if k not in ("low", "high")}}
    out = prime_rl_loss(x, **args)
    assert out.loss.dim() == 0
    assert out.loss.item() == pytest.approx(_by_hand(x, **kw), rel=1e-12)
    masked = out.metrics["is_masked"].item()
    assert 0.0 < masked < 1.0  # the random case exercises both sides of the trust region


def test_the_mask_depends_on_the_advantage_sign():
    # Token 0: probability went up by 0.3 and the advantage is positive: masked (already pushed up).
    # Token 1: the same move with a negative advantage: kept. Token 2: down by 0.3, negative advantage: masked.
    # Token 3: the same move with a positive advantage: kept.
    p_inf = torch.tensor([0.3, 0.3, 0.6, 0.6], dtype=torch.float64)
    p_new = torch.tensor([0.6, 0.6, 0.3, 0.3], dtype=torch.float64)
    x = LossInputs(p_new.log(), p_inf.log(), None, torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64),
                   torch.ones(4, dtype=torch.bool))
    lp = x.trainer_logprobs.clone().requires_grad_(True)
    out = prime_rl_loss(LossInputs(lp, x.inference_logprobs, None, x.advantages, x.loss_mask), kl_tau=0.0)
    out.loss.backward()
    ratio = (p_new / p_inf)
    # d/d lp of -adv * ratio is -adv * ratio for kept tokens, 0 for masked ones
    assert torch.allclose(lp.grad, torch.stack([0 * ratio[0], ratio[1], 0 * ratio[2], -ratio[3]]))
    assert out.metrics["is_masked"].item() == 0.5
    assert out.metrics["is_masked_high"].item() == 0.25 and out.metrics["is_masked_low"].item() == 0.25


def test_the_kl_term_pulls_towards_the_sampling_policy_on_every_trainable_token():
    x = _inputs(seed=3)
    lp = x.trainer_logprobs.clone().requires_grad_(True)
    prime_rl_loss(LossInputs(lp, x.inference_logprobs, None, torch.zeros_like(lp), x.loss_mask), kl_tau=0.5).loss.backward()
    want = torch.where(x.loss_mask, 2 * 0.5 * (x.trainer_logprobs - x.inference_logprobs), torch.zeros_like(lp))
    assert torch.allclose(lp.grad, want)


def test_channels_two_and_three_are_refused_with_the_reason():
    x = _inputs()
    with pytest.raises(ValueError, match=r"sdpo_weight must be 0: channel 2 .*full next-token distributions"):
        prime_rl_loss(x, sdpo_weight=0.1)
    with pytest.raises(ValueError, match=r"dpo_weight must be 0: channel 3"):
        prime_rl_loss(x, dpo_weight=0.5)
    with pytest.raises(ValueError, match="differ in shape"):
        prime_rl_loss(LossInputs(x.trainer_logprobs, x.inference_logprobs[:5], None, x.advantages, x.loss_mask))


def test_the_documented_prime_rl_config_resolves_and_runs():
    doc = (ROOT / "docs" / "trainer.md").read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", doc, re.M | re.S)  # (language, body), in order
    block = next(b for lang, b in blocks if lang == "toml" and 'type = "custom"' in b)
    loss = tomllib.loads(block)["trainer"]["loss"]
    assert loss["type"] == "custom"
    module, name = loss["import_path"].rsplit(".", 1)  # how PRIME-RL's import_object splits it
    fn = getattr(importlib.import_module(module), name)
    assert fn is prime_rl_loss
    x = _inputs()
    assert fn(x, **loss["kwargs"]).loss.item() == pytest.approx(_by_hand(x, **{
        "low": loss["kwargs"]["dppo_mask_low"], "high": loss["kwargs"]["dppo_mask_high"],
        "adv_tau": loss["kwargs"]["adv_tau"], "kl_tau": loss["kwargs"]["kl_tau"]}), rel=1e-12)
