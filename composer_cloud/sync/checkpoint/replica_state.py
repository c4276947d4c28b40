"""One replica's inner state in the store: what it needs to resume bit-exactly, for both sync modes.

The tree (:func:`replica_state`) holds the trainer's state (inner optimizer,
data position, RNGs it draws from), the process RNGs and, where they differ
from the global parameters, the local parameters. It is written as a
safetensors blob, then a marker with the blob's crc32 and the run's replica
count (a data position means nothing under another count):

* lock-step: ``checkpoints/<r>/replica-<k>.*``, one per checkpointed round,
  written *before* the replica's slice of round ``r``'s global state, so a
  replica killed during the global upload resumes round ``r`` exactly;
* decoupled: ``decoupled/replica/<k>/<seq>.*`` after contribution ``seq``,
  the newest ``keep`` kept.

A marker whose blob is missing or damaged is skipped: the replica resumes from
an older state, or from the global parameters with fresh inner state.
"""

from __future__ import annotations

import logging
import random
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from composer_cloud.errors import BadObject, CorruptCheckpoint, ObjectNotFound
from composer_cloud.hooks import NO_HOOKS, Hooks
from composer_cloud.round_numbers import shown_round
from composer_cloud.storage import layout
from composer_cloud.storage.records import ReplicaMarker
from composer_cloud.storage.records.limits import MARKER_MAX_BYTES
from composer_cloud.storage.store import Store
from composer_cloud.sync.checkpoint.global_state import read_verified

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- the state tree
def replica_state(trainer: Any, local_params: dict[str, torch.Tensor] | None, *,
                  codec: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Everything one replica needs to resume bit-exactly, as a state tree.

    ``codec``: the wire codec's state (the sparse codec's error-feedback accumulators), stored under
    ``"codec"`` when there is any.
    """
    import torch

    tensors, meta = trainer.state_dict()
    tree = {
        "trainer": tensors,
        "trainer_meta": _json_safe(meta),
        "torch_rng": torch.get_rng_state(),
        "python_rng": _json_safe(random.getstate()),
        "local_params": local_params or {},
    }
    if codec:
        tree["codec"] = codec
    return tree


def restore_replica_state(trainer: Any, tree: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Load :func:`replica_state` output (this sets the process RNGs); returns the stored local params."""
    import torch

    trainer.load_state_dict(tree["trainer"], tree["trainer_meta"])
    torch.set_rng_state(tree["torch_rng"])
    random.setstate(_as_tuple(tree["python_rng"]))
    return tree.get("local_params", {})


def _encode(tree: dict[str, Any], metadata: dict[str, str]) -> bytes:
    from composer_cloud.storage.tensors import encode_state

    return encode_state(tree, metadata=metadata)


def _decode(key: str, data: memoryview) -> dict[str, Any]:
    from composer_cloud.storage.tensors import decode_state

    try:
        return decode_state(data)
    except Exception as exc:  # noqa: BLE001 - any decode failure means a bad object
        raise CorruptCheckpoint(key, f"not a valid replica state ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class ResumePoint:
    """Where a (re)starting lock-step replica resumes: round ``round``'s durable global state, and its own
    inner state of that round when ``replica_crc32`` is set (exact resume) or fresh inner state when it is
    None (``reason`` says why)."""

    round: int
    replica_crc32: int | None
    reason: str = ""


@dataclass(frozen=True)
class DecoupledResume:
    """A decoupled replica's newest usable inner state: after contribution ``seq``, at global ``version``."""

    seq: int
    version: int
    tree: dict[str, Any]


class ReplicaStateStore:
    """Writes and reads replicas' inner states. ``hooks``: the ``checkpoint`` fault point (blob, then marker)."""

    def __init__(self, store: Store, *, hooks: Hooks = NO_HOOKS) -> None:
        self.store = store
        self.hooks = hooks

    # ------------------------------------------------------------ lock-step
    def write(self, round: int, rank: int, tree: dict[str, Any], *, world_size: int) -> int:
        """Write ``rank``'s inner state for checkpoint ``round``, then its marker. Returns bytes written."""
        blob = _encode(tree, {"round": str(round), "rank": str(rank)})
        self.store.put(layout.replica_blob_key(round, rank), blob)
        self.hooks.at("checkpoint", round, rank)
        marker = ReplicaMarker(rank=rank, position=round, bytes=len(blob), crc32=zlib.crc32(blob),
                               world_size=world_size)
        self.store.put_json(layout.replica_marker_key(round, rank), marker.to_json())
        return len(blob)

    def marker(self, round: int, rank: int) -> ReplicaMarker | None:
        """``rank``'s marker for checkpoint ``round`` (None if absent or unusable)."""
        key = layout.replica_marker_key(round, rank)
        try:
            obj = self.store.try_get_json(key, max_bytes=MARKER_MAX_BYTES)
            return None if obj is None else ReplicaMarker.from_json(obj, key=key, rank=rank, position=round,
                                                                    decoupled=False)
        except BadObject as exc:
            logger.warning("ignoring replica-state marker %s", exc)
            return None

    def load(self, round: int, rank: int, crc32: int | None) -> dict[str, Any]:
        """``rank``'s inner state of checkpoint ``round``, read and verified once (against ``crc32``)."""
        key = layout.replica_blob_key(round, rank)
        return _decode(key, read_verified(self.store, key, crc32))

    def resume_point(self, rank: int, *, world_size: int, durable_rounds: list[int]) -> ResumePoint | None:
        """The newest durable round with ``rank``'s own inner state, else the newest durable round.

        Needs no manifest: a replica restarted right after a commit resumes from
        that round as soon as its global state is durable (survivors finish it),
        even if nobody has written the manifest yet. None: nothing durable yet.
        """
        if not durable_rounds:
            return None
        newest_reason = f"the checkpoint of round {shown_round(durable_rounds[-1])} has no state for replica {rank}"
        for round in reversed(durable_rounds):
            rec = self.marker(round, rank)
            if rec is None:
                continue
            if rec.world_size != world_size:
                # Data shards are rank::world_size, so a stored data position means nothing under another count.
                newest_reason = (f"the checkpoint of round {shown_round(round)} was taken with {rec.world_size} "
                                 f"replicas, now {world_size}")
                break
            return ResumePoint(round=round, replica_crc32=rec.crc32)
        return ResumePoint(round=durable_rounds[-1], replica_crc32=None, reason=newest_reason)

    # ------------------------------------------------------------ decoupled
    def write_decoupled(self, rank: int, seq: int, tree: dict[str, Any], *, version: int, world_size: int,
                        keep: int) -> None:
        """``rank``'s inner state after contribution ``seq`` (blob, then marker); all but the ``keep`` newest go."""
        blob = _encode(tree, {"rank": str(rank), "seq": str(seq), "version": str(version)})
        self.store.put(layout.decoupled_replica_key(rank, seq, "safetensors"), blob)
        marker = ReplicaMarker(rank=rank, position=seq, bytes=len(blob), crc32=zlib.crc32(blob),
                               world_size=world_size, version=version, time=time.time())
        self.store.put_json(layout.decoupled_replica_key(rank, seq, "json"), marker.to_json())
        for old in self._decoupled_seqs(rank)[:-keep]:
            for ext in ("safetensors", "json"):
                self.store.delete(layout.decoupled_replica_key(rank, old, ext))

    def load_decoupled(self, rank: int, *, world_size: int) -> DecoupledResume | None:
        """``rank``'s newest verified inner state (None: none usable; the replica starts from a global)."""
        for seq in reversed(self._decoupled_seqs(rank)):
            key = layout.decoupled_replica_key(rank, seq, "json")
            try:
                rec = ReplicaMarker.from_json(self.store.get_json(key, max_bytes=MARKER_MAX_BYTES), key=key, rank=rank,
                                              position=seq,
                                              decoupled=True)
                if rec.world_size != world_size:
                    raise BadObject(key, f"written with {rec.world_size} replicas, now {world_size}")
                blob_key = layout.decoupled_replica_key(rank, seq, "safetensors")
                tree = _decode(blob_key, read_verified(self.store, blob_key, rec.crc32))
                assert rec.version is not None
                return DecoupledResume(seq=seq, version=rec.version, tree=tree)
            except (BadObject, ObjectNotFound) as exc:
                logger.warning("replica %d: inner state %d unusable (%s); trying an older one", rank, seq, exc)
        return None

    def _decoupled_seqs(self, rank: int) -> list[int]:
        names = self.store.list_dirs(layout.decoupled_replica_prefix(rank))
        return sorted(s for s in map(layout.parse_num_json, names) if s is not None)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, (tuple, list)):
        return [_json_safe(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    return obj


def _as_tuple(obj: Any) -> Any:
    if isinstance(obj, list):
        return tuple(_as_tuple(x) for x in obj)
    return obj


__all__ = ["DecoupledResume", "ReplicaStateStore", "ResumePoint", "replica_state", "restore_replica_state"]
