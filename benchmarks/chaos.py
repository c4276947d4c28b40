#!/usr/bin/env python
"""Chaos benchmark: goodput and loss of lock-step vs. decoupled DiLoCo under kills, pauses and a slow replica.

    python benchmarks/chaos.py --quick            # smoke version (tiny model, short delays), < 2 min
    python benchmarks/chaos.py                    # full version (~10-15 min on 2 cores)
    python benchmarks/chaos.py --modes lockstep   # one arm only
    python benchmarks/chaos.py --set decoupled sync.min_quorum=2   # extra spec overrides for one mode

Definitions, method and results: ``docs/chaos.md``.

N replica processes (``python -m composer_cloud.replica --run URI --rank R``, the command every executor
runs) train the causal-lm trainer on the stdlib corpus (``composer_cloud.stdlib_corpus``) through a
``file://`` store in a temporary directory. This script is their executor: it writes the run spec through
the launch API's own checks (``check_before_launch``, the store probe, write-once ``spec.json``), starts the
processes itself, and applies a seeded fault schedule to them:

* ``kill``: SIGKILL of replica X, restarted (same rank, same run) after a cold-start delay;
* ``stop``: SIGSTOP of replica Y for some seconds, then SIGCONT;
* ``slow``: replica Z slowed ``--slow-factor`` x for the whole run by a SIGSTOP/SIGCONT duty cycle
  (running 1/3 of each period, stopped 2/3 of it; done from outside so no replica code is involved).

Scenarios (each a separate run; the mode is the spec override ``sync.mode``):

``baseline``  lock-step, no faults: the reference loss (and the target = ``--target-factor`` x its final loss);
``chaos``     the full schedule (kill + stop + slow), once per mode;
``mixed``     only the slow replica (no faults), once per mode; compared at equal total tokens.

A mode the installed code does not know (``SpecError`` on ``sync.mode``) is skipped with a message.
Held-out loss is measured offline after each run: every durable global version in the store
(``checkpoint.global_state_rounds``) is loaded into the model and scored on held-out stdlib files, with the
wall time at which the harness first saw it durable. That is the same for every mode.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from chaos_schedule import QUICK, Config, first_time_at_least, first_time_at_most, goodput, make_schedule, merged

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
DOC_IMG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img", "chaos.png")


# ----------------------------------------------------------------------------- configuration
# ----------------------------------------------------------------------------- offline evaluation
def evaluate_versions(cfg: Config, run: dict[str, Any], model_dir: Path, heldout: Any,
                      max_points: int = 24) -> list[tuple[float, int, float]]:
    """``(t, version, held-out loss)`` for durable global versions (evenly thinned, always the last)."""
    import torch
    from transformers import AutoModelForCausalLM

    from composer_cloud.runs.sync_state import attempt_of
    from composer_cloud.storage.run import open_run
    from composer_cloud.sync.checkpoint.global_state import GlobalStateStore
    from composer_cloud.sync.lockstep.diloco import load_global_parameters, split_fragments

    opened = open_run(run["run_uri"])
    states, attempt = GlobalStateStore(opened.store), attempt_of(opened.store, opened.spec)
    seen = {int(r): t for r, t in run["versions_seen"].items()}
    rounds = sorted(set(states.durable_rounds(attempt)) | set(seen))
    if len(rounds) > max_points:
        idx = sorted({round(i * (len(rounds) - 1) / (max_points - 1)) for i in range(max_points)})
        rounds = [rounds[i] for i in idx]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    fragments = split_fragments(model, 1)
    out = []
    for r in rounds:
        try:
            load_global_parameters(fragments, states.load(r, attempt(r)))
        except Exception as exc:  # noqa: BLE001 - report and go on: one unreadable version is not the run
            print(f"  version {r}: cannot load ({type(exc).__name__}: {exc})", flush=True)
            continue
        out.append((seen.get(r, run["train_wall_s"]), r, heldout_loss(model, heldout)))
    return out


def heldout_loss(model: Any, heldout: Any) -> float:
    """Mean next-token loss (nats/token) of ``model`` over the held-out rows, in batches of 16."""
    import torch

    with torch.no_grad():
        losses = [float(model(input_ids=heldout[i:i + 16], labels=heldout[i:i + 16]).loss)
                  for i in range(0, len(heldout), 16)]
    return sum(losses) / len(losses)


def initial_loss(model_dir: Path, heldout: Any) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    return heldout_loss(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval(), heldout)


# ----------------------------------------------------------------------------- reporting
def summarize(cfg: Config, runs: list[dict[str, Any]]) -> dict[str, Any]:
    base = next((r for r in runs if r["scenario"] == "baseline"), None)
    base_final = base["final_loss"] if base and base.get("final_loss") is not None else None
    target = base_final * cfg.target_factor if base_final is not None else None
    budget_steps = cfg.rounds * cfg.inner_steps * cfg.replicas
    rows = []
    for r in runs:
        g = r["goodput"]
        row = {"run": f"{r['scenario']}/{r['mode']}", "scenario": r["scenario"], "mode": r["mode"],
               "goodput": g["goodput"], "useful_steps_per_replica_s": g["useful_steps_per_replica_s"],
               "useful_steps": g["useful_steps"], "wasted_steps": g["wasted_steps"], "replica_s": g["replica_s"],
               "train_wall_s": r["train_wall_s"], "final_loss": r.get("final_loss"),
               "versions": len(r.get("curve", [])), "timed_out": r["timed_out"]}
        row["time_to_target_s"] = first_time_at_most([(t, v) for t, _, v in r.get("curve", [])], target) \
            if target is not None else None
        # Equal total tokens: first time the replicas together trained the spec's budget of steps.
        row["time_to_budget_tokens_s"] = first_time_at_least([(t, s) for t, s, _ in r["timeline"]], budget_steps)
        if base_final is not None and row["final_loss"] is not None:
            row["loss_vs_baseline_pct"] = 100 * (row["final_loss"] / base_final - 1)
        rows.append(row)
    by = {(x["scenario"], x["mode"]): x for x in rows}
    checks: dict[str, Any] = {"target_loss": target, "budget_steps": budget_steps}
    lc, dc = by.get(("chaos", "lockstep")), by.get(("chaos", "decoupled"))
    if dc:
        checks["chaos_decoupled_goodput_ge_95pct"] = dc["goodput"] >= 0.95
    if lc and dc:
        checks["chaos_goodput_ratio_decoupled_vs_lockstep"] = dc["goodput"] / lc["goodput"] if lc["goodput"] else None
        if lc["final_loss"] and dc["final_loss"]:
            checks["chaos_final_loss_decoupled_vs_lockstep_pct"] = 100 * (dc["final_loss"] / lc["final_loss"] - 1)
    if dc and base_final:
        checks["chaos_final_loss_decoupled_vs_baseline_pct"] = dc.get("loss_vs_baseline_pct")
    lm, dm = by.get(("mixed", "lockstep")), by.get(("mixed", "decoupled"))
    if lm and dm:
        tl, td = lm["time_to_budget_tokens_s"] or lm["train_wall_s"], dm["time_to_budget_tokens_s"] or dm["train_wall_s"]
        checks["mixed_speedup_at_equal_tokens"] = tl / td if td else None
    return {"rows": rows, "checks": checks}


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ["run", "goodput", "useful steps/replica-s", "useful", "wasted", "replica-s", "train wall s",
                "to target s", "to budget tokens s", "final loss", "vs baseline"]:
        t.add_column(col, justify="left" if col == "run" else "right", no_wrap=col == "run")

    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for r in rows:
        t.add_row(r["run"] + (" (timed out)" if r["timed_out"] else ""), f(100 * r["goodput"], ".1f") + "%",
                  f(r["useful_steps_per_replica_s"], ".2f"), str(r["useful_steps"]), str(r["wasted_steps"]),
                  f(r["replica_s"], ".0f"), f(r["train_wall_s"], ".0f"), f(r["time_to_target_s"], ".0f"),
                  f(r["time_to_budget_tokens_s"], ".0f"), f(r["final_loss"], ".4f"),
                  f(r.get("loss_vs_baseline_pct"), "+.2f") + ("%" if r.get("loss_vs_baseline_pct") is not None else ""))
    Console(width=max(160, shutil.get_terminal_size().columns)).print(t)


def plot(cfg: Config, runs: list[dict[str, Any]], summary: dict[str, Any], paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 3]})
    rows = summary["rows"]
    colors = {"lockstep": "tab:blue", "decoupled": "tab:orange"}
    labels = [r["run"] for r in rows]
    ax.bar(range(len(rows)), [100 * r["goodput"] for r in rows],
           color=[colors.get(r["mode"], "tab:gray") if r["scenario"] != "baseline" else "k" for r in rows])
    for i, r in enumerate(rows):
        ax.text(i, 100 * r["goodput"] + 1, f"{100 * r['goodput']:.0f}%", ha="center", fontsize=8)
    ax.axhline(95, color="tab:red", linestyle=":", linewidth=1, label="95%")
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("goodput (% of billed replica time)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    styles = {"baseline": "-", "chaos": "-", "mixed": "--"}
    for r in runs:
        pts = r.get("curve") or []
        if not pts:
            continue
        c = "k" if r["scenario"] == "baseline" else colors.get(r["mode"], "tab:gray")
        bx.plot([t for t, _, _ in pts], [v for _, _, v in pts], color=c, linestyle=styles.get(r["scenario"], "-"),
                marker="o", markersize=2.5, label=f"{r['scenario']}/{r['mode']} ({pts[-1][2]:.3f})")
    for r in runs:
        if r["scenario"] == "chaos":
            for ev in r["faults"]:
                if ev["event"] in ("kill", "sigstop"):
                    bx.axvline(ev["t"], color=colors.get(r["mode"], "gray"), alpha=0.25, linewidth=1)
    if summary["checks"].get("target_loss"):
        bx.axhline(summary["checks"]["target_loss"], color="tab:red", linestyle=":", linewidth=1,
                   label=f"target ({cfg.target_factor}x baseline final)")
    bx.set_xlabel("wall time since all replicas started training (s)")
    bx.set_ylabel("held-out loss of the global model")
    bx.set_yscale("log")
    bx.grid(True, which="both", alpha=0.3)
    bx.legend(fontsize=8)
    bx.set_title(f"{cfg.replicas} replicas, {cfg.rounds} rounds x {cfg.inner_steps} steps, stdlib corpus")
    fig.tight_layout()
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> tuple[Config, argparse.Namespace]:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smoke version: {QUICK}")
    p.add_argument("--replicas", type=int, default=None, help=f"3..8 (default {d.replicas}; the issue asks for 4-8)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--inner-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed, help="schedule and training seed")
    p.add_argument("--modes", nargs="+", default=d.modes)
    p.add_argument("--scenarios", nargs="+", default=d.scenarios, choices=["baseline", "chaos", "mixed"])
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("MODE", "KEY=VALUE"),
                   help="extra spec override for one mode (JSON value, else string), e.g. decoupled sync.min_quorum=2")
    for name in ("hidden", "intermediate", "vocab", "seq_len", "batch_size", "corpus_bytes", "eval_rows"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    for name in ("inner_lr", "quorum_timeout_s", "round_timeout_s", "kill_at", "stop_at", "cold_start_s",
                 "stop_s", "slow_factor", "target_factor", "timeout_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=None)
    p.add_argument("--min-replicas", type=int, default=None)
    p.add_argument("--out-dir", default=OUT_DIR)
    p.add_argument("--no-doc-plot", action="store_true", help=f"do not write {DOC_IMG}")
    p.add_argument("--keep", action="store_true", help="keep the temporary store and logs")
    a = p.parse_args(argv)
    values: dict[str, Any] = QUICK.copy() if a.quick else {}
    for f in Config.__dataclass_fields__:
        v = getattr(a, f, None)
        if v is not None and f not in ("modes", "scenarios", "seed"):
            values[f] = v
    overrides: dict[str, dict[str, Any]] = {}
    for mode, kv in a.set:
        key, _, raw = kv.partition("=")
        try:
            val = json.loads(raw)
        except json.JSONDecodeError:
            val = raw
        overrides.setdefault(mode, {})[key] = val
    cfg = Config(**values, modes=a.modes, scenarios=a.scenarios, seed=a.seed, mode_overrides=overrides)
    if not 3 <= cfg.replicas <= 8:
        p.error("--replicas must be between 3 and 8")
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    cfg, a = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from chaos_harness import Harness

    from composer_cloud import stdlib_corpus
    from composer_cloud.model import TinyModelConfig
    from composer_cloud.spec import SpecError

    torch.set_num_threads(1)
    os.makedirs(a.out_dir, exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="cc-bench-chaos-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    t_start = time.monotonic()
    runs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    try:
        model_dir = stdlib_corpus.write_model_dir(work / "model", seed=cfg.seed, vocab_size=cfg.vocab, config=TinyModelConfig(
            hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.intermediate))
        tok = stdlib_corpus.build_tokenizer(cfg.vocab)
        # Warm the token cache once, so replicas (and restarts) load rows instead of tokenizing.
        stdlib_corpus.token_rows(tok, "train", cfg.seq_len, max_bytes=cfg.corpus_bytes)
        heldout = stdlib_corpus.token_rows(tok, "heldout", cfg.seq_len, max_rows=cfg.eval_rows)
        init = initial_loss(model_dir, heldout)
        print(f"{cfg.replicas} replicas x {cfg.rounds} rounds x {cfg.inner_steps} steps; model hidden {cfg.hidden}, "
              f"vocab {len(tok)}; {cores} cores, load average {os.getloadavg()[0]:.2f}; initial held-out loss "
              f"{init:.3f}", flush=True)
        plan = []
        if "baseline" in cfg.scenarios:
            plan.append(("baseline", "lockstep"))
        for scenario in ("chaos", "mixed"):
            if scenario in cfg.scenarios:
                plan += [(scenario, m) for m in cfg.modes]
        base_s: float | None = None
        for scenario, mode in plan:
            if mode in skipped:
                continue
            sched = make_schedule(scenario, replicas=cfg.replicas, seed=cfg.seed,
                                  base_s=base_s or cfg.rounds * cfg.inner_steps * 0.25, kill_at=cfg.kill_at,
                                  stop_at=cfg.stop_at, cold_start_s=cfg.cold_start_s, stop_s=cfg.stop_s,
                                  slow_factor=cfg.slow_factor)
            t0 = time.monotonic()
            h = Harness(cfg, work, model_dir, mode, scenario, sched)
            try:
                r = h.run()
            except SpecError as exc:
                if "sync.mode" not in str(exc) and "sync" != getattr(exc, "field", ""):
                    raise
                skipped[mode] = str(exc)
                print(f"{scenario}/{mode}: SKIPPED, this code does not know sync.mode={mode!r} ({exc})", flush=True)
                continue
            if scenario == "baseline":
                base_s = r["train_wall_s"]
            curve = evaluate_versions(cfg, r, model_dir, heldout)
            r["curve"] = [(0.0, -1, init)] + curve
            r["final_loss"] = curve[-1][2] if curve else None
            runs.append(r)
            g = r["goodput"]
            print(f"{scenario:>8}/{mode:<9}: goodput {100 * g['goodput']:.1f}%, useful {g['useful_steps']}/"
                  f"{g['steps']} steps, {g['replica_s']:.0f} replica-s, train wall {r['train_wall_s']:.0f}s, final "
                  f"held-out {r['final_loss'] if r['final_loss'] is None else round(r['final_loss'], 4)}, "
                  f"exits {sorted(set(r['exit'].values()))}  [{time.monotonic() - t0:.0f}s]", flush=True)
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    total_s = time.monotonic() - t_start
    summary = summarize(cfg, runs)
    print_table(summary["rows"], f"chaos benchmark ({total_s:.0f}s); target loss = {cfg.target_factor} x baseline final")
    for k, v in summary["checks"].items():
        print(f"  {k}: {v}")
    for mode, why in skipped.items():
        print(f"  {mode}: skipped ({why})")
    stem = "chaos-quick" if a.quick else "chaos"
    json_path = os.path.join(a.out_dir, f"{stem}.json")
    doc = {"config": asdict(cfg), "quick": a.quick, "cores": cores, "total_s": total_s, "initial_loss": init,
           "skipped": skipped, "definitions": {
               "goodput": "measured compute seconds of inner steps in merged rounds (sync step counted as the "
                          "incarnation's median step, SIGSTOP-long steps as the run's median) divided by billed "
                          "replica-seconds (first heartbeat to exit or kill; SIGSTOPped and slowed time "
                          "included, cold-start delay and process start excluded)",
               "useful step": "an inner step in a round whose round row says committed/merged",
               "time_to_target_s": "first durable global version with held-out loss <= target, seconds after "
                                   "all replicas started training",
               "time_to_budget_tokens_s": "first time the replicas together recorded rounds x inner_steps x "
                                          "replicas inner steps"},
           **summary, "runs": runs}
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    paths = [os.path.join(a.out_dir, f"{stem}.png")] + ([] if a.quick or a.no_doc_plot else [DOC_IMG])
    if runs:
        plot(cfg, runs, summary, paths)
    print(f"wrote {json_path} and {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
