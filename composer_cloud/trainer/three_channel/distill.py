"""Channel 2's divergences: how the student's next-token distributions are pulled towards the hinted teacher's.

All take ``(B, T, V)`` student and teacher logits at the positions predicting
the completion tokens and a ``(B, T)`` mask, detach the teacher, and return a
scalar averaged over the masked tokens (nats). ``sdpo_variant`` picks one:

* ``"jsd"``: :func:`gjsd_loss`, the generalized Jensen-Shannon divergence
  (TRL's ``GKDTrainer.generalized_jsd_loss``);
* ``"taid"``: :func:`taid_loss`, TAID (Shing et al., arXiv 2501.16937): the
  target interpolates from the student towards the teacher as training goes,
  driven by :class:`TAIDSchedule`;
* ``"entropy_opd"``: :func:`entropy_opd_loss`, entropy-aware on-policy
  distillation (arXiv 2603.07079): forward KL where the teacher is unsure,
  reverse KL where it is sure.

Torch only; no TRL, no model.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    keep = mask.bool()
    return per_token[keep].sum() / keep.sum().clamp_min(1)


# --------------------------------------------------------------------------- jsd
def gjsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence per token, averaged over masked tokens (nats).

    With ``S = softmax(student / T)``, ``P = softmax(teacher / T)`` and the
    mixture ``M = (1 - beta) * S + beta * P``::

        JSD_beta = beta * KL(P || M) + (1 - beta) * KL(S || M)
        beta = 0  ->  KL(P || S)   (forward KL: teacher || student)
        beta = 1  ->  KL(S || P)   (reverse KL: student || teacher)

    The result is ``sum_{masked (b, t)} sum_v JSD / max(#masked, 1)``, which is
    exactly TRL's ``GKDTrainer.generalized_jsd_loss(student, teacher, labels,
    beta, temperature, reduction="batchmean")`` with ``labels = -100`` where
    ``mask`` is 0. The teacher is detached: no gradient ever reaches it.

    Args:
        student_logits: ``(B, T, V)`` logits predicting the completion tokens.
        teacher_logits: ``(B, T, V)`` logits of the teacher at the same positions.
        mask: ``(B, T)`` 1 where the token counts.
        beta: interpolation in ``[0, 1]``.
        temperature: softmax temperature applied to both.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student {tuple(student_logits.shape)} and teacher {tuple(teacher_logits.shape)} differ")
    # Same operations, in the same order, as TRL's GKD implementation, so the
    # two agree to float rounding.
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits.detach() / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-b), teacher_log_probs + torch.log(b)]), dim=0
        )
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = b * kl_teacher + (1 - b) * kl_student
    return _masked_mean(jsd, mask)


# --------------------------------------------------------------------------- TAID
class TAIDLoss(NamedTuple):
    """:func:`taid_loss`'s result: the loss (with gradient) and TAID's own objective value (no gradient)."""

    kl: torch.Tensor
    cross_entropy: torch.Tensor


def taid_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, *, t: float) -> TAIDLoss:
    """TAID's distillation loss at interpolation ``t`` in ``[0, 1]``.

    The target is ``p_t = softmax((1 - t) * stopgrad(student) + t * teacher)``
    (the interpolation is in logit space, as in TAID's code). TAID minimises
    the cross-entropy ``-sum_v p_t(v) log p_s(v)``; ``kl`` is that minus the
    target's entropy ``H(p_t)``, which has no gradient: ``KL(p_t || p_s)``,
    the same gradient, a value that is 0 when the student matches the
    target. At ``t = 0`` the target is the student itself (no teacher signal,
    zero gradient); at ``t = 1`` ``kl`` is the forward KL ``KL(teacher ||
    student)``. ``cross_entropy`` is TAID's objective value, which its
    adaptive schedule reads (:meth:`TAIDSchedule.update`).
    """
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"t must be in [0, 1], got {t}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student {tuple(student_logits.shape)} and teacher {tuple(teacher_logits.shape)} differ")
    student_logp = F.log_softmax(student_logits, dim=-1)
    target_logp = F.log_softmax((1.0 - t) * student_logits.detach() + t * teacher_logits.detach(), dim=-1)
    kl = F.kl_div(student_logp, target_logp, reduction="none", log_target=True).sum(-1)
    with torch.no_grad():
        entropy = -(target_logp.exp() * target_logp).sum(-1)
    loss = _masked_mean(kl, mask)
    return TAIDLoss(loss, (loss.detach() + _masked_mean(entropy, mask)))


@dataclass
class TAIDSchedule:
    """TAID's interpolation parameter ``t`` over optimizer steps.

    ``"linear"``: ``t`` goes from ``t_start`` to ``t_end`` over ``steps``
    optimizer steps. ``"adaptive"`` (TAID's default): after each step with
    objective ``J``, ``m <- beta * m + (1 - beta) * (J_prev - J) / J_prev``
    and ``t <- min(t_end, max(linear target, t + alpha * sigmoid(m) * (1 - t)))``,
    so ``t`` never falls behind the linear schedule and runs ahead of it
    while the objective keeps falling. The first step only records ``J``
    (as TAID's ``update_t`` does). Values are Python floats, so the state
    (:meth:`state_dict`, JSON) restores bit-for-bit.
    """

    t_start: float = 0.4
    t_end: float = 1.0
    alpha: float = 5e-4
    beta: float = 0.99
    steps: int = 1000
    adaptive: bool = True
    t: float = -1.0  # set to t_start in __post_init__
    momentum: float = 0.0
    prev_objective: float | None = None
    step: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.t_start <= self.t_end <= 1.0:
            raise ValueError(f"TAID needs 0 <= t_start <= t_end <= 1, got {self.t_start}, {self.t_end}")
        if self.t < 0.0:
            self.t = float(self.t_start)

    def target(self) -> float:
        """The linear schedule's ``t`` at the current step."""
        progress = min(1.0, self.step / self.steps)
        return self.t_start + (self.t_end - self.t_start) * progress

    def update(self, objective: float | None) -> float:
        """Advance one optimizer step whose TAID objective was ``objective`` (``None``: no channel-2 token)."""
        if objective is not None and self.prev_objective is None:
            self.prev_objective = float(objective)  # TAID: the first step only records the objective
        elif not self.adaptive:
            self.t = min(self.t_end, self.target())
        elif objective is not None:
            change = (self.prev_objective - objective) / (self.prev_objective + 1e-15)
            self.momentum = self.beta * self.momentum + (1.0 - self.beta) * change
            delta = self.alpha * (1.0 / (1.0 + math.exp(-self.momentum))) * (1.0 - self.t)
            self.t = min(self.t_end, max(self.target(), self.t + delta))
            self.prev_objective = float(objective)
        else:
            self.t = min(self.t_end, max(self.target(), self.t))
        self.step += 1
        return self.t

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "momentum": self.momentum, "prev_objective": self.prev_objective, "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t, self.momentum = float(state["t"]), float(state["momentum"])
        prev = state["prev_objective"]
        self.prev_objective = None if prev is None else float(prev)
        self.step = int(state["step"])


# --------------------------------------------------------------------------- entropy-aware OPD
def entropy_opd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, *, h_max: float | None = None
) -> torch.Tensor:
    """Entropy-aware on-policy distillation, averaged over masked tokens (nats).

    Per token ``w * KL(teacher || student) + (1 - w) * KL(student || teacher)``
    with ``w = clamp(H(teacher) / h_max, 0, 1)`` (no gradient) and ``h_max``
    defaulting to ``log V``: forward (mode-covering) KL where the teacher
    spreads its mass, reverse (mode-seeking) KL where it is confident.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student {tuple(student_logits.shape)} and teacher {tuple(teacher_logits.shape)} differ")
    h_max = math.log(student_logits.size(-1)) if h_max is None else float(h_max)
    if h_max <= 0:
        raise ValueError(f"h_max must be > 0, got {h_max}")
    student_logp = F.log_softmax(student_logits, dim=-1)
    teacher_logp = F.log_softmax(teacher_logits.detach(), dim=-1)
    forward = F.kl_div(student_logp, teacher_logp, reduction="none", log_target=True).sum(-1)
    reverse = F.kl_div(teacher_logp, student_logp, reduction="none", log_target=True).sum(-1)
    with torch.no_grad():
        w = (-(teacher_logp.exp() * teacher_logp).sum(-1) / h_max).clamp(0.0, 1.0)
    return _masked_mean(w * forward + (1.0 - w) * reverse, mask)


__all__ = ["TAIDLoss", "TAIDSchedule", "entropy_opd_loss", "gjsd_loss", "taid_loss"]
