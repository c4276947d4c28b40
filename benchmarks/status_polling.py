"""Store and executor calls made by watching a run: a fresh status per poll vs. one StatusTracker.

    python benchmarks/status_polling.py                 # 2 local replicas, 8 rounds, 1 poll/s
    python benchmarks/status_polling.py --rounds 20 --json benchmarks/out/status_polling.json

While a small local run trains, two watchers poll it once per second, side by side:

* ``fresh``: what ``status`` did before (and still does for one call): a new
  :class:`~composer_cloud.runs.status.StatusTracker` per poll, i.e. new executor
  objects and round discovery from round 0;
* ``tracker``: what ``wait``/``launch`` do now: one tracker for the whole watch
  (executors kept, discovery resumed from the last committed round, finished
  jobs not polled again).

Calls are counted with wrapper instances around each watcher's store
filesystem and executors (no module is patched). The table gives calls per
minute at one poll per second; the ratio is within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support.specs import SMALL_RUN_TOML  # noqa: E402

from composer_cloud import runs  # noqa: E402
from composer_cloud.runs.status import StatusTracker  # noqa: E402

class CountingFS:
    """Forwards every attribute of an fsspec filesystem, counting method calls by name."""

    def __init__(self, fs: Any, counts: Counter[str]) -> None:
        self._fs, self._counts = fs, counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counts[f"store.{name}"] += 1
            return attr(*args, **kwargs)

        return counted


class CountingExecutor:
    def __init__(self, ex: Any, counts: Counter[str]) -> None:
        self._ex, self._counts = ex, counts

    def poll(self, handle: Any) -> Any:
        self._counts["executor.poll"] += 1
        return self._ex.poll(handle)


def _watcher(uri: str, mode: str, counts: Counter[str], stop: threading.Event, polls: list[int]) -> None:
    from composer_cloud.jobs import get_executor

    run = runs.open_run(uri)
    run.store.backend.fs = CountingFS(run.store.backend.fs, counts)  # this watcher's store object only
    tracker = StatusTracker(run)
    n = 0
    while not stop.is_set():
        t = tracker if mode == "tracker" else StatusTracker(run)
        for h in runs.load_handles(run.store):
            if h.executor not in t._executors:
                counts["executor.create"] += 1
                t._executors[h.executor] = CountingExecutor(get_executor(h.executor, run.spec), counts)
        st = t.poll()
        n += 1
        if st.state != "running":
            break
        time.sleep(1.0)
    polls.append(n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "out" / "status_polling.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "spec.toml"
        cfg.write_text(SMALL_RUN_TOML)
        run = runs.launch(config=cfg, overrides={"store": f"file://{tmp}/store", "run_id": "watched",
                                                 "rounds": args.rounds, "inner_steps": args.inner_steps})
        results: dict[str, dict[str, Any]] = {}
        stop = threading.Event()
        threads = []
        for mode in ("fresh", "tracker"):
            counts: Counter[str] = Counter()
            polls: list[int] = []
            results[mode] = {"counts": counts, "polls": polls}
            th = threading.Thread(target=_watcher, args=(run.uri, mode, counts, stop, polls))
            th.start()
            threads.append(th)
        t0 = time.monotonic()
        final = runs.wait(run, timeout_s=1800)
        stop.set()
        for th in threads:
            th.join()
        wall = time.monotonic() - t0
    rows = []
    for mode, r in results.items():
        polls = max(1, r["polls"][0] if r["polls"] else 1)
        store_calls = sum(v for k, v in r["counts"].items() if k.startswith("store."))
        per_min = 60.0 / 1.0  # polls per minute at 1 Hz
        rows.append({"watcher": mode, "polls": polls, "store_calls_per_poll": store_calls / polls,
                     "store_calls_per_min": store_calls / polls * per_min,
                     "executor_polls_per_min": r["counts"]["executor.poll"] / polls * per_min,
                     "executors_created": r["counts"]["executor.create"],
                     "by_method": dict(r["counts"])})
    fresh, tracked = rows
    ratio = tracked["store_calls_per_poll"] / fresh["store_calls_per_poll"]
    print(f"run: {args.rounds} rounds x {args.inner_steps} inner steps, 2 local replicas, {wall:.0f} s, "
          f"final state {final.state}")
    print(f"{'watcher':<9} {'polls':>6} {'store calls/poll':>17} {'store calls/min':>16} "
          f"{'executor polls/min':>19} {'executors created':>18}")
    for r in rows:
        print(f"{r['watcher']:<9} {r['polls']:>6} {r['store_calls_per_poll']:>17.1f} {r['store_calls_per_min']:>16.0f} "
              f"{r['executor_polls_per_min']:>19.0f} {r['executors_created']:>18}")
    print(f"tracker / fresh store calls per poll: {ratio:.2f}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rounds": args.rounds, "inner_steps": args.inner_steps, "wall_s": wall, "rows": rows,
                   "ratio_store_calls": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
