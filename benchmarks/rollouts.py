#!/usr/bin/env python
"""Rollout workers against colocated sampling, on CPU processes (issue 36, item 6).

    python benchmarks/rollouts.py                    # colocated-2, colocated-4, workers-2+2; 4 rounds x 4 steps
    python benchmarks/rollouts.py --rounds 3 --inner-steps 2 --json benchmarks/out/rollouts.json

The runs are the spec of ``tests/test_rollout_workers_e2e.py`` (the three-channel trainer on a question/answer
set, the small CPU model, lock-step, ``max_staleness = 1``), launched through the CLI on the local executor and a
``file://`` store:

* ``colocated-2``: 2 replicas, each sampling its own completions (2 processes);
* ``colocated-4``: 4 replicas (4 processes: the process count of the next run, so equal devices);
* ``workers-2+2``: 2 replicas fed by 2 rollout workers (4 processes).

Figures, from the runs' own rows and records:

* ``busy``: the trainers' busy fraction, (compute seconds - seconds waiting for a rollout batch) / wall seconds of
  their rounds (sampling counts as busy when the trainer samples itself);
* ``tok/s``: completion tokens sampled per second of the run's wall time (all samplers together);
* ``eval_loss``: the held-out per-token loss of the reference answers after the last round, and ``reward``, the
  mean training reward of the last round;
* ``policy MB/round``: bytes of the policy chain per round (``policy/`` objects over rounds) against the full bf16
  model (``full MB``); ``-`` when the replicas publish no chain (colocated runs, or a build without it).

On this shared 2-core machine 4 processes share 2 cores, so the figures compare the shapes of the runs, not
hardware; label them as CPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from composer_cloud.runs import open_run  # noqa: E402
from composer_cloud.runs.metrics import read_metrics  # noqa: E402
from composer_cloud.storage import layout  # noqa: E402
from support.cli import cli  # noqa: E402
from support.specs import ROLLOUT_QA, rollout_spec  # noqa: E402

RUNS = {"colocated-2": (2, 0), "colocated-4": (4, 0), "workers-2+2": (2, 2)}


def run_case(root: Path, name: str, replicas: int, workers: int, *, rounds: int, inner_steps: int) -> dict:
    """Launch one run to completion; its figures (see the module)."""
    cwd = root / name
    cwd.mkdir()
    (cwd / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROLLOUT_QA))
    (cwd / "spec.toml").write_text(rollout_spec(rounds=rounds, inner_steps=inner_steps))
    store = f"file://{cwd}/store"
    t0 = time.monotonic()
    res = cli("launch", "--config", str(cwd / "spec.toml"), "--store", store, "--run-id", "run", "--replicas",
              str(replicas), "--set", f"min_replicas={replicas}", "--set", f"rollouts.workers={workers}",
              # 4 processes starting on a shared 2-core box straggle past the spec's 60 s quorum wait
              "--set", "sync.quorum_timeout_s=300", "--set", "sync.round_timeout_s=600",
              "--set", "sync.heal_timeout_s=1200",
              # This toy task gives almost no gradient: with 3+ replicas the outlier rule excludes the one replica
              # whose step had one (0.097 against a no-gradient floor of 0.0095 per slot), and min_replicas =
              # replicas cannot retry (docs/rollouts.md). The benchmark measures throughput, not that rule.
              "--set", "sync.outlier_factor=1e9", cwd=cwd, timeout=3600)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"{name}: {res.stdout[-3000:]}{res.stderr[-3000:]}")
    run = open_run(f"{store}/run")
    rounds_rows = read_metrics(run.store, kind="round")
    steps = read_metrics(run.store, kind="step")
    waited = sum(float(r.get("rollouts/waited_s", 0.0)) for r in steps)
    compute = sum(float(r["compute_s"]) for r in rounds_rows)
    trainer_wall = sum(float(r["wall_s"]) for r in rounds_rows)
    last = max(int(r["round"]) for r in rounds_rows)
    final = [r for r in rounds_rows if int(r["round"]) == last]
    if workers:
        tokens = 0
        for key in run.store.list(layout.ROLLOUT_BATCHES):
            tokens += sum(len(row) for row in run.store.get_json(key, max_bytes=1 << 26)["completion_ids"])
    else:  # every step sampled its batch: mean completion length x rows per step
        batch = run.spec.trainer.batch_size
        tokens = int(sum(float(r.get("completion_length", 0.0)) * batch for r in steps))
    policy = _policy_bytes(run.store)
    return {"replicas": replicas, "workers": workers, "wall_s": wall, "busy": (compute - waited) / trainer_wall,
            "tokens_per_s": tokens / wall, "tokens": tokens,
            "eval_loss": _mean(final, "eval_loss"), "reward": _mean(final, "reward_mean"),
            "policy_bytes_per_round": None if policy is None else policy[0] / (rounds + 1),
            "full_bf16_bytes": None if policy is None else policy[1]}


def _mean(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _policy_bytes(store) -> tuple[int, int] | None:
    """(bytes of every ``policy/`` object, bytes of one full bf16 state), or None without a chain."""
    if not hasattr(layout, "POLICY"):
        return None
    keys = store.list(layout.POLICY)
    if not keys:
        return None
    total = sum(len(store.get(k)) for k in keys)
    anchors = [k for k in keys if "anchor" in k]
    return total, len(store.get(anchors[0])) if anchors else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=["colocated-2", "colocated-4", "workers-2+2"])
    parser.add_argument("--json", default="benchmarks/out/rollouts.json")
    parser.add_argument("--keep", default=None, help="run in this folder and keep the runs (default: a temporary one)")
    args = parser.parse_args()
    result: dict = {"rounds": args.rounds, "inner_steps": args.inner_steps, "device": "cpu", "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in args.runs:
            replicas, workers = RUNS[name]
            result["runs"][name] = run_case(root, name, replicas, workers, rounds=args.rounds,
                                            inner_steps=args.inner_steps)
    print(f"| run | processes | wall s | trainer busy | tok/s | eval_loss | reward | policy MB/round (full) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in result["runs"].items():
        policy = "-" if r["policy_bytes_per_round"] is None else (
            f"{r['policy_bytes_per_round'] / 1e6:.3f} ({r['full_bf16_bytes'] / 1e6:.3f})")
        loss = "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        reward = "-" if r["reward"] is None else f"{r['reward']:.3f}"
        print(f"| {name} | {r['replicas'] + r['workers']} | {r['wall_s']:.1f} | {r['busy']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {loss} | {reward} | {policy} |")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
