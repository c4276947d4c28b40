"""The decoupled merge's robust guard: each contribution bounded by its own replica's history.

The median rule of :func:`composer_cloud.sync.checks.outliers` compares the
contributions of one merge with each other; it cannot help when every pending
contribution is forged alike (equal norms), nor with fewer than 3. This guard
compares each contribution with a *reference* that only accepted contributions
built: per rank, a running reference of its accepted pseudo-gradient norms and
token counts, carried in the (write-once, signed) merge records.

Rule (``factor`` = ``sync.outlier_factor``, ``floor`` = ``DecoupledConfig.norm_floor``): a contribution of rank
``r`` is refused when its norm exceeds ``factor x max(ref_norm, floor)`` or its tokens exceed
``factor x ref_tokens``, where ``ref`` is rank ``r``'s reference, or, for a rank with none yet, the median of the
other ranks' references. When no reference exists at all (the run's first merge) only the median rule applies.
A merged contribution moves its rank's reference as ``ref <- DECAY x ref + (1 - DECAY) x max(norm, floor)``.

The floor (:func:`composer_cloud.sync.checks.norm_floor_rms` x sqrt(parameters): 0.1 % of the synced parameters'
norm as built) is the norm of a contribution that carries almost no gradient. Without it, a replica whose first
merged contributions had none (every completion masked: reference 0.0047) had every later real one refused
(> 10 x 0.0047), and refusals never move a reference: it was out for the rest of the run. So a contribution below
the floor counts as the floor, and the bar is never below ``factor x floor``. The floor comes from the parameters
every replica holds, never from the bucket, so a forger cannot raise it.

Guarantee: every merged contribution has ``norm <= factor x max(ref_norm, floor)`` and
``tokens <= factor x ref_tokens`` of a reference built from previously merged contributions only, so a merge
moves the global parameters by at most ``lr x factor x max(max ref_norm, floor)`` (token weights sum to at most
1), and forged or compromised inputs can raise a reference to at most ``DECAY + (1 - DECAY) x factor`` times
``max(ref_norm, floor)`` (3.7 with the default factor 10) per merge they take part in: steering the model
needs many merges, each bounded. Below the floor (a replica with no gradient so far) a forged contribution
gets through only up to ``factor x floor``, 1 % of the parameters' norm with the default factor.
What it does not guarantee: a contribution within the bounds but pointing the
wrong way is merged (templar's held-out-loss check would catch that; it needs
data and compute in the merger, and is left out).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Weight of the previous reference in the running update (0.7: a reference follows a trend within a few merges).
DECAY = 0.7


@dataclass(frozen=True)
class Reference:
    """A rank's running reference: pseudo-gradient L2 norm and tokens per contribution (both > 0)."""

    norm: float
    tokens: float


def reference_for(rank: int, refs: Mapping[int, Reference]) -> Reference | None:
    """``rank``'s own reference, else the median of the other ranks' (None: nobody has one yet)."""
    if rank in refs:
        return refs[rank]
    if not refs:
        return None
    return Reference(norm=statistics.median(r.norm for r in refs.values()),
                     tokens=statistics.median(r.tokens for r in refs.values()))


def refusal(rank: int, norm: float, tokens: int, refs: Mapping[int, Reference], factor: float | None,
            floor: float = 0.0) -> str | None:
    """Why a contribution must not be merged under the guard, or None (``floor``: the no-gradient norm)."""
    ref = reference_for(rank, refs)
    if factor is None or ref is None:
        return None
    bar = max(ref.norm, floor)
    if bar > 0 and norm > factor * bar:
        scale = (f"reference {ref.norm:.4g}" if ref.norm >= floor else
                 f"no-gradient floor {floor:.4g} (reference {ref.norm:.4g} is below it)")
        return f"norm {norm:.4g} > outlier_factor={factor} x {scale} (replica {rank}'s history)"
    if tokens > factor * ref.tokens:
        return f"tokens {tokens} > outlier_factor={factor} x reference {ref.tokens:.4g} (replica {rank}'s history)"
    return None


def updated(refs: Mapping[int, Reference], accepted: Sequence[tuple[int, float, int]],
            floor: float = 0.0) -> dict[int, Reference]:
    """References after a merge that accepted ``(rank, norm, tokens)`` contributions (in merge order).

    A norm below ``floor`` counts as ``floor``: a contribution with almost no gradient never lowers the bar.
    """
    out = dict(refs)
    for rank, norm, tokens in accepted:
        if not (math.isfinite(norm) and norm >= 0 and tokens > 0):
            continue
        norm = max(norm, floor)
        old = out.get(rank)
        out[rank] = Reference(norm, float(tokens)) if old is None else Reference(
            DECAY * old.norm + (1 - DECAY) * norm, DECAY * old.tokens + (1 - DECAY) * tokens)
    return out


__all__ = ["DECAY", "Reference", "reference_for", "refusal", "updated"]
