"""Crash-test fault injection: the environment-driven :class:`~composer_cloud.hooks.Hooks`, built at start-up.

Only the replica's entry point builds one (:meth:`EnvFaults.from_env`), from
the :class:`~composer_cloud.env.JobEnv` it read once; without any of the
variables below it gets :data:`~composer_cloud.hooks.NO_HOOKS`, so production
replicas run no fault code at all.

* ``COMPOSER_CLOUD_STALL_AT=phase:round:rank[:local_rank]`` (with ``COMPOSER_CLOUD_STALL_MARKER=/path``):
  when that replica reaches ``phase`` (:data:`~composer_cloud.hooks.PHASES`) in
  ``round`` it creates the marker file (``phase:round:rank`` and a ``pid <pid>`` line)
  and sleeps until killed, so a test can SIGKILL the launcher and every replica
  (or that one process) at exactly that point. With a marker the stall happens
  once: a restarted replica that reaches the same point again (a re-run round)
  goes on. ``local_rank`` picks one local rank of a multi-GPU replica (default: 0).
* ``COMPOSER_CLOUD_SLOW=rank:factor[,rank:factor...]`` simulates slower
  hardware: after each inner step of ``rank`` the replica sleeps
  ``(factor - 1)`` times that step's compute time, so it runs ``factor`` times slower.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from composer_cloud import env
from composer_cloud.errors import ConfigError
from composer_cloud.hooks import NO_HOOKS, PHASES, Hooks, Phase


def parse_stall(value: str) -> tuple[str, int, int] | tuple[str, int, int, int]:
    """``phase:round:rank[:local_rank]`` -> its parts; a malformed value names
    :data:`~composer_cloud.env.STALL_AT`."""
    try:
        phase, round_s, rank_s, *local = value.split(":")
        if len(local) > 1:
            raise ValueError(value)
        stall = (phase, int(round_s), int(rank_s), *(int(x) for x in local))
    except ValueError:
        raise ConfigError(f"{env.STALL_AT}={value!r}: expected phase:round:rank[:local_rank]") from None
    if phase not in PHASES:
        raise ConfigError(f"{env.STALL_AT}: phase {phase!r} is not one of {PHASES}")
    return stall


def parse_slow(value: str) -> dict[int, float]:
    """``rank:factor[,rank:factor...]`` -> ``{rank: factor}``; a malformed value names :data:`~composer_cloud.env.SLOW`."""
    out: dict[int, float] = {}
    for part in value.split(","):
        try:
            r, f = part.split(":")
            rank, factor = int(r), float(f)
        except ValueError:
            raise ConfigError(f"{env.SLOW}={value!r}: expected rank:factor[,rank:factor...]") from None
        if not factor >= 1.0:
            raise ConfigError(f"{env.SLOW}: factor {f!r} must be >= 1")
        out[rank] = factor
    return out


@dataclass(frozen=True)
class EnvFaults:
    """Stall at one point, and slow some ranks down, as the job's environment asked."""

    stall: tuple[str, int, int] | tuple[str, int, int, int] | None = None
    marker: str | None = None
    slow: dict[int, float] = field(default_factory=dict)
    local_rank: int = 0

    @classmethod
    def from_env(cls, job_env: env.JobEnv, *, local_rank: int = 0) -> Hooks:
        """The hooks ``job_env`` asks for: :data:`~composer_cloud.hooks.NO_HOOKS` when it asks for none."""
        if not (job_env.stall_at or job_env.slow):
            return NO_HOOKS
        return cls(stall=parse_stall(job_env.stall_at) if job_env.stall_at else None, marker=job_env.stall_marker,
                   slow=parse_slow(job_env.slow) if job_env.slow else {}, local_rank=local_rank)

    def at(self, phase: Phase, round: int, rank: int) -> None:
        if self.stall is None or self.stall[:3] != (phase, round, rank) or \
                (self.stall[3] if len(self.stall) == 4 else 0) != self.local_rank:
            return
        if self.marker:
            if os.path.exists(self.marker):
                return  # stall once per marker: a restarted replica that reaches the point again runs on
            with open(self.marker, "w") as f:
                f.write(f"{phase}:{round}:{rank}\npid {os.getpid()}\n")
        while True:  # until killed
            time.sleep(3600)

    def after_step(self, rank: int, step_s: float) -> float:
        """Sleep ``(factor - 1) * step_s`` for a slowed ``rank``; returns the seconds slept."""
        extra = (self.slow.get(rank, 1.0) - 1.0) * max(0.0, step_s)
        if extra > 0:
            time.sleep(extra)
        return extra


__all__ = ["EnvFaults", "parse_slow", "parse_stall"]
