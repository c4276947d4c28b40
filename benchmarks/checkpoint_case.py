"""The measured side of ``benchmarks/checkpoint.py``: one (model, store) case, run in a fresh child process.

Everything here calls the library's own checkpoint functions on a scratch store
(see ``benchmarks/checkpoint.py`` for what is measured and how it is reported).
The phases of :func:`run_case` write their numbers to a JSON file as they go,
so a case cut short (memory guard, timeout) still reports what it measured.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import threading
import time
import traceback
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import psutil
import torch
from checkpoint_before import old_resume_reads, old_write_global_state
from checkpoint_states import (
    GlobalLive,
    SyntheticTrainer,
    synthetic_global_live,
    synthetic_shapes,
    tiny_global_live,
    tiny_setup,
)

from composer_cloud.storage.tensors import flatten
from composer_cloud.storage.store import Store

# The runtime's replica snapshot, measured as the runtime runs it on the critical path of a checkpoint round.
from composer_cloud.replica.boundary import snapshot as replica_snapshot

MB = 1e6

ROUND = 7  # any committed round number; the key is checkpoints/00000007/...
ROUND_OLD = 50  # the old leader's whole-state upload (before)
ROUND_SWEEP = 200  # checkpoints/<200 + W>: the W-participant global state; 200 + resume_w is the resume checkpoint


def _ckpt_api() -> Any:
    """The checkpoint calls this benchmark times, on the library's classes (attempt 0: no round records here)."""
    import types

    from composer_cloud.storage import layout
    from composer_cloud.sync.checkpoint import manifests
    from composer_cloud.sync.checkpoint.global_state import GlobalStateStore, split_global_state
    from composer_cloud.sync.checkpoint.replica_state import ReplicaStateStore, replica_state

    def attempt_0(round: int) -> int:
        return 0

    def resume_point(store: Any, rank: int, *, world_size: int) -> Any:
        durable = GlobalStateStore(store).durable_rounds(attempt_0)
        return ReplicaStateStore(store).resume_point(rank, world_size=world_size, durable_rounds=durable)

    return types.SimpleNamespace(
        split_global_state=split_global_state, replica_state=replica_state,
        checkpoint_prefix=layout.checkpoint_prefix,
        write_global_state=lambda store, round, tree, *, writer, num_shards=1: GlobalStateStore(store).write(
            round, 0, tree, writer=writer, num_slices=num_shards),
        write_global_shard=lambda store, round, slices, index, *, writer: GlobalStateStore(store).write_slice(
            round, 0, slices, index, writer=writer),
        has_global_state=lambda store, round, num_shards=None: GlobalStateStore(store).durable(
            round, 0, num_slices=num_shards),
        load_global=lambda store, round: GlobalStateStore(store).load(round, 0),
        write_replica_state=lambda store, round, rank, tree, world_size=1: ReplicaStateStore(store).write(
            round, rank, tree, world_size=world_size),
        load_replica_at=lambda store, round, rank, crc32=None: ReplicaStateStore(store).load(round, rank, crc32),
        write_manifest=lambda store, round, participants, *, deadline_s: manifests.write_manifest(
            GlobalStateStore(store), ReplicaStateStore(store), round, 0, participants, deadline_s=deadline_s),
        read_manifest=lambda store, round: manifests.read_manifest(GlobalStateStore(store), round),
        latest_checkpoint=lambda store, verify=True: manifests.latest_checkpoint(GlobalStateStore(store), attempt_0,
                                                                                   verify=verify),
        resume_point=resume_point)


ckpt = _ckpt_api()


class Timers:
    """Accumulated wall time and call counts by name (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)

    def add(self, name: str, dt: float) -> None:
        with self.lock:
            self.t[name] += dt
            self.n[name] += 1

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.add(name, time.perf_counter() - t0)
                self.add(f"{name}.cpu", time.thread_time() - c0)
        timed.__wrapped__ = fn
        return timed

    def take(self) -> dict[str, float]:
        with self.lock:
            out = {k: round(v, 4) for k, v in self.t.items()}
            self.t.clear()
            self.n.clear()
        return out


class TimedStore:
    """Delegates to a real Store; times put/create/get and their JSON forms."""

    def __init__(self, store: Any, timers: Timers) -> None:
        self._s = store
        for name in ("put", "put_json", "create_json", "get", "get_json", "wait_get", "exists", "list_dirs"):
            setattr(self, name, timers.wrap(f"store.{name}", getattr(store, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class MemoryGuard(threading.Thread):
    """Abort the child (exit code 3) if the machine runs out of memory: other people share it."""

    def __init__(self, floor_bytes: int) -> None:
        super().__init__(daemon=True)
        self.floor = floor_bytes
        self.min_available = None

    def run(self) -> None:
        while True:
            avail = psutil.virtual_memory().available
            self.min_available = avail if self.min_available is None else min(self.min_available, avail)
            if avail < self.floor:
                sys.stderr.write(f"checkpoint benchmark: only {avail / 2**30:.2f} GiB available; aborting\n")
                os._exit(3)
            time.sleep(0.05)


@contextmanager
def phase(rec: dict[str, Any]):
    gc.collect()
    start = _rss()
    exact = _reset_hwm()
    t0, c0 = time.perf_counter(), time.process_time()
    yield
    rec["wall_s"] = round(time.perf_counter() - t0, 4)
    rec["cpu_s"] = round(time.process_time() - c0, 4)
    peak = _hwm() if exact else max(_rss(), start)
    rec["rss_start_mb"] = round(start / MB, 1)
    rec["peak_rss_mb"] = round(peak / MB, 1)
    rec["peak_over_start_mb"] = round((peak - start) / MB, 1)


def _tensor_digest(tree: Any) -> dict[str, int]:
    tensors, _ = flatten(tree)
    return {k: zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()) for k, t in tensors.items()}


def _tensor_bytes(tree: Any) -> int:
    tensors, _ = flatten(tree)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _write_whole_global(store: Any, round: int, tree: dict[str, Any]) -> int:
    """The whole global state by one writer (W = 1)."""
    return ckpt.write_global_state(store, round, tree, writer=0, num_shards=1)


def _write_my_slice(store: Any, round: int, tree: dict[str, Any], world: int, index: int) -> int:
    """What one participant uploads after a commit: its 1/W slice (``_publish_global_state`` without the
    takeover wait, which only writes when another participant died)."""
    return ckpt.write_global_shard(store, round, ckpt.split_global_state(tree, world), index, writer=index)


def _after_then(after: Any, fn: Any, *args: Any) -> float:
    """Wait for ``after`` (a future or None), then time ``fn`` (as ``publish_state(after=...)`` orders them)."""
    if after is not None:
        after.result()
    return _timed_call(fn, *args)


def _timed_call(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def run_case(model_name: str, store_uri: str, opts: dict[str, Any], out_path: str) -> None:
    """Child process: one (model, store) case; writes its result as JSON to ``out_path``."""
    try:
        _run_case(model_name, store_uri, opts, out_path)
    except BaseException as exc:
        traceback.print_exc()
        partial: dict[str, Any] = {"model": model_name, "store": store_uri.split("://")[0]}
        if os.path.exists(out_path):
            with open(out_path) as f:
                partial = json.load(f)
        partial["error"] = f"{type(exc).__name__}: {exc}"
        with open(out_path, "w") as f:
            json.dump(partial, f)
        raise SystemExit(1) from None


_STORE_OPS = ("store.put", "store.put_json", "store.create_json", "store.exists", "store.get", "store.get_json",
              "store.wait_get", "store.list_dirs")


def _split_timers(total_s: float, tm: dict[str, float]) -> dict[str, float]:
    """Wall of a library call split into store I/O (timed on the store wrapper) and the rest (encode/decode)."""
    io = sum(tm.get(k, 0.0) for k in _STORE_OPS)
    return {"store_io_s": round(io, 4), "compute_s": round(max(0.0, total_s - io), 4)}


def fresh_store(uri: str) -> Any:
    """A new Store object on the same store: its own ``bytes_read``/``bytes_written`` counters."""
    return Store(uri)


def _run_case(model_name: str, store_uri: str, opts: dict[str, Any], out_path: str) -> None:
    torch.set_num_threads(1)  # a replica's default (COMPOSER_CLOUD_THREADS=1)
    guard = MemoryGuard(int(opts["memory_floor_gb"] * 2**30))
    guard.start()

    snapshot = replica_snapshot
    timers = Timers()
    real = Store(store_uri)
    real.check_access()
    store = TimedStore(real, timers)  # a wrapper instance around the store we pass in; no module is patched
    result: dict[str, Any] = {"model": model_name, "store": store_uri.split("://")[0], "store_uri": store_uri,
                              "phases": {}}
    phases = result["phases"]

    def save() -> None:
        result["min_available_gb"] = round((guard.min_available or 0) / 2**30, 2)
        with open(out_path, "w") as f:
            json.dump(result, f)

    trainer = live_g = None
    shapes: list[tuple[str, tuple[int, ...]]] | None = None
    if model_name == "tiny":
        tiny_model, trainer, result["params"] = tiny_setup()
        live_g = tiny_global_live(tiny_model)
    else:
        shapes = synthetic_shapes(model_name)
        result["params"] = sum(int(torch.Size(s).numel()) for _, s in shapes)
        result["tensors"] = len(shapes)
    param_bytes = result["params"] * 4
    payload = 2 * param_bytes  # global: params + momentum; replica: exp_avg + exp_avg_sq
    save()

    def short_of_memory(factor: float) -> str | None:
        need = factor * payload + opts["memory_floor_gb"] * 2**30
        avail = psutil.virtual_memory().available
        if avail < need:
            return (f"skipped: needs ~{need / 2**30:.1f} GiB ({factor:g}x the state + floor), "
                    f"{avail / 2**30:.1f} GiB available")
        return None

    def global_tree() -> dict[str, Any]:
        return (live_g or synthetic_global_live(shapes)).snapshot()

    def replica_tree() -> dict[str, Any]:
        return snapshot(ckpt.replica_state(trainer or SyntheticTrainer(shapes), None))

    # ---------------------------------------------------------------- 1. global state, one writer (W = 1)
    rec: dict[str, Any] = {}
    skip = short_of_memory(1.6)
    if skip:
        rec["skipped"] = skip
    else:
        if live_g is None:
            t0 = time.perf_counter()
            live_g = synthetic_global_live(shapes)
            rec["build_s"] = round(time.perf_counter() - t0, 4)
        with phase(rec):  # critical path, every round: {key: save_fn()} as _maybe_publish_state builds it
            t0 = time.perf_counter()
            gtree = live_g.snapshot()
            rec["snapshot_s"] = round(time.perf_counter() - t0, 4)
        if shapes is not None:
            live_g = None  # the benchmark keeps only what is written (the runtime also keeps the backup)
    phases["global_snapshot"] = rec
    rec = {}
    skip = skip or short_of_memory(3.1)
    digest_global: dict[str, int] = {}
    if skip:
        rec["skipped"] = skip
    else:
        with phase(rec):  # background in the runtime (joined at the next start_quorum)
            rec["tensor_bytes"] = _tensor_bytes(gtree)
            digest_global = _tensor_digest(gtree)
            timers.take()
            t0 = time.perf_counter()
            slices = ckpt.split_global_state(gtree, 1)
            rec["split_s"] = round(time.perf_counter() - t0, 4)
            t0 = time.perf_counter()
            rec["bytes"] = ckpt.write_global_shard(store, ROUND, slices, 0, writer=0)  # exists, encode, put, marker
            rec["write_total_s"] = round(time.perf_counter() - t0, 4)
            rec["timers"] = timers.take()
            rec.update(_split_timers(rec["write_total_s"], rec["timers"]))
            slices = None
        real.delete(ckpt.checkpoint_prefix(ROUND), recursive=True)
    phases["global_write"] = rec
    save()

    # ---------------------------------------------------------------- 2. global upload per participant, W = 2,4,8
    sweep: dict[str, Any] = {}
    if skip:
        sweep["skipped"] = skip
    else:
        # Before: the old leader uploads the whole state (951ee6d); bytes from its own Store's counter.
        leader = fresh_store(store_uri)
        t0 = time.perf_counter()
        old_write_global_state(leader, ROUND_OLD, gtree, writer=0)
        sweep["before"] = {"leader_bytes": leader.bytes_written, "leader_wall_s": round(time.perf_counter() - t0, 4)}
        real.delete(ckpt.checkpoint_prefix(ROUND_OLD), recursive=True)
        for w in opts["world_sizes"]:
            t0 = time.perf_counter()
            slices = ckpt.split_global_state(gtree, w)
            split_s = time.perf_counter() - t0
            parts = []
            for i in range(w):  # one Store object per simulated participant (run one after the other)
                p = fresh_store(store_uri)
                t0 = time.perf_counter()
                ckpt.write_global_shard(p, ROUND_SWEEP + w, slices, i, writer=i)
                parts.append({"bytes_written": p.bytes_written, "wall_s": round(time.perf_counter() - t0, 4),
                              "tensors": len(slices.groups[i])})
            slices = None
            ok = ckpt.has_global_state(real, ROUND_SWEEP + w, num_shards=w)
            if w != opts["resume_w"]:
                real.delete(ckpt.checkpoint_prefix(ROUND_SWEEP + w), recursive=True)
            b = [q["bytes_written"] for q in parts]
            sweep[str(w)] = {"split_s": round(split_s, 4), "participants": parts, "complete": ok,
                             "max_bytes": max(b), "mean_bytes": round(statistics.mean(b)), "total_bytes": sum(b),
                             "slowest_wall_s": max(q["wall_s"] for q in parts)}
            save()
    phases["global_upload_by_w"] = sweep
    gtree = None
    save()

    # ---------------------------------------------------------------- 3. replica state (every replica)
    rec = {}
    skip = short_of_memory(2.1)
    if skip:
        rec["skipped"] = skip
    else:
        src = trainer
        if src is None:
            t0 = time.perf_counter()
            src = SyntheticTrainer(shapes)
            rec["build_s"] = round(time.perf_counter() - t0, 4)
        with phase(rec):  # critical path, checkpoint rounds
            t0 = time.perf_counter()
            rtree = snapshot(ckpt.replica_state(src, None))
            rec["snapshot_s"] = round(time.perf_counter() - t0, 4)
        src = None
    phases["replica_snapshot"] = rec
    rec = {}
    skip = skip or short_of_memory(3.1)
    digest_replica: dict[str, int] = {}
    resume_round = ROUND_SWEEP + opts["resume_w"]
    if skip:
        rec["skipped"] = skip
    else:
        with phase(rec):  # background in the runtime (_io pool)
            rec["tensor_bytes"] = _tensor_bytes(rtree)
            digest_replica = _tensor_digest(rtree)
            timers.take()
            t0 = time.perf_counter()
            # encode -> put blob -> crc32 -> put marker; rank 0 of the resume checkpoint
            rec["bytes"] = ckpt.write_replica_state(store, resume_round, 0, rtree, world_size=opts["resume_w"])
            rec["write_total_s"] = round(time.perf_counter() - t0, 4)
            rec["timers"] = timers.take()
            rec.update(_split_timers(rec["write_total_s"], rec["timers"]))
    phases["replica_write"] = rec
    save()
    if any("skipped" in phases[k] for k in ("global_write", "replica_write")):
        phases["read"] = {"skipped": "a write phase was skipped"}
        save()
        return
    # The other replicas of the resume checkpoint (same tree; only the bytes matter for read volume).
    for rank in range(1, opts["resume_w"]):
        ckpt.write_replica_state(real, resume_round, rank, rtree, world_size=opts["resume_w"])
    if model_name != "tiny":
        rtree = None

    # ---------------------------------------------------------------- 4. repeats and concurrent writes
    if payload <= opts["repeat_max_mb"] * MB and opts["repeats"] > 0:
        rep: dict[str, list[float]] = defaultdict(list)
        for i in range(opts["repeats"]):
            t0 = time.perf_counter()
            g = live_g.snapshot()
            rep["global_snapshot_s"].append(time.perf_counter() - t0)
            rep["global_write_s"].append(_timed_call(_write_whole_global, real, 100 + i, g))
            t0 = time.perf_counter()
            r = snapshot(ckpt.replica_state(trainer, None))
            rep["replica_snapshot_s"].append(time.perf_counter() - t0)
            rep["replica_write_s"].append(_timed_call(ckpt.write_replica_state, real, 100 + i, 0, r))
            real.delete(ckpt.checkpoint_prefix(100 + i), recursive=True)
        timers.take()
        result["repeats"] = {k: [round(x, 4) for x in v] for k, v in rep.items()}
        save()
    if not short_of_memory(8.5):
        # On a participant both writes run at once (its global slice + its replica state); W = 1 here.
        g, r = global_tree(), replica_tree()
        rec = {}
        with phase(rec):
            with ThreadPoolExecutor(2) as pool:
                fg = pool.submit(_timed_call, _write_whole_global, real, ROUND + 1, g)
                fr = pool.submit(_timed_call, ckpt.write_replica_state, real, ROUND + 1, 0, r)
                rec["global_write_s"], rec["replica_write_s"] = round(fg.result(), 4), round(fr.result(), 4)
        g = r = None
        real.delete(ckpt.checkpoint_prefix(ROUND + 1), recursive=True)
        phases["concurrent_writes"] = rec
        save()

    # ---------------------------------------------------------------- 5. manifest (any participant)
    rec = {}
    participants = list(range(opts["resume_w"]))
    timers.take()
    with phase(rec):
        rec["ok"] = ckpt.write_manifest(store, resume_round, participants, deadline_s=30)
    rec["timers"] = timers.take()
    phases["manifest"] = rec
    save()

    # ---------------------------------------------------------------- 6. resume reads (after), each on a fresh Store
    manifest = ckpt.read_manifest(real, resume_round)
    g_bytes = sum(e.bytes for e in manifest.slices)
    r_bytes = {rank: e.bytes for rank, e in manifest.replicas.items()}
    reads: dict[str, Any] = {"world_size": opts["resume_w"], "global_bytes": g_bytes, "replica_bytes": r_bytes,
                             "checkpoint_bytes": g_bytes + sum(r_bytes.values()),
                             "replica_needs_bytes": g_bytes + r_bytes[0]}
    rec = {}
    s = fresh_store(store_uri)
    with phase(rec):
        found = ckpt.latest_checkpoint(TimedStore(s, timers), verify=True)  # what `resume` runs in the launcher
    rec["round"] = found.round if found else None
    rec["bytes_read"] = s.bytes_read
    rec["x_needed"] = round(s.bytes_read / reads["checkpoint_bytes"], 4)
    rec["timers"] = timers.take()
    reads["latest_checkpoint"] = rec
    # One (re)starting replica: resume_point, load_global, load_replica_at (its own state only).
    s = fresh_store(store_uri)
    ts = TimedStore(s, timers)
    startup: dict[str, Any] = {}
    with phase(startup):
        t0 = time.perf_counter()
        point = ckpt.resume_point(ts, 0, world_size=opts["resume_w"])
        startup["resume_point_s"] = round(time.perf_counter() - t0, 4)
        startup["resume_point_bytes"] = s.bytes_read
        startup["round"] = point.round if point else None
        skip = short_of_memory(3.05)
        if skip or point is None:
            startup["skipped"] = skip or "no resume point"
        else:
            for kind, load, digest in (
                    ("load_global", lambda: ckpt.load_global(ts, point.round), digest_global),
                    ("load_replica", lambda: ckpt.load_replica_at(ts, point.round, 0, point.replica_crc32),
                     digest_replica)):
                r = {}
                before = s.bytes_read
                timers.take()
                t0 = time.perf_counter()
                tree = load()
                r["load_s"] = round(time.perf_counter() - t0, 4)
                r["timers"] = timers.take()
                r["get_s"] = r["timers"].get("store.get", 0.0)
                got = _tensor_digest(tree)
                r["verified"] = got == digest
                r["tensors"] = len(got)
                tree = None
                r["bytes_read"] = s.bytes_read - before
                startup[kind] = r
    startup["bytes_read"] = s.bytes_read
    startup["x_needed"] = round(s.bytes_read / reads["replica_needs_bytes"], 4)
    reads["replica_startup"] = startup
    # (for the per-object table) the same loads under their old names
    reads["load_global"] = startup.get("load_global", {"skipped": startup.get("skipped", "-")})
    reads["load_replica"] = startup.get("load_replica", {"skipped": startup.get("skipped", "-")})
    phases["read"] = reads
    save()

    # ---------------------------------------------------------------- 7. resume reads (before), the 951ee6d code
    real.delete(ckpt.checkpoint_prefix(resume_round), recursive=True)
    result["before_resume"] = old_resume_reads(opts, store_uri, global_tree, replica_tree if rtree is None
                                                else (lambda: rtree), short_of_memory)
    save()

    # ---------------------------------------------------------------- 8. rounds with and without a checkpoint
    if trainer is not None and opts["rounds"] > 0:
        result["rounds"] = _time_rounds(opts, trainer, live_g, real, snapshot)
        timers.take()
        save()


def _time_rounds(opts: dict[str, Any], trainer: Any, live_g: GlobalLive, real: Any,
                 snapshot: Any) -> dict[str, Any]:
    """Alternate plain rounds, global-only rounds and checkpoint rounds of participant 0 of W = ``resume_w``,
    as the runtime does them (its global slice every committed round; its replica state on checkpoint rounds)."""
    world = opts["resume_w"]

    h = opts["h"]
    publish = ThreadPoolExecutor(1, thread_name_prefix="sync")  # the manager's exchange/publish thread
    io = ThreadPoolExecutor(2, thread_name_prefix="replica-io")  # Replica._io
    out: dict[str, list[float]] = defaultdict(list)
    r = 300
    try:
        for _ in range(opts["rounds"]):
            for kind in ("plain", "global_only", "checkpoint"):
                r += 1
                t0 = time.perf_counter()
                fg = fr = None
                if kind == "checkpoint":  # replica._after_commit: snapshot, replica write first ...
                    tree = snapshot(ckpt.replica_state(trainer, None))
                    fr = io.submit(_timed_call, ckpt.write_replica_state, real, r, 0, tree)
                    tree = None
                if kind != "plain":  # ... then publish_state(after=that write): save_fn now, my slice after it
                    fg = publish.submit(_after_then, fr, _write_my_slice, real, r, live_g.snapshot(), world, 0)
                out[f"{kind}_critical_s"].append(time.perf_counter() - t0)
                for _ in range(h):
                    trainer.step()
                if fg is not None:
                    t1 = time.perf_counter()
                    out[f"{kind}_global_write_s"].append(fg.result())  # start_quorum -> flush_state joins it
                    out[f"{kind}_join_wait_s"].append(time.perf_counter() - t1)
                out[f"{kind}_round_s"].append(time.perf_counter() - t0)
                if fr is not None:  # not joined by the runtime; joined here so it cannot spill into the next round
                    t1 = time.perf_counter()
                    out[f"{kind}_replica_write_s"].append(fr.result())
                    out[f"{kind}_replica_tail_s"].append(time.perf_counter() - t1)
                real.delete(f"checkpoints/{r:08d}", recursive=True)
    finally:
        publish.shutdown()
        io.shutdown()
    res: dict[str, Any] = {"h": h, "rounds_each": opts["rounds"],
                           "samples": {k: [round(x, 4) for x in v] for k, v in out.items()}}
    for k, v in out.items():
        res[k] = round(statistics.median(v), 4)
    res["step_s"] = round(res["plain_round_s"] / h, 4)
    for kind in ("global_only", "checkpoint"):
        res[f"{kind}_overhead_pct"] = round(100 * (res[f"{kind}_round_s"] / res["plain_round_s"] - 1), 1)
    return res
