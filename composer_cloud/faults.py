"""Fault injection for crash tests: stall a replica at a named phase.

Set ``COMPOSER_CLOUD_STALL_AT=phase:round:rank`` (and
``COMPOSER_CLOUD_STALL_MARKER=/path``) in a replica's environment; when that
replica reaches ``phase`` in ``round`` it creates the marker file and sleeps,
so a test can SIGKILL the launcher and every replica at exactly that point.
With a marker, the stall happens once: a restarted replica that reaches the
same point again (a re-run round) goes on.
Phases: ``inner_step`` (between inner steps), ``upload`` (after part of the
pseudo-gradient was uploaded), ``reduce`` (after this replica published its
reduced slot, before the commit), ``checkpoint`` (after the replica state
blob, before its marker and the manifest), ``global_upload`` (after this
replica's slice of the committed global state, before its marker). Unset,
every call is a no-op.

``COMPOSER_CLOUD_SLOW=rank:factor[,rank:factor...]`` simulates slower
hardware: after each inner step of ``rank`` (either sync mode) the replica
sleeps ``(factor - 1)`` times that step's compute time, so it runs ``factor``
times slower. Unset: a no-op.
"""

from __future__ import annotations

import os
import time

from composer_cloud import env

ENV = env.STALL_AT
MARKER_ENV = env.STALL_MARKER
SLOW_ENV = env.SLOW
PHASES = ("inner_step", "upload", "reduce", "checkpoint", "global_upload")


def stall_point(phase: str, round: int, rank: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    want_phase, want_round, want_rank = spec.split(":")
    if want_phase != phase or int(want_round) != round or int(want_rank) != rank:
        return
    marker = os.environ.get(MARKER_ENV)
    if marker:
        if os.path.exists(marker):
            return  # stall once per marker: a restarted replica that reaches the point again runs on
        with open(marker, "w") as f:
            f.write(f"{phase}:{round}:{rank}\n")
    while True:  # until killed
        time.sleep(3600)


def slow_factor(rank: int) -> float:
    """This rank's slowdown factor from ``COMPOSER_CLOUD_SLOW`` (1.0: none). A malformed value is an error."""
    spec = os.environ.get(SLOW_ENV, "").strip()
    if not spec:
        return 1.0
    for part in spec.split(","):
        try:
            r, f = part.split(":")
            factor = float(f)
        except ValueError:
            raise ValueError(f"{SLOW_ENV}={spec!r}: expected rank:factor[,rank:factor...]") from None
        if not factor >= 1.0:
            raise ValueError(f"{SLOW_ENV}: factor {f!r} must be >= 1")
        if int(r) == rank:
            return factor
    return 1.0


def slow_step(rank: int, step_s: float) -> float:
    """Sleep ``(factor - 1) * step_s`` for a slowed ``rank``; returns the seconds slept."""
    extra = (slow_factor(rank) - 1.0) * max(0.0, step_s)
    if extra > 0:
        time.sleep(extra)
    return extra


class EnvFaults:
    """The :class:`~composer_cloud.hooks.Hooks` of crash tests, from this process's environment."""

    def at(self, phase: str, round: int, rank: int) -> None:
        stall_point(phase, round, rank)

    def after_step(self, rank: int, step_s: float) -> float:
        return slow_step(rank, step_s)
