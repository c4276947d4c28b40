"""One decoupled boundary's view of the store: every folder listed at most once, every record read at most once.

A replica's boundary (publish, merge, adopt, the fleet's budget) asks the same
questions of the store several times: the contributions of every rank (for the
merge and for the budget), the merge records (the newest, then the adopted
one's), the checkpoints (is ``v`` durable? the newest durable one?). A
:class:`BoundaryView` answers them from one look per folder, taken when first
needed and kept for the boundary:

* ``decoupled/contrib/`` and ``checkpoints/`` are listed *recursively*, once
  (one paginated LIST on S3), and every listing under them is derived from that;
  any other folder is listed once with :meth:`Store.list_dirs`;
* JSON records (metas, merge records, markers, manifests, ``final.json``) are
  read once, their absence remembered for the boundary;
* this process's own writes and deletes go through the view and update it, so
  it never misses what the boundary itself wrote (and never reads back a record it wrote).

Invariant: a view is as fresh as its first look at each folder. That is the
staleness the protocol already tolerates (a listing sees a prefix of each
rank's seqs; a record decided from it consumes exactly what it lists). A lost
write-once create means someone else wrote meanwhile, so the view forgets
everything and looks again (:meth:`refresh`): the race's winner is seen at once.
Create a new view at every boundary; never keep one across boundaries.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from composer_cloud.errors import ObjectNotFound
from composer_cloud.storage import layout
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)

#: Folders listed recursively once per view; listings under them are derived from that one LIST.
RECURSIVE_ROOTS = (layout.CONTRIBUTIONS, layout.CHECKPOINTS)
_ABSENT = object()


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + "/")


class BoundaryView:
    """A :class:`Store` for one boundary: listings and JSON reads cached, writes passed through and recorded.

    Everything not overridden here (blob reads, byte counters, ``uri``, ``signed``, ...) is the store's own.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._trees: dict[str, set[str]] = {}  # recursive root -> keys under it
        self._dirs: dict[str, set[str]] = {}  # other folder -> child names
        self._json: dict[str, Any] = {}  # key -> parsed record, or _ABSENT

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def refresh(self) -> None:
        """Forget every look taken (after losing a write-once race: someone else wrote meanwhile)."""
        self._trees.clear()
        self._dirs.clear()
        self._json.clear()

    # ------------------------------------------------------------ listings
    def _root(self, prefix: str) -> str | None:
        return next((r for r in RECURSIVE_ROOTS if _under(prefix, r)), None)

    def _tree(self, root: str) -> set[str]:
        if root not in self._trees:
            self._trees[root] = set(self.store.list(root))
        return self._trees[root]

    def list(self, prefix: str = "") -> list[str]:
        root = self._root(prefix)
        if root is None:
            return self.store.list(prefix)
        return sorted(k for k in self._tree(root) if _under(k, prefix))

    def list_dirs(self, prefix: str = "") -> list[str]:
        root = self._root(prefix)
        if root is None:
            if prefix not in self._dirs:
                self._dirs[prefix] = set(self.store.list_dirs(prefix))
            return sorted(self._dirs[prefix])
        cut = len(prefix) + 1
        return sorted({k[cut:].split("/", 1)[0] for k in self._tree(root) if k.startswith(prefix + "/")})

    def _wrote(self, key: str, obj: Any = _ABSENT) -> None:
        """Record this process's write of ``key`` (``obj``: the JSON record written, read back as JSON gives it)."""
        self._json.pop(key, None)
        if obj is not _ABSENT:
            self._json[key] = json.loads(json.dumps(obj))
        root = self._root(key)
        if root is not None:
            if root in self._trees:
                self._trees[root].add(key)
            return
        parent, _, name = key.rpartition("/")
        if parent in self._dirs:
            self._dirs[parent].add(name)

    # ------------------------------------------------------------ writes (recorded)
    def put(self, key: str, payload: Any, *, durable: bool = True) -> int:
        n = self.store.put(key, payload, durable=durable)
        self._wrote(key)
        return n

    def put_json(self, key: str, obj: Any) -> int:
        n = self.store.put_json(key, obj)
        self._wrote(key, obj)
        return n

    def create(self, key: str, payload: Any, *, settle: bool = True) -> bool:
        return self._created(key, self.store.create(key, payload, settle=settle))

    def create_json(self, key: str, obj: Any, *, settle: bool = True) -> bool:
        return self._created(key, self.store.create_json(key, obj, settle=settle), obj)

    def _created(self, key: str, created: bool, obj: Any = _ABSENT) -> bool:
        if created:
            self._wrote(key, obj)
        else:
            self.refresh()
        return created

    def delete(self, key: str, *, recursive: bool = False) -> None:
        self.store.delete(key, recursive=recursive)
        gone = (lambda k: _under(k, key)) if recursive else (lambda k: k == key)
        for keys in self._trees.values():
            keys.difference_update({k for k in keys if gone(k)})
        for k in [k for k in self._json if gone(k)]:
            del self._json[k]
        parent, _, name = key.rpartition("/")
        if parent in self._dirs:
            self._dirs[parent].discard(name)

    # ------------------------------------------------------------ records (read once)
    def get_json(self, key: str, **kwargs: Any) -> Any:
        if key not in self._json:
            try:
                self._json[key] = self.store.get_json(key, **kwargs)
            except ObjectNotFound:
                self._json[key] = _ABSENT
        found = self._json[key]
        if found is _ABSENT:
            raise ObjectNotFound(key)
        return copy.deepcopy(found)

    def try_get_json(self, key: str, **kwargs: Any) -> Any | None:
        try:
            return self.get_json(key, **kwargs)
        except ObjectNotFound:
            return None


__all__ = ["BoundaryView", "RECURSIVE_ROOTS"]
