"""Settings of the object-store all-reduce (:class:`AllReduceConfig`), built from the spec only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from composer_cloud.spec import RunSpec


@dataclass(frozen=True)
class AllReduceConfig:
    """Settings of the object-store all-reduce. Times are seconds. Built from the spec
    (:meth:`from_spec`), which holds every default.

    Attributes:
        replicas: number of replicas launched (the quorum is decided early when all joined).
        min_replicas: fewest participants a round may commit with.
        codec: wire codec name (``fp32``, ``bf16``, ``int8``).
        quorum_timeout_s: after joining, how long to wait for the others.
        round_timeout_s: deadline for every other wait of the round.
        io_threads: parallel transfers per replica.
        outlier_factor: a participant's slot whose L2 norm exceeds this many
            times the median of the participants' norms for that slot (or the
            slot's no-gradient floor, when larger) aborts the attempt and is
            excluded (needs >= 3 participants; ``None`` disables the check; must be > 1).
        norm_floor_rms: per-element scale of that floor (``checks.norm_floor_rms`` of the synced
            parameters, set by ``build_diloco``; a slot of ``n`` elements has the floor
            ``norm_floor_rms x sqrt(n)``); 0.0: no floor.
        max_attempts: attempts of a round run back to back within one sync
            when integrity checks abort them (``1``: never retry at once).
    """

    replicas: int
    min_replicas: int
    codec: str
    quorum_timeout_s: float
    round_timeout_s: float
    io_threads: int
    outlier_factor: float | None
    max_attempts: int
    norm_floor_rms: float = 0.0

    @classmethod
    def from_spec(cls, spec: RunSpec) -> "AllReduceConfig":
        s = spec.sync
        return cls(replicas=spec.replicas, min_replicas=spec.min_replicas, codec=s.codec,
                   quorum_timeout_s=s.quorum_timeout_s, round_timeout_s=s.round_timeout_s, io_threads=s.io_threads,
                   outlier_factor=s.outlier_factor, max_attempts=s.max_attempts)


__all__ = ["AllReduceConfig"]
