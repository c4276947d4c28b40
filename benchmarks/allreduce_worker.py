"""The replica side of ``benchmarks/allreduce.py``: one process per replica, a runner per method, the profiler.

``worker`` is each process's entry point; the parent (``allreduce.py``) starts W of them per method and world
size and reads back one report per rank. The profiler wraps library functions in the worker process only.
"""

from __future__ import annotations

import abc
import os
import threading
import time
import traceback
import types
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from composer_cloud.sync.lockstep import codec as wire
from composer_cloud.retry import PollPolicy
from composer_cloud.spec import spec_from_dict
from composer_cloud.storage import framing
from composer_cloud.storage import store as store_mod
from composer_cloud.storage.backends import LocalBackend
from composer_cloud.storage.store import Store, iter_chunks
from composer_cloud.sync.lockstep.allreduce import AllReduceConfig, ObjectStoreAllReduce

#: Store-based methods (profiled, their rounds deleted afterwards); ``gloo`` is the network reference.
STORE_METHODS = ("raw_store", "scatter_reduce", "naive")
MIB = 1 << 20


class Profiler:
    """Thread-safe accumulators of (wall seconds, CPU seconds, calls) per category."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        self.lag: list[float] = []

    def add(self, name: str, wall: float, cpu: float) -> None:
        with self.lock:
            d = self.data[name]
            d[0] += wall
            d[1] += cpu
            d[2] += 1

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0, time.thread_time() - c0)
        timed.__wrapped__ = fn
        return timed

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            out = {k: {"wall_s": v[0], "cpu_s": v[1], "calls": int(v[2])} for k, v in self.data.items()}
            if self.lag:
                out["poll_lag"] = {"wall_s": sum(self.lag), "max_s": max(self.lag), "calls": len(self.lag)}
            return out


PROF = Profiler()


def install_profiler() -> None:
    """Wrap library functions (in this worker process only) with timers."""
    wire.encode = PROF.wrap("encode", wire.encode)
    wire.decode = PROF.wrap("decode", wire.decode)
    store_mod.frame = PROF.wrap("frame", store_mod.frame)        # header + copies + crc32
    store_mod.unframe = PROF.wrap("unframe", store_mod.unframe)  # checks + crc32
    framing.zlib = types.SimpleNamespace(crc32=PROF.wrap("crc32", zlib.crc32))
    os.fsync = PROF.wrap("fsync", os.fsync)
    LocalBackend._write = PROF.wrap("file_write", LocalBackend._write)  # makedirs, write, fsync, rename

    timed_sleep = PROF.wrap("poll_sleep", time.sleep)
    from composer_cloud.sync.lockstep import allreduce as ar_mod
    for mod in (store_mod, ar_mod):
        shim = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
        shim.sleep = timed_sleep
        mod.time = shim

    orig_wait_get = Store.wait_get

    def wait_get(self: Store, key: str, **kwargs):
        start_ns = time.time_ns()
        out = orig_wait_get(self, key, **kwargs)
        end_ns = time.time_ns()
        if isinstance(self.backend, LocalBackend):
            try:
                visible_ns = os.stat(self.path(key)).st_ctime_ns  # rename sets ctime: when it became visible
            except OSError:
                return out
            if visible_ns > start_ns:  # we really waited for it
                with PROF.lock:
                    PROF.lag.append((end_ns - visible_ns) / 1e9)
        return out

    Store.wait_get = wait_get


def _patch_fs_reads(store: Store) -> None:
    cls = type(store.backend.fs)
    if not getattr(cls.cat_file, "_bench_wrapped", False):
        wrapped = PROF.wrap("file_read", cls.cat_file)
        wrapped._bench_wrapped = True
        cls.cat_file = wrapped


def make_store(uri: str, poll: dict[str, float]) -> Store:
    return Store(uri, poll=PollPolicy(**poll))


def base_tensor(numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(12345)
    return torch.randn(numel, generator=g)


class Runner(abc.ABC):
    """One method, one replica. ``prepare`` is untimed, ``run`` is timed."""

    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        self.rank, self.world, self.cfg = rank, world, cfg
        self.base = base_tensor(cfg["numel"])
        self.x = torch.empty_like(self.base)

    def prepare(self, i: int) -> None:
        torch.add(self.base, float(self.rank), out=self.x)

    @abc.abstractmethod
    def run(self, i: int) -> dict[str, Any]:
        """One timed operation ``i``; what it measured."""

    def check(self) -> dict[str, Any]:
        expected = self.base + (self.world - 1) / 2
        err = float((self.x - expected).abs().max()) if self.x.numel() else 0.0
        return {"max_abs_err": err, "digest": zlib.crc32(memoryview(self.x.numpy()))}

    def close(self) -> None:
        pass


class StoreRunner(Runner):
    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        super().__init__(rank, world, cfg)
        self.store = make_store(cfg["uri"], cfg["poll"])
        if cfg["profile"]:
            _patch_fs_reads(self.store)

    def counters(self) -> tuple[int, int]:
        return self.store.bytes_read, self.store.bytes_written


class PooledStoreRunner(StoreRunner):
    """A store runner that moves its objects on its own pool of ``io_threads`` threads."""

    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        super().__init__(rank, world, cfg)
        self.pool = ThreadPoolExecutor(max_workers=cfg["io_threads"])

    def close(self) -> None:
        self.pool.shutdown()


class ScatterReduceRunner(StoreRunner):
    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        super().__init__(rank, world, cfg)
        spec = spec_from_dict({"replicas": world, "min_replicas": world, "sync": {
            "codec": cfg["codec"], "io_threads": cfg["io_threads"], "quorum_timeout_s": cfg["timeout_s"],
            "round_timeout_s": cfg["timeout_s"], "heal_timeout_s": 2 * cfg["timeout_s"]}})
        self.ar = ObjectStoreAllReduce(self.store, rank, AllReduceConfig.from_spec(spec))

    def run(self, i: int) -> dict[str, Any]:
        res = self.ar.allreduce(i, self.x)
        if not (res.committed and res.participated):
            raise RuntimeError(f"round {i} did not commit: {res}")
        phases = dict(res.timings)
        phases["quorum_wait_s"] = res.quorum_wait_s
        phases["other_s"] = res.wall_s - sum(phases.values())  # open_attempt, join, commit record
        phases["round_wall_s"] = res.wall_s
        return {"bytes_read": res.bytes_read, "bytes_written": res.bytes_written,
                "wire_payload_bytes": res.payload_bytes, "phases": phases}

    def close(self) -> None:
        self.ar.close()


class NaiveRunner(PooledStoreRunner):
    def run(self, i: int) -> dict[str, Any]:
        codec, store = self.cfg["codec"], self.store
        r0, w0 = self.counters()
        deadline = time.monotonic() + self.cfg["timeout_s"]
        mine = wire.encode(codec, self.x)
        store.put(f"{i}/{self.rank}", mine)
        futures = {r: self.pool.submit(store.wait_get, f"{i}/{r}", deadline=deadline)
                   for r in range(self.world) if r != self.rank}
        acc: torch.Tensor | None = None
        for r in range(self.world):  # rank order: deterministic, identical on every replica
            part = wire.decode(codec, mine if r == self.rank else futures[r].result(), key=f"{i}/{r}")
            acc = part if acc is None else acc.add_(part)
        assert acc is not None
        self.x.copy_(acc.div_(self.world))
        r1, w1 = self.counters()
        return {"bytes_read": r1 - r0, "bytes_written": w1 - w0, "wire_payload_bytes": len(mine)}


class RawStoreRunner(PooledStoreRunner):
    """Moves the objects a scatter-reduce replica moves, minus everything but put/get."""

    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        super().__init__(rank, world, cfg)
        self.prepare(0)
        slots = list(iter_chunks(self.x.numel(), world))
        self.encoded = [wire.encode(cfg["codec"], self.x[s:e]) for s, e in slots]

    def run(self, i: int) -> dict[str, Any]:
        w, me = self.world, self.rank
        r0, w0 = self.counters()
        # writes: my W slots, then my reduced slot (W + 1 puts)
        puts = [(f"{i}/{me}/grad/{j}", self.encoded[j]) for j in range(w)]
        list(self.pool.map(lambda kv: self.store.put(*kv), puts))
        self.store.put(f"{i}/{me}/reduced", self.encoded[me])
        # reads: W - 1 slots for the reduce, W - 1 slots for the gather
        keys = [f"{i}/{me}/grad/{j}" for j in range(w) if j != me]
        list(self.pool.map(self.store.get, keys))
        list(self.pool.map(self.store.get, keys))
        r1, w1 = self.counters()
        return {"bytes_read": r1 - r0, "bytes_written": w1 - w0,
                "wire_payload_bytes": sum(len(e) for e in self.encoded)}

    def check(self) -> dict[str, Any]:
        return {"max_abs_err": None, "digest": None}


def read_loopback_tx() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


class GlooRunner(Runner):
    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        super().__init__(rank, world, cfg)
        import datetime

        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.dist = dist
        dist.init_process_group("gloo", init_method=cfg["gloo_init"], rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg["timeout_s"]))

    def run(self, i: int) -> dict[str, Any]:
        self.dist.all_reduce(self.x)
        self.x.div_(self.world)
        return {"wire_payload_bytes": self.x.numel() * 4}

    def close(self) -> None:
        self.dist.destroy_process_group()


RUNNERS = {"scatter_reduce": ScatterReduceRunner, "naive": NaiveRunner, "gloo": GlooRunner,
           "raw_store": RawStoreRunner}


def worker(q, rank: int, method: str, world: int, cfg: dict[str, Any], barrier) -> None:
    """Entry point of one replica process. Puts ``(rank, report)`` on ``q`` exactly once."""
    tmo = cfg["timeout_s"]
    try:
        torch.set_num_threads(cfg["torch_threads"])
        profile = cfg["profile"] and method in STORE_METHODS
        if profile:
            install_profiler()
        runner = RUNNERS[method](rank, world, cfg)
        samples = []
        for i in range(cfg["warmup"] + cfg["repeats"]):
            runner.prepare(i)
            barrier.wait(tmo)
            net0 = read_loopback_tx() if rank == 0 else 0
            barrier.wait(tmo)
            PROF.reset()
            c0, m0, t0 = time.process_time(), time.monotonic(), time.perf_counter()
            info = runner.run(i)
            t1, m1, c1 = time.perf_counter(), time.monotonic(), time.process_time()
            barrier.wait(tmo)
            net1 = read_loopback_tx() if rank == 0 else 0
            if i < cfg["warmup"]:
                continue
            info.update(op_s=t1 - t0, start=m0, end=m1, cpu_s=c1 - c0, loopback_tx=net1 - net0)
            if profile:
                info["profile"] = PROF.snapshot()
            samples.append(info)
        result = runner.check()
        import composer_cloud
        result["library"] = os.path.dirname(os.path.abspath(composer_cloud.__file__))
        barrier.wait(tmo)
        runner.close()
        q.put((rank, {"samples": samples, **result}))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails loudly
        barrier.abort()
        q.put((rank, {"error": traceback.format_exc()}))
