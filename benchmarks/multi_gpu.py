#!/usr/bin/env python
"""Multi-GPU replicas on CPU (gloo): equivalence, bytes and step time per local rank, and kill -9 faults.

    python benchmarks/multi_gpu.py                  # 2 replicas x 2 local ranks vs x 1 (~1.5 min)
    python benchmarks/multi_gpu.py --faults         # + kill -9 of one local rank at every phase (~5 min)
    python benchmarks/multi_gpu.py --faults --phases upload   # only the kills at these phases
    python benchmarks/multi_gpu.py --bf16           # the same under bf16 autocast
    python benchmarks/multi_gpu.py --parallelism fsdp   # FSDP2 inside the N-rank replicas
    python benchmarks/multi_gpu.py --lora           # [model.lora] in both runs (DDP over the adapters)
    python benchmarks/multi_gpu.py --json out.json

The runs are the spec of ``tests/test_multi_gpu_e2e.py`` (the tiny model, 3 lock-step rounds of 2 inner
steps, a replica batch of 4 rows) launched through the CLI on the local executor and a ``file://`` store.
Figures, from the runs' own round rows (local rank 0 reports for its replica, with shard 0's bytes):

* ``max_abs_diff``: exported weights of the ``N``-rank run against the one-rank run (same global batch);
* ``bytes_per_rank``: store bytes (read + written) of one local rank's sync per round, and its ratio to a
  one-rank replica's;
* ``step_s``: compute seconds per inner step of one local rank (``compute_s / inner_steps``, mean over rounds
  and replicas). On this shared 2-core machine the 4 processes of the 2 x 2 run share 2 cores, so this is a
  correctness run, not a speed measurement.

``--faults``: for each phase of ``composer_cloud.hooks.PHASES`` and each local rank that reaches it (the
checkpoint phases are local rank 0's), local rank ``k`` of
replica 0 stalls at that phase of round 1 and is SIGKILLed, ``max_restarts = 1``. A case *survived* when the
run completed, replica 0 restarted once, no attempt of round 1 committed without both replicas, and both
replicas end on the same parameters; it is *bitwise* when, besides, the exported model equals the
uninterrupted ``N``-rank run's byte for byte (issue 37: a survivor that only agreed with its peer hid a round
re-run from fresh inner steps).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from composer_cloud.hooks import PHASES  # noqa: E402
from composer_cloud.runs import open_run  # noqa: E402
from composer_cloud.runs.metrics import read_metrics  # noqa: E402
from composer_cloud.storage import layout  # noqa: E402
from composer_cloud.sync.lockstep.rounds import read_outcome  # noqa: E402
from support.faults import stalled_pid  # noqa: E402
from support.local_jobs import launch_stalled  # noqa: E402
from support.resume import Weights, export_weights, launch_run, same_weights  # noqa: E402
from support.specs import MULTI_GPU_LORA_TOML, multi_gpu_spec  # noqa: E402

#: The phases every local rank passes (the others, checkpoint writes, are local rank 0's alone).
RANK_PHASES = ("inner_step", "upload", "reduce")


def _rows(run_uri: str) -> list[dict]:
    return read_metrics(open_run(run_uri).store, kind="round")


def _spec(ranks: int, *, bf16: bool = False, lora: bool = False, parallelism: str = "ddp", extra: str = "") -> str:
    """The multi-GPU spec with ``ranks`` local ranks (``parallelism`` for ``ranks > 1``) and the options."""
    if ranks > 1:
        extra = f'{extra}\nparallelism = "{parallelism}"'
    spec = multi_gpu_spec(ranks, extra)
    if bf16:
        spec = spec.replace("[model]\n", '[model]\nprecision = "bf16"\n')
    return spec + (MULTI_GPU_LORA_TOML if lora else "")


def measure(root: Path, n: int, *, bf16: bool = False, lora: bool = False,
            parallelism: str = "ddp") -> tuple[dict, Weights]:
    """The one-rank run and the ``n``-rank run: diff, bytes per rank, step time per rank; the ``n``-rank model."""
    out: dict = {}
    weights = {}
    for ranks in (1, n):
        cwd = root / f"x{ranks}"
        cwd.mkdir()
        store = f"file://{cwd}/store"
        t0 = time.monotonic()
        res = launch_run(cwd, store, "run", _spec(ranks, bf16=bf16, lora=lora, parallelism=parallelism))
        if res.returncode != 0:
            raise SystemExit(res.stdout + res.stderr)
        rows = _rows(f"{store}/run")
        out[f"x{ranks}"] = {
            "wall_s": time.monotonic() - t0,
            "bytes_per_rank": sum(r["bytes_read"] + r["bytes_written"] for r in rows) / len(rows),
            "step_s": sum(r["compute_s"] for r in rows) / len(rows) / 2,
        }
        weights[ranks] = export_weights(cwd, f"{store}/run", "model")
    a, b = weights[1], weights[n]
    out["max_abs_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    out["bytes_ratio"] = out[f"x{n}"]["bytes_per_rank"] / out["x1"]["bytes_per_rank"]
    return out, weights[n]


def fault_case(root: Path, phase: str, local_rank: int, uninterrupted: Weights, **options: object) -> dict:
    """Kill local rank ``local_rank`` of replica 0 at ``phase`` of round 1; compare with ``uninterrupted``."""
    cwd = root / f"{phase}-{local_rank}"
    cwd.mkdir()
    store = f"file://{cwd}/store"
    cfg = cwd / "spec.toml"
    cfg.write_text(_spec(2, extra="max_restarts = 1", **options))
    t0 = time.monotonic()
    launcher = launch_stalled(cwd, cfg, store, "run", phase=phase, round=1, rank=0, local_rank=local_rank)
    os.kill(stalled_pid(cwd / "stalled-run"), signal.SIGKILL)
    try:
        launcher.communicate(timeout=400)
    except Exception:  # noqa: BLE001 - a hang is a result
        launcher.kill()
        return {"phase": phase, "local_rank": local_rank, "result": "hung"}
    run = open_run(f"{store}/run")
    outcomes, attempt = [], 0
    while (o := read_outcome(run.store, 1, attempt, replicas=2)) is not None:
        outcomes.append(o)
        attempt += 1
    partial = [o.attempt for o in outcomes if o.committed and o.participants != [0, 1]]
    digests = {run.store.get_json(layout.heartbeat_key(r)).get("params_sha256") for r in range(2)}
    ok = launcher.returncode == 0 and not partial and len(digests) == 1 and None not in digests
    bitwise = ok and same_weights(export_weights(cwd, run.uri, "model"), uninterrupted)
    return {"phase": phase, "local_rank": local_rank, "result": "survived" if ok else "failed", "bitwise": bitwise,
            "attempts_round_1": [("commit" if o.committed else f"abort {o.missing} ({o.reason[:70]})")
                                 for o in outcomes],
            "wall_s": time.monotonic() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                        help="with --faults: the phases to kill at (default: every phase)")
    parser.add_argument("--bf16", action="store_true", help='model.precision = "bf16" (autocast) in both runs')
    parser.add_argument("--parallelism", choices=("ddp", "fsdp"), default="ddp",
                        help="how the N-rank replicas hold the model (the one-rank baseline needs neither)")
    parser.add_argument("--lora", action="store_true", help="[model.lora] in both runs")
    parser.add_argument("--json", default="benchmarks/out/multi_gpu.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        options = {"bf16": args.bf16, "lora": args.lora, "parallelism": args.parallelism}
        measured, uninterrupted = measure(root, args.ranks, **options)
        result = {"options": options, **measured}
        n = args.ranks
        print(f"{'':24}{'1 rank':>14}{f'{n} ranks':>14}")
        for key in ("bytes_per_rank", "step_s", "wall_s"):
            print(f"{key:24}{result['x1'][key]:>14.4g}{result[f'x{n}'][key]:>14.4g}")
        print(f"bytes per rank ratio {result['bytes_ratio']:.3f}; max abs diff of the exported weights "
              f"{result['max_abs_diff']:.3g}")
        if args.faults:
            result["faults"] = [fault_case(root, phase, k, uninterrupted, **options)
                                for phase in args.phases for k in range(n)
                                if k == 0 or phase in RANK_PHASES]
            for case in result["faults"]:
                print(f"kill -9 local rank {case['local_rank']} at {case['phase']:14} {case['result']:9} "
                      f"{'bitwise' if case.get('bitwise') else 'differs':8} "
                      f"{case.get('attempts_round_1', '')}")
            survived = sum(c["result"] == "survived" for c in result["faults"])
            bitwise = sum(bool(c.get("bitwise")) for c in result["faults"])
            print(f"faults: {survived}/{len(result['faults'])} survived, {bitwise} bitwise the uninterrupted run")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
