#!/usr/bin/env python
"""Round-checkpoint cost: bytes, snapshot/encode/write/read times, peak memory, share of a round.

    python benchmarks/checkpoint.py                  # tiny (file://, S3), mid (file://), 0.5B (file://): ~7 min
    python benchmarks/checkpoint.py --skip-big       # without the 0.5B case (~1.5 min)
    python benchmarks/checkpoint.py --models tiny,mid --mid-s3 --json out.json
    python benchmarks/checkpoint.py --big-h 100 --big-step-s 0.5   # the assumed 0.5B round (see below)

Needs ~17 GiB of free RAM and ~13 GB of disk for the 0.5B case (writing one
3.95 GB state object peaks at 4x its size); a phase is skipped, with the
reason, when memory is short, and a case is aborted if the machine's
available memory falls below ``--memory-floor-gb`` (the machine may be shared).

What a checkpoint costs a round (``composer_cloud/replica.py`` ``_after_commit``,
``rendezvous/manager.py`` ``_publish_global_state``, ``composer_cloud/checkpoint.py``):

* on the critical path: every participant's ``manager.publish_state()`` calls every
  fragment's ``save_fn`` (torchft clones ``original_parameters``; the outer
  optimizer state is referenced) **every committed round**; on checkpoint rounds every
  replica takes ``_snapshot(checkpoint.replica_state(trainer))``;
* in the background: each of the W participants encodes and uploads its 1/W
  slice of the global state (``split_global_state`` + ``write_global_shard``;
  joined by ``flush_state()`` at the next ``start_quorum``), and writes missing
  slices itself after ``takeover_after_s``; each replica's
  ``write_replica_state``; any participant's ``write_manifest`` (``_io`` pool).

Models:

``tiny``
    The built-in model (``load_model("tiny", seed=0)``), with the real
    causal-LM trainer: its AdamW state after real inner steps is the replica
    state; the global state is what torchft's fragment ``save_fn`` returns
    (a clone of the parameters + the outer Nesterov-SGD ``state_dict()``).
``mid``
    Synthetic fp32 weights shaped like a ~55 M-param Qwen2 (vocab 32000,
    hidden 640, 8 layers).
``0.5b``
    Synthetic fp32 weights shaped exactly like Qwen2.5-0.5B (494 M params,
    290 tensors; shapes from a ``Qwen2Config`` on the meta device, nothing is
    downloaded). Global state ≈ 2 × 1.98 GB, replica state ≈ 2 × 1.98 GB.

For each (model, store) a fresh child process (so memory of one case never
inflates another) runs the library's own public functions on a scratch store:

1. **global snapshot** — ``{key: save_fn()}`` as ``_maybe_publish_state``
   builds it; **global write** — the whole state by one writer
   (``write_global_shard`` of ``split_global_state(tree, 1)``);
2. **global upload per participant** at W = ``--world-sizes`` (2, 4, 8):
   before = the 951ee6d leader's upload of the whole state (``encode_state`` →
   ``global.safetensors`` → ``global.json``, the three lines of the old
   ``ObjectStoreManager._write_global_state``); after = ``write_global_shard``
   of slice i by participant i, each with its own ``Store`` object so that
   ``Store.bytes_written`` is that participant's upload (max, mean, slowest);
3. **replica snapshot** and ``write_replica_state``; repeats (small states) and
   both writes at once;
4. ``write_manifest`` of a checkpoint with ``--resume-w`` replicas (global
   state in W slices, every replica's state);
5. **resume reads**, each on a fresh ``Store`` (its ``bytes_read``): the
   launcher's ``latest_checkpoint(verify=True)``, and one replica's startup
   (``resume_point`` + ``load_global`` + ``load_replica_at``), every decoded
   tensor compared (crc32) with what was written; **before**: the same
   checkpoint written and read by ``git show 951ee6d:composer_cloud/checkpoint.py``
   (loaded as a separate module, ``old_checkpoint_951ee6d``): its launcher's
   ``latest_checkpoint(verify=True)`` and its replica startup
   (``latest_checkpoint`` + ``load_global`` + ``load_replica``);
6. **rounds** (tiny) — alternating plain rounds (H inner steps), global-only
   rounds and checkpoint rounds of participant 0 of W = ``--resume-w``, done as
   the runtime does them (snapshots on the critical path, its slice and its
   replica write in background threads during the H steps, the slice upload
   joined at the end like ``start_quorum`` does).

For ``0.5b`` the round is an explicit assumption (``--big-h`` inner steps ×
``--big-step-s`` seconds per step on an H100), stated in the output.

No library module is patched. Store time is measured by a wrapper *instance*
around the ``Store`` object passed to the library (``TimedStore``); a library
call's time minus its store time is its encode/decode time. Peak memory per
phase is the kernel's high-water mark (``VmHWM``, reset via
``/proc/self/clear_refs``) above the phase's starting RSS. Small states (tiny)
are written ``--repeats`` more times (medians and minima reported). A
machine-state line (copy, crc32 and fsync throughput, load average) is
measured first and stored as ``calibration``.

S3 runs against a loopback ``moto_server`` (tests/s3server.py); it is
in-memory, so only tiny (and with ``--mid-s3`` mid) go through it. Its
bandwidth says nothing about real S3; it exercises the real client path
(s3fs single PUT below 100 MiB, multipart above).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types
import uuid
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(ROOT, "benchmarks", "out", "checkpoint.json")
MB = 1e6
FRAGMENT = "StreamingDiLoCoFragment_0"  # torchft's key for fragment 0 (sync.fragments = 1)

# Synthetic shapes (Qwen2 layout; tied embeddings). 0.5b = Qwen2.5-0.5B's config.
SYNTHETIC = {
    "mid": dict(vocab_size=32000, hidden_size=640, num_hidden_layers=8, num_attention_heads=10,
                num_key_value_heads=2, intermediate_size=1728),
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864),
}
ROUND = 7  # any committed round number; the key is checkpoints/00000007/...
ROUND_OLD = 50  # the old leader's whole-state upload (before)
ROUND_SWEEP = 200  # checkpoints/<200 + W>: the W-participant global state; 200 + resume_w is the resume checkpoint
OLD_COMMIT = "951ee6d"  # the last commit with the leader-written global state (checkpoint.py, manager.py)


# =========================================================================== child side
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
        import psutil

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
    import torch

    from composer_cloud.storage.tensors import flatten

    tensors, _ = flatten(tree)
    return {k: zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()) for k, t in tensors.items()}


def _tensor_bytes(tree: Any) -> int:
    from composer_cloud.storage.tensors import flatten

    tensors, _ = flatten(tree)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _synthetic_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SYNTHETIC[name], tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _fill(shape: tuple[int, ...], gen: Any) -> Any:
    import torch

    return torch.empty(shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=gen)


def _sgd_param_group(n: int) -> dict[str, Any]:
    """The exact param_groups entry of the runtime's outer optimizer (Nesterov SGD, spec defaults)."""
    import torch

    from composer_cloud.spec import OuterOptimizerSpec

    o = OuterOptimizerSpec()
    group = torch.optim.SGD([torch.zeros(1)], lr=o.lr, momentum=o.momentum, nesterov=o.nesterov).state_dict()
    g = dict(group["param_groups"][0])
    g["params"] = list(range(n))
    return g


def _adamw_param_group(n: int) -> dict[str, Any]:
    import torch

    from composer_cloud.spec import InnerOptimizerSpec
    from composer_cloud.trainer.optim import build_inner_optimizer

    opt = build_inner_optimizer(torch.nn.Linear(1, 1, bias=False), InnerOptimizerSpec().model_dump(mode="json"))
    g = dict(opt.state_dict()["param_groups"][0])
    g["params"] = list(range(n))
    return g


class SyntheticTrainer:
    """Just enough of a trainer for ``checkpoint.replica_state``: AdamW state in torch's own format."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], rows: int = 4000) -> None:
        import torch

        gen = torch.Generator().manual_seed(2)
        state = {}
        for i, (_, shape) in enumerate(shapes):
            state[i] = {"step": torch.tensor(10.0), "exp_avg": _fill(shape, gen),
                        "exp_avg_sq": _fill(shape, gen).abs_()}
        self._opt_state = {"state": state, "param_groups": [_adamw_param_group(len(shapes))]}
        self.generator = torch.Generator().manual_seed(3)
        self.order = torch.randperm(rows, generator=self.generator)

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from composer_cloud.trainer.optim import optimizer_state

        tensors, meta = optimizer_state(types.SimpleNamespace(state_dict=lambda: self._opt_state))
        tensors["data/order"] = self.order.clone()
        tensors["data/generator"] = self.generator.get_state()
        meta["data"] = {"epoch": 0, "position": 80}
        return tensors, meta



class GlobalLive:
    """The leader's live global state of one fragment, and torchft's ``save_fn`` over it."""

    def __init__(self, backup: dict[str, Any], outer_state_dict: Any) -> None:
        self.backup = backup  # DiLoCo's original_parameters (the global params, on CPU)
        self._outer_state_dict = outer_state_dict

    def save_fn(self) -> dict[str, Any]:
        """Exactly torchft's fragment save_fn: outer optimizer state_dict (references) + cloned params."""
        from torchft.local_sgd import extract_local_tensor

        return {"outer_optimizer": self._outer_state_dict(),
                "original_parameters": {n: extract_local_tensor(t) for n, t in self.backup.items()}}

    def snapshot(self) -> dict[str, Any]:
        """What ``ObjectStoreManager._maybe_publish_state`` builds on the critical path."""
        return {FRAGMENT: self.save_fn()}


def synthetic_global_live(shapes: list[tuple[str, tuple[int, ...]]]) -> GlobalLive:
    import torch

    gen = torch.Generator().manual_seed(1)
    backup = {name: _fill(shape, gen) for name, shape in shapes}
    state = {"state": {i: {"momentum_buffer": _fill(shape, gen)} for i, (_, shape) in enumerate(shapes)},
             "param_groups": [_sgd_param_group(len(shapes))]}
    return GlobalLive(backup, lambda: state)


def tiny_global_live(model: Any) -> GlobalLive:
    """The real outer optimizer (Nesterov SGD, spec defaults) after one outer step, over copies of the params."""
    import torch

    from composer_cloud.spec import OuterOptimizerSpec

    o = OuterOptimizerSpec()
    named = list(model.named_parameters())
    shadow = [torch.nn.Parameter(p.detach().clone()) for _, p in named]
    outer = torch.optim.SGD(shadow, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov)
    gen = torch.Generator().manual_seed(4)
    for p in shadow:
        p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3, generator=gen)
    outer.step()
    for p in shadow:
        p.grad = None
    return GlobalLive({n: p.detach().clone() for (n, _), p in zip(named, shadow)}, outer.state_dict)


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


def _replica_snapshot_fn() -> Any:
    """The runtime's replica snapshot (``composer_cloud.replica.boundary.snapshot``)."""
    from composer_cloud.replica.boundary import snapshot

    return snapshot


def _tiny_setup() -> tuple[Any, Any, int]:
    """Real tiny model + causal-LM trainer (spec defaults), warmed up so AdamW has state."""
    import torch

    from composer_cloud.model import count_parameters, load_model
    from composer_cloud.spec import InnerOptimizerSpec, TrainerSpec
    from composer_cloud.trainer import TrainerContext, build_trainer

    torch.manual_seed(0)
    model, tokenizer = load_model("tiny", seed=0)
    trainer = build_trainer("causal-lm", TrainerContext(
        model=model, tokenizer=tokenizer, rank=0, world_size=2, seed=0, device=torch.device("cpu"),
        settings=TrainerSpec().settings(), inner_optimizer=InnerOptimizerSpec().model_dump(mode="json")))
    for _ in range(3):
        trainer.step()
    return model, trainer, count_parameters(model)


def _write_whole_global(store: Any, round: int, tree: dict[str, Any]) -> int:
    """The whole global state by one writer (W = 1)."""
    ckpt = _ckpt_api()

    return ckpt.write_global_state(store, round, tree, writer=0, num_shards=1)


def _write_my_slice(store: Any, round: int, tree: dict[str, Any], world: int, index: int) -> int:
    """What one participant uploads after a commit: its 1/W slice (``_publish_global_state`` without the
    takeover wait, which only writes when another participant died)."""
    ckpt = _ckpt_api()

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
        import traceback

        traceback.print_exc()
        partial: dict[str, Any] = {"model": model_name, "store": store_uri.split("://")[0]}
        if os.path.exists(out_path):
            with open(out_path) as f:
                partial = json.load(f)
        partial["error"] = f"{type(exc).__name__}: {exc}"
        with open(out_path, "w") as f:
            json.dump(partial, f)
        raise SystemExit(1) from None


def load_old_checkpoint_module(commit: str = OLD_COMMIT) -> types.ModuleType:
    """The pre-sharding ``composer_cloud/checkpoint.py`` (leader-written global state), from git.

    Loaded as a separate module object (``old_checkpoint_<commit>``); the library's own modules are
    not touched. Its one import that no longer exists (``manager.global_state_prefix``) is replaced
    by that function's body at ``commit`` (``rendezvous/manager.py``: ``f"checkpoints/{round:08d}"``).
    """
    import subprocess

    src = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:composer_cloud/checkpoint.py"],
                         capture_output=True, text=True, check=True).stdout
    old_import = "from composer_cloud.rendezvous.manager import global_state_prefix\n"
    if old_import not in src:
        raise RuntimeError(f"{commit}:composer_cloud/checkpoint.py no longer has the expected import")
    src = src.replace(old_import, 'def global_state_prefix(round: int) -> str:\n'
                                  '    return f"checkpoints/{round:08d}"\n')
    mod = types.ModuleType(f"old_checkpoint_{commit}")
    mod.__file__ = f"<git {commit}:composer_cloud/checkpoint.py>"
    sys.modules[mod.__name__] = mod  # a new name of its own (dataclasses look their module up here)
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - our own code from our own git history
    return mod


def old_write_global_state(store: Any, round: int, tree: dict[str, Any], *, writer: int = 0) -> int:
    """The leader's upload before sharding (``ObjectStoreManager._write_global_state`` at 951ee6d,
    ``rendezvous/manager.py:256-260``): one blob of the whole state, then the write-once marker."""
    from composer_cloud.storage.tensors import encode_state

    prefix = f"checkpoints/{round:08d}"
    blob = encode_state(tree, metadata={"round": str(round)})
    store.put(f"{prefix}/global.safetensors", blob)
    store.create_json(f"{prefix}/global.json", {"round": round, "bytes": len(blob), "by": writer})
    return len(blob)


_STORE_OPS = ("store.put", "store.put_json", "store.create_json", "store.exists", "store.get", "store.get_json",
              "store.wait_get", "store.list_dirs")


def _split_timers(total_s: float, tm: dict[str, float]) -> dict[str, float]:
    """Wall of a library call split into store I/O (timed on the store wrapper) and the rest (encode/decode)."""
    io = sum(tm.get(k, 0.0) for k in _STORE_OPS)
    return {"store_io_s": round(io, 4), "compute_s": round(max(0.0, total_s - io), 4)}


def _fresh_store(uri: str) -> Any:
    """A new Store object on the same store: its own ``bytes_read``/``bytes_written`` counters."""
    from composer_cloud.storage.store import Store

    return Store(uri)


def _run_case(model_name: str, store_uri: str, opts: dict[str, Any], out_path: str) -> None:
    import psutil
    import torch

    torch.set_num_threads(1)  # a replica's default (COMPOSER_CLOUD_THREADS=1)
    guard = MemoryGuard(int(opts["memory_floor_gb"] * 2**30))
    guard.start()

    ckpt = _ckpt_api()
    from composer_cloud.storage.store import Store

    snapshot = _replica_snapshot_fn()
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
        tiny_model, trainer, result["params"] = _tiny_setup()
        live_g = tiny_global_live(tiny_model)
    else:
        shapes = _synthetic_shapes(model_name)
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
        leader = _fresh_store(store_uri)
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
                p = _fresh_store(store_uri)
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
    g_bytes = sum(e["bytes"] for e in manifest["global"])
    r_bytes = {int(k): v["bytes"] for k, v in manifest["replicas"].items()}
    reads: dict[str, Any] = {"world_size": opts["resume_w"], "global_bytes": g_bytes, "replica_bytes": r_bytes,
                             "checkpoint_bytes": g_bytes + sum(r_bytes.values()),
                             "replica_needs_bytes": g_bytes + r_bytes[0]}
    rec = {}
    s = _fresh_store(store_uri)
    with phase(rec):
        found = ckpt.latest_checkpoint(TimedStore(s, timers), verify=True)  # what `resume` runs in the launcher
    rec["round"] = found.round if found else None
    rec["bytes_read"] = s.bytes_read
    rec["x_needed"] = round(s.bytes_read / reads["checkpoint_bytes"], 4)
    rec["timers"] = timers.take()
    reads["latest_checkpoint"] = rec
    # One (re)starting replica: resume_point, load_global, load_replica_at (its own state only).
    s = _fresh_store(store_uri)
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
    result["before_resume"] = _old_resume_reads(opts, store_uri, global_tree, replica_tree if rtree is None
                                                else (lambda: rtree), short_of_memory)
    save()

    # ---------------------------------------------------------------- 8. rounds with and without a checkpoint
    if trainer is not None and opts["rounds"] > 0:
        result["rounds"] = _time_rounds(opts, trainer, live_g, real, snapshot)
        timers.take()
        save()


def _old_resume_reads(opts: dict[str, Any], store_uri: str, global_tree: Any, replica_tree: Any,
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
    base = _fresh_store(uri)
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
    s = _fresh_store(uri)
    t0 = time.perf_counter()
    found = old.latest_checkpoint(s, verify=True)  # old launcher `resume`
    out["latest_checkpoint"] = {"bytes_read": s.bytes_read, "wall_s": round(time.perf_counter() - t0, 4),
                                "x_needed": round(s.bytes_read / out["checkpoint_bytes"], 4),
                                "round": found.round if found else None}
    # Old replica startup (951ee6d replica.py:147, 267, 279): latest_checkpoint(verify) + load_global + load_replica.
    s = _fresh_store(uri)
    t0 = time.perf_counter()
    found = old.latest_checkpoint(s)
    old.load_global(s, found.round)  # decoded and dropped: only the bytes read matter here
    old.load_replica(s, found, 0)
    out["replica_startup"] = {"bytes_read": s.bytes_read, "wall_s": round(time.perf_counter() - t0, 4),
                              "x_needed": round(s.bytes_read / out["replica_needs_bytes"], 4)}
    base.delete("checkpoints", recursive=True)
    return out


def _time_rounds(opts: dict[str, Any], trainer: Any, live_g: GlobalLive, real: Any,
                 snapshot: Any) -> dict[str, Any]:
    """Alternate plain rounds, global-only rounds and checkpoint rounds of participant 0 of W = ``resume_w``,
    as the runtime does them (its global slice every committed round; its replica state on checkpoint rounds)."""
    ckpt = _ckpt_api()

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


# =========================================================================== parent side
def calibrate(workdir: str, mb: int = 256) -> dict[str, float]:
    """This machine's primitives at the moment of the run: copy into fresh memory, crc32, write+fsync."""
    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, size=mb * 2**20, dtype=np.uint8).tobytes()
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    dup = bytes(memoryview(src))  # what frame() and decode_state() do: a copy into freshly allocated memory
    out["fresh_copy_gbps"] = round(len(src) / (time.perf_counter() - t0) / 1e9, 2)
    del dup
    t0 = time.perf_counter()
    zlib.crc32(src)
    out["crc32_gbps"] = round(len(src) / (time.perf_counter() - t0) / 1e9, 2)
    path = os.path.join(workdir, "calibrate.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(src)
        f.flush()
        os.fsync(f.fileno())
    out["file_write_fsync_mbps"] = round(len(src) / (time.perf_counter() - t0) / 1e6, 1)
    os.unlink(path)
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return out


def _spawn_case(model: str, uri: str, opts: dict[str, Any], workdir: str, timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = os.path.join(workdir, f"result-{model}-{uuid.uuid4().hex[:6]}.json")
    t0 = time.perf_counter()
    p = ctx.Process(target=run_case, args=(model, uri, opts, out))
    p.start()
    p.join(timeout)
    timed_out = p.is_alive()
    if timed_out:
        p.terminate()
        p.join(10)
    res: dict[str, Any] = {"model": model, "store": uri.split("://")[0]}
    if os.path.exists(out):
        with open(out) as f:
            res = json.load(f)
    res["case_wall_s"] = round(time.perf_counter() - t0, 1)
    if timed_out:
        res["error"] = f"timed out after {timeout:.0f}s"
    elif p.exitcode == 3:
        res["error"] = "aborted by the memory guard (machine low on memory)"
    elif p.exitcode != 0:
        res.setdefault("error", f"child exit code {p.exitcode}")
    return res


def _g(d: dict[str, Any], *path: str, default: Any = None) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _med(first: float | None, more: list[float] | None) -> tuple[float, float] | None:
    samples = ([first] if first is not None else []) + list(more or [])
    if not samples:
        return None
    return statistics.median(samples), min(samples)


def summarize(case: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Derived per-case numbers: what is on the critical path, what runs in the background, share of a round."""
    ph = case.get("phases", {})
    gw, rw = ph.get("global_write", {}), ph.get("replica_write", {})
    if "write_total_s" not in gw or "write_total_s" not in rw:
        return {}
    rep = case.get("repeats", {})
    s: dict[str, Any] = {"global_bytes": gw["bytes"], "replica_bytes": rw["bytes"]}
    for key, first, more in (
            ("global_snapshot", _g(ph, "global_snapshot", "snapshot_s"), rep.get("global_snapshot_s")),
            ("replica_snapshot", _g(ph, "replica_snapshot", "snapshot_s"), rep.get("replica_snapshot_s")),
            ("global_write", gw["write_total_s"], rep.get("global_write_s")),
            ("replica_write", rw["write_total_s"], rep.get("replica_write_s"))):
        med, lo = _med(first, more)
        s[f"{key}_s"], s[f"{key}_min_s"] = round(med, 4), round(lo, 4)
    s["write_samples"] = 1 + len(rep.get("global_write_s", []))
    # Current runtime (replica.py _after_commit): every participant's save_fn (every committed round) +
    # replica snapshot (checkpoint rounds) block; writes are background. (Key names kept from the leader era.)
    s["critical_leader_every_round_s"] = s["global_snapshot_s"]
    s["critical_leader_ckpt_round_s"] = round(s["global_snapshot_s"] + s["replica_snapshot_s"], 4)
    s["critical_other_replicas_s"] = s["replica_snapshot_s"]
    s["background_leader_s"] = round(s["global_write_s"] + s["replica_write_s"], 4)
    conc = ph.get("concurrent_writes")
    if conc:
        s["background_leader_concurrent_s"] = max(conc["global_write_s"], conc["replica_write_s"])
    rounds = case.get("rounds")
    round_s = None
    if rounds:
        round_s = rounds["plain_round_s"]
        s["round_basis"] = (f"measured: {rounds['h']} inner steps of the causal-LM trainer "
                            f"({rounds['step_s']:.3f} s/step), median of {rounds['rounds_each']}")
        s["measured_checkpoint_round_s"] = rounds["checkpoint_round_s"]
        s["measured_global_only_round_s"] = rounds["global_only_round_s"]
        s["measured_checkpoint_overhead_pct"] = rounds["checkpoint_overhead_pct"]
        s["measured_global_only_overhead_pct"] = rounds["global_only_overhead_pct"]
        s["measured_replica_tail_s"] = rounds.get("checkpoint_replica_tail_s")
    elif case["model"] == "0.5b":
        round_s = opts["big_h"] * opts["big_step_s"]
        s["round_basis"] = (f"assumed: H={opts['big_h']} inner steps x {opts['big_step_s']} s/step "
                            f"({opts['big_step_note']})")
    else:
        s["round_basis"] = "n/a (no round assumption for this size)"
    if round_s:
        s["round_s"] = round(round_s, 4)
        s["critical_pct_of_round"] = round(100 * s["critical_leader_ckpt_round_s"] / round_s, 1)
        s["background_pct_of_round"] = round(100 * s["background_leader_s"] / round_s, 1)
        # The global upload is joined at the next start_quorum: what it takes beyond the H steps blocks there.
        s["global_upload_excess_s"] = round(max(0.0, s["global_write_s"] - round_s), 4)
    rd = ph.get("read", {})
    if "latest_checkpoint" in rd:
        s["launcher_resume_read_s"] = _g(rd, "latest_checkpoint", "wall_s")
        s["replica_startup_read_s"] = _g(rd, "replica_startup", "wall_s")
        s["launcher_resume_x"] = _g(rd, "latest_checkpoint", "x_needed")
        s["replica_startup_x"] = _g(rd, "replica_startup", "x_needed")
        s["verified"] = all(_g(rd, k, "verified", default=False) for k in ("load_global", "load_replica"))
    return s


def upload_rows(case: dict[str, Any]) -> list[dict[str, Any]]:
    """Global-state bytes each replica uploads per committed round: old leader vs. each participant's slice."""
    sw = _g(case, "phases", "global_upload_by_w", default={})
    if "before" not in sw:
        return []
    before = sw["before"]
    rows = []
    for w in sorted(int(k) for k in sw if k.isdigit()):
        d = sw[str(w)]
        rows.append({"model": case["model"], "store": case["store"], "W": w,
                     "before_leader_mb": before["leader_bytes"] / MB, "before_others_mb": 0.0,
                     "after_max_mb": d["max_bytes"] / MB, "after_mean_mb": d["mean_bytes"] / MB,
                     "max_over_before": d["max_bytes"] / before["leader_bytes"],
                     "mean_over_before": d["mean_bytes"] / before["leader_bytes"],
                     "ideal": 1 / w, "before_wall_s": before["leader_wall_s"],
                     "after_slowest_wall_s": d["slowest_wall_s"],
                     "wall_ratio": d["slowest_wall_s"] / before["leader_wall_s"] if before["leader_wall_s"] else None,
                     "complete": d["complete"]})
    return rows


def resume_rows(case: dict[str, Any]) -> list[dict[str, Any]]:
    """Bytes read at resume, after (this code) and before (951ee6d), as multiples of what is needed."""
    rd = _g(case, "phases", "read", default={})
    if "latest_checkpoint" not in rd:
        return []
    old = case.get("before_resume", {})
    rows = []
    for what, key, need in (("launcher resume: latest_checkpoint(verify=True)", "latest_checkpoint",
                             "checkpoint_bytes"),
                            ("replica startup (own state)", "replica_startup", "replica_needs_bytes")):
        after = rd[key]
        row = {"model": case["model"], "store": case["store"], "W": rd["world_size"], "what": what,
               "needed_mb": rd[need] / MB, "after_read_mb": after["bytes_read"] / MB, "after_x": after["x_needed"],
               "after_s": after.get("wall_s")}
        if key in old:
            row.update(before_needed_mb=old[need] / MB, before_read_mb=old[key]["bytes_read"] / MB,
                       before_x=old[key]["x_needed"], before_s=old[key]["wall_s"])
        else:
            row["before_note"] = old.get("skipped", "not measured")
        rows.append(row)
    if "replica_startup" in old:
        w = rd["world_size"]
        # Every replica starts up: the store serves W times one replica's startup reads.
        rows.append({"model": case["model"], "store": case["store"], "W": w,
                     "what": f"all {w} replicas' startups together", "needed_mb": w * rd["replica_needs_bytes"] / MB,
                     "after_read_mb": w * rd["replica_startup"]["bytes_read"] / MB,
                     "after_x": rd["replica_startup"]["x_needed"], "after_s": None,
                     "before_needed_mb": w * old["replica_needs_bytes"] / MB,
                     "before_read_mb": w * old["replica_startup"]["bytes_read"] / MB,
                     "before_x": old["replica_startup"]["x_needed"], "before_s": None})
    return rows


def print_tables(cases: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=200)
    t = Table(title="Per state object, one replica (first write; seconds, MB)")
    cols = ("model", "params", "store", "state", "MB", "snapshot", "encode", "store I/O", "write total",
            "peak +MB write", "read(verify)", "load", "get", "ok")
    for col in cols:
        t.add_column(col, justify="left" if col in ("model", "store", "state") else "right")
    for c in cases:
        ph = c.get("phases", {})
        rd = ph.get("read", {})
        for state in ("global", "replica"):
            w, sn = ph.get(f"{state}_write", {}), ph.get(f"{state}_snapshot", {})
            if "write_total_s" not in w:
                why = w.get("skipped") or sn.get("skipped") or c.get("error", "failed")
                t.add_row(c["model"], f"{c.get('params', 0) / 1e6:.1f}M", c["store"], state, *["-"] * 9, why[:40])
                continue
            r = rd.get(f"load_{state}", {})
            peak = w.get("peak_over_start_mb", 0.0)
            t.add_row(
                c["model"], f"{c['params'] / 1e6:.1f}M", c["store"], state, f"{w['bytes'] / MB:.1f}",
                f"{sn.get('snapshot_s', float('nan')):.3f}", f"{w.get('compute_s', float('nan')):.3f}",
                f"{w.get('store_io_s', float('nan')):.3f}", f"{w['write_total_s']:.3f}",
                f"{peak:.0f} ({peak * MB / max(1, w['bytes']):.1f}x)",
                f"{_g(rd, 'latest_checkpoint', 'wall_s', default=float('nan')):.3f}",
                f"{r.get('load_s', float('nan')):.3f}", f"{r.get('get_s', float('nan')):.3f}",
                {True: "yes", False: "NO"}.get(r.get("verified"), r.get("skipped", "-")[:20]))
    con.print(t)
    con.print("  snapshot = critical-path copy (global: torchft save_fn clone of the params; replica: "
              "replica._snapshot of AdamW state + data position + RNG). global = the whole state by one writer "
              "(write_global_shard of split_global_state(tree, 1)); replica = write_replica_state. "
              "store I/O = time inside the Store calls (put incl. framing, marker, exists; timed on a wrapper "
              "around the store object); encode = write total - store I/O (safetensors encode, crc32). "
              "peak +MB write = kernel VmHWM above the RSS at the start of the write (the snapshot being "
              "written is not included: add 1x). read(verify) = latest_checkpoint(verify=True) of the W-replica "
              "checkpoint (reads every object once); load = load_global / load_replica_at of one replica's startup, "
              "get = its time in Store.get (the rest is decode).")
    print_upload_and_resume(con, cases)

    t2 = Table(title="Per round, current runtime: snapshots block, writes run in the background")
    for col in ("model", "store", "global MB", "replica MB", "writes", "critical: ckpt round s",
                "critical: global-only round s", "background: W=1 s", "round s", "critical %", "background %",
                "measured ckpt round",
                "round"):
        t2.add_column(col, justify="left" if col in ("model", "store", "round") else "right")
    for c, s in zip(cases, summaries):
        if not s:
            continue
        has = "round_s" in s
        meas = "-"
        if "measured_checkpoint_overhead_pct" in s:
            meas = (f"{s['measured_checkpoint_overhead_pct']:+.1f}% "
                    f"(global only {s['measured_global_only_overhead_pct']:+.1f}%)")
        bg = f"{s['background_leader_s']:.3f}"
        if "background_leader_concurrent_s" in s:
            bg += f" ({s['background_leader_concurrent_s']:.3f} together)"
        t2.add_row(c["model"], c["store"], f"{s['global_bytes'] / MB:.1f}", f"{s['replica_bytes'] / MB:.1f}",
                   str(s["write_samples"]), f"{s['critical_leader_ckpt_round_s']:.3f}",
                   f"{s['critical_leader_every_round_s']:.3f}", bg,
                   f"{s['round_s']:.2f}" if has else "-",
                   f"{s['critical_pct_of_round']:.1f}%" if has else "-",
                   f"{s['background_pct_of_round']:.1f}%" if has else "-", meas, s["round_basis"].split(":")[0])
    con.print(t2)
    for c, s in zip(cases, summaries):
        if s and "round_s" in s:
            con.print(f"  round of {c['model']}/{c['store']}: {s['round_basis']}")
    con.print("  critical (every participant): ckpt round = save_fn clone + replica snapshot; global-only round "
              "= save_fn clone. background: W=1 = the whole global write + replica write (one participant holding "
              "all of the global state; with W participants its global part is ~1/W, see the upload table), "
              "sequential sum (and both at once where measured); must fit in a round, else the slice upload's "
              "excess blocks at the next sync. "
              "measured ckpt round (tiny) = a checkpoint round of participant 0 of W = --resume-w done as the "
              "runtime does it (replica write, then its slice) "
              "vs a plain round of H inner steps "
              "(medians, same process, 1 torch thread; the background work competes with training for this machine's "
              "cores). Medians over 'writes' samples per state.")


def print_upload_and_resume(con: Any, cases: list[dict[str, Any]]) -> None:
    from rich.table import Table

    t = Table(title="Global-state upload per replica per committed round (MB): before = the leader uploads all, "
                    "after = each participant its slice")
    for col in ("model", "store", "W", "before: leader", "before: others", "after: max", "after: mean",
                "max/before", "mean/before", "1/W", "before s (leader)", "after s (slowest)", "slowest/before",
                "durable"):
        t.add_column(col, justify="left" if col in ("model", "store") else "right")
    for c in cases:
        for r in upload_rows(c):
            t.add_row(r["model"], r["store"], str(r["W"]), f"{r['before_leader_mb']:.1f}", "0",
                      f"{r['after_max_mb']:.1f}", f"{r['after_mean_mb']:.1f}", f"{r['max_over_before']:.3f}",
                      f"{r['mean_over_before']:.3f}", f"{r['ideal']:.3f}", f"{r['before_wall_s']:.3f}",
                      f"{r['after_slowest_wall_s']:.3f}", f"{r['wall_ratio']:.2f}" if r["wall_ratio"] else "-",
                      "yes" if r["complete"] else "NO")
    con.print(t)
    con.print("  bytes = Store.bytes_written (framed blob + marker) of one Store object per simulated participant; "
              "participants run one after the other on this machine (wall = each one's own write). Slices are "
              "whole tensors (the tied embedding is ~27% of the 0.5B state), so the largest slice exceeds 1/W.")
    t = Table(title="Resume read volume (Store.bytes_read of a fresh Store object), as a multiple of what is needed")
    for col in ("model", "store", "W", "reader", "needed MB", "after MB", "after x", "after s", "before MB",
                "before x", "before s"):
        t.add_column(col, justify="left" if col in ("model", "store", "reader") else "right")
    for c in cases:
        for r in resume_rows(c):
            t.add_row(r["model"], r["store"], str(r["W"]), r["what"], f"{r['needed_mb']:.1f}",
                      f"{r['after_read_mb']:.1f}", f"{r['after_x']:.3f}",
                      "-" if r.get("after_s") is None else f"{r['after_s']:.2f}",
                      f"{r['before_read_mb']:.1f}" if "before_read_mb" in r else r.get("before_note", "-")[:30],
                      f"{r['before_x']:.3f}" if "before_x" in r else "-",
                      "-" if r.get("before_s") is None else f"{r['before_s']:.2f}")
    con.print(t)
    con.print(f"  needed: launcher = the checkpoint's blobs (global slices + every replica state); replica = global "
              f"+ its own state. before = the same checkpoint written and read by the {OLD_COMMIT} code "
              "(git show, loaded as a separate module): its replica startup ran latest_checkpoint(verify=True) "
              "(every object) then load_global and load_replica (again).")


def markdown_upload_resume(cases: list[dict[str, Any]]) -> str:
    lines = ["| model | store | W | before: leader MB | before: others MB | after: max MB | after: mean MB "
             "| max / before | mean / before | 1/W | before s (leader) | after s (slowest participant) |",
             "|" + "---|" * 12]
    for c in cases:
        for r in upload_rows(c):
            lines.append(f"| {r['model']} | {r['store']} | {r['W']} | {r['before_leader_mb']:.1f} | 0 "
                         f"| {r['after_max_mb']:.1f} | {r['after_mean_mb']:.1f} | {r['max_over_before']:.3f} "
                         f"| {r['mean_over_before']:.3f} | {r['ideal']:.3f} | {r['before_wall_s']:.3f} "
                         f"| {r['after_slowest_wall_s']:.3f} |")
    lines += ["", "| model | store | W | reader | needed MB | after: read MB | after: x needed | before: read MB "
              "| before: x needed |", "|" + "---|" * 9]
    for c in cases:
        for r in resume_rows(c):
            lines.append(f"| {r['model']} | {r['store']} | {r['W']} | {r['what']} | {r['needed_mb']:.1f} "
                         f"| {r['after_read_mb']:.1f} | {r['after_x']:.3f} "
                         f"| {r['before_read_mb']:.1f} | {r['before_x']:.3f} |" if "before_x" in r else
                         f"| {r['model']} | {r['store']} | {r['W']} | {r['what']} | {r['needed_mb']:.1f} "
                         f"| {r['after_read_mb']:.1f} | {r['after_x']:.3f} | - | {r.get('before_note', '-')} |")
    return "\n".join(lines) + "\n"


def markdown_tables(cases: list[dict[str, Any]], summaries: list[dict[str, Any]], calib: dict[str, Any]) -> str:
    """The two tables as Markdown (for docs/checkpoints.md)."""
    def f(x: Any, nd: int = 3) -> str:
        return "-" if x is None else f"{x:.{nd}f}"

    lines = [f"Machine at the start: {calib}", "",
             "| model | store | state | MB | snapshot s | encode s | store I/O s | write s | peak write MB "
             "| read+verify s | load s | ok |", "|" + "---|" * 12]
    for c in cases:
        ph, rd = c.get("phases", {}), _g(c, "phases", "read", default={})
        for state in ("global", "replica"):
            w, sn, r = ph.get(f"{state}_write", {}), ph.get(f"{state}_snapshot", {}), rd.get(f"load_{state}", {})
            if "write_total_s" not in w:
                continue
            lines.append(
                f"| {c['model']} | {c['store']} | {state} | {w['bytes'] / MB:.1f} | {f(sn.get('snapshot_s'))} "
                f"| {f(w.get('compute_s'))} | {f(w.get('store_io_s'))} | {f(w['write_total_s'])} "
                f"| {w.get('peak_over_start_mb', 0):.0f} ({w.get('peak_over_start_mb', 0) * MB / w['bytes']:.1f}x) "
                f"| {f(_g(rd, 'latest_checkpoint', 'wall_s'))} | {f(r.get('load_s'))} "
                f"| {'yes' if r.get('verified') else r.get('skipped', 'NO')} |")
    lines += ["", "| model | store | writes | critical: ckpt round s | critical: global-only round s "
              "| background: W=1 s "
              "| round s | critical % | background % | measured checkpoint round vs plain |", "|" + "---|" * 10]
    for c, s in zip(cases, summaries):
        if not s:
            continue
        bg = f(s["background_leader_s"])
        if "background_leader_concurrent_s" in s:
            bg += f" ({f(s['background_leader_concurrent_s'])} together)"
        meas = "-"
        if "measured_checkpoint_overhead_pct" in s:
            meas = (f"{s['measured_checkpoint_overhead_pct']:+.1f}% (global-only round "
                    f"{s['measured_global_only_overhead_pct']:+.1f}%)")
        has = "round_s" in s
        lines.append(f"| {c['model']} | {c['store']} | {s['write_samples']} | {f(s['critical_leader_ckpt_round_s'])} "
                     f"| {f(s['critical_leader_every_round_s'])} | {bg} | {f(s.get('round_s'), 2)} "
                     f"| {f(s.get('critical_pct_of_round'), 1) + '%' if has else '-'} "
                     f"| {f(s.get('background_pct_of_round'), 1) + '%' if has else '-'} | {meas} |")
    return "\n".join(lines) + "\n\n" + markdown_upload_resume(cases)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,mid,0.5b", help="comma-separated subset of tiny,mid,0.5b")
    ap.add_argument("--skip-big", action="store_true", help="skip the ~0.5B-param case")
    ap.add_argument("--skip-mid", action="store_true", help="skip the ~55M-param case")
    ap.add_argument("--no-s3", action="store_true", help="skip the moto S3 runs")
    ap.add_argument("--mid-s3", action="store_true", help="also run the ~55M case on moto S3 (~1 min)")
    ap.add_argument("--h", type=int, default=10, help="inner steps per round for the tiny model (spec default)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="tiny: rounds of each kind (plain, global-only, checkpoint) timed; 0 skips")
    ap.add_argument("--repeats", type=int, default=7, help="extra writes of small states (median/min reported)")
    ap.add_argument("--repeat-max-mb", type=float, default=100, help="repeat only states up to this size")
    ap.add_argument("--big-h", type=int, default=100, help="assumed inner steps per round for 0.5B")
    ap.add_argument("--big-step-s", type=float, default=0.5,
                    help="assumed H100 seconds per inner step for 0.5B (see docs/checkpoints.md)")
    ap.add_argument("--big-step-note", help="the reasoning behind --big-step-s, printed with it",
                    default="0.5B bf16, 64K tokens/step = 2.0e14 FLOP at ~40%% MFU of an "
                    "H100's 989 TFLOP/s")
    ap.add_argument("--tmp", default=None, help="scratch dir for the file:// store (needs ~9 GB with 0.5B)")
    ap.add_argument("--memory-floor-gb", type=float, default=1.0,
                    help="abort a case if machine-wide available memory falls below this")
    ap.add_argument("--world-sizes", default="2,4,8", help="participant counts W for the global-upload table")
    ap.add_argument("--resume-w", type=int, default=2,
                    help="replicas in the checkpoint used for the resume reads (and the timed rounds' W)")
    ap.add_argument("--case-timeout", type=float, default=2400,
                    help="seconds per file:// case (0.5B writes ~8 states of 4 GB and reads ~50 GB: ~15 min here)")
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--markdown", default=None, help="also write the tables as Markdown to this file")
    args = ap.parse_args(argv)

    opts = {"h": args.h, "rounds": args.rounds, "repeats": args.repeats, "repeat_max_mb": args.repeat_max_mb,
            "big_h": args.big_h, "big_step_s": args.big_step_s, "big_step_note": args.big_step_note.replace("%%", "%"),
            "memory_floor_gb": args.memory_floor_gb,
            "world_sizes": sorted({int(w) for w in args.world_sizes.split(",") if w} | {args.resume_w}),
            "resume_w": args.resume_w}
    workdir = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.tmp)
    models = [m for m in args.models.split(",") if m]
    if args.skip_mid:
        models = [m for m in models if m != "mid"]
    if args.skip_big:
        models = [m for m in models if m != "0.5b"]
    plan: list[tuple[str, str]] = [(m, "file") for m in ("tiny", "mid", "0.5b") if m in models]
    if not args.no_s3:
        plan += [(m, "s3") for m in ("tiny", "mid") if m in models and (m == "tiny" or args.mid_s3)]

    cases: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    calib = calibrate(workdir)
    print(f"[checkpoint bench] machine now: {calib}", flush=True)
    try:
        for model, kind in [p for p in plan if p[1] == "file"]:
            uri = f"file://{workdir}/store-{model}"
            print(f"[checkpoint bench] {model} on file:// ...", flush=True)
            cases.append(_spawn_case(model, uri, opts, workdir, timeout=args.case_timeout))
            shutil.rmtree(f"{workdir}/store-{model}", ignore_errors=True)
            shutil.rmtree(f"{workdir}/store-{model}-old", ignore_errors=True)
        s3_plan = [p for p in plan if p[1] == "s3"]
        if s3_plan:
            sys.path.insert(0, ROOT)
            from tests.s3server import moto_s3_server, s3_environ

            for model, _ in s3_plan:
                # A fresh moto server per case: it keeps every object in memory.
                with moto_s3_server("ckpt-bench") as server, s3_environ(server):
                    print(f"[checkpoint bench] {model} on s3:// (moto, loopback) ...", flush=True)
                    cases.append(_spawn_case(model, f"s3://ckpt-bench/{model}", opts, workdir, timeout=600))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    summaries = [summarize(c, opts) for c in cases]
    print_tables(cases, summaries)
    import torch

    out = {
        "benchmark": "checkpoint",
        "env": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                "loadavg_at_end": os.getloadavg(), "torch_threads": 1, "platform": platform.platform()},
        "options": opts,
        "calibration": calib,
        "assumptions": {"0.5b_round": f"H={args.big_h} x {args.big_step_s} s/step: {opts['big_step_note']}"},
        "wall_s": round(time.perf_counter() - t_start, 1),
        "cases": [dict(c, summary=s) for c, s in zip(cases, summaries)],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.json} ({out['wall_s']:.0f}s)")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_tables(cases, summaries, calib))
        print(f"wrote {args.markdown}")
    return 0 if all("error" not in c for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
