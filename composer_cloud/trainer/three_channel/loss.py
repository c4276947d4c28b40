"""The three-channel loss as pure tensor functions (torch only, no TRL, no model).

``total = pg_weight * pg + sdpo_weight * sdpo + dpo_weight * dpo`` where

* **pg** (channel 1) is the clipped-ratio policy gradient of GRPO / DAPO on
  sampled completions scored by a verifiable reward;
* **sdpo** (channel 2) is a divergence between the student (the model
  without a hint) and the teacher (the same model with a hint in its
  context) on the same completion tokens: the generalized Jensen-Shannon
  divergence, TAID or entropy-aware on-policy distillation
  (:mod:`~composer_cloud.trainer.three_channel.distill`);
* **dpo** (channel 3) is a preference loss on replayed (chosen, rejected) pairs
  with stored reference log-probabilities (DPO, sigmoid) or without a reference
  (SimPO).

Units and conventions used throughout:

* log-probabilities are natural-log (nats) per token, shape ``(B, T)`` over the
  completion positions only; ``mask`` is ``(B, T)`` with 1 on real completion
  tokens and 0 on padding;
* logits are ``(B, T, V)`` at the positions that *predict* the completion
  tokens (i.e. already shifted);
* sequence log-probabilities (channel 3) are sums of per-token log-probs over
  the response tokens, shape ``(N,)``;
* every function returns a scalar (0-dim) loss to be minimised.

Parameter names follow the TRL function each one mirrors: ``gjsd_loss(beta=)``
is ``GKDTrainer.generalized_jsd_loss``'s interpolation, ``dpo_loss(beta=)``
DPO's inverse temperature. Their config fields carry a prefix (``jsd_beta``,
``dpo_beta``, ``kl_coef``) because one config holds all of them; see
:mod:`composer_cloud.trainer.three_channel.settings`.

The aggregations of :func:`pg_loss` are the ones of TRL 1.16's
``GRPOTrainer._compute_loss`` for ``importance_sampling_level="token"`` and one
process without gradient accumulation; :func:`gjsd_loss` is TRL's
``GKDTrainer.generalized_jsd_loss`` with ``reduction="batchmean"``. Parity with
both is tested in ``tests/test_loss.py`` and ``tests/test_three_channel.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from composer_cloud.trainer.three_channel.distill import entropy_opd_loss, gjsd_loss, taid_loss

# The loss's hyper-parameters are part of the trainer's one settings class (defined, and validated, there).
from composer_cloud.trainer.three_channel.settings import (
    DPO_VARIANTS,
    LOSS_TYPES,
    SDPO_VARIANTS,
    DPOVariant,
    LossType,
    ThreeChannelConfig,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- channel 1
def pg_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float = 0.28,
    loss_type: LossType = "dapo",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    max_completion_length: int | None = None,
    num_items: torch.Tensor | float | None = None,
    kl_bias_correction: bool = True,
    sampling_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clipped-ratio policy-gradient loss of GRPO and its variants.

    Per token ``t`` of completion ``i`` with ratio ``r = exp(logp - old_logp)``::

        l_it = -min(r * A_i, clip(r, 1 - epsilon, 1 + epsilon_high) * A_i)
               + kl_coef * w * (exp(ref - logp) - (ref - logp) - 1)   # k3 estimator of KL(pi || ref)

    where ``w = r`` (differentiable, so it changes the KL gradient even
    on-policy, where its value is 1) when ``kl_bias_correction`` is on, as in
    TRL >= 1.16's default ``use_bias_correction_kl=True`` (DeepSeek-V3.2's
    unbiased reverse-KL gradient), and ``w = 1`` otherwise.

    and the aggregation over masked tokens is

    * ``grpo``:    mean over sequences of (sum_t l_it / |o_i|);
    * ``bnpo``:    sum_it l_it / sum_i |o_i|  (token mean over the micro-batch);
    * ``dr_grpo``: sum_it l_it / (B * max_completion_length);
    * ``dapo``:    sum_it l_it / num_items, where ``num_items`` is TRL's
      normaliser: the completion tokens of the whole generation batch
      (``num_items_in_batch``), clamped to >= 1, over the micro-batches it is
      split into; it defaults to ``max(mask.sum(), 1)``, which is the same
      thing when a generation batch is one micro-batch.

    Args:
        logp: ``(B, T)`` per-token log-probs of the current policy (with grad).
        old_logp: ``(B, T)`` log-probs of the policy that sampled the tokens;
            ``None`` means on-policy (``logp.detach()``), as in TRL.
        advantages: ``(B,)`` or ``(B, T)`` advantages (no grad).
        mask: ``(B, T)`` 1 for completion tokens, 0 for padding.
        epsilon: lower clip range (TRL's ``epsilon``/``epsilon_low``).
        epsilon_high: upper clip range (DAPO's "clip-higher").
        loss_type: one of ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``.
        ref_logp: ``(B, T)`` reference log-probs; required when ``kl_coef != 0``.
        kl_coef: weight of the per-token k3 KL penalty (TRL's ``beta``).
        max_completion_length: required for ``dr_grpo`` (its constant normaliser).
        num_items: ``dapo`` normaliser (tokens, > 0, used as given); defaults to ``max(mask.sum(), 1)``.
        kl_bias_correction: multiply the KL term by the ratio (TRL's default).
        sampling_ratio: ``(B, T)`` or ``(B, 1)`` importance weights of the
            training policy against the engine that sampled (vLLM); the
            clipped term is multiplied by it, the KL term is not (TRL's
            ``importance_sampling_ratio``, computed by ``GRPOTrainer`` from
            ``vllm_importance_sampling_mode`` and its clip bounds).

    Returns:
        Scalar loss (nats per token for bnpo/dapo, per token averaged per
        sequence for grpo).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if old_logp is None:
        old_logp = logp.detach()
    mask = mask.to(logp.dtype)

    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if sampling_ratio is not None:
        per_token_loss = per_token_loss * sampling_ratio
    if kl_coef != 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef != 0 needs ref_logp")
        per_token_kl = k3_kl(logp, ref_logp)
        if kl_bias_correction:
            per_token_kl = per_token_kl * coef_1
        per_token_loss = per_token_loss + kl_coef * per_token_kl

    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (its normaliser is B * L_max)")
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    # dapo: a given normaliser is used as it is (TRL clamps the token count to >= 1 before scaling it)
    if num_items is None:
        num_items = mask.sum().clamp(min=1.0)
    if not isinstance(num_items, torch.Tensor):
        num_items = torch.tensor(float(num_items), dtype=logp.dtype, device=logp.device)
    return (per_token_loss * mask).sum() / num_items.to(logp.device)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, nats)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


#: Channel 1's clipping metrics, TRL's names (see :func:`pg_clip_stats`).
CLIP_METRICS: tuple[str, ...] = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


@torch.no_grad()
def pg_clip_stats(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float = 0.28,
) -> dict[str, torch.Tensor]:
    """TRL's ``clip_ratio/*`` metrics: which masked tokens the clipped objective cuts off.

    A token is low-clipped when ``r < 1 - epsilon`` and ``A < 0``, high-clipped
    when ``r > 1 + epsilon_high`` and ``A > 0``. ``*_mean`` are fractions of
    the masked tokens; ``low_min`` / ``high_max`` the smallest / largest
    per-sequence fraction (sequences without tokens are ignored).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if old_logp is None:
        old_logp = logp
    ratio = torch.exp(logp - old_logp)
    m = mask.to(logp.dtype)
    low = ((ratio < 1 - epsilon) & (advantages < 0)).to(logp.dtype)
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(logp.dtype)

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * m).sum() / m.sum().clamp(min=1.0)

    def per_sequence(x: torch.Tensor) -> torch.Tensor:
        return (x * m).sum(-1) / m.sum(-1)  # NaN for a sequence without tokens, as in TRL

    return {
        "clip_ratio/low_mean": token_mean(low),
        "clip_ratio/high_mean": token_mean(high),
        "clip_ratio/region_mean": token_mean(torch.maximum(low, high)),
        "clip_ratio/low_min": _nan_reduce(per_sequence(low), torch.min),
        "clip_ratio/high_max": _nan_reduce(per_sequence(high), torch.max),
    }


def _nan_reduce(x: torch.Tensor, reduce: Any) -> torch.Tensor:
    """``reduce`` over the non-NaN entries of ``x``; NaN when there are none (TRL's ``nanmin`` / ``nanmax``)."""
    kept = x[~torch.isnan(x)]
    return reduce(kept) if kept.numel() else torch.tensor(float("nan"), dtype=x.dtype, device=x.device)


# --------------------------------------------------------------------------- channel 3
def dpo_loss(
    policy_chosen_logp: torch.Tensor,
    policy_rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor | None = None,
    ref_rejected_logp: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    variant: DPOVariant = "sigmoid",
    gamma: float = 0.5,
    chosen_length: torch.Tensor | None = None,
    rejected_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """Preference loss on ``N`` pairs, averaged over pairs (nats).

    * ``sigmoid`` (DPO): ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))`` with
      sequence log-probs of the policy (``pc``, ``pr``) and of the reference
      (``rc``, ``rr``). Equals ``log 2`` when policy == reference.
    * ``simpo`` (SimPO, no reference): ``-log sigmoid(beta * (pc / |yc| - pr / |yr|) - gamma)``
      on length-averaged log-probs; ``chosen_length`` / ``rejected_length``
      (response tokens, ``(N,)``) are required, the reference is ignored.
      SimPO is usually run with ``beta`` around 2 and ``gamma`` around 0.5-1.5.
    """
    if variant == "sigmoid":
        if ref_chosen_logp is None or ref_rejected_logp is None:
            raise ValueError("variant='sigmoid' needs ref_chosen_logp and ref_rejected_logp")
        logits = (policy_chosen_logp - ref_chosen_logp) - (policy_rejected_logp - ref_rejected_logp)
        return -F.logsigmoid(beta * logits).mean()
    if variant == "simpo":
        if chosen_length is None or rejected_length is None:
            raise ValueError("variant='simpo' needs chosen_length and rejected_length")
        return simpo_loss(
            policy_chosen_logp / chosen_length.to(policy_chosen_logp.dtype).clamp(min=1.0),
            policy_rejected_logp / rejected_length.to(policy_rejected_logp.dtype).clamp(min=1.0),
            beta=beta,
            gamma=gamma,
        )
    raise ValueError(f"variant must be one of {DPO_VARIANTS}, got {variant!r}")


def simpo_loss(
    chosen_avg_logp: torch.Tensor, rejected_avg_logp: torch.Tensor, *, beta: float = 2.0, gamma: float = 0.5
) -> torch.Tensor:
    """SimPO on length-averaged log-probs: ``-log sigmoid(beta * (c - r) - gamma)``, mean over pairs."""
    return -F.logsigmoid(beta * (chosen_avg_logp - rejected_avg_logp) - gamma).mean()


# --------------------------------------------------------------------------- combined
@dataclass
class PGInputs:
    """Channel 1 inputs; see :func:`pg_loss` for shapes."""

    logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    num_items: torch.Tensor | float | None = None
    sampling_ratio: torch.Tensor | None = None


@dataclass
class SDPOInputs:
    """Channel 2 inputs; see :func:`gjsd_loss` for shapes. ``taid_t``: TAID's current ``t`` (``"taid"`` only)."""

    student_logits: torch.Tensor
    teacher_logits: torch.Tensor
    mask: torch.Tensor
    taid_t: float | None = None


@dataclass
class DPOInputs:
    """Channel 3 inputs; see :func:`dpo_loss` for shapes."""

    policy_chosen_logp: torch.Tensor
    policy_rejected_logp: torch.Tensor
    ref_chosen_logp: torch.Tensor | None = None
    ref_rejected_logp: torch.Tensor | None = None
    chosen_length: torch.Tensor | None = None
    rejected_length: torch.Tensor | None = None


@dataclass
class LossOutput:
    """``total`` carries the gradient; ``metrics`` are detached 0-dim tensors.

    ``metrics`` has ``total`` plus one entry per *computed* channel (``pg``,
    ``sdpo``, ``dpo``, unweighted) and diagnostics: channel 1's under TRL's
    names (``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
    ``clip_ratio/region_mean``, ``clip_ratio/low_min``,
    ``clip_ratio/high_max``, ``kl``), channel 3's ``dpo_margin`` and
    ``dpo_accuracy``. A skipped channel
    has no entry; ``active`` lists the computed channels in order.
    """

    total: torch.Tensor
    metrics: dict[str, torch.Tensor]
    active: tuple[str, ...]


def three_channel_loss(
    config: ThreeChannelConfig,
    *,
    pg: PGInputs | None = None,
    sdpo: SDPOInputs | None = None,
    dpo: DPOInputs | None = None,
) -> LossOutput:
    """``total = pg_weight * pg + sdpo_weight * sdpo + dpo_weight * dpo``.

    A channel whose weight is 0 or whose inputs are ``None`` is skipped: its
    loss is not computed and it contributes neither value nor gradient. (To
    save the *forward passes* too, callers check ``config.*_active`` before
    building a channel's inputs.) At least one channel must be computed.

    Raises:
        ValueError: when every channel is skipped.
    """
    terms: list[torch.Tensor] = []
    metrics: dict[str, torch.Tensor] = {}
    active: list[str] = []

    if config.pg_active and pg is not None:
        value, extra = _pg_term(config, pg)
        terms.append(config.pg_weight * value)
        metrics["pg"] = value.detach()
        metrics.update(extra)
        active.append("pg")

    if config.sdpo_active and sdpo is not None:
        value, extra = sdpo_loss(config, sdpo)
        terms.append(config.sdpo_weight * value)
        metrics["sdpo"] = value.detach()
        metrics.update(extra)
        active.append("sdpo")

    if config.dpo_active and dpo is not None:
        value = dpo_loss(dpo.policy_chosen_logp, dpo.policy_rejected_logp, dpo.ref_chosen_logp, dpo.ref_rejected_logp,
                         beta=config.dpo_beta, variant=config.dpo_variant, gamma=config.simpo_gamma,
                         chosen_length=dpo.chosen_length, rejected_length=dpo.rejected_length)
        terms.append(config.dpo_weight * value)
        metrics["dpo"] = value.detach()
        metrics.update(_dpo_stats(dpo, config))
        active.append("dpo")

    if not terms:
        raise ValueError("three_channel_loss: every channel is skipped (zero weight or no inputs)")
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    metrics["total"] = total.detach()
    return LossOutput(total=total, metrics=metrics, active=tuple(active))


def _pg_term(config: ThreeChannelConfig, pg: PGInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Channel 1 under ``config``, and TRL's diagnostics of it (``clip_ratio/*``, ``kl``)."""
    value = pg_loss(pg.logp, pg.old_logp, pg.advantages, pg.mask, epsilon=config.epsilon,
                    epsilon_high=config.epsilon_high, loss_type=config.loss_type, ref_logp=pg.ref_logp,
                    kl_coef=config.kl_coef, max_completion_length=config.completion_length, num_items=pg.num_items,
                    kl_bias_correction=config.kl_bias_correction, sampling_ratio=pg.sampling_ratio)
    metrics = pg_clip_stats(pg.logp.detach(), pg.old_logp, pg.advantages, pg.mask, epsilon=config.epsilon,
                            epsilon_high=config.epsilon_high)
    if config.kl_coef != 0.0 and pg.ref_logp is not None:
        with torch.no_grad():  # TRL's "kl": the k3 term as it enters the loss (times the ratio when corrected)
            kl = k3_kl(pg.logp, pg.ref_logp)
            if config.kl_bias_correction:
                kl = kl * torch.exp(pg.logp - (pg.logp if pg.old_logp is None else pg.old_logp))
            m = pg.mask.to(pg.logp.dtype)
            metrics["kl"] = (kl * m).sum() / m.sum().clamp(min=1.0)
    return value, metrics


def sdpo_loss(config: ThreeChannelConfig, sdpo: SDPOInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Channel 2 under ``config.sdpo_variant``, and its diagnostics (``taid_t``, ``taid_objective``)."""
    if config.sdpo_variant == "jsd":
        value = gjsd_loss(sdpo.student_logits, sdpo.teacher_logits, sdpo.mask, beta=config.jsd_beta,
                          temperature=config.jsd_temperature)
        return value, {}
    if config.sdpo_variant == "taid":
        if sdpo.taid_t is None:
            raise ValueError("sdpo_variant='taid' needs SDPOInputs.taid_t (the schedule's current t)")
        taid = taid_loss(sdpo.student_logits, sdpo.teacher_logits, sdpo.mask, t=sdpo.taid_t)
        t = torch.tensor(sdpo.taid_t, dtype=taid.kl.dtype)
        return taid.kl, {"taid_t": t, "taid_objective": taid.cross_entropy}
    if config.sdpo_variant == "entropy_opd":
        return entropy_opd_loss(sdpo.student_logits, sdpo.teacher_logits, sdpo.mask, h_max=config.opd_h_max), {}
    raise ValueError(f"sdpo_variant must be one of {SDPO_VARIANTS}, got {config.sdpo_variant!r}")


@torch.no_grad()
def _dpo_stats(dpo: DPOInputs, config: ThreeChannelConfig) -> dict[str, torch.Tensor]:
    """Implicit-reward margin (nats) and the fraction of pairs where chosen beats rejected."""
    if config.dpo_variant == "sigmoid" and dpo.ref_chosen_logp is not None and dpo.ref_rejected_logp is not None:
        margin = (dpo.policy_chosen_logp - dpo.ref_chosen_logp) - (dpo.policy_rejected_logp - dpo.ref_rejected_logp)
        margin = config.dpo_beta * margin
    elif dpo.chosen_length is not None and dpo.rejected_length is not None:
        margin = dpo.policy_chosen_logp / dpo.chosen_length.clamp(min=1) - dpo.policy_rejected_logp / (
            dpo.rejected_length.clamp(min=1)
        )
    else:
        return {}
    return {"dpo_margin": margin.mean(), "dpo_accuracy": (margin > 0).to(margin.dtype).mean()}


__all__ = [
    "CLIP_METRICS",
    "DPOInputs",
    "LossOutput",
    "PGInputs",
    "SDPOInputs",
    "ThreeChannelConfig",
    "dpo_loss",
    "gjsd_loss",
    "k3_kl",
    "pg_clip_stats",
    "pg_loss",
    "sdpo_loss",
    "simpo_loss",
    "three_channel_loss",
]
