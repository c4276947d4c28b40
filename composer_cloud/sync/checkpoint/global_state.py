"""Round checkpoints in the store: the one owner of every key under ``checkpoints/``.

Layout for committed round ``r`` (zero-padded to 8 digits so listings sort)::

    checkpoints/<r>/global-a<a>-<i>-of-<n>.safetensors  slice i of the global state committed by attempt a
    checkpoints/<r>/global-a<a>-<i>-of-<n>.json         write-once marker: slice i complete (bytes, crc32)
    checkpoints/<r>/replica-<k>.safetensors        replica k's inner state (optimizer, data position, RNG)
    checkpoints/<r>/replica-<k>.json               marker: replica k's state complete
    checkpoints/<r>/manifest.json                  written LAST: every object with its crc32

Invariants:

* **No single writer.** After a commit every participant holds bitwise-identical
  global state. The state is cut into ``n`` = number of participants slices
  (:func:`split_global_state`, deterministic); participant ``i`` writes slice
  ``i`` and any participant may write a missing slice (same bytes). The
  global state of ``r`` is *durable* once all ``n`` markers exist
  (:func:`has_global_state`); healing and resume read only durable states.
* **Blob before marker.** A marker is created (write-once) only after its blob
  is fully written, so a reader that sees a marker sees a complete blob.
* **Manifest last.** Any participant writes the manifest once the global state
  is durable and the participants' replica states are present (write-once: the
  first writer wins). ``resume`` and ``export`` read manifests only.
* **Verified in one read.** A marker and the manifest record the blob's crc32,
  which equals the crc32 in the store's framing of the blob, so checking it
  costs no second pass: every object is verified by the same read that loads it.
* **Void commits.** If a committed round's global state can never become
  durable (every participant died before writing its slice), a replica voids
  that attempt's commit (:func:`composer_cloud.sync.lockstep.rounds.declare_void`);
  the round is then run again as a new attempt. Slices are named by attempt,
  so a voided attempt's slices are never mixed with the new ones.
* Old checkpoints beyond ``keep`` are deleted only after a newer manifest exists.
"""

from __future__ import annotations

import json
import logging
import random
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from composer_cloud import faults
from composer_cloud.sync.lockstep import rounds
from composer_cloud.errors import BadObject, ChecksumMismatch, CorruptCheckpoint, ObjectNotFound, StoreTimeout
from composer_cloud.storage.store import Store
from composer_cloud.storage import layout
from composer_cloud.storage.records import BlobEntry, Manifest, ReplicaMarker, SliceMarker
from composer_cloud.retry import PollPolicy, poll_until

if TYPE_CHECKING:
    import torch

# torch, safetensors and the state codec are imported where tensors are handled, so that reading a
# run's checkpoint records (status, resume planning) does not load torch.

logger = logging.getLogger(__name__)

checkpoint_prefix = layout.checkpoint_prefix


@dataclass(frozen=True)
class Checkpoint:
    """A valid checkpoint: its round and manifest."""

    round: int
    manifest: Manifest


# ---------------------------------------------------------------- global state: slices
@dataclass(frozen=True)
class GlobalStateSlices:
    """A global state tree cut into ``num_shards`` slices of whole tensors, ready to encode.

    The cut is a pure function of the tree's tensor order and sizes, so every
    participant computes the same slices (and the same bytes) from the same state.
    """

    tensors: dict[str, torch.Tensor]
    skeleton: Any
    groups: list[list[str]] = field(default_factory=list)

    @property
    def num_shards(self) -> int:
        return len(self.groups)

    def encode(self, index: int, *, round: int) -> bytes:
        """Slice ``index`` as safetensors bytes; the tree's skeleton rides in every slice's metadata."""
        meta = {"round": str(round), "shard": str(index), "num_shards": str(self.num_shards),
                "skeleton": json.dumps(self.skeleton)}
        from composer_cloud.storage.tensors import save_tensors

        return save_tensors({k: self.tensors[k] for k in self.groups[index]}, meta)


def split_global_state(tree: dict[str, Any], num_shards: int) -> GlobalStateSlices:
    """Cut ``tree`` into ``num_shards`` contiguous groups of whole tensors of ~equal bytes.

    A tensor is never split, so one tensor larger than ``1/num_shards`` of the
    state makes its slice larger than the others (e.g. a big embedding).
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    from composer_cloud.storage.tensors import flatten

    tensors, skeleton = flatten(tree)
    sizes = [(k, t.numel() * t.element_size()) for k, t in tensors.items()]
    total = sum(n for _, n in sizes) or 1
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    seen = 0
    for key, nbytes in sizes:
        # Assign by the tensor's midpoint, so big tensors land near where their bytes fall.
        groups[min(num_shards - 1, (2 * seen + nbytes) * num_shards // (2 * total))].append(key)
        seen += nbytes
    return GlobalStateSlices(tensors=tensors, skeleton=skeleton, groups=groups)


def write_global_shard(store: Store, round: int, slices: GlobalStateSlices, index: int, *, writer: int,
                       attempt: int = 0) -> int:
    """Write slice ``index`` of the global state that ``round``'s ``attempt`` committed, unless its marker
    exists. Returns bytes written.

    Idempotent and safe to race: every writer writes the same bytes, the blob
    put is atomic, and the marker is write-once.
    """
    n = slices.num_shards
    if store.exists(layout.slice_marker_key(round, attempt, index, n)):
        return 0
    blob = slices.encode(index, round=round)
    store.put(layout.slice_blob_key(round, attempt, index, n), blob)
    faults.stall_point("global_upload", round, writer)
    marker = SliceMarker(round=round, attempt=attempt, index=index, num_slices=n, bytes=len(blob),
                         crc32=zlib.crc32(blob), by=writer)
    store.create_json(layout.slice_marker_key(round, attempt, index, n), marker.to_json())
    return len(blob)


def write_global_state(store: Store, round: int, tree: dict[str, Any], *, writer: int, num_shards: int = 1,
                       attempt: int = 0) -> int:
    """Write every slice of ``tree`` (a single writer; tests and tools). Returns bytes written."""
    slices = split_global_state(tree, num_shards)
    return sum(write_global_shard(store, round, slices, i, writer=writer, attempt=attempt)
               for i in range(num_shards))


@dataclass(frozen=True)
class ShardMarkers:
    """The global-state markers of one round's attempt: ``num_shards`` -> {index: marker record}."""

    by_count: dict[int, dict[int, SliceMarker]]

    def complete(self, num_shards: int | None = None) -> int | None:
        """A shard count whose slices are all present (the expected one if given), else None."""
        counts = [num_shards] if num_shards is not None else sorted(self.by_count)
        for n in counts:
            if len(self.by_count.get(n, {})) == n:
                return n
        return None

    def missing(self, num_shards: int) -> list[int]:
        have = self.by_count.get(num_shards, {})
        return [i for i in range(num_shards) if i not in have]


def state_attempt(store: Store, round: int) -> int | None:
    """The attempt whose global state is round ``round``'s: its committed (not void) attempt.

    A round with no round records at all (written by a tool, or a store whose
    round records were removed) has attempt 0 by convention.
    """
    committed = rounds.committed_attempt(store, round)
    if committed is not None:
        return committed
    return None if rounds.attempts(store, round) else 0


def shard_markers(store: Store, round: int, *, attempt: int | None = None) -> ShardMarkers:
    """The slice markers of ``round``'s ``attempt`` (default: :func:`state_attempt`); bad ones are skipped."""
    if attempt is None:
        attempt = state_attempt(store, round)
        if attempt is None:
            return ShardMarkers({})
    prefix = checkpoint_prefix(round)
    by_count: dict[int, dict[int, SliceMarker]] = {}
    for name in store.list_dirs(prefix):
        parsed = layout.parse_slice_marker(name)
        if parsed is None or parsed[0] != attempt:
            continue
        _, index, n = parsed
        key = layout.slice_marker_key(round, attempt, index, n)
        try:
            marker = SliceMarker.from_json(store.get_json(key), key=key, round=round, attempt=attempt, index=index,
                                           num_slices=n)
        except (BadObject, ObjectNotFound) as exc:
            logger.warning("ignoring global-state marker %s (%s)", key, exc)
            continue
        by_count.setdefault(n, {})[index] = marker
    return ShardMarkers(by_count)


def has_global_state(store: Store, round: int, *, num_shards: int | None = None,
                     attempt: int | None = None) -> bool:
    """Whether round ``round``'s global state is durable: every slice's marker exists.

    ``attempt`` defaults to the round's committed (not void) attempt; ``num_shards``
    to any complete set of slices.
    """
    return shard_markers(store, round, attempt=attempt).complete(num_shards) is not None


def global_state_rounds(store: Store) -> list[int]:
    """Rounds whose global state is durable, ascending."""
    return [r for r in checkpoint_rounds(store) if has_global_state(store, r)]


def _read_verified(store: Store, key: str, crc32: int | None) -> memoryview:
    """Read ``key`` once: the store verifies its framing; ``crc32`` (from a marker) must match the payload's."""
    try:
        data = store.get(key)
    except ObjectNotFound:
        raise CorruptCheckpoint(key, "missing") from None
    except ChecksumMismatch as exc:
        raise CorruptCheckpoint(key, exc.reason) from None
    if crc32 is not None and zlib.crc32(data) != crc32:
        raise CorruptCheckpoint(key, "crc32 differs from its marker/manifest; it was not used")
    return data


def load_global(store: Store, round: int, *, num_shards: int | None = None) -> dict[str, Any]:
    """Round ``round``'s global state tree, each slice read and verified once.

    Raises :class:`CorruptCheckpoint` naming the slice if one is missing or damaged.
    """
    markers = shard_markers(store, round)
    n = markers.complete(num_shards)
    if n is None:
        raise CorruptCheckpoint(checkpoint_prefix(round), "global state incomplete (slices present: "
                                f"{ {k: sorted(v) for k, v in markers.by_count.items()} })")
    from safetensors.torch import load as st_load

    from composer_cloud.storage.tensors import read_metadata, unflatten

    tensors: dict[str, torch.Tensor] = {}
    skeleton: Any = None
    for i in range(n):
        marker = markers.by_count[n][i]
        key = layout.slice_blob_key(round, marker.attempt, i, n)
        raw = bytes(_read_verified(store, key, marker.crc32))
        try:
            meta = read_metadata(raw)
            tensors.update(st_load(raw))
            skeleton = json.loads(meta["skeleton"]) if skeleton is None else skeleton
        except Exception as exc:  # noqa: BLE001 - any decode failure means a bad object
            raise CorruptCheckpoint(key, f"not a valid global-state slice ({type(exc).__name__}: {exc})") from None
        del raw
    try:
        return unflatten(tensors, skeleton)
    except KeyError as exc:
        raise CorruptCheckpoint(checkpoint_prefix(round), f"global state lacks tensor {exc}") from None


# ---------------------------------------------------------------- replica state
def replica_state(trainer: Any, local_params: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Everything one replica needs to resume bit-exactly, as a state tree."""
    import torch

    tensors, meta = trainer.state_dict()
    return {
        "trainer": tensors,
        "trainer_meta": _json_safe(meta),
        "torch_rng": torch.get_rng_state(),
        "python_rng": _json_safe(random.getstate()),
        "local_params": local_params or {},
    }


def restore_replica_state(trainer: Any, tree: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Load :func:`replica_state` output; returns the stored local params (may be empty)."""
    import torch

    trainer.load_state_dict(tree["trainer"], tree["trainer_meta"])
    torch.set_rng_state(tree["torch_rng"])
    random.setstate(_as_tuple(tree["python_rng"]))
    return tree.get("local_params", {})


def write_replica_state(store: Store, round: int, rank: int, tree: dict[str, Any], *,
                        world_size: int | None = None) -> int:
    """Write replica ``rank``'s inner state for checkpoint ``round``, then its marker. Returns bytes.

    ``world_size`` (the run's replica count) is recorded: a data position means
    nothing under another replica count.
    """
    from composer_cloud.storage.tensors import encode_state

    blob = encode_state(tree, metadata={"round": str(round), "rank": str(rank)})
    store.put(layout.replica_blob_key(round, rank), blob)
    faults.stall_point("checkpoint", round, rank)
    marker = ReplicaMarker(rank=rank, position=round, bytes=len(blob), crc32=zlib.crc32(blob), world_size=world_size)
    store.put_json(layout.replica_marker_key(round, rank), marker.to_json())
    return len(blob)


def replica_state_marker(store: Store, round: int, rank: int) -> ReplicaMarker | None:
    """Replica ``rank``'s marker for checkpoint ``round`` (None if absent or unusable)."""
    key = layout.replica_marker_key(round, rank)
    try:
        obj = store.try_get_json(key)
        return None if obj is None else ReplicaMarker.from_json(obj, key=key, rank=rank, position=round,
                                                                decoupled=False)
    except BadObject as exc:
        logger.warning("ignoring replica-state marker %s", exc)
        return None


def load_replica_at(store: Store, round: int, rank: int, crc32: int | None = None) -> dict[str, Any]:
    """Replica ``rank``'s inner state of checkpoint ``round``, read and verified once."""
    key = layout.replica_blob_key(round, rank)
    data = _read_verified(store, key, crc32)
    try:
        from composer_cloud.storage.tensors import decode_state

        return decode_state(data)
    except Exception as exc:  # noqa: BLE001
        raise CorruptCheckpoint(key, f"not a valid replica state ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class ResumePoint:
    """Where a (re)starting replica resumes: round ``round``'s durable global state, and its own
    inner state of that round when ``replica_crc32`` is set (exact resume) or fresh inner state
    when it is None (``reason`` says why)."""

    round: int
    replica_crc32: int | None
    reason: str = ""


def resume_point(store: Store, rank: int, *, world_size: int) -> ResumePoint | None:
    """The newest durable round with this replica's own inner state, else the newest durable round.

    Needs no manifest: a replica restarted right after a commit resumes from
    that round as soon as its global state is durable (survivors finish it),
    even if nobody has written the manifest yet. None: nothing durable yet.
    """
    durable = global_state_rounds(store)
    if not durable:
        return None
    newest_reason = f"checkpoint {durable[-1]} has no state for replica {rank}"
    for round in reversed(durable):
        rec = replica_state_marker(store, round, rank)
        if rec is None:
            continue
        saved_world = rec.world_size
        if saved_world != world_size:
            # Data shards are rank::world_size, so a stored data position means
            # nothing under another replica count.
            newest_reason = f"checkpoint {round} was taken with {saved_world} replicas, now {world_size}"
            break
        return ResumePoint(round=round, replica_crc32=rec.crc32)
    return ResumePoint(round=durable[-1], replica_crc32=None, reason=newest_reason)


# ---------------------------------------------------------------- manifests
def write_manifest(store: Store, round: int, participants: list[int], *, deadline_s: float, attempt: int = 0,
                   spec_round_meta: dict[str, Any] | None = None) -> bool:
    """Wait for the durable global state and every participant's state, then write the manifest.

    Any participant may call this; the manifest is write-once, so the first
    writer wins and the others return False. Replicas whose state does not
    arrive by the deadline are left out (they resume with fresh inner state).
    """
    prefix = checkpoint_prefix(round)
    deadline = time.monotonic() + deadline_s
    n = len(participants)

    def stop_if_written(misses: int) -> None:
        if misses % 8 == 0 and store.exists(layout.manifest_key(round)):
            raise _ManifestExists()

    try:
        poll_until(lambda: True if has_global_state(store, round, num_shards=n, attempt=attempt) else None,
                   deadline=deadline, policy=PollPolicy(initial_s=0.05, max_s=1.0), between=stop_if_written,
                   on_timeout=lambda waited: StoreTimeout(f"{prefix} global state", waited))
    except StoreTimeout:
        logger.warning("checkpoint %d: global state not durable within %.0fs; no manifest from this replica",
                       round, deadline_s)
        return False
    except _ManifestExists:
        return False
    markers = shard_markers(store, round, attempt=attempt).by_count[n]
    replicas: dict[int, BlobEntry] = {}
    for rank in participants:
        try:
            store.wait_get(layout.replica_marker_key(round, rank), deadline=deadline)
        except StoreTimeout:
            logger.warning("checkpoint %d: replica %d state missing; it will resume with fresh inner state",
                           round, rank)
            continue
        rec = replica_state_marker(store, round, rank)
        if rec is not None:
            replicas[rank] = BlobEntry(key=layout.replica_blob_name(rank), bytes=rec.bytes, crc32=rec.crc32)
    manifest = Manifest(round=round, attempt=attempt, slices=[_slice_entry(markers[i]) for i in range(n)],
                        replicas=replicas, participants=participants, time=time.time(),
                        extra=dict(spec_round_meta or {}))
    return store.create_json(layout.manifest_key(round), manifest.to_json())


def _slice_entry(marker: SliceMarker) -> BlobEntry:
    name = layout.slice_blob_key(marker.round, marker.attempt, marker.index, marker.num_slices).rsplit("/", 1)[1]
    return BlobEntry(key=name, bytes=marker.bytes, crc32=marker.crc32)


class _ManifestExists(Exception):
    """Another participant already wrote the manifest: stop waiting."""


def checkpoint_rounds(store: Store) -> list[int]:
    """Rounds with a directory under ``checkpoints/`` (stray names skipped), ascending."""
    return sorted(r for r in map(layout.parse_num, store.list_dirs(layout.CHECKPOINTS)) if r is not None)


def read_manifest(store: Store, round: int) -> Manifest | None:
    """Round ``round``'s manifest if present and well-formed, else None (with a warning if unusable)."""
    key = layout.manifest_key(round)
    try:
        return Manifest.from_json(store.get_json(key), key=key, round=round)
    except ObjectNotFound:
        return None
    except BadObject as exc:
        logger.warning("checkpoint %s is unusable (%s); skipping it", checkpoint_prefix(round), exc)
        return None


def latest_checkpoint(store: Store, *, before: int | None = None, verify: bool = True) -> Checkpoint | None:
    """Newest valid checkpoint (manifest present, not void), optionally ``< before``.

    ``verify=True`` reads every listed object once, one object in memory at a
    time, and checks it against the manifest (what ``resume`` does before it
    discards anything). Replicas pass ``verify=False`` and verify what they load
    in the same read (:func:`load_global`, :func:`load_replica_at`). A torn or
    corrupt checkpoint is skipped with a warning naming it, and the previous
    one is used.
    """
    for round in reversed(checkpoint_rounds(store)):
        if before is not None and round >= before:
            continue
        prefix = checkpoint_prefix(round)
        manifest = read_manifest(store, round)
        if manifest is None:
            logger.warning("checkpoint %s/%s has no valid manifest (torn write?); skipping it", store.uri, prefix)
            continue
        if state_attempt(store, round) != manifest.attempt:
            logger.warning("checkpoint %s/%s belongs to a voided commit; skipping it", store.uri, prefix)
            continue
        if verify:
            try:
                for entry in [*manifest.slices, *manifest.replicas.values()]:
                    _read_verified(store, layout.in_checkpoint(round, entry.key), entry.crc32)
            except CorruptCheckpoint as exc:
                logger.warning("checkpoint %s/%s is corrupt or incomplete (%s); falling back to an earlier one",
                               store.uri, prefix, exc)
                continue
        return Checkpoint(round=round, manifest=manifest)
    return None


def prune_checkpoints(store: Store, *, keep: int, newest: int) -> list[int]:
    """Delete checkpoint dirs older than the ``keep`` newest manifests (never the newest)."""
    present = checkpoint_rounds(store)
    valid = [r for r in present if r <= newest and store.exists(layout.manifest_key(r))]
    keep_set = set(valid[-keep:])
    removed = []
    # Global-only rounds (healing states) older than ``newest`` are superseded too.
    for r in present:
        if r < newest and r not in keep_set:
            store.delete(checkpoint_prefix(r), recursive=True)
            removed.append(r)
    return removed


def discard_after(store: Store, round: int) -> None:
    """Delete round records and checkpoints newer than ``round`` (resume from ``round``).

    Only valid when every replica of the previous launch is stopped: those
    objects belong to rounds that will be recomputed.
    """
    rounds.discard_after(store, round)
    for r in checkpoint_rounds(store):
        if r > round:
            store.delete(checkpoint_prefix(r), recursive=True)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return [_json_safe(x) for x in obj]
    if isinstance(obj, list):
        return [_json_safe(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    return obj


def _as_tuple(obj: Any) -> Any:
    if isinstance(obj, list):
        return tuple(_as_tuple(x) for x in obj)
    return obj


__all__ = [
    "Checkpoint",
    "CorruptCheckpoint",
    "GlobalStateSlices",
    "checkpoint_prefix",
    "checkpoint_rounds",
    "discard_after",
    "global_state_rounds",
    "has_global_state",
    "latest_checkpoint",
    "load_global",
    "load_replica_at",
    "prune_checkpoints",
    "replica_state",
    "replica_state_marker",
    "restore_replica_state",
    "resume_point",
    "ResumePoint",
    "shard_markers",
    "state_attempt",
    "split_global_state",
    "write_global_shard",
    "write_global_state",
    "write_manifest",
]
