"""Checkpoints as a whole: manifests (written last), the newest valid checkpoint, pruning, and versions.

A checkpoint of round (or decoupled version) ``r`` is valid for ``resume`` and
``export`` once ``checkpoints/<r>/manifest.json`` exists: it is written last and
write-once, and lists every object with its size and crc32. Lock-step: any
participant writes it once the round's global state is durable and the
participants' inner states are present (:func:`write_manifest`). Decoupled:
the writer of version ``v`` writes it right after ``v``'s one slice (the
version API, :class:`composer_cloud.sync.decoupled.versions.GlobalVersions`,
which reads manifests with :func:`read_manifest` and builds them with :func:`slice_entry`).

Old checkpoints beyond ``keep`` are deleted only after a newer manifest exists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from composer_cloud.errors import BadObject, CorruptCheckpoint, ObjectNotFound, StoreTimeout
from composer_cloud.retry import PollPolicy, poll_until
from composer_cloud.round_numbers import shown_round
from composer_cloud.storage import layout
from composer_cloud.storage.records import BlobEntry, Manifest, SliceMarker
from composer_cloud.storage.records.limits import MANIFEST_MAX_BYTES
from composer_cloud.storage.store import Store
from composer_cloud.sync.checkpoint.global_state import AttemptOf, GlobalStateStore, read_verified
from composer_cloud.sync.checkpoint.replica_state import ReplicaStateStore, ResumePoint
from composer_cloud.sync.trust import create_over_forged

logger = logging.getLogger(__name__)

#: How often :func:`load_resume` chooses again when its choice was pruned under it (each retry is a newer round).
_RESUME_TRIES = 20


@dataclass(frozen=True)
class Checkpoint:
    """A valid checkpoint: its round and manifest."""

    round: int
    manifest: Manifest


def slice_entry(marker: SliceMarker) -> BlobEntry:
    """The manifest's entry of the slice ``marker`` describes (its blob's name, size and crc32)."""
    name = layout.slice_blob_key(marker.round, marker.attempt, marker.index, marker.num_slices).rsplit("/", 1)[1]
    return BlobEntry(key=name, bytes=marker.bytes, crc32=marker.crc32)


class _ManifestExists(Exception):
    """Another participant already wrote the manifest: stop waiting."""


def write_manifest(states: GlobalStateStore, replicas: ReplicaStateStore, round: int, attempt: int,
                   participants: list[int], *, deadline_s: float, extra: dict[str, Any] | None = None,
                   abandoned: Callable[[], bool] | None = None, committed: Callable[[], bool] | None = None) -> bool:
    """Wait for the durable global state and every participant's inner state, then write the manifest.

    Any participant may call this; the manifest is write-once, so the first
    writer wins and the others return False. Replicas whose state does not
    arrive by the deadline are left out (they resume with fresh inner state).

    The waits end as soon as their answer is decided, not at the deadline: when the manifest
    exists, when ``abandoned()`` says the commit was given up (voided), and, for a participant's
    inner state, when that participant's slice of the global state was written by someone else.
    A replica writes its inner state *before* its slice, so a slice that had to be taken over
    means its owner stopped before finishing either (it died, or restarted past this round):
    its inner state is then taken only if it is already there.

    ``committed()`` says whether ``attempt`` is the round's valid commit now: a manifest already there for
    *another* attempt is then stale (that attempt's records were damaged after its commit and the round was
    committed again, issue 33) and is replaced, so the round's model gets a manifest at all.
    """
    store = states.store
    deadline = time.monotonic() + deadline_s
    n = len(participants)

    def stop_if_written(misses: int) -> None:
        if misses % 8 == 0 and read_manifest(states, round) is not None:  # read and verified, not "exists"
            raise _ManifestExists()
        if misses % 8 == 4 and abandoned is not None and abandoned():
            raise _ManifestExists()

    try:
        poll_until(lambda: True if states.durable(round, attempt, num_slices=n) else None,
                   deadline=deadline, policy=PollPolicy(initial_s=0.05, max_s=1.0), between=stop_if_written,
                   on_timeout=lambda waited: StoreTimeout(f"{layout.checkpoint_prefix(round)} global state", waited))
    except StoreTimeout:
        logger.warning("checkpoint of round %d: global state not durable within %.0fs; no manifest from this "
                       "replica", shown_round(round), deadline_s)
        return False
    except _ManifestExists:
        return False
    markers = states.markers(round, attempt).by_count[n]
    entries: dict[int, BlobEntry] = {}
    for index, rank in enumerate(participants):
        taken_over = markers[index].by != rank
        try:
            store.wait_get(layout.replica_marker_key(round, rank),
                           deadline=time.monotonic() if taken_over else deadline)
        except StoreTimeout:
            logger.warning("checkpoint of round %d: replica %d state missing; it will resume with fresh inner "
                           "state", shown_round(round), rank)
            continue
        rec = replicas.marker(round, rank)
        if rec is not None:
            entries[rank] = BlobEntry(key=layout.replica_blob_name(rank), bytes=rec.bytes, crc32=rec.crc32)
    manifest = Manifest(round=round, attempt=attempt, slices=[slice_entry(markers[i]) for i in range(n)],
                        replicas=entries, participants=participants, time=time.time(), extra=dict(extra or {}))
    # A late writer (its replica was slow or paused) must not leave a manifest listing objects that a
    # newer checkpoint's prune already removed: check before and after the write-once create.
    if not _listed_objects_exist(store, manifest):
        logger.info("checkpoint of round %d was pruned before its manifest was written; not writing it",
                    shown_round(round))
        return False
    key = layout.manifest_key(round)

    def parse(obj: Any) -> Manifest:
        found = Manifest.from_json(obj, key=key, round=round)
        if found.attempt != attempt and committed is not None and committed():
            raise BadObject(key, f"names attempt {found.attempt}, but attempt {attempt} is the round's commit")
        return found

    if not create_over_forged(store, key, manifest.to_json(), parse):
        stale = read_manifest(states, round)
        if not (stale is not None and stale.attempt != attempt and committed is not None and committed()):
            return False
        logger.warning("checkpoint of round %d: replacing the manifest of attempt %d, which is not the round's "
                       "commit (attempt %d is)", shown_round(round), stale.attempt, attempt)
        store.delete(key)
        if not store.create_json(key, manifest.to_json()):
            return False
    if not _listed_objects_exist(store, manifest):
        store.delete(key)
        logger.info("checkpoint of round %d was pruned while its manifest was written; removed the manifest",
                    shown_round(round))
        return False
    return True


def _listed_objects_exist(store: Store, manifest: Manifest) -> bool:
    """Whether every object ``manifest`` lists is still in the store (one existence check each)."""
    entries = [*manifest.slices, *manifest.replicas.values()]
    return all(store.exists(layout.in_checkpoint(manifest.round, e.key)) for e in entries)


def read_manifest(states: GlobalStateStore, round: int) -> Manifest | None:
    """Round ``round``'s manifest if present and well-formed, else None (with a warning if unusable)."""
    key = layout.manifest_key(round)
    try:
        return Manifest.from_json(states.store.get_json(key, max_bytes=MANIFEST_MAX_BYTES), key=key, round=round)
    except ObjectNotFound:
        return None
    except BadObject as exc:
        logger.warning("checkpoint %s is unusable (%s); skipping it", layout.checkpoint_prefix(round), exc)
        return None


def latest_checkpoint(states: GlobalStateStore, attempt_of: AttemptOf, *, before: int | None = None,
                      verify: bool = True, pending_ok: bool = False) -> Checkpoint | None:
    """Newest valid checkpoint (manifest present, of the attempt ``attempt_of`` names), optionally ``< before``.

    ``verify=True`` reads every listed object once, one object in memory at a
    time, and checks it against the manifest (what ``resume`` does before it
    discards anything). Readers that load the state anyway pass ``verify=False``
    and verify what they load in the same read. A torn or corrupt checkpoint is
    skipped with a warning naming it, and the previous one is used. ``pending_ok``: a checkpoint without a
    manifest is taken for one its replicas are still writing (the manifest comes last) and skipped at debug
    level, for a reader that polls a live run and reports what is missing itself (``status``).
    """
    store = states.store
    for round in reversed(states.rounds()):
        if before is not None and round >= before:
            continue
        prefix = layout.checkpoint_prefix(round)
        manifest = read_manifest(states, round)
        if manifest is None:
            logger.log(logging.DEBUG if pending_ok else logging.WARNING,
                       "checkpoint %s/%s has no valid manifest (still being written, or torn); skipping it",
                       store.uri, prefix)
            continue
        if attempt_of(round) != manifest.attempt:
            logger.warning("checkpoint %s/%s belongs to a voided commit; skipping it", store.uri, prefix)
            continue
        if verify:
            try:
                for entry in [*manifest.slices, *manifest.replicas.values()]:
                    read_verified(store, layout.in_checkpoint(round, entry.key), entry.crc32)
            except CorruptCheckpoint as exc:
                logger.warning("checkpoint %s/%s is corrupt or incomplete (%s); falling back to an earlier one",
                               store.uri, prefix, exc)
                continue
        return Checkpoint(round=round, manifest=manifest)
    return None


@dataclass(frozen=True)
class LoadedResume:
    """A resume point read into memory: the round's global state, and the replica's own inner state of that
    round (None: fresh inner state from the global parameters, ``point.reason`` or a warning says why)."""

    point: ResumePoint
    global_state: dict[str, Any]
    replica_state: dict[str, Any] | None


def load_resume(states: GlobalStateStore, replicas: ReplicaStateStore, rank: int, *, world_size: int,
                attempt_of: AttemptOf) -> LoadedResume | None:
    """Choose ``rank``'s resume point (:meth:`ReplicaStateStore.resume_point`) and read it, both trees verified.

    A replica that restarts while the fleet runs on races :func:`prune`: the
    round it chose can be deleted before or while it reads it. A read that
    fails because the round is gone (no longer durable, or its commit voided)
    chooses again; pruning only removes rounds older than a newer durable one,
    so this ends. A read that fails while the round is still durable is damage:
    :class:`~composer_cloud.errors.CorruptCheckpoint` for the global state, a
    warning and fresh inner state for the replica's own state (as before).
    None: nothing durable yet.
    """
    for _ in range(_RESUME_TRIES):
        point = replicas.resume_point(rank, world_size=world_size, durable_rounds=states.durable_rounds(attempt_of))
        if point is None:
            return None
        attempt = attempt_of(point.round)
        if attempt is None:
            continue  # its commit became unreadable since the listing: choose again
        try:
            tree = states.load(point.round, attempt)
        except CorruptCheckpoint:
            if _gone(states, attempt_of, point.round, attempt, rank):
                continue
            raise
        if point.replica_crc32 is None:
            return LoadedResume(point, tree, None)
        try:
            own = replicas.load(point.round, rank, point.replica_crc32)
        except CorruptCheckpoint as exc:
            if _gone(states, attempt_of, point.round, attempt, rank):
                continue
            logger.warning("%s; replica %d continues with fresh inner state from global params", exc, rank)
            own = None
        return LoadedResume(point, tree, own)
    raise CorruptCheckpoint(layout.CHECKPOINTS, f"replica {rank}: every resume point chosen in {_RESUME_TRIES} "
                            "tries went away while it was read; the store keeps changing under the replica")


def _gone(states: GlobalStateStore, attempt_of: AttemptOf, round: int, attempt: int, rank: int) -> bool:
    """Whether checkpoint ``round`` stopped being a durable committed state (pruned, or its commit voided)."""
    if attempt_of(round) == attempt and states.durable(round, attempt):
        return False
    logger.warning("replica %d: the checkpoint of round %d went away while it was read (pruned as the fleet "
                   "moved on); choosing again", rank, shown_round(round))
    return True


def prune(states: GlobalStateStore, *, keep: int, newest: int) -> list[int]:
    """Delete checkpoints older than the ``keep`` newest manifests (never ``newest`` or later); returns them.

    Rounds with a global state but no manifest older than ``newest`` (healing states) go too.
    """
    store = states.store
    present = states.rounds()
    # A manifest counts once read and verified: a forged one must not make prune drop real checkpoints.
    valid = [r for r in present if r <= newest and read_manifest(states, r) is not None]
    keep_set = set(valid[-keep:])
    removed = []
    for r in present:
        if r < newest and r not in keep_set:
            store.delete(layout.checkpoint_prefix(r), recursive=True)
            removed.append(r)
    return removed


def discard_after(states: GlobalStateStore, round: int) -> None:
    """Delete checkpoints newer than ``round`` (resume from ``round``: they belong to rounds run again).

    Only valid when every replica of the previous launch is stopped.
    """
    for r in states.rounds():
        if r > round:
            states.store.delete(layout.checkpoint_prefix(r), recursive=True)


__all__ = ["Checkpoint", "LoadedResume", "discard_after", "latest_checkpoint", "load_resume", "prune", "read_manifest",
           "slice_entry", "write_manifest"]
