"""The sparse codec's outer step for ``benchmarks/convergence.py --engine sim --diloco-codec sparse``.

Exactly what a replica and the exchange planned for phase B compute (docs/sparse.md), in one process:

* every replica folds its pseudo-gradient into its own error-feedback accumulator and encodes the chunk-wise
  top-k (``composer_cloud.sync.sparse.ErrorFeedback``, one accumulator over the whole flat vector);
* the W payloads are decoded from their bytes (as a reader of the store would) and averaged in float32 in
  rank order (``sparse.mean``); the outer optimizer steps with that mean;
* the first ``warmup_syncs`` syncs are dense fp32 (the scatter-reduce of today) and leave the accumulators
  empty.

Bytes per replica per round are computed from the real payload sizes: a sparse round is a flat gather
(upload one payload, download the W - 1 others: ``W * P_sparse``); a dense round is the scatter-reduce,
``(3 - 1/W) * P_fp32``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from composer_cloud.sync import sparse


@dataclass
class SparseExchange:
    """Per-run state of the simulated sparse exchange: W accumulators and the byte counts."""

    settings: sparse.SparseSettings
    world: int
    warmup_syncs: int = 0
    group_size: int = 0  # > 0: the two-level exchange (sync/lockstep/grouped.py) with groups of this size
    syncs: int = 0
    payload_bytes: list[int] = field(default_factory=list)
    bytes_per_replica: float = 0.0
    residual_norms: list[float] = field(default_factory=list)
    union_density: list[float] = field(default_factory=list)  # support of the W-sum / numel, per sparse sync

    def __post_init__(self) -> None:
        self.replicas = [sparse.ErrorFeedback(self.settings) for _ in range(self.world)]

    def mean(self, flats: list[torch.Tensor], dense_mean: "callable", dense_round_bytes: float) -> torch.Tensor:
        """The averaged (decoded) update of one sync; ``dense_mean`` serves the warm-up syncs."""
        self.syncs += 1
        if self.syncs <= self.warmup_syncs:
            self.bytes_per_replica += dense_round_bytes
            return dense_mean(flats)
        updates = []
        for ef, flat in zip(self.replicas, flats):
            enc = ef.encode("flat", flat)
            self.payload_bytes.append(len(enc.payload))
            updates.append(sparse.decode(enc.payload, numel=flat.numel(), settings=self.settings))
        self.residual_norms.append(sum(float(ef.state_dict()["flat"].norm()) for ef in self.replicas) / self.world)
        self.bytes_per_replica += self.world * sum(self.payload_bytes[-self.world:]) / self.world
        self.union_density.append(sparse.merge(updates).indices.numel() / flats[0].numel())
        if self.group_size:
            return self._two_level(updates)
        return sparse.mean(updates)

    def _two_level(self, updates: list[sparse.SparseUpdate]) -> torch.Tensor:
        """What ``GroupedSparseAllReduce`` computes: re-sparsified group sums, their residual fed back."""
        from composer_cloud.sync.lockstep.grouped import GroupedSparseAllReduce, groups_of

        groups = groups_of(list(range(self.world)), self.group_size)
        sums = []
        for group in groups:
            exact = sparse.total([updates[p] for p in group])
            enc = sparse.encode(exact, None, self.settings)
            sums.append(sparse.decode(enc.payload, numel=exact.numel(), settings=self.settings))
            for p in group:
                back = GroupedSparseAllReduce._residual(updates[p], sums[-1], exact if p == group[0] else None)
                ef = self.replicas[p]
                ef.load_state_dict({"flat": ef.state_dict()["flat"] + back})
        # Bytes: (m + 2) payloads per replica instead of the gather's W (both already counted as W above).
        p = sum(self.payload_bytes[-self.world:]) / self.world
        self.bytes_per_replica -= (self.world - (len(groups) + 2)) * p
        return sparse.total(sums).div_(self.world)

    def summary(self, numel: int) -> dict[str, float]:
        p = sum(self.payload_bytes) / max(1, len(self.payload_bytes))
        return {"sparse_payload_bytes": p, "payload_compression": 4 * numel / p if p else 0.0,
                "sparse_nnz": sparse.nnz_of(numel, self.settings), "sparse_topk": self.settings.topk,
                "residual_norm_last": self.residual_norms[-1] if self.residual_norms else 0.0,
                "union_density_mean": sum(self.union_density) / max(1, len(self.union_density)),
                "density": sparse.nnz_of(numel, self.settings) / numel}
