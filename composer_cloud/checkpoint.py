"""Round checkpoints in the store, and finding the latest valid one.

Layout for committed round ``r`` (zero-padded)::

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

import logging
import random
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from composer_cloud import faults
from composer_cloud.rendezvous.manager import global_state_prefix
from composer_cloud.rendezvous.state import decode_state, encode_state
from composer_cloud.rendezvous.store import ChecksumMismatch, ObjectNotFound, Store, StoreError, StoreTimeout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A valid checkpoint: its round and manifest."""

    round: int
    manifest: dict[str, Any]

    @property
    def replicas(self) -> list[int]:
        return sorted(int(k) for k in self.manifest.get("replicas", {}))


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


def write_replica_state(store: Store, round: int, rank: int, tree: dict[str, Any]) -> None:
    prefix = global_state_prefix(round)
    blob = encode_state(tree, metadata={"round": str(round), "rank": str(rank)})
    store.put(f"{prefix}/replica-{rank}.safetensors", blob)
    faults.stall_point("checkpoint", round, rank)
    store.put_json(f"{prefix}/replica-{rank}.json",
                   {"round": round, "rank": rank, "bytes": len(blob), "crc32": zlib.crc32(blob)})


def write_manifest(store: Store, round: int, participants: list[int], *, deadline_s: float,
                   spec_round_meta: dict[str, Any] | None = None) -> bool:
    """Leader: wait for the global state and every participant's state, then write the manifest.

    Replicas whose state does not arrive by the deadline are left out of the
    manifest (they resume with fresh inner state). Returns whether written.
    """
    prefix = global_state_prefix(round)
    deadline = time.monotonic() + deadline_s
    try:
        glob = store.wait_get(f"{prefix}/global.json", deadline=deadline)
    except StoreTimeout:
        logger.warning("checkpoint %d: global state never appeared; no manifest", round)
        return False
    import json

    glob_meta = json.loads(bytes(glob))
    replicas: dict[str, Any] = {}
    for rank in participants:
        try:
            rec = json.loads(bytes(store.wait_get(f"{prefix}/replica-{rank}.json", deadline=deadline)))
        except StoreTimeout:
            logger.warning("checkpoint %d: replica %d state missing; it will resume with fresh inner state",
                           round, rank)
            continue
        replicas[str(rank)] = {"key": f"replica-{rank}.safetensors", "bytes": rec["bytes"], "crc32": rec["crc32"]}
    manifest = {
        "round": round,
        "global": {"key": "global.safetensors", "bytes": glob_meta.get("bytes")},
        "replicas": replicas,
        "participants": participants,
        "time": time.time(),
        **(spec_round_meta or {}),
    }
    return store.create_json(f"{prefix}/manifest.json", manifest)


def checkpoint_rounds(store: Store) -> list[int]:
    return sorted(int(n) for n in store.list_dirs("checkpoints") if n.isdigit())


def latest_checkpoint(store: Store, *, before: int | None = None, verify: bool = True) -> Checkpoint | None:
    """Newest valid checkpoint (manifest present, objects verified), optionally ``< before``."""
    for round in reversed(checkpoint_rounds(store)):
        if before is not None and round >= before:
            continue
        prefix = global_state_prefix(round)
        try:
            manifest = store.get_json(f"{prefix}/manifest.json")
        except ObjectNotFound:
            logger.warning("checkpoint %s/%s has no manifest (torn write); skipping it", store.uri, prefix)
            continue
        except ChecksumMismatch as exc:
            logger.warning("checkpoint %s is corrupt (%s); skipping it", prefix, exc)
            continue
        if verify:
            try:
                store.get(f"{prefix}/global.safetensors")
                for entry in manifest.get("replicas", {}).values():
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
    return decode_state(store.get(f"{global_state_prefix(round)}/global.safetensors"))


def load_replica(store: Store, ckpt: Checkpoint, rank: int) -> dict[str, Any] | None:
    entry = ckpt.manifest.get("replicas", {}).get(str(rank))
    if entry is None:
        return None
    return decode_state(store.get(f"{global_state_prefix(ckpt.round)}/{entry['key']}"))


def prune_checkpoints(store: Store, *, keep: int, newest: int) -> list[int]:
    """Delete checkpoint dirs older than the ``keep`` newest manifests (never the newest)."""
    rounds = checkpoint_rounds(store)
    valid = [r for r in rounds if r <= newest and store.exists(f"{global_state_prefix(r)}/manifest.json")]
    keep_set = set(valid[-keep:])
    removed = []
    # Global-only rounds (healing states) older than ``newest`` are superseded too.
    for r in rounds:
        if r < newest and r not in keep_set:
            store.delete(global_state_prefix(r), recursive=True)
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
            store.delete(global_state_prefix(r), recursive=True)


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
    "StoreError",
    "checkpoint_rounds",
    "discard_after",
    "latest_checkpoint",
    "load_global",
    "load_replica",
    "prune_checkpoints",
    "replica_state",
    "restore_replica_state",
    "write_manifest",
    "write_replica_state",
]
