"""The sparse codec's two-level exchange: groups of about sqrt(W), re-sparsified group sums, one gather.

The flat gather (:mod:`.gather`) has every participant read the ``W - 1`` others' contributions: ``W * P``
bytes down and ``2W`` reads per replica, O(W^2) requests a round. Above a few dozen replicas this exchange
replaces it (``sync.sparse.exchange``; ``"auto"`` picks it from :data:`TWO_LEVEL_FROM` replicas on)::

    1. every participant uploads its compressed contribution (as the gather does: ``layout.sparse_key``)
    2. the participants, in order, split into ``m = max(1, n // g)`` contiguous groups of ``g = ceil(sqrt(n))``
       or more (sizes differ by at most one; ``sync.sparse.group_size`` forces ``g``). A group's first
       member (its aggregator) strictly decodes the group's contributions, sums them in participant order
       in float32 (``S``), and re-sparsifies the sum with the run's codec: ``A = encode(S)`` (chunk-wise
       top-k at the run's density, n-bit values). It uploads ``A`` (``sparse/g<i>/sum``), then its
       write-once digest (crc32 of the bytes, every member's input norm).
    3. every participant reads every group's digest and sum, checks the crc, the global outlier rule over
       all the input norms (in the digests) and its own norm at its place, decodes each sum strictly, and
       sums them in group order: ``mean = sum_i decode(A_i) / n``. Same bytes, same order: bitwise-same
       mean everywhere; the write-once outcome commits the attempt (join/quorum/outcome are the base's).

A group whose digest has not appeared at half the round's remaining time is recomputed by the reader from
the same contributions: :func:`sparse.encode` is deterministic, so the bytes are identical and a late
aggregator's write-once digest create finds its own record (a differing record is rejected, as for the
scatter-reduce's reduced slots).

Where the re-sparsification error goes (nothing is dropped). ``S - decode(A)`` has two parts:

* positions of the group's union that ``A`` dropped (about ``(g - 1) / g`` of them): every member puts its
  own sent values at those positions back into its error-feedback accumulator, as gTop-k S-SGD does with
  the locally selected values that the global top-k dropped (Shi et al., ICDCS 2019, arXiv 1901.04359):
  their sum over the members is exactly ``S`` there, and each member re-sends its part when it grows;
* the value-quantisation error at the kept positions: only the aggregator knows ``S``; the group's first
  member, the one that computes ``S`` whenever it is alive, adds it to its own accumulator.

So ``sum_i (new e_i) = sum_i (decay e_i + delta_i) - n * mean`` exactly (up to float32 rounding), the
invariant that makes SparseLoCo's single compressor safe (DeMo/SparseLoCo: what is not sent is delayed, not
lost). The feedback joins the accumulator only when the round commits (``allreduce``), like the rest of it;
a replica that did not compute its group's sum in a committed round (it was slow and someone else's bytes
were used, or it crashed) misses only that round's quantisation part. This is a second compression stage
in the optimizer: its loss is measured in ``docs/sparse.md``.
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from typing import TYPE_CHECKING, Any

import torch

from composer_cloud.errors import BadObject, ChecksumMismatch, ObjectNotFound
from composer_cloud.hooks import NO_HOOKS, Hooks
from composer_cloud.storage import layout
from composer_cloud.storage.records import SlotDigest
from composer_cloud.sync import sparse
from composer_cloud.sync.checks import RejectedPayload, check_outliers
from composer_cloud.sync.lockstep.allreduce import (AllReduceConfig, RoundResult, RoundTimeout, InlineFuture,
                                                   publish_with_digest)
from composer_cloud.sync.lockstep.gather import SparseGatherAllReduce

if TYPE_CHECKING:
    from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)

#: ``sync.sparse.exchange = "auto"`` uses the two-level exchange from this many replicas on: the first W
#: where the flat gather's busiest key prefix needs more than 10 s a round at S3's request rates
#: (``benchmarks/scale.py``, crossover ``gather_layout_floor_over_10s``). Below, the exact gather is kept
#: although the two-level exchange moves fewer bytes from W = 5 on: re-sparsifying costs loss (+2.3 % at
#: W = 4, groups of 2; +6.8 % at W = 16, groups of 4, after 10 syncs: docs/sparse.md). Force "two_level"
#: to trade loss for bytes.
TWO_LEVEL_FROM = 235


def groups_of(participants: list[int], group_size: int | None = None) -> list[list[int]]:
    """Contiguous groups of ``participants`` (their order): ``max(1, n // g)`` groups, sizes within one.

    ``g = group_size`` or ``ceil(sqrt(n))``; every group has at least ``min(g, n)`` members.
    """
    n = len(participants)
    g = group_size or math.ceil(math.sqrt(n))
    m = max(1, n // g)
    base, extra = divmod(n, m)
    out, start = [], 0
    for i in range(m):
        size = base + (1 if i < extra else 0)
        out.append(participants[start:start + size])
        start += size
    return out


def uses_two_level(exchange: str, replicas: int) -> bool:
    """Whether ``sync.sparse.exchange`` (``auto`` | ``gather`` | ``two_level``) picks the two-level exchange."""
    return exchange == "two_level" or (exchange == "auto" and replicas >= TWO_LEVEL_FROM)


def sparse_allreduce(store: Store, rank: int, config: AllReduceConfig, *, settings: sparse.SparseSettings,
                     exchange: str = "auto", group_size: int | None = None, fragments: int = 1,
                     hooks: Hooks = NO_HOOKS) -> SparseGatherAllReduce:
    """The sparse codec's exchange for a run of ``config.replicas`` (the same choice on every replica)."""
    if uses_two_level(exchange, config.replicas):
        return GroupedSparseAllReduce(store, rank, config, settings=settings, group_size=group_size,
                                      fragments=fragments, hooks=hooks)
    return SparseGatherAllReduce(store, rank, config, settings=settings, fragments=fragments, hooks=hooks)


class GroupedSparseAllReduce(SparseGatherAllReduce):
    """The two-level exchange of ``sync.codec = "sparse"`` for one replica (see the module docstring).

    Args:
        group_size: members per group (``None``: ``ceil(sqrt(participants))``).
    """

    def __init__(self, store: Store, rank: int, config: AllReduceConfig, *, settings: sparse.SparseSettings,
                 group_size: int | None = None, fragments: int = 1, hooks: Hooks = NO_HOOKS) -> None:
        if group_size is not None and group_size < 2:
            raise ValueError(f"sync.sparse.group_size: {group_size} must be >= 2")
        super().__init__(store, rank, config, settings=settings, fragments=fragments, hooks=hooks)
        self.group_size = group_size
        self._returned: torch.Tensor | None = None  # this attempt's re-sparsification residual, kept on commit

    def _committed_accumulator(self, enc: sparse.SparseEncoding) -> torch.Tensor:
        returned, self._returned = self._returned, None
        return enc.accumulator if returned is None else enc.accumulator + returned

    # ------------------------------------------------------------ the round
    def _mean(self, round: int, attempt: int, participants: list[int], flat: torch.Tensor,
              result: RoundResult) -> torch.Tensor:
        """Upload, aggregate my group (its first member), gather and check every group's sum, average.

        Raises :class:`RoundTimeout` or :class:`RejectedPayload` (the base's ``_exchange`` aborts on them).
        """
        cfg = self.config
        numel = flat.numel()
        deadline = time.monotonic() + cfg.round_timeout_s
        groups = groups_of(participants, self.group_size)
        mine = next(i for i, g in enumerate(groups) if self.rank in g)
        self._returned = None
        enc = self._upload(round, attempt, flat, result)
        t = time.monotonic()
        exact: torch.Tensor | None = None
        if groups[mine][0] == self.rank:
            data, norms, exact = self._aggregate(round, attempt, groups[mine], numel, deadline, own=enc)
            self._publish_group(round, attempt, mine, data, numel, norms)
        self.hooks.at("reduce", round, self.rank)
        result.timings["reduce_s"] = time.monotonic() - t

        # The aggregator reads its group's sum back like everyone (two GETs): all use the stored bytes.
        t = time.monotonic()
        fetches = [self._pool.submit(self._fetch_group, round, attempt, i, group, numel, deadline)
                   for i, group in enumerate(groups)]
        sums, norms = [], []
        for i, (group, fut) in enumerate(zip(groups, fetches)):
            record, data = fut.result()
            sums.append(self._check_group(round, attempt, i, group, record, data, numel,
                                          own=enc.sent.norm() if i == mine else None))
            norms.extend(record["input_norms"])
        check_outliers(participants, norms, slot=0, outlier_factor=cfg.outlier_factor,
                       floor=cfg.norm_floor_rms * math.sqrt(numel))
        mean = sparse.total(sums, numel=numel).div_(len(participants))
        if not bool(torch.isfinite(mean).all()):  # finite sums can still overflow float32 when added
            raise RejectedPayload("sparse group sums: their total overflows float32", check="nonfinite", slot=0)
        self._returned = self._residual(enc.sent, sums[mine], exact)
        result.timings["gather_s"] = time.monotonic() - t
        return mean

    @staticmethod
    def _residual(sent: sparse.SparseUpdate, group_sum: sparse.SparseUpdate,
                  exact: torch.Tensor | None) -> torch.Tensor:
        """What re-sparsification did not deliver, returned to my accumulator (module docstring).

        My sent values at positions my group's sum dropped; plus, if I computed the group's exact sum
        ``exact`` (its first member), the value error ``exact - decoded`` at the positions it kept.
        """
        out = torch.zeros(sent.numel, dtype=torch.float32)
        dropped = ~torch.isin(sent.indices, group_sum.indices)
        out[sent.indices[dropped]] = sent.values[dropped]
        if exact is not None:
            out[group_sum.indices] += exact[group_sum.indices] - group_sum.values
        return out

    def _aggregate(self, round: int, attempt: int, group: list[int], numel: int, deadline: float,
                   own: sparse.SparseEncoding | None = None,
                   parallel: bool = True) -> tuple[bytes, list[float], torch.Tensor]:
        """Decode the group's contributions strictly, sum them in order, re-sparsify the sum.

        Returns ``(payload of the group sum, the members' input norms, the exact sum, dense float32)``.
        Raises :class:`RoundTimeout` (contributions missing) or :class:`RejectedPayload` (a malformed one).
        """
        def fetch(rank: int) -> Any:
            key = layout.sparse_key(round, attempt, rank, self.config.replicas)
            return self._wait_in_round(round, attempt, key, deadline, rank)

        futures: dict[int, Any] = {}
        for p in group:
            if own is None or p != self.rank:
                futures[p] = self._pool.submit(fetch, p) if parallel else InlineFuture(fetch, p)
        updates: list[sparse.SparseUpdate] = []
        missing: list[int] = []
        for p in group:
            if own is not None and p == self.rank:
                updates.append(own.sent)  # what the readers decode from my bytes (sparse.encode's invariant)
            else:
                updates.append(self._decode(round, attempt, p, futures[p], numel, missing))
        if missing:
            raise RoundTimeout(round, missing, "sparse contributions missing")
        exact = sparse.total(updates, numel=numel)
        if not bool(torch.isfinite(exact).all()):
            raise RejectedPayload(f"sparse group of replicas {group}: the sum overflows float32", check="nonfinite",
                                  slot=0, excluded=[group[max(range(len(group)), key=lambda i: updates[i].norm())]])
        return sparse.encode(exact, None, self.settings).payload, [u.norm() for u in updates], exact

    def _publish_group(self, round: int, attempt: int, index: int, data: bytes, numel: int,
                       norms: list[float]) -> dict[str, Any]:
        """Upload a group's sum, then its write-once digest; a differing existing digest is rejected."""
        digest = SlotDigest(round=round, attempt=attempt, slot=index, numel=numel, crc32=zlib.crc32(data),
                            input_norms=list(norms), by=self.rank)
        return publish_with_digest(self.store, layout.sparse_group_key(round, attempt, index), data,
                                   layout.sparse_group_digest_key(round, attempt, index), digest,
                                   what=f"sparse group {index}", settle=False)

    def _fetch_group(self, round: int, attempt: int, index: int, group: list[int], numel: int,
                     deadline: float) -> tuple[dict[str, Any], bytes | memoryview]:
        """Wait for group ``index``'s digest and sum; recompute them if its aggregator did not publish."""
        takeover_at = time.monotonic() + 0.5 * max(0.0, deadline - time.monotonic())
        digest_key = layout.sparse_group_digest_key(round, attempt, index)
        try:
            raw = self._wait_in_round(round, attempt, digest_key, takeover_at, group[0])
            record = json.loads(bytes(raw))
        except RoundTimeout as exc:
            if exc.aborted:
                raise
            logger.warning("%s: aggregator %d did not publish; recomputing the group", digest_key, group[0])
            # Inline fetches: this runs on the pool already, and waiting on more pool work could exhaust it.
            data, norms, _ = self._aggregate(round, attempt, group, numel, deadline, parallel=False)
            return self._publish_group(round, attempt, index, data, numel, norms), data
        except (ChecksumMismatch, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RejectedPayload(f"sparse group {index}: unreadable digest ({exc})", check="reduced",
                                  slot=index) from None
        try:
            return record, self.store.get(layout.sparse_group_key(round, attempt, index))
        except (ObjectNotFound, ChecksumMismatch) as exc:
            raise RejectedPayload(f"sparse group {index}: {exc}", check="reduced", slot=index) from None

    def _check_group(self, round: int, attempt: int, index: int, group: list[int], record: Any,
                     data: bytes | memoryview, numel: int, own: float | None) -> sparse.SparseUpdate:
        """Check a group's sum against its digest (and my norm in it, if I am a member); decode it strictly."""
        key = layout.sparse_group_key(round, attempt, index)
        try:
            digest = SlotDigest.from_json(record, key=f"{key}.json", round=round, attempt=attempt, slot=index,
                                          participants=len(group))
        except BadObject as exc:
            raise RejectedPayload(f"sparse group {index}: {exc.reason}", check="reduced", slot=index) from None
        if digest.numel != numel or digest.crc32 != zlib.crc32(bytes(data)):
            raise RejectedPayload(f"sparse group {index}: {key} does not match its digest (crc32/numel)",
                                  check="reduced", slot=index)
        if own is not None:
            theirs = digest.input_norms[group.index(self.rank)]
            if not abs(theirs - own) <= 1e-6 * abs(own) + 1e-30:
                raise RejectedPayload(f"sparse group {index}: the aggregator summed another contribution of "
                                      f"replica {self.rank} (norm {theirs:.6g}, sent {own:.6g})",
                                      check="reduced", slot=index)
        try:
            return sparse.decode(data, key=key, numel=numel, settings=self.settings)
        except sparse.SparsePayloadError as exc:
            raise RejectedPayload(f"sparse group {index}: {exc.problem}", check="reduced", slot=index) from None


__all__ = ["GroupedSparseAllReduce", "TWO_LEVEL_FROM", "groups_of", "sparse_allreduce", "uses_two_level"]
