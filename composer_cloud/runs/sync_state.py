"""A run's sync state as the client sees it (``status``, ``resume``, ``export``): what depends on the sync mode.

Both modes keep their global states as checkpoints; they differ in which
attempt of a round counts (lock-step: the committed one, from the round
records; decoupled: the one attempt of a version), in what "committed" counts
(rounds, or merged versions) and in which round is the final one.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer_cloud.spec import RunSpec
from composer_cloud.storage.store import Store
from composer_cloud.sync.checkpoint import manifests
from composer_cloud.sync.checkpoint.global_state import AttemptOf, GlobalStateStore
from composer_cloud.sync.decoupled.versions import VERSION_ATTEMPT, GlobalVersions
from composer_cloud.sync.lockstep import rounds
from composer_cloud.sync.lockstep.durable import model_attempt_of


def attempt_of(store: Store, spec: RunSpec) -> AttemptOf:
    """Which attempt's global state is round (or version) ``r``'s model (lock-step:
    :func:`~composer_cloud.sync.lockstep.durable.model_attempt_of`, the answer the replicas use too)."""
    if spec.sync.mode == "decoupled":
        return lambda version: VERSION_ATTEMPT
    return model_attempt_of(store)


@dataclass(frozen=True)
class Progress:
    """How far a run got: ``committed`` rounds (decoupled: merged versions), and its final round or version
    when it is known (``final``; lock-step: ``rounds - 1`` once committed; decoupled: the recorded final version)."""

    committed: int
    final: int | None


def progress(store: Store, spec: RunSpec, *, start: int = 0) -> Progress:
    """The run's progress from its records alone (``start``: a round known committed, to scan from)."""
    if spec.sync.mode == "decoupled":
        merged, final = GlobalVersions(store).progress()
        return Progress(committed=merged, final=final)
    committed = rounds.latest_committed_round(store, start=start) + 1
    return Progress(committed=committed, final=spec.rounds - 1 if committed >= spec.rounds else None)


def final_round(spec: RunSpec, progress: Progress) -> int | None:
    """The round (decoupled: version) whose checkpoint completes the run, when known: lock-step's last round
    always (``rounds - 1``), decoupled's recorded final version once recorded."""
    return progress.final if spec.sync.mode == "decoupled" else spec.rounds - 1


def latest_model(store: Store, spec: RunSpec, *, verify: bool = True,
                 pending_ok: bool = False) -> manifests.Checkpoint | None:
    """The run's latest durable model: its newest checkpoint whose manifest is verified, of the attempt
    :func:`attempt_of` names, every listed object present and (``verify``) read back against the manifest.

    The one answer for ``status`` ("completed" = this is the final round's), ``export`` without
    ``--round`` (exports exactly this round), ``resume`` and ``wait`` (issue 33, item 3). ``pending_ok``: a
    checkpoint still being written is skipped quietly (a poller of a live run that reports what is missing).
    """
    return latest_checkpoint(store, spec, verify=verify, pending_ok=pending_ok)


def latest_checkpoint(store: Store, spec: RunSpec, *, before: int | None = None, verify: bool = True,
                      pending_ok: bool = False) -> manifests.Checkpoint | None:
    """The run's newest valid checkpoint (see :func:`~composer_cloud.sync.checkpoint.manifests.latest_checkpoint`)."""
    return manifests.latest_checkpoint(GlobalStateStore(store), attempt_of(store, spec), before=before, verify=verify,
                                       pending_ok=pending_ok)


def discard_after(store: Store, round: int) -> None:
    """Delete what rounds after ``round`` left (round records, checkpoints): ``resume`` runs them again."""
    rounds.discard_after(store, round)
    manifests.discard_after(GlobalStateStore(store), round)


__all__ = ["Progress", "attempt_of", "discard_after", "final_round", "latest_checkpoint", "latest_model", "progress"]
