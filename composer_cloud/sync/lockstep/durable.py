"""Which attempt's global state is a lock-step round's durable model: the one answer (issue 33, item 3).

``status``, ``ls``, ``wait``, ``export``, ``resume`` and the replicas (resume point, end-of-run check)
all ask "which attempt of round ``r`` holds the run's model" through :func:`model_attempt_of`, so they
cannot disagree about the run's latest durable model.

The answer is the round's valid commit (:func:`~composer_cloud.sync.lockstep.rounds.committed_attempt`)
when its records are readable. When they are not (an outcome or quorum damaged, unsigned, deleted after
the fact), the round's *verified* manifest is the evidence instead: a manifest is signed (in a signed
run) and written only after its attempt committed and its state became durable, so its attempt is the
round's model unless a verified record denies it (a valid abort or void of that attempt:
:func:`~composer_cloud.sync.lockstep.rounds.may_have_committed`). An object that fails verification is
absent, so it can neither make a round durable nor take a durable round away.
"""

from __future__ import annotations

import logging

from composer_cloud.storage.store import Store
from composer_cloud.round_numbers import shown_round
from composer_cloud.sync.checkpoint.global_state import AttemptOf, GlobalStateStore
from composer_cloud.sync.checkpoint.manifests import read_manifest
from composer_cloud.sync.lockstep import rounds

logger = logging.getLogger(__name__)


def model_attempt_of(store: Store) -> AttemptOf:
    """``round -> attempt`` whose global state is the round's model, or None (no verified evidence of one)."""
    states = GlobalStateStore(store)

    def attempt(round: int) -> int | None:
        committed = rounds.committed_attempt(store, round)
        if committed is not None:
            return committed
        manifest = read_manifest(states, round)
        if manifest is None or not rounds.may_have_committed(store, round, manifest.attempt):
            return None
        logger.debug("round %d: records unreadable; its signed manifest names attempt %d", shown_round(round),
                 manifest.attempt)
        return manifest.attempt

    return attempt


__all__ = ["model_attempt_of"]
