"""Checkpoint records: slice and replica-state markers, and the manifest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from composer_cloud.errors import BadObject
from composer_cloud.storage.records.fields import as_object, check_position, int_field, rank_list


@dataclass(frozen=True)
class SliceMarker:
    """``global-a<a>-<i>-of-<n>.json``: slice ``index`` of a global state is complete (write-once)."""

    round: int
    attempt: int
    index: int
    num_slices: int
    bytes: int
    crc32: int
    by: int

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "attempt": self.attempt, "shard": self.index, "num_shards": self.num_slices,
                "bytes": self.bytes, "crc32": self.crc32, "by": self.by}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, round: int, attempt: int, index: int, num_slices: int) -> "SliceMarker":
        obj = as_object(obj, key)
        check_position(obj, key=key, round=round, attempt=attempt, shard=index, num_shards=num_slices)
        return cls(round=round, attempt=attempt, index=index, num_slices=num_slices,
                   bytes=int_field(obj, "bytes", key), crc32=int_field(obj, "crc32", key),
                   by=int_field(obj, "by", key))


@dataclass(frozen=True)
class ReplicaMarker:
    """The marker of one replica's inner-state blob, written after the blob.

    Lock-step (``checkpoints/<r>/replica-<k>.json``): ``position`` is the round.
    Decoupled (``decoupled/replica/<k>/<seq>.json``): ``position`` is the
    contribution seq, and ``version`` the global version the state had adopted.
    ``world_size``: the run's replica count when it was written (a data position
    means nothing under another count).
    """

    rank: int
    position: int
    bytes: int
    crc32: int
    world_size: int
    version: int | None = None
    time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        if self.version is None:
            return {"round": self.position, "rank": self.rank, "bytes": self.bytes, "crc32": self.crc32,
                    "world_size": self.world_size}
        return {"rank": self.rank, "seq": self.position, "version": self.version, "world_size": self.world_size,
                "bytes": self.bytes, "crc32": self.crc32, "time": self.time}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, rank: int, position: int, decoupled: bool) -> "ReplicaMarker":
        obj = as_object(obj, key)
        check_position(obj, key=key, rank=rank, **({"seq": position} if decoupled else {"round": position}))
        return cls(rank=rank, position=position, bytes=int_field(obj, "bytes", key),
                   crc32=int_field(obj, "crc32", key), world_size=int_field(obj, "world_size", key, lo=1),
                   version=int_field(obj, "version", key) if decoupled else None,
                   time=obj["time"] if decoupled and isinstance(obj.get("time"), (int, float)) else 0.0)


@dataclass(frozen=True)
class BlobEntry:
    """One object a manifest lists: its name inside the checkpoint, size and crc32."""

    key: str
    bytes: int
    crc32: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "BlobEntry":
        obj = as_object(obj, key)
        name = obj.get("key")
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise BadObject(key, f"entry {str(name)[:40]!r} is not an object name inside the checkpoint")
        return cls(key=name, bytes=int_field(obj, "bytes", key), crc32=int_field(obj, "crc32", key))


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``: written last; the checkpoint is valid for resume and export once it exists.

    ``extra`` carries mode-specific fields (lock-step: ``replicas_launched``; decoupled: ``decoupled``).
    """

    round: int
    attempt: int
    slices: list[BlobEntry]
    replicas: dict[int, BlobEntry]
    participants: list[int]
    time: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "round": self.round, "attempt": self.attempt,
                "global": [e.to_json() for e in self.slices],
                "replicas": {str(r): e.to_json() for r, e in sorted(self.replicas.items())},
                "participants": self.participants, "time": self.time}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, round: int) -> "Manifest":
        obj = as_object(obj, key)
        check_position(obj, key=key, round=round)
        attempt = int_field(obj, "attempt", key)
        entries = obj.get("global")
        if not isinstance(entries, list) or not entries:
            raise BadObject(key, "field 'global' must list the global state's slices")
        replicas = obj.get("replicas", {})
        if not isinstance(replicas, dict) or not all(isinstance(r, str) and r.isdigit() for r in replicas):
            raise BadObject(key, "field 'replicas' must map ranks to objects")
        participants = obj.get("participants", [])
        extra = {k: v for k, v in obj.items()
                 if k not in ("round", "attempt", "global", "replicas", "participants", "time")}
        return cls(round=round, attempt=attempt, slices=[BlobEntry.from_json(e, key=key) for e in entries],
                   replicas={int(r): BlobEntry.from_json(e, key=key) for r, e in replicas.items()},
                   participants=rank_list(participants, key=key, name="participants", replicas=None),
                   time=obj["time"] if isinstance(obj.get("time"), (int, float)) else 0.0, extra=extra)
