"""Run a function in several processes and collect one value from each (replicas of in-process protocol tests,
benchmark workers)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

# Workers are forked from a server that imported torch but never ran a parallel op, so children neither
# re-import torch (slow) nor inherit OpenMP state.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "composer_cloud.sync.lockstep.manager"])


def run_processes(target: Callable[..., Any], args_per_proc: Sequence[tuple], *, timeout: float = 120,
                  ctx: Any = None, join_s: float = 10,
                  failure: Callable[[int, Any], str | None] | None = None) -> list[Any]:
    """Run ``target(queue, index, *args)`` in one process per args tuple; return what each put, in order.

    Each worker must ``queue.put((index, value))`` exactly once, where
    ``index`` is its position in ``args_per_proc``. Values must be plain
    Python/numpy objects (no torch tensors: they would be shared via fds).

    Args:
        timeout: seconds for all values to arrive.
        ctx: the multiprocessing context (default :data:`CTX`, a forkserver that preloaded torch).
        join_s: seconds each process gets to exit after the values arrived, before it is killed.
        failure: ``(index, value) -> message or None``; a message stops the wait at once (the other
            processes are killed) and is raised.

    Raises:
        RuntimeError: a process died before putting its value (its exit code is named), ``timeout``
            passed, or ``failure`` named a value.
    """
    ctx = ctx or CTX
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(q, i, *a), daemon=True) for i, a in enumerate(args_per_proc)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    ok = False
    try:
        while len(results) < len(procs):
            try:
                i, value = q.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = {i: p.exitcode for i, p in enumerate(procs) if i not in results and p.exitcode not in (None, 0)}
                if dead:
                    raise RuntimeError(f"worker process(es) died before reporting: exit codes {dead}") from None
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"workers {sorted(set(range(len(procs))) - set(results))} reported nothing "
                                       f"within {timeout:g}s") from None
                continue
            message = failure(i, value) if failure is not None else None
            if message:
                raise RuntimeError(message)
            results[i] = value
        ok = True
    finally:
        for p in procs:
            p.join(timeout=join_s if ok else 0.1)
            if p.is_alive():
                p.kill()
    return [results[i] for i in range(len(procs))]
