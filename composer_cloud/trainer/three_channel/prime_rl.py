"""Channel 1 as a PRIME-RL custom loss: the three-channel trainer's policy gradient inside PRIME-RL's trainer.

PRIME-RL (``PrimeIntellect-ai/prime-rl``) calls a custom loss once per sequence
with its ``LossInputs`` (1-D tensors over the sequence's tokens:
``trainer_logprobs``, ``inference_logprobs``, ``ref_logprobs``,
``advantages``, ``loss_mask``, ``loss_weights``) and the ``kwargs`` of its
``CustomLossConfig``, and reads ``loss`` and ``metrics`` from what it returns;
it sums the per-sequence losses and divides by the global token count. Wire it
in PRIME-RL's trainer config::

    [trainer.loss]
    type = "custom"
    import_path = "composer_cloud.trainer.three_channel.prime_rl.prime_rl_loss"

    [trainer.loss.kwargs]
    dppo_mask_low = 0.2
    dppo_mask_high = 0.2
    adv_tau = 1.0
    kl_tau = 0.001

The loss (per sequence, summed over its tokens)::

    ratio  = exp(trainer_lp - inference_lp)
    diff   = exp(trainer_lp) - exp(inference_lp)              # probability moved since sampling
    masked = diff > dppo_mask_high   where advantage > 0       # pushed up too far already
             diff < -dppo_mask_low   where advantage <= 0      # pushed down too far already
    keep   = loss_mask & ~masked
    pg     = keep * adv_tau * advantage * ratio
    kl     = loss_mask * (trainer_lp - inference_lp) ** 2
    loss   = pg_weight * sum((-pg + kl_tau * kl) * loss_weights)

Only channel 1 can run there: channel 2 needs the student's and the teacher's
full next-token distributions, and PRIME-RL hands a loss the sampled tokens'
log-probabilities only; channel 3 needs replayed pairs and a forward pass of
the model. A non-zero ``sdpo_weight`` or ``dpo_weight`` is refused with that
reason. Nothing here imports PRIME-RL: any object with those attributes is
accepted, and :class:`PrimeRLLossOutputs` has the fields PRIME-RL reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class PrimeRLLossOutputs:
    """What PRIME-RL reads from a custom loss: a scalar ``loss`` and 0-dim ``metrics`` (averaged over sequences)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def prime_rl_loss(
    inputs: Any,
    *,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    pg_weight: float = 1.0,
    sdpo_weight: float = 0.0,
    dpo_weight: float = 0.0,
) -> PrimeRLLossOutputs:
    """Channel 1 on one PRIME-RL sequence (see the module docstring for the formula and the config snippet).

    Args:
        inputs: PRIME-RL's ``LossInputs`` (or anything with its attributes),
            1-D tensors of one sequence's length; ``loss_weights`` may be ``None``.
        dppo_mask_low, dppo_mask_high: probability-difference trust region, conditioned on the advantage's sign.
        adv_tau: scale of the advantage term; kl_tau: weight of the squared log-ratio.
        pg_weight: channel 1's weight. sdpo_weight, dpo_weight: must be 0 (refused with the reason).

    Raises:
        ValueError: channel 2 or 3 asked for, or tensors of different shapes.
    """
    if sdpo_weight != 0.0:
        raise ValueError(
            "prime_rl_loss: sdpo_weight must be 0: channel 2 compares the student's and the hinted teacher's full "
            "next-token distributions, and PRIME-RL passes a loss the sampled tokens' log-probabilities only. "
            "Run channel 2 with composer-cloud's three-channel trainer."
        )
    if dpo_weight != 0.0:
        raise ValueError(
            "prime_rl_loss: dpo_weight must be 0: channel 3 scores replayed (chosen, rejected) pairs with a forward "
            "pass of the model, which a PRIME-RL loss function does not get."
        )
    trainer_lp, inference_lp = inputs.trainer_logprobs, inputs.inference_logprobs
    advantages, loss_mask = inputs.advantages, inputs.loss_mask.bool()
    shapes = {tuple(t.shape) for t in (trainer_lp, inference_lp, advantages, loss_mask)}
    if len(shapes) != 1:
        raise ValueError(f"prime_rl_loss: trainer/inference log-probs, advantages and loss_mask differ in shape: "
                         f"{sorted(shapes)}")

    log_ratio = trainer_lp - inference_lp
    ratio = torch.exp(log_ratio)
    diff = torch.exp(trainer_lp) - torch.exp(inference_lp)
    too_high, too_low = diff > dppo_mask_high, diff < -dppo_mask_low
    positive = advantages > 0
    masked = torch.where(positive, too_high, too_low)
    keep = loss_mask & ~masked

    pg = keep * (adv_tau * advantages) * ratio
    kl = loss_mask * log_ratio**2
    per_token = -pg + kl_tau * kl
    weights = getattr(inputs, "loss_weights", None)
    if weights is not None:
        per_token = per_token * weights
    loss = pg_weight * per_token.sum()

    with torch.no_grad():
        mismatch_kl = ratio - log_ratio - 1
        metrics = {
            "is_masked": _mean(masked, loss_mask),
            "is_masked_high": _mean(positive & too_high, loss_mask),
            "is_masked_low": _mean(~positive & (advantages < 0) & too_low, loss_mask),
            "masked_mismatch_kl": _mean(mismatch_kl, loss_mask & masked),
            "unmasked_mismatch_kl": _mean(mismatch_kl, keep),
        }
    return PrimeRLLossOutputs(loss=loss, metrics=metrics)


def _mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` holds; 0 when it holds nowhere (PRIME-RL's ``_safe_mean``)."""
    return values.float()[mask].sum() / mask.sum().clamp(min=1)


__all__ = ["PrimeRLLossOutputs", "prime_rl_loss"]
