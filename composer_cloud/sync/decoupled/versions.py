"""Decoupled mode's global versions as the store has them: written, durable, complete, decided, final.

Global version ``v`` is checkpoint ``v`` written as one slice of attempt
:data:`VERSION_ATTEMPT` (blob, write-once marker, then a write-once manifest),
so ``export``, ``resume`` and ``status`` read it like a lock-step checkpoint.
:class:`GlobalVersions` is the one version API: it calls the global-state
store (:class:`~composer_cloud.sync.checkpoint.global_state.GlobalStateStore`)
and the manifest reader directly; the protocol (:mod:`.protocol`) and the
client (``runs/``) ask it and never spell a checkpoint key. Keys:
:mod:`composer_cloud.storage.layout`; records: :mod:`composer_cloud.storage.records`.

Invariants:

* **Durable means adoptable.** ``v`` is durable once its slice's marker exists,
  or its verified manifest (written after the marker) does: a deleted marker
  does not take a version away. *Complete* means the manifest exists too (its
  writer finished, so the inputs it consumed may be pruned).
* **Idempotent writes.** An existing marker is kept (the blob is not
  rewritten) and a second manifest is refused, so a completer finishes
  whatever a dead writer left, in order.
* **Verified reads.** A version is read once through its marker's crc32 (or
  its verified manifest's) and checked to be a decoupled global state of the
  model's shapes, finite.
* **Nothing here is trusted because it is listed.** ``final.json`` finishes the
  run only when it names a version whose merge record is flagged final and
  whose global state is durable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from composer_cloud.errors import BadObject, CorruptCheckpoint, ObjectNotFound
from composer_cloud.storage import layout
from composer_cloud.storage.records import FinalRecord, Manifest, SliceMarker
from composer_cloud.storage.records.limits import MARKER_MAX_BYTES
from composer_cloud.storage.store import Store
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore
from composer_cloud.sync.checkpoint.manifests import read_manifest, slice_entry
from composer_cloud.sync.checks import check_tree
from composer_cloud.sync.decoupled.outer import FRAGMENT_KEY
from composer_cloud.sync.trust import create_over_forged, warn_once

logger = logging.getLogger(__name__)

#: Decoupled versions are single-writer states: one attempt, one slice.
VERSION_ATTEMPT = 0

Shapes = Mapping[str, tuple[int, ...]]


def _version_attempt(version: int) -> int:
    return VERSION_ATTEMPT


class GlobalVersions:
    """The global versions of one decoupled run in ``store`` (a :class:`Store`, or one boundary's view of it).

    Reads only what is asked; through a :class:`~.view.BoundaryView` each folder is listed once per boundary.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.states = GlobalStateStore(store)

    # ------------------------------------------------------------ durable state
    def durable(self, version: int) -> bool:
        """Whether global ``version`` is durable (its marker, or its verified manifest, exists): it may be adopted."""
        return self.states.durable(version, VERSION_ATTEMPT, num_slices=1) or self.complete(version)

    def complete(self, version: int) -> bool:
        """Whether global ``version``'s manifest exists too (its writer finished; its inputs may be pruned)."""
        return read_manifest(self.states, version) is not None

    def newest(self, *, floor: int = -1) -> int | None:
        """Newest version > ``floor`` whose global state is durable (its marker exists), None if none."""
        return self.states.newest_durable(_version_attempt, above=floor)

    def load(self, version: int, shapes: Shapes) -> dict[str, Any]:
        """Global ``version``, read once through its marker's crc32 (or its verified manifest's when the marker
        is gone or damaged), its parameters and momentum checked against ``shapes`` and finite.

        Raises :class:`BadObject` (a ``CorruptCheckpoint`` for a bad blob) naming the checkpoint.
        """
        try:
            tree = self.states.load(version, VERSION_ATTEMPT, num_slices=1)
        except CorruptCheckpoint:
            manifest = read_manifest(self.states, version)
            if manifest is None or manifest.attempt != VERSION_ATTEMPT or len(manifest.slices) != 1:
                raise
            tree = self.states.load(version, VERSION_ATTEMPT, crcs=[manifest.slices[0].crc32])
        key = layout.checkpoint_prefix(version)
        try:
            frag = tree[FRAGMENT_KEY]
            check_tree(frag["original_parameters"], shapes, key)
            for i, st in frag["outer_optimizer"]["state"].items():
                buf = st.get("momentum_buffer") if isinstance(st, dict) else None
                name = list(shapes)[int(i)]
                if buf is not None:
                    check_tree({name: buf}, {name: shapes[name]}, f"{key} momentum")
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise BadObject(key, f"not a decoupled global state ({type(exc).__name__}: {exc})") from None
        return tree

    def write(self, version: int, tree: dict[str, Any], *, writer: int, meta: dict[str, Any] | None = None) -> None:
        """Global ``version``: blob, write-once marker, then (write-once) the manifest. Idempotent.

        ``meta`` is recorded in the manifest under ``decoupled`` (its ``ranks`` as the participants).
        """
        meta = meta or {}
        self.states.write(version, VERSION_ATTEMPT, tree, writer=writer, num_slices=1)
        # The marker is read at its key, not found through a listing: a listing may not show it yet (a store's
        # list-after-write lag), which used to end a merge with a bare KeyError.
        key = layout.slice_marker_key(version, VERSION_ATTEMPT, 0, 1)
        try:
            marker = SliceMarker.from_json(self.store.get_json(key, max_bytes=MARKER_MAX_BYTES), key=key,
                                           round=version, attempt=VERSION_ATTEMPT, index=0, num_slices=1)
        except ObjectNotFound:
            raise CorruptCheckpoint(key, f"global version {version}: its marker is missing right after it was "
                                         "written (deleted meanwhile?)") from None
        manifest = Manifest(round=version, attempt=VERSION_ATTEMPT, slices=[slice_entry(marker)], replicas={},
                            participants=list(meta.get("ranks", [])), time=time.time(), extra={"decoupled": meta})
        manifest_key = layout.manifest_key(version)
        create_over_forged(self.store, manifest_key, manifest.to_json(),
                           lambda o: Manifest.from_json(o, key=manifest_key, round=version))

    # ------------------------------------------------------------ decided and final
    def decided(self) -> list[int]:
        """Versions with a merge record, ascending (records are not read)."""
        return sorted(v for v in map(layout.parse_num_json, self.store.list_dirs(layout.MERGES)) if v is not None)

    def final(self) -> int | None:
        """The final version if the run finished: ``final.json`` read and verified, naming a version whose merge
        record is flagged final and whose global state is durable. Anything else there finishes nothing."""
        try:
            obj = self.store.try_get_json(layout.FINAL)
            if obj is None:
                return None
            version = FinalRecord.from_json(obj, key=layout.FINAL).version
            merge = self.store.try_get_json(layout.merge_key(version)) if version > 0 else None
            if not (isinstance(merge, dict) and merge.get("final") is True and merge.get("version") == version):
                raise BadObject(layout.FINAL, f"names version {version}, which no final merge record decided")
            if not self.durable(version):
                raise BadObject(layout.FINAL, f"names version {version}, whose global state is not durable")
            return version
        except BadObject as exc:
            warn_once(f"final:{self.store.uri}:{exc.reason}", "ignoring %s", exc)
            return None

    def progress(self) -> tuple[int, int | None]:
        """(merged versions, final version or None) for status: cheap, reads no tensors."""
        versions = self.decided()
        return (versions[-1] if versions else 0), self.final()


__all__ = ["GlobalVersions", "Shapes", "VERSION_ATTEMPT"]
