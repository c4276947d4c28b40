"""Round checkpoints in the store: the one owner of every key under ``checkpoints/``.

Layout for committed round ``r`` (zero-padded to 8 digits so listings sort)::

    checkpoints/<r>/global.safetensors   global params + outer optimizer state (round leader)
    checkpoints/<r>/global.json          write-once marker: global state complete
    checkpoints/<r>/replica-<k>.safetensors  replica k's inner state (optimizer, data position, RNG)
    checkpoints/<r>/replica-<k>.json     marker: replica k's state complete
    checkpoints/<r>/manifest.json        written LAST by the leader: lists every object with its crc32

Invariants:

* A checkpoint is valid only once ``manifest.json`` exists; resume reads
  manifests only and verifies every listed object (store framing + the
  manifest's crc32). A torn or corrupt checkpoint is skipped with a warning
  naming it, and the previous valid one is used.
* The global state is written every round (late replicas heal from it); the
  per-replica inner state only every ``checkpoint_every`` rounds.
* Old checkpoints beyond ``keep`` are deleted only after a newer manifest exists.
"""

from __future__ import annotations

import json
import logging
import random
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from composer_cloud import faults
from composer_cloud.rendezvous.state import decode_state, encode_state
from composer_cloud.rendezvous.store import ChecksumMismatch, ObjectNotFound, Store, StoreTimeout

logger = logging.getLogger(__name__)

_GLOBAL_BLOB = "global.safetensors"
_GLOBAL_MARKER = "global.json"
_MANIFEST = "manifest.json"


def checkpoint_prefix(round: int) -> str:
    """``checkpoints/<r>``: every object of round ``r``'s checkpoint lies under it."""
    return f"checkpoints/{round:08d}"


def _replica_blob(rank: int) -> str:
    return f"replica-{rank}.safetensors"


def _replica_marker(rank: int) -> str:
    return f"replica-{rank}.json"


@dataclass(frozen=True)
class Checkpoint:
    """A valid checkpoint: its round and manifest."""

    round: int
    manifest: dict[str, Any]


# ---------------------------------------------------------------- global state
def write_global_state(store: Store, round: int, tree: dict[str, Any], *, writer: int) -> int:
    """Write round ``round``'s global state, then its write-once marker. Returns the blob's bytes.

    Ordering: blob first, marker last, so a reader that sees the marker sees a
    complete blob (a crash in between leaves an unmarked blob nobody reads).
    """
    prefix = checkpoint_prefix(round)
    blob = encode_state(tree, metadata={"round": str(round)})
    store.put(f"{prefix}/{_GLOBAL_BLOB}", blob)
    store.create_json(f"{prefix}/{_GLOBAL_MARKER}",
                      {"round": round, "bytes": len(blob), "crc32": zlib.crc32(blob), "by": writer})
    return len(blob)


def has_global_state(store: Store, round: int) -> bool:
    """Whether round ``round``'s global state is complete (its marker exists)."""
    return store.exists(f"{checkpoint_prefix(round)}/{_GLOBAL_MARKER}")


def global_state_rounds(store: Store) -> list[int]:
    """Rounds whose global state is complete, ascending."""
    return [r for r in checkpoint_rounds(store) if has_global_state(store, r)]


def replica_state(trainer: Any, local_params: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Everything one replica needs to resume bit-exactly, as a state tree."""
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
    trainer.load_state_dict(tree["trainer"], tree["trainer_meta"])
    torch.set_rng_state(tree["torch_rng"])
    random.setstate(_as_tuple(tree["python_rng"]))
    return tree.get("local_params", {})


def write_replica_state(store: Store, round: int, rank: int, tree: dict[str, Any]) -> int:
    """Write replica ``rank``'s inner state for checkpoint ``round``, then its marker. Returns bytes."""
    prefix = checkpoint_prefix(round)
    blob = encode_state(tree, metadata={"round": str(round), "rank": str(rank)})
    store.put(f"{prefix}/{_replica_blob(rank)}", blob)
    faults.stall_point("checkpoint", round, rank)
    store.put_json(f"{prefix}/{_replica_marker(rank)}",
                   {"round": round, "rank": rank, "bytes": len(blob), "crc32": zlib.crc32(blob)})
    return len(blob)


def write_manifest(store: Store, round: int, participants: list[int], *, deadline_s: float,
                   spec_round_meta: dict[str, Any] | None = None) -> bool:
    """Leader: wait for the global state and every participant's state, then write the manifest.

    Replicas whose state does not arrive by the deadline are left out of the
    manifest (they resume with fresh inner state). Returns whether written.
    """
    prefix = checkpoint_prefix(round)
    deadline = time.monotonic() + deadline_s
    try:
        glob = store.wait_get(f"{prefix}/{_GLOBAL_MARKER}", deadline=deadline)
    except StoreTimeout:
        logger.warning("checkpoint %d: global state never appeared; no manifest", round)
        return False
    glob_meta = json.loads(bytes(glob))
    replicas: dict[str, Any] = {}
    for rank in participants:
        try:
            rec = json.loads(bytes(store.wait_get(f"{prefix}/{_replica_marker(rank)}", deadline=deadline)))
        except StoreTimeout:
            logger.warning("checkpoint %d: replica %d state missing; it will resume with fresh inner state",
                           round, rank)
            continue
        replicas[str(rank)] = {"key": _replica_blob(rank), "bytes": rec["bytes"], "crc32": rec["crc32"]}
    manifest = {
        "round": round,
        "global": {"key": _GLOBAL_BLOB, "bytes": glob_meta.get("bytes"), "crc32": glob_meta.get("crc32")},
        "replicas": replicas,
        "participants": participants,
        "time": time.time(),
        **(spec_round_meta or {}),
    }
    return store.create_json(f"{prefix}/{_MANIFEST}", manifest)


def checkpoint_rounds(store: Store) -> list[int]:
    return sorted(int(n) for n in store.list_dirs("checkpoints") if n.isdigit())


def latest_checkpoint(store: Store, *, before: int | None = None, verify: bool = True) -> Checkpoint | None:
    """Newest valid checkpoint (manifest present, objects verified), optionally ``< before``."""
    for round in reversed(checkpoint_rounds(store)):
        if before is not None and round >= before:
            continue
        prefix = checkpoint_prefix(round)
        try:
            manifest = store.get_json(f"{prefix}/{_MANIFEST}")
        except ObjectNotFound:
            logger.warning("checkpoint %s/%s has no manifest (torn write); skipping it", store.uri, prefix)
            continue
        except ChecksumMismatch as exc:
            logger.warning("checkpoint %s is corrupt (%s); skipping it", prefix, exc)
            continue
        if verify:
            try:
                entries = [manifest.get("global", {}), *manifest.get("replicas", {}).values()]
                for entry in entries:
                    if entry.get("crc32") is None:  # a manifest from before global crc32s: framing only
                        store.get(f"{prefix}/{entry.get('key', _GLOBAL_BLOB)}")
                        continue
                    data = store.get(f"{prefix}/{entry['key']}")
                    if zlib.crc32(data) != entry["crc32"]:
                        raise ChecksumMismatch(f"{prefix}/{entry['key']}", "crc32 differs from manifest")
            except (ObjectNotFound, ChecksumMismatch) as exc:
                logger.warning("checkpoint %s/%s is corrupt or incomplete (%s); falling back to an earlier one",
                               store.uri, prefix, exc)
                continue
        return Checkpoint(round=round, manifest=manifest)
    return None


def load_global(store: Store, round: int) -> dict[str, Any]:
    """Round ``round``'s global state tree (the registered torchft state dicts by key)."""
    return decode_state(store.get(f"{checkpoint_prefix(round)}/{_GLOBAL_BLOB}"))


def load_replica(store: Store, ckpt: Checkpoint, rank: int) -> dict[str, Any] | None:
    """Replica ``rank``'s inner state in ``ckpt``, or None if the manifest has none for it."""
    entry = ckpt.manifest.get("replicas", {}).get(str(rank))
    if entry is None:
        return None
    return decode_state(store.get(f"{checkpoint_prefix(ckpt.round)}/{entry['key']}"))


def prune_checkpoints(store: Store, *, keep: int, newest: int) -> list[int]:
    """Delete checkpoint dirs older than the ``keep`` newest manifests (never the newest)."""
    rounds = checkpoint_rounds(store)
    valid = [r for r in rounds if r <= newest and store.exists(f"{checkpoint_prefix(r)}/{_MANIFEST}")]
    keep_set = set(valid[-keep:])
    removed = []
    # Global-only rounds (healing states) older than ``newest`` are superseded too.
    for r in rounds:
        if r < newest and r not in keep_set:
            store.delete(checkpoint_prefix(r), recursive=True)
            removed.append(r)
    return removed


def discard_after(store: Store, round: int) -> None:
    """Delete round records and checkpoints newer than ``round`` (resume from ``round``).

    Only valid when every replica of the previous launch is stopped: those
    objects belong to rounds that will be recomputed.
    """
    for name in store.list_dirs("rounds"):
        if name.isdigit() and int(name) > round:
            store.delete(f"rounds/{name}", recursive=True)
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
    "checkpoint_prefix",
    "checkpoint_rounds",
    "discard_after",
    "global_state_rounds",
    "has_global_state",
    "latest_checkpoint",
    "load_global",
    "load_replica",
    "prune_checkpoints",
    "replica_state",
    "restore_replica_state",
    "write_global_state",
    "write_manifest",
    "write_replica_state",
]
