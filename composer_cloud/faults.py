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
"""

from __future__ import annotations

import os
import time

from composer_cloud import env

ENV = env.STALL_AT
MARKER_ENV = env.STALL_MARKER
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
