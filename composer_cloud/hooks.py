"""Fault hooks: the points where a test may stall or slow a replica, as an object handed down.

The sync protocols and the replica loop call a :class:`Hooks` they were given
at construction; they never read the environment. Production code gets
:data:`NO_HOOKS` (every call a no-op). The crash tests' implementation, which
reads ``COMPOSER_CLOUD_STALL_AT`` and friends once, is
:class:`composer_cloud.replica.faults.EnvFaults`, built only by the replica's
entry point.

Points (``phase`` of :meth:`Hooks.at`), in the order a lock-step round reaches them:

* ``inner_step``: halfway through a round's inner steps;
* ``upload``: after part of the pseudo-gradient was uploaded;
* ``reduce``: after this replica published its reduced slot, before the commit;
* ``checkpoint``: after the replica-state blob, before its marker and the manifest;
* ``global_upload``: after this replica's slice of the committed global state, before its marker.
"""

from __future__ import annotations

from typing import Literal, Protocol

Phase = Literal["inner_step", "upload", "reduce", "checkpoint", "global_upload"]
PHASES: tuple[Phase, ...] = ("inner_step", "upload", "reduce", "checkpoint", "global_upload")


class Hooks(Protocol):
    """Fault points a replica passes through. Implementations must be cheap when they do nothing."""

    def at(self, phase: Phase, round: int, rank: int) -> None:
        """Replica ``rank`` reached ``phase`` of ``round`` (a contribution count in decoupled mode)."""
        ...

    def after_step(self, rank: int, step_s: float) -> float:
        """Replica ``rank`` finished an inner step that computed for ``step_s`` seconds; returns seconds added."""
        ...


class NoHooks:
    """The production hooks: nothing happens."""

    def at(self, phase: Phase, round: int, rank: int) -> None:
        return None

    def after_step(self, rank: int, step_s: float) -> float:
        return 0.0


NO_HOOKS: Hooks = NoHooks()

__all__ = ["Hooks", "NO_HOOKS", "NoHooks", "PHASES", "Phase"]
