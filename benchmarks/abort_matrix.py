#!/usr/bin/env python
"""The abort rule under every integrity fault point of a lock-step round: does each run end bitwise where
the run without the fault ends?

    python benchmarks/abort_matrix.py                 # 2 and 3 replicas, every point, both damage kinds (~2 min)
    python benchmarks/abort_matrix.py --worlds 2      # 2 replicas only
    python benchmarks/abort_matrix.py --json out.json

Replicas are threads running torchft's DiLoCo over one ``file://`` store (``tests/support/threads.py``),
``min_replicas = replicas``, 3 rounds of 2 inner steps; the fault hits round 1, attempt 0. Fault points:
every pseudo-gradient part a reducer reads (``grad/<rank>/<slot>`` read by ``slot``'s reducer) and every
reduced slot a gatherer reads (``reduced/<slot>`` read by each other participant). Damage kinds: one
damaged read (a torn or corrupt GET; the object is fine) and a damaged object (every read of it fails).
Peer phases: the other participants run freely, or one of them holds its last slot upload (pseudo-gradient
faults only: a reduced slot exists only once every part was written), or its commit, until the attempt is
decided (so the abort lands while it is still writing, or while it commits).

Each case is classified as: bitwise (final parameters of every replica equal the fault-free run's),
failed cleanly (a replica raised a named error), hung, or wrong model (completed, parameters differ;
must be 0). Prints a table and writes JSON (``benchmarks/out/abort_matrix.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import numpy as np  # noqa: E402

from composer_cloud.storage import layout  # noqa: E402
from support.threads import FAULT_ROUND, FaultyStore, run_threads  # noqa: E402


def cases(world: int) -> list[dict]:
    """Every (fault point, damage kind, peer phase) of a ``world``-replica round."""
    points = []
    for slot in range(world):  # reducer ``slot`` reads every other participant's part of its slot
        for rank in range(world):
            if rank != slot:
                points.append((f"grad/{rank}/{slot}", slot, layout.grad_key(FAULT_ROUND, 0, rank, slot)))
    for slot in range(world):  # every other participant gathers reduced slot ``slot``
        for reader in range(world):
            if reader != slot:
                points.append((f"reduced/{slot} by {reader}", reader, layout.reduced_key(FAULT_ROUND, 0, slot)))
    out = []
    for name, reader, key in points:
        peer = (reader + 1) % world
        phases = [("free", {}), ("peer committing", {"hold_create": layout.outcome_key(FAULT_ROUND, 0)})]
        if name.startswith("grad/"):  # a reduced slot exists only once every part was written
            phases.insert(1, ("peer writing", {"hold_put": layout.grad_key(FAULT_ROUND, 0, peer, world - 1)}))
        for kind in ("damaged read", "damaged object"):
            for phase, hold in phases:
                out.append({"world": world, "point": name, "reader": reader, "key": key, "kind": kind,
                            "phase": phase, "peer": peer, "hold": hold})
    return out


def classify(out: dict, baseline: dict) -> str:
    if any(r.get("hung") for r in out.values()):
        return "hung"
    if any("error" in r for r in out.values()):
        return "failed cleanly"
    same = all(np.array_equal(a, b) for rank in baseline for a, b in zip(out[rank]["params"], baseline[rank]["params"]))
    return "bitwise" if same else "wrong model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,3", help="replica counts, comma-separated")
    parser.add_argument("--json", default="benchmarks/out/abort_matrix.json")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            baseline = run_threads(f"file://{tmp}/baseline-{world}/store", {}, world=world)
            assert all("error" not in r for r in baseline.values()), baseline
            for i, case in enumerate(cases(world)):
                uri = f"file://{tmp}/w{world}-{i}/store"
                stores = {case["reader"]: FaultyStore(uri, tear=case["key"], persistent=case["kind"] == "damaged object"),
                          case["peer"]: FaultyStore(uri, **case["hold"])}
                t0 = time.monotonic()
                out = run_threads(uri, stores, world=world)
                injected = stores[case["reader"]].damaged
                verdict = classify(out, baseline) if injected else "not injected"
                rows.append({k: v for k, v in case.items() if k not in ("key", "hold")} |
                            {"verdict": verdict, "damaged_reads": injected, "wall_s": round(time.monotonic() - t0, 2),
                             "errors": {r: str(o["error"])[:200] for r, o in out.items() if "error" in o}})
    counts = Counter(r["verdict"] for r in rows)
    print(f"{'world':>5}  {'fault point':<16} {'kind':<15} {'peer phase':<16} {'verdict':<15} {'s':>5}")
    for r in rows:
        print(f"{r['world']:>5}  {r['point']:<16} {r['kind']:<15} {r['phase']:<16} {r['verdict']:<15} {r['wall_s']:>5}")
    print(f"\ntried {len(rows)}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"worlds": worlds, "counts": counts, "cases": rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
