"""The sparse codec's exchange: a flat gather of error-feedback compressed pseudo-gradients.

``sync.codec = "sparse"`` (SparseLoCo, :mod:`composer_cloud.sync.sparse`): every participant folds its
pseudo-gradient into an error-feedback accumulator, uploads ONE compressed contribution (chunk-wise top-k,
n-bit values, Rice-coded positions), reads the others', decodes them strictly against the run's settings,
and sums them in participant order in float32, divided by ``W``. Everyone sums the same bytes in the same
order, so every participant ends with the bitwise-same mean: no reduced slots. Before committing, each
publishes a small digest of its mean (``sparse/ack/<rank>.json``) and waits for everyone's: no replica
commits before every participant checked every contribution, and equal digests pin equal results. Join,
quorum, attempts, aborts and the write-once outcome are :class:`ObjectStoreAllReduce`'s, unchanged.

Why a gather, not the scatter-reduce: the sum of W sparse contributions is W times denser than each, so a
scatter-reduce of sparse payloads must send dense reduced slots back; the gather moves ``P`` up and
``(W - 1) P`` down per replica (``P`` = one contribution, ~1/80 of fp32 at the defaults) and costs
``2W`` reads (contributions and digests of the others, quorum, outcome). It moves fewer bytes than bf16 scatter-reduce up to W ~ 290 at 1.56 % density (measured
crossovers: ``docs/scale.md``); above ``spec_sync.GATHER_MAX_REPLICAS`` the
spec refuses it (``grouped.py``'s two-level exchange serves larger runs). The
contributions of a round spread over ``ceil(W / 32)`` key prefixes (``layout.sparse_key``).

Error feedback is training state (DESIGN invariant 13). ``encode`` is pure: the new accumulator is kept
only when this replica's round commits; an aborted attempt retries with the payload it sent (same bytes),
an uncommitted round re-encodes the next sync's pseudo-gradient from the committed accumulator. One
accumulator per DiLoCo fragment (``round % fragments``: torchft syncs fragments in turn).
:meth:`codec_state` / :meth:`load_codec_state` move them in and out of the replica's checkpoint bitwise.
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from composer_cloud.errors import ChecksumMismatch
from composer_cloud.hooks import NO_HOOKS, Hooks
from composer_cloud.storage import layout
from composer_cloud.storage.records import Outcome, SlotDigest
from composer_cloud.sync import sparse
from composer_cloud.sync.checks import RejectedPayload, check_finite, check_outliers, digest_mismatch
from composer_cloud.sync.lockstep.allreduce import AllReduceConfig, ObjectStoreAllReduce, RoundResult, RoundTimeout

if TYPE_CHECKING:
    from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)


class SparseGatherAllReduce(ObjectStoreAllReduce):
    """The object-store all-reduce of ``sync.codec = "sparse"`` for one replica.

    Args:
        settings: the run's codec settings; payloads with other settings are rejected.
        fragments: DiLoCo fragments synced in turn (one accumulator each).
    """

    codecs = (sparse.CODEC,)

    def __init__(self, store: Store, rank: int, config: AllReduceConfig, *, settings: sparse.SparseSettings,
                 fragments: int = 1, hooks: Hooks = NO_HOOKS) -> None:
        super().__init__(store, rank, config, hooks=hooks)
        self.settings = settings
        self.fragments = fragments
        self._acc: dict[str, torch.Tensor] = {}
        self._encoded: tuple[str, sparse.SparseEncoding] | None = None  # this call's payload, for its retries

    # ------------------------------------------------------------ codec state (checkpointed)
    def codec_state(self) -> dict[str, torch.Tensor]:
        """The committed error-feedback accumulators by fragment (copies; float32, 1-D)."""
        return {name: t.clone() for name, t in sorted(self._acc.items())}

    def load_codec_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`codec_state` output (from a checkpoint); raises ``ValueError`` naming a bad entry."""
        ef = sparse.ErrorFeedback(self.settings)
        ef.load_state_dict(state)
        self._acc = ef.state_dict()

    # ------------------------------------------------------------ the round
    def allreduce(self, round: int, flat: torch.Tensor) -> RoundResult:
        """As :meth:`ObjectStoreAllReduce.allreduce`; ``flat`` becomes the mean of the decoded contributions."""
        self._encoded = None
        result = super().allreduce(round, flat)
        if result.committed and result.participated and self._encoded is not None:
            name, enc = self._encoded
            self._acc[name] = self._committed_accumulator(enc)
        self._encoded = None
        return result

    def _committed_accumulator(self, enc: sparse.SparseEncoding) -> torch.Tensor:
        """The accumulator kept once this replica's round committed (two-level adds its returned residual)."""
        return enc.accumulator

    def _encode(self, round: int, flat: torch.Tensor) -> sparse.SparseEncoding:
        """This sync's contribution, encoded once from the committed accumulator (every attempt sends it)."""
        if self._encoded is None:
            check_finite(flat, rank=self.rank, slot=None)  # a NaN pseudo-gradient is rejected, not encoded
            name = f"fragment{round % self.fragments}"
            acc = self._acc.get(name)
            if acc is not None and acc.numel() != flat.numel():
                raise ValueError(f"error-feedback state {name!r} has {acc.numel()} elements, the pseudo-gradient "
                                 f"{flat.numel()}: it was saved for another model")
            self._encoded = (name, sparse.encode(flat, acc, self.settings))
        return self._encoded[1]

    def _exchange(self, round: int, attempt: int, participants: list[int], flat: torch.Tensor,
                  result: RoundResult) -> Outcome:
        """Compute the checked mean (:meth:`_mean`), then commit; a failed check or wait aborts the attempt."""
        try:
            mean = self._mean(round, attempt, participants, flat, result)
        except RoundTimeout as exc:
            return self._finish_aborted(round, attempt, participants, result, str(exc), missing=exc.missing_ranks)
        except RejectedPayload as exc:
            return self._finish_aborted(round, attempt, participants, result, exc.reason, check=exc.check,
                                        excluded=exc.excluded, slot=exc.slot, retry=True)
        return self._commit(round, attempt, participants, mean, flat, result)

    def _mean(self, round: int, attempt: int, participants: list[int], flat: torch.Tensor,
              result: RoundResult) -> torch.Tensor:
        """Upload my contribution, gather and check the others', average in participant order, acknowledge.

        Raises :class:`RoundTimeout` or :class:`RejectedPayload`.
        """
        cfg = self.config
        numel = flat.numel()
        deadline = time.monotonic() + cfg.round_timeout_s
        timings = result.timings
        enc = self._upload(round, attempt, flat, result)
        t = time.monotonic()
        others = {p: self._pool.submit(self._wait_in_round, round, attempt,
                                       layout.sparse_key(round, attempt, p, cfg.replicas), deadline, p)
                  for p in participants if p != self.rank}
        updates: list[sparse.SparseUpdate] = []
        missing: list[int] = []
        for p in participants:
            if p == self.rank:
                updates.append(enc.sent)  # what the readers decode from my bytes (sparse.encode's invariant)
                continue
            updates.append(self._decode(round, attempt, p, others[p], numel, missing))
        if missing:
            raise RoundTimeout(round, missing, "sparse contributions missing")
        norms = [u.norm() for u in updates]
        check_outliers(participants, norms, slot=0, outlier_factor=cfg.outlier_factor,
                       floor=cfg.norm_floor_rms * math.sqrt(numel))
        mean = sparse.mean(updates, numel=numel)
        self.hooks.at("reduce", round, self.rank)
        timings["gather_s"] = time.monotonic() - t
        t = time.monotonic()
        self._acknowledge(round, attempt, participants, mean, norms, deadline)
        timings["ack_s"] = time.monotonic() - t
        return mean

    def _upload(self, round: int, attempt: int, flat: torch.Tensor, result: RoundResult) -> sparse.SparseEncoding:
        """Encode (once per sync) and upload my contribution; returns it."""
        t = time.monotonic()
        enc = self._encode(round, flat)
        result.payload_bytes = len(enc.payload)
        self.store.put(layout.sparse_key(round, attempt, self.rank, self.config.replicas), enc.payload,
                       durable=False)
        self.hooks.at("upload", round, self.rank)
        result.timings["scatter_s"] = time.monotonic() - t
        return enc

    def _acknowledge(self, round: int, attempt: int, participants: list[int], mean: torch.Tensor,
                     norms: list[float], deadline: float) -> None:
        """Publish the digest of my mean, then wait for every participant's and compare.

        Nobody commits before every participant checked every contribution: without this a replica whose
        own payload was damaged (it never reads it back) could commit before the others reject it.
        Equal digests also pin that everyone computed the same bytes.
        """
        mine = SlotDigest(round=round, attempt=attempt, slot=0, numel=mean.numel(),
                          crc32=zlib.crc32(mean.numpy().tobytes()), input_norms=norms, by=self.rank)
        self.store.put(layout.sparse_ack_key(round, attempt, self.rank), json.dumps(mine.to_json()).encode(),
                       durable=False)
        waits = {p: self._pool.submit(self._wait_in_round, round, attempt, layout.sparse_ack_key(round, attempt, p),
                                      deadline, p) for p in participants if p != self.rank}
        missing = []
        for p, fut in waits.items():
            key = layout.sparse_ack_key(round, attempt, p)
            try:
                found = json.loads(bytes(fut.result()))
            except RoundTimeout as exc:
                if exc.aborted:
                    raise
                missing.append(p)
                continue
            except (ChecksumMismatch, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise RejectedPayload(f"{key}: unreadable digest ({exc})", check="reduced", slot=0) from None
            if (problem := digest_mismatch(mine, found, key=key)) is not None:
                raise RejectedPayload(f"replica {p} computed another mean ({problem.reason})", check="reduced",
                                      slot=0)
        if missing:
            raise RoundTimeout(round, missing, "sparse digests missing")

    def _decode(self, round: int, attempt: int, rank: int, fetch: Future, numel: int,
                missing: list[int]) -> sparse.SparseUpdate:
        """Wait for and strictly decode ``rank``'s contribution (a missing one is appended to ``missing``)."""
        key = layout.sparse_key(round, attempt, rank, self.config.replicas)
        try:
            data = fetch.result()
            return sparse.decode(data, key=key, numel=numel, settings=self.settings)
        except RoundTimeout as exc:
            if exc.aborted:
                raise
            missing.append(rank)
            return sparse.SparseUpdate(numel, torch.zeros(0, dtype=torch.int64), torch.zeros(0))
        except ChecksumMismatch as exc:
            # Damaged in storage or transit: nobody to blame, a fresh attempt re-uploads it.
            raise RejectedPayload(str(exc), check="corrupt", slot=0) from None
        except sparse.SparsePayloadError as exc:
            raise RejectedPayload(f"sparse contribution of replica {rank}: {exc.problem}", check="malformed",
                                  slot=0, excluded=[rank]) from None


__all__ = ["SparseGatherAllReduce"]
