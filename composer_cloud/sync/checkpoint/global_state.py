"""Global states under ``checkpoints/<r>/``: sliced, written by every participant, read back verified.

A global state (lock-step: the round's fragment backups and outer optimizer
state; decoupled: version ``v``'s parameters and momentum) is a state tree
written as ``n`` slices of whole tensors, each a safetensors blob followed by
a write-once marker (keys: :mod:`composer_cloud.storage.layout`). Every call
names the *attempt* whose state it means: the sync layer above knows which
attempt of a round committed (lock-step round records) or that there is only
one (decoupled versions, attempt 0), so nothing here reads round records.

Invariants:

* **No single writer.** After a commit every participant holds bitwise-identical
  global state. The state is cut into ``n`` = number of participants slices
  (:func:`split_global_state`, deterministic); participant ``i`` writes slice
  ``i`` and any participant may write a missing slice (same bytes, write-once
  marker). The state is *durable* once all ``n`` markers exist; healing,
  resume and adoption read only durable states.
* **Blob before marker.** A marker is created only after its blob is fully
  written, so a reader that sees a marker sees a complete blob.
* **Verified in one read.** A marker records the blob's crc32, which equals the
  crc32 in the store's framing of the blob, so checking it costs no second pass.
* **Attempts never mix.** Slices are named by attempt, so the slices of a
  voided commit are never combined with those of the attempt that replaced it.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from composer_cloud.errors import BadObject, ChecksumMismatch, CorruptCheckpoint, ObjectNotFound, StoreTimeout
from composer_cloud.hooks import NO_HOOKS, Hooks
from composer_cloud.retry import PollPolicy, poll_until
from composer_cloud.round_numbers import shown_round
from composer_cloud.storage import layout
from composer_cloud.storage.records import SliceMarker
from composer_cloud.storage.records.limits import MARKER_MAX_BYTES
from composer_cloud.storage.store import Store
from composer_cloud.sync.trust import create_over_forged

if TYPE_CHECKING:
    import torch

# torch, safetensors and the tensor codec are imported where tensors are handled, so that reading a
# run's checkpoint records (status, resume planning) does not load torch.

logger = logging.getLogger(__name__)

#: Which attempt's state is round ``r``'s (``None``: no valid one); given by the sync mode above.
AttemptOf = Callable[[int], "int | None"]


# ---------------------------------------------------------------- slices
@dataclass(frozen=True)
class GlobalStateSlices:
    """A global state tree cut into ``num_slices`` slices of whole tensors, ready to encode.

    The cut is a pure function of the tree's tensor order and sizes, so every
    participant computes the same slices (and the same bytes) from the same state.
    """

    tensors: dict[str, torch.Tensor]
    skeleton: Any
    groups: list[list[str]] = field(default_factory=list)

    @property
    def num_slices(self) -> int:
        return len(self.groups)

    def encode(self, index: int, *, round: int) -> bytes:
        """Slice ``index`` as safetensors bytes; the tree's skeleton rides in every slice's metadata."""
        meta = {"round": str(round), "shard": str(index), "num_shards": str(self.num_slices),
                "skeleton": json.dumps(self.skeleton)}
        from composer_cloud.storage.tensors import save_tensors

        return save_tensors({k: self.tensors[k] for k in self.groups[index]}, meta)


def split_global_state(tree: dict[str, Any], num_slices: int) -> GlobalStateSlices:
    """Cut ``tree`` into ``num_slices`` contiguous groups of whole tensors of ~equal bytes.

    A tensor is never split, so one tensor larger than ``1/num_slices`` of the
    state makes its slice larger than the others (e.g. a big embedding).
    """
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}")
    from composer_cloud.storage.tensors import flatten

    tensors, skeleton = flatten(tree)
    sizes = [(k, t.numel() * t.element_size()) for k, t in tensors.items()]
    total = sum(n for _, n in sizes) or 1
    groups: list[list[str]] = [[] for _ in range(num_slices)]
    seen = 0
    for key, nbytes in sizes:
        # Assign by the tensor's midpoint, so big tensors land near where their bytes fall.
        groups[min(num_slices - 1, (2 * seen + nbytes) * num_slices // (2 * total))].append(key)
        seen += nbytes
    return GlobalStateSlices(tensors=tensors, skeleton=skeleton, groups=groups)


@dataclass(frozen=True)
class SliceMarkers:
    """The slice markers of one round's attempt: ``num_slices`` -> {index: marker}."""

    by_count: dict[int, dict[int, SliceMarker]]

    def complete(self, num_slices: int | None = None) -> int | None:
        """A slice count whose slices are all present (the expected one if given), else None."""
        counts = [num_slices] if num_slices is not None else sorted(self.by_count)
        for n in counts:
            if len(self.by_count.get(n, {})) == n:
                return n
        return None

    def missing(self, num_slices: int) -> list[int]:
        have = self.by_count.get(num_slices, {})
        return [i for i in range(num_slices) if i not in have]


def read_verified(store: Store, key: str, crc32: int | None) -> memoryview:
    """Read ``key`` once: the store verifies its framing; ``crc32`` (a marker's) must match the payload's."""
    try:
        data = store.get(key)
    except ObjectNotFound:
        raise CorruptCheckpoint(key, "missing") from None
    except ChecksumMismatch as exc:
        raise CorruptCheckpoint(key, exc.reason) from None
    if crc32 is not None and zlib.crc32(data) != crc32:
        raise CorruptCheckpoint(key, "crc32 differs from its marker/manifest; it was not used")
    return data


# ---------------------------------------------------------------- the store of global states
class GlobalStateStore:
    """Writes and reads the global states of a run's store.

    ``hooks``: the fault points of the crash tests (``global_upload``, between a
    slice's blob and its marker); :data:`~composer_cloud.hooks.NO_HOOKS` in production.
    """

    def __init__(self, store: Store, *, hooks: Hooks = NO_HOOKS) -> None:
        self.store = store
        self.hooks = hooks

    # ------------------------------------------------------------ writing
    def write_slice(self, round: int, attempt: int, slices: GlobalStateSlices, index: int, *, writer: int) -> int:
        """Write slice ``index`` unless its marker exists; returns bytes written.

        Idempotent and safe to race: every writer writes the same bytes, the
        blob put is atomic, and the marker is write-once.
        """
        n = slices.num_slices
        marker_key = layout.slice_marker_key(round, attempt, index, n)
        try:  # a marker counts once read and verified; a forged one is replaced below
            SliceMarker.from_json(self.store.get_json(marker_key, max_bytes=MARKER_MAX_BYTES), key=marker_key,
                                  round=round, attempt=attempt,
                                  index=index, num_slices=n)
            return 0
        except ObjectNotFound:
            pass
        except BadObject as exc:
            logger.warning("global-state marker %s is not valid (%s); writing the slice", marker_key, exc)
        blob = slices.encode(index, round=round)
        self.store.put(layout.slice_blob_key(round, attempt, index, n), blob)
        self.hooks.at("global_upload", round, writer)
        marker = SliceMarker(round=round, attempt=attempt, index=index, num_slices=n, bytes=len(blob),
                             crc32=zlib.crc32(blob), by=writer)
        create_over_forged(self.store, marker_key, marker.to_json(), lambda o: SliceMarker.from_json(
            o, key=marker_key, round=round, attempt=attempt, index=index, num_slices=n))
        return len(blob)

    def write(self, round: int, attempt: int, tree: dict[str, Any], *, writer: int, num_slices: int = 1) -> int:
        """Write every slice of ``tree`` (one writer: decoupled versions, tools, tests). Returns bytes written."""
        slices = split_global_state(tree, num_slices)
        return sum(self.write_slice(round, attempt, slices, i, writer=writer) for i in range(num_slices))

    def publish(self, round: int, attempt: int, tree: dict[str, Any], *, participants: Sequence[int], rank: int,
                takeover_after_s: float) -> int:
        """Make a committed state durable: write my slice, then, after a grace, any slice still missing.

        Every participant holds the same state, so a slice whose owner died is
        written by whoever notices first (same bytes; markers are write-once).
        Nothing of the round then depends on one replica. Returns bytes written.
        """
        n = len(participants)
        slices = split_global_state(tree, n)
        written = self.write_slice(round, attempt, slices, list(participants).index(rank), writer=rank)
        try:
            poll_until(lambda: True if self.durable(round, attempt, num_slices=n) else None,
                       deadline=time.monotonic() + takeover_after_s, policy=PollPolicy(initial_s=0.05, max_s=1.0),
                       on_timeout=lambda waited: StoreTimeout(f"global state of round {shown_round(round)}", waited))
            return written
        except StoreTimeout:
            pass
        for index in self.markers(round, attempt).missing(n):
            logger.warning("round %d: slice %d of the global state (replica %d's) is missing after %.0fs; "
                           "writing it", shown_round(round), index, participants[index], takeover_after_s)
            written += self.write_slice(round, attempt, slices, index, writer=rank)
        return written

    # ------------------------------------------------------------ reading
    def markers(self, round: int, attempt: int) -> SliceMarkers:
        """The slice markers of ``round``'s ``attempt``; unusable ones are skipped with a warning."""
        by_count: dict[int, dict[int, SliceMarker]] = {}
        for name in self.store.list_dirs(layout.checkpoint_prefix(round)):
            parsed = layout.parse_slice_marker(name)
            if parsed is None or parsed[0] != attempt:
                continue
            _, index, n = parsed
            key = layout.slice_marker_key(round, attempt, index, n)
            try:
                obj = self.store.get_json(key, max_bytes=MARKER_MAX_BYTES)
                marker = SliceMarker.from_json(obj, key=key, round=round, attempt=attempt, index=index, num_slices=n)
            except (BadObject, ObjectNotFound) as exc:
                logger.warning("ignoring global-state marker %s (%s)", key, exc)
                continue
            by_count.setdefault(n, {})[index] = marker
        return SliceMarkers(by_count)

    def durable(self, round: int, attempt: int, *, num_slices: int | None = None) -> bool:
        """Whether every slice of ``round``'s ``attempt`` has its marker (``num_slices``: that many, else any)."""
        return self.markers(round, attempt).complete(num_slices) is not None

    def load(self, round: int, attempt: int, *, num_slices: int | None = None,
             crcs: Sequence[int] | None = None) -> dict[str, Any]:
        """The state tree of ``round``'s ``attempt``, each slice read and verified once.

        ``crcs``: the slices' crc32s from a verified manifest (slice ``i`` of ``len(crcs)``), used instead of
        the slice markers (a checkpoint with a manifest does not depend on its markers any more).
        Raises :class:`~composer_cloud.errors.CorruptCheckpoint` naming the slice if one is missing or damaged.
        """
        if crcs is not None:
            n, expected = len(crcs), list(crcs)
        else:
            markers = self.markers(round, attempt)
            found = markers.complete(num_slices)
            if found is None:
                raise CorruptCheckpoint(layout.checkpoint_prefix(round), "global state incomplete (slices present: "
                                        f"{ {k: sorted(v) for k, v in markers.by_count.items()} })")
            n, expected = found, [markers.by_count[found][i].crc32 for i in range(found)]
        from safetensors.torch import load as st_load

        from composer_cloud.storage.tensors import read_metadata, unflatten

        tensors: dict[str, torch.Tensor] = {}
        skeleton: Any = None
        for i in range(n):
            key = layout.slice_blob_key(round, attempt, i, n)
            raw = bytes(read_verified(self.store, key, expected[i]))
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
            raise CorruptCheckpoint(layout.checkpoint_prefix(round), f"global state lacks tensor {exc}") from None

    def rounds(self) -> list[int]:
        """Rounds with anything under ``checkpoints/`` (stray names skipped), ascending."""
        return sorted(r for r in map(layout.parse_num, self.store.list_dirs(layout.CHECKPOINTS)) if r is not None)

    def durable_rounds(self, attempt_of: AttemptOf, *, above: int = -1) -> list[int]:
        """Rounds ``> above`` whose state (of the attempt ``attempt_of`` names) is durable, ascending."""
        out = []
        for r in self.rounds():
            if r > above and (a := attempt_of(r)) is not None and self.durable(r, a):
                out.append(r)
        return out

    def newest_durable(self, attempt_of: AttemptOf, *, above: int = -1) -> int | None:
        """The newest round ``> above`` with a durable state, checking newest first (None: none)."""
        for r in sorted((r for r in self.rounds() if r > above), reverse=True):
            if (a := attempt_of(r)) is not None and self.durable(r, a):
                return r
        return None


__all__ = ["AttemptOf", "GlobalStateSlices", "GlobalStateStore", "SliceMarkers", "read_verified",
           "split_global_state"]
