"""The "before" side of ``benchmarks/checkpoint.py``: the same checkpoint written and read by the pre-sharding
code of commit ``951ee6d`` (the leader wrote the whole global state), loaded from git as a module of its own.

The library's modules are not touched; the old module only reads and writes a scratch store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from typing import Any

from composer_cloud.storage.tensors import encode_state
from composer_cloud.storage.store import Store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_COMMIT = "951ee6d"  # the last commit with the leader-written global state (checkpoint.py, manager.py)
ROUND = 7  # the round of the checkpoint written and read


#: The old module's imports that no longer exist, and what stands in for them today: the modules
#: that own the same functions now, ``manager.global_state_prefix``'s body at that commit, and no
#: fault injection (a benchmark never stalls).
OLD_IMPORTS = {
    "from composer_cloud import faults\n":
        "import types as _types\nfaults = _types.SimpleNamespace(stall_point=lambda *a, **k: None)\n",
    "from composer_cloud.rendezvous.manager import global_state_prefix\n":
        'def global_state_prefix(round: int) -> str:\n    return f"checkpoints/{round:08d}"\n',
    "from composer_cloud.rendezvous.state import decode_state, encode_state\n":
        "from composer_cloud.storage.tensors import decode_state, encode_state\n",
    "from composer_cloud.rendezvous.store import ChecksumMismatch, ObjectNotFound, Store, StoreError, StoreTimeout\n":
        "from composer_cloud.errors import ChecksumMismatch, ObjectNotFound, StoreError, StoreTimeout\n"
        "from composer_cloud.storage.store import Store\n",
}


def load_old_checkpoint_module(commit: str = OLD_COMMIT) -> types.ModuleType:
    """The pre-sharding ``composer_cloud/checkpoint.py`` (leader-written global state), from git.

    Loaded as a separate module object (``old_checkpoint_<commit>``); the library's own modules are
    not touched; the imports that no longer exist are replaced (:data:`OLD_IMPORTS`).
    """
    src = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:composer_cloud/checkpoint.py"],
                         capture_output=True, text=True, check=True).stdout
    for old_import, today in OLD_IMPORTS.items():
        if old_import not in src:
            raise RuntimeError(f"{commit}:composer_cloud/checkpoint.py no longer has the import {old_import!r}")
        src = src.replace(old_import, today)
    mod = types.ModuleType(f"old_checkpoint_{commit}")
    mod.__file__ = f"<git {commit}:composer_cloud/checkpoint.py>"
    sys.modules[mod.__name__] = mod  # a new name of its own (dataclasses look their module up here)
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - our own code from our own git history
    return mod


def old_write_global_state(store: Any, round: int, tree: dict[str, Any], *, writer: int = 0) -> int:
    """The leader's upload before sharding (``ObjectStoreManager._write_global_state`` at 951ee6d,
    ``rendezvous/manager.py:256-260``): one blob of the whole state, then the write-once marker."""
    prefix = f"checkpoints/{round:08d}"
    blob = encode_state(tree, metadata={"round": str(round)})
    store.put(f"{prefix}/global.safetensors", blob)
    store.create_json(f"{prefix}/global.json", {"round": round, "bytes": len(blob), "by": writer})
    return len(blob)


def old_resume_reads(opts: dict[str, Any], store_uri: str, global_tree: Any, replica_tree: Any,
                      short_of_memory: Any) -> dict[str, Any]:
    """The same checkpoint (W = ``resume_w`` replicas) written and read by the pre-sharding code (951ee6d)."""
    out: dict[str, Any] = {"code": f"git show {OLD_COMMIT}:composer_cloud/checkpoint.py"}
    skip = short_of_memory(4.1)
    if skip:
        out["skipped"] = skip
        return out
    try:
        old = load_old_checkpoint_module()
    except Exception as exc:  # noqa: BLE001 - no git, or the file moved: say so, compute instead
        out["skipped"] = f"old code not loadable ({type(exc).__name__}: {exc})"
        return out
    uri = store_uri.rstrip("/") + "-old"
    w = opts["resume_w"]
    base = Store(uri)
    base.check_access()
    g = global_tree()
    g_bytes = old_write_global_state(base, ROUND, g)
    g = None
    r = replica_tree()
    r_bytes = {}
    for rank in range(w):
        old.write_replica_state(base, ROUND, rank, r)
        r_bytes[rank] = base.get_json(f"checkpoints/{ROUND:08d}/replica-{rank}.json")["bytes"]
    r = None
    out["manifest_written"] = old.write_manifest(base, ROUND, list(range(w)), deadline_s=30)
    out.update({"world_size": w, "global_bytes": g_bytes, "replica_bytes": r_bytes,
                "checkpoint_bytes": g_bytes + sum(r_bytes.values()), "replica_needs_bytes": g_bytes + r_bytes[0]})
    s = Store(uri)
    t0 = time.perf_counter()
    found = old.latest_checkpoint(s, verify=True)  # old launcher `resume`
    out["latest_checkpoint"] = {"bytes_read": s.bytes_read, "wall_s": round(time.perf_counter() - t0, 4),
                                "x_needed": round(s.bytes_read / out["checkpoint_bytes"], 4),
                                "round": found.round if found else None}
    # Old replica startup (951ee6d replica.py:147, 267, 279): latest_checkpoint(verify) + load_global + load_replica.
    s = Store(uri)
    t0 = time.perf_counter()
    found = old.latest_checkpoint(s)
    old.load_global(s, found.round)  # decoded and dropped: only the bytes read matter here
    old.load_replica(s, found, 0)
    out["replica_startup"] = {"bytes_read": s.bytes_read, "wall_s": round(time.perf_counter() - t0, 4),
                              "x_needed": round(s.bytes_read / out["replica_needs_bytes"], 4)}
    base.delete("checkpoints", recursive=True)
    return out
