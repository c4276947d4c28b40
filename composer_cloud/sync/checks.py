"""Payload checks of both sync modes: what is verified before a pseudo-gradient or a state is used.

Shared: :func:`l2` (an accurate norm at float32 speed), :func:`outliers` (the
median rule), :func:`check_tree` (names, shapes, finite values of a tensor
tree read from the store). The decoupled merge applies them to whole
contributions (``sync/decoupled/protocol.py``); the lock-step all-reduce to
slots, as follows.

Nothing read from the bucket is trusted (``docs/store.md``). Checks that
cost O(payload) compute and O(W) tiny objects, so traffic stays O(P):

* **Inputs** (the reducer of slot ``j``, on every participant's part of
  slot ``j``): well-formed for the codec and of the slot's length, finite,
  and, with at least 3 participants and ``outlier_factor`` set, an L2 norm at
  most ``outlier_factor`` times the larger of the median of the participants'
  norms for that slot and the slot's *no-gradient floor* (:func:`outliers`). A failure names
  the rank, the slot and the check; the attempt is aborted and that rank is
  excluded from the retries of the round (its pseudo-gradient is bad; the
  others' are not).
* **Reduced slots** (every reader): the reducer publishes a write-once digest
  ``reduced/<j>.json`` next to the slot: crc32 of the encoded bytes, the
  slot's length and the decoded norms of every input. A reader checks that the
  slot's bytes match the digest (so all readers apply the same bytes), that
  the decoded mean is finite, that its norm is at most the mean of the input
  norms (triangle inequality, widened by the codec's bound ``norm_rtol``),
  and that the digest's entry for its own input equals the norm of what it
  sent (within ``norm_rtol``). A failure aborts the attempt without
  excluding anyone (the culprit is unknown) and the attempt is retried.
  A reducer keeps its own slot in memory and does not read it back, so it
  may commit before a reader meets a replaced slot; that reader then does not
  apply the result (it heals at its next sync). Invariant: no replica applies
  bytes that failed its own checks, and all that apply, apply the same bytes
  (the digest is write-once).

Residual risk, without a run key: a writer with read and write access to the
bucket can still create consistent objects (a digest and a slot that match,
with the honest input norms copied from the ``grad/`` objects), racing the
reducer. The norm bound then limits such a forged slot to the size of an
honest mean: no NaN, no 1e3 blow-up, but a wrong direction is possible.
Authenticity needs the run key (HMAC at the Store level).
"""

from __future__ import annotations

import math
import statistics
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from composer_cloud.errors import BadObject, SyncError
from composer_cloud.storage.records import SlotDigest

if TYPE_CHECKING:
    import torch


class RejectedPayload(SyncError):
    """A slot failed a check: the attempt is aborted with this reason (and record fields)."""

    def __init__(self, reason: str, *, check: str, slot: int | None, excluded: Sequence[int] = ()) -> None:
        self.reason = reason
        self.check = check
        self.slot = slot
        self.excluded = sorted(excluded)
        super().__init__(reason)


_NORM_ROW = 4096


def l2(x: torch.Tensor) -> float:
    """L2 norm of a 1-D float tensor; NaN or inf iff ``x`` has non-finite values.

    One float32 pass over rows of 4096 elements, rows summed in float64:
    relative error ~1e-9 (a plain float32 norm is off by ~1e-3 on 16M
    elements) at float32 speed (~3 ms for 16M elements on one core). A row
    that overflows float32 is redone in float64, so finite inputs give finite norms.
    """
    import torch

    n = x.numel()
    full = n - n % _NORM_ROW
    total = torch.zeros((), dtype=torch.float64)
    if full:
        rows = torch.linalg.vector_norm(x[:full].view(-1, _NORM_ROW), dim=1)
        if not bool(torch.isfinite(rows).all()):
            return float(torch.linalg.vector_norm(x, dtype=torch.float64))
        total = rows.double().square().sum()
    if full < n:
        total = total + torch.linalg.vector_norm(x[full:], dtype=torch.float64).square()
    return float(total.sqrt())


def nonfinite_count(x: torch.Tensor) -> int:
    import torch

    return int(x.numel() - torch.isfinite(x).sum()) if x.numel() else 0


def check_finite(x: torch.Tensor, *, rank: int, slot: int | None) -> float:
    """The L2 norm of ``x``; raises :class:`RejectedPayload` (excluding ``rank``) on NaN or infinite values."""
    norm = l2(x)
    if not math.isfinite(norm):
        where = "its payload" if slot is None else f"slot {slot}"
        raise RejectedPayload(f"pseudo-gradient of replica {rank}, {where}: {nonfinite_count(x)} non-finite values "
                              f"of {x.numel()}", check="nonfinite", slot=slot, excluded=[rank])
    return norm


#: An update whose L2 norm is below this fraction of the L2 norm of the parameters it updates carries almost no
#: gradient (weight decay alone moves them by ``inner lr x weight decay x inner steps``, ~1e-5 of their norm).
NO_GRADIENT_REL = 1e-3


def norm_floor_rms(params: Iterable[torch.Tensor]) -> float:
    """``NO_GRADIENT_REL x`` the RMS of ``params``: the per-element scale of the outlier rule's floor.

    A payload (or slot) of ``n`` elements has the floor ``norm_floor_rms x sqrt(n)``: the norm of an update that
    moves each of its elements by 0.1 % of the parameters' RMS. Computed from the synced parameters as built
    (the same initial or loaded weights on every replica); 0.0 for no parameters (no floor).
    """
    import torch

    total, count = 0.0, 0
    for p in params:
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP shard: this rank's chunk
        if t.numel() and t.is_floating_point():
            total += float(torch.linalg.vector_norm(t.reshape(-1), dtype=torch.float64)) ** 2
            count += t.numel()
    rms = math.sqrt(total / count) if count else 0.0
    return NO_GRADIENT_REL * rms if math.isfinite(rms) else 0.0


def outliers(norms: Sequence[float], outlier_factor: float | None, floor: float = 0.0) -> tuple[float, list[int]]:
    """``(median, indices of the norms above outlier_factor x max(median, floor))``.

    Applies only with at least 3 norms (with 2, the median cannot tell which
    one is off) and a positive scale ``max(median, floor)``; otherwise nothing is an outlier.

    Why the floor: honest replicas whose data gave no gradient (every reward 0, every completion masked)
    send updates of almost no norm (weight decay only); with them as the median, the one replica with a real
    gradient looked like a 70x outlier and was excluded (measured: 5e-4 vs 0.034). From norms alone that case
    cannot be told from a forged 70x update among real ones, so the scale comes from what no participant
    controls: ``floor`` = the norm of an update carrying almost no gradient for these elements
    (:func:`norm_floor_rms`, from the parameters every replica holds). A median below it is no scale.
    What still holds: every accepted norm is at most ``outlier_factor x max(median, floor)``; with the median
    above the floor (real updates) the rule is the plain median rule, and a forged update among near-zero
    honest ones is refused above ``outlier_factor x floor`` (1 % of the parameters' norm with factor 10), as is
    one among a median of 0, which the rule without a floor let through.
    """
    if outlier_factor is None or len(norms) < 3:
        return 0.0, []
    median = statistics.median(norms)
    scale = max(median, floor)
    if not scale > 0:
        return median, []
    return median, [i for i, n in enumerate(norms) if n > outlier_factor * scale]


def check_outliers(ranks: Sequence[int], norms: Sequence[float], *, slot: int,
                   outlier_factor: float | None, floor: float = 0.0) -> None:
    """Raise :class:`RejectedPayload` excluding every rank whose norm is an outlier (:func:`outliers`)."""
    median, bad = outliers(norms, outlier_factor, floor)
    if bad:
        desc = ", ".join(f"replica {ranks[i]} has norm {norms[i]:.4g}" for i in bad)
        raise RejectedPayload(f"pseudo-gradient slot {slot}: {desc} > outlier_factor={outlier_factor} x "
                              f"{scale_text(median, floor)}", check="outlier", slot=slot,
                              excluded=[ranks[i] for i in bad])


def scale_text(median: float, floor: float) -> str:
    """How the outlier rule's scale reads in a reason: the median, or the no-gradient floor above it."""
    if floor > median:
        return f"no-gradient floor {floor:.4g} (the median {median:.4g} is below it)"
    return f"median {median:.4g}"


def tree_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of a tree of tensors taken as one vector."""
    return math.sqrt(sum(l2(t.reshape(-1)) ** 2 for t in tensors.values()))


def check_tree(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], key: str) -> None:
    """Names and shapes equal ``shapes``; every floating value finite. Raises :class:`BadObject` naming ``key``."""
    import torch

    if set(tensors) != set(shapes):
        extra, missing = sorted(set(tensors) - set(shapes))[:3], sorted(set(shapes) - set(tensors))[:3]
        raise BadObject(key, f"tensors differ from the model's (extra {extra}, missing {missing})")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(shapes[name]):
            raise BadObject(key, f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shapes[name])}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise BadObject(key, f"tensor {name!r} has non-finite values")


def verify_reduced(record: Any, data: bytes | memoryview, decoded: torch.Tensor, *, key: str, round: int,
                   attempt: int, slot: int, participants: Sequence[int], me: int, my_norm: float,
                   rtol: float) -> None:
    """Check a reduced slot against its digest record; raises :class:`RejectedPayload`.

    ``my_norm`` is the norm of this reader's own part of the slot before
    encoding; ``me`` its index among ``participants``; ``rtol`` the wire
    codec's relative norm error (``codec.norm_rtol``).
    """
    def reject(problem: str) -> RejectedPayload:
        return RejectedPayload(f"reduced slot {slot} ({key}): {problem}", check="reduced", slot=slot)

    try:
        digest = SlotDigest.from_json(record, key=key, round=round, attempt=attempt, slot=slot,
                                      participants=len(participants))
    except BadObject as exc:
        raise reject(exc.reason) from None
    if digest.numel != decoded.numel():
        raise reject(f"digest field 'numel' is {digest.numel}, expected {decoded.numel()}")
    norms = digest.input_norms
    if digest.crc32 != zlib.crc32(data):
        raise reject("bytes do not match the reducer's digest (corrupt or replaced)")
    norm = l2(decoded)
    if not math.isfinite(norm):
        raise reject(f"{nonfinite_count(decoded)} non-finite values")
    if abs(norms[me] - my_norm) > rtol * my_norm + 1e-30:
        raise reject(f"digest says this replica's input norm is {norms[me]:.6g}, it sent {my_norm:.6g}")
    bound = sum(norms) / len(norms)
    # Sum in float32 of W parts, then the codec: both only widen the triangle bound slightly.
    if norm > bound * (1 + rtol + 1e-4 * len(norms)) + 1e-30:
        raise reject(f"norm {norm:.6g} exceeds the mean input norm {bound:.6g}")


def digest_mismatch(mine: SlotDigest, found: Any, *, key: str) -> BadObject | None:
    """Why an existing digest record differs from the one this reducer computed, or None if it matches."""
    try:
        theirs = SlotDigest.from_json(found, key=key, round=mine.round, attempt=mine.attempt, slot=mine.slot,
                                      participants=len(mine.input_norms))
    except BadObject as exc:
        return exc
    for name in ("crc32", "numel"):
        if getattr(theirs, name) != getattr(mine, name):
            return BadObject(key, f"field {name!r} differs from this reducer's result")
    # Norms may differ in the last bits between processes (reduction order); the crc pins the bytes.
    if not all(abs(a - b) <= 1e-9 * abs(b) + 1e-30 for a, b in zip(theirs.input_norms, mine.input_norms)):
        return BadObject(key, "field 'input_norms' differs from this reducer's result")
    return None
