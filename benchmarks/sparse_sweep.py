#!/usr/bin/env python
"""Recipe study of the sparse codec: loss penalty vs. compression, against fp32 DiLoCo (docs/sparse.md).

    python benchmarks/sparse_sweep.py --h 50 --steps 2000 --variants sl_d3 sl_d1 sl_d2
    python benchmarks/sparse_sweep.py --h 50 --steps 2000 --report-only     # table + Pareto plot from the JSON

Each variant is one ``benchmarks/convergence.py --engine sim --corpus stdlib --methods diloco`` run (W = 4
replicas, the stdlib corpus defaults) with ``--diloco-codec sparse`` and the variant's settings; the baseline
``fp32`` is the same run with fp32 pseudo-gradients and the default outer Nesterov step (lr 0.7, momentum
0.9). Runs go one after the other (the machine's cores are shared) and are appended to
``OUT/sparse-h<H>-s<steps>.json`` as they finish; a variant already there is not run again.

Compression is reported two ways, both from the real payload sizes:

* ``payload x``: fp32 bytes of the pseudo-gradient over one sparse contribution's bytes;
* ``traffic x``: bytes per replica per round of fp32 DiLoCo's scatter-reduce, ``(3 - 1/W) * P_fp32``, over
  the sparse flat gather's ``W * P_sparse`` (what a replica moves; dense warm-up rounds included). At W = 4
  it is 0.69 x the payload ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import convergence as conv  # noqa: E402

#: name -> overrides of convergence.Config (codec "sparse" unless given).
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"diloco_codec": "fp32"},
    # Control: fp32 pseudo-gradients with SparseLoCo's outer step (plain averaging, SGD lr 1, no momentum).
    "fp32_sgd": {"diloco_codec": "fp32", "outer_lr": 1.0, "outer_momentum": 0.0},
    # SparseLoCo's recipe (error feedback 0.95, plain SGD outer step lr 1, 2-bit, chunk 4096) at densities d/64.
    "sl_d1": {"sparse_density": 1 / 64},
    "sl_d2": {"sparse_density": 2 / 64},
    "sl_d3": {"sparse_density": 3 / 64},
    "sl_d4": {"sparse_density": 4 / 64},
    "sl_d6": {"sparse_density": 6 / 64},
    # Variations around d3.
    "d3_decay90": {"sparse_density": 3 / 64, "sparse_decay": 0.9},
    "d3_decay99": {"sparse_density": 3 / 64, "sparse_decay": 0.99},
    "d3_warm2": {"sparse_density": 3 / 64, "sparse_warmup_syncs": 2},
    "d3_mom5": {"sparse_density": 3 / 64, "sparse_outer_momentum": 0.5},
    "d3_lr07_mom9": {"sparse_density": 3 / 64, "sparse_outer_lr": 0.7, "sparse_outer_momentum": 0.9},
    "d3_bits1": {"sparse_density": 3 / 64, "sparse_bits": 1},
    "d3_bits4": {"sparse_density": 3 / 64, "sparse_bits": 4},
    "d3_lr12": {"sparse_density": 3 / 64, "sparse_outer_lr": 1.2},
    "d2_chunk256": {"sparse_density": 2 / 64, "sparse_chunk": 256},
}


def run_variant(base: conv.Config, name: str, h: int) -> dict[str, Any]:
    over = dict(VARIANTS[name])
    over.setdefault("diloco_codec", "sparse")
    cfg = replace(base, **over)
    t0 = time.monotonic()
    r = conv.run_sim(cfg, f"diloco_h{h}")
    numel = None
    if "sparse_nnz" in r:
        numel = round(r["payload_compression"] * r["sparse_payload_bytes"] / 4)
    return {"name": name, "overrides": over, "final_loss": r["curve"][-1][1], "curve": r["curve"],
            "syncs": r["syncs"], "bytes_per_replica": r["bytes_per_replica"], "numel": numel,
            "sparse_payload_bytes": r.get("sparse_payload_bytes"), "payload_compression": r.get("payload_compression"),
            "fp32_round_bytes": r.get("fp32_round_bytes"), "wall_s": time.monotonic() - t0,
            "residual_norm_last": r.get("residual_norm_last"), "union_density_mean": r.get("union_density_mean"),
            "density": r.get("density")}


def rows_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    runs = doc["runs"]
    base = runs.get("fp32")
    rows = []
    for name, r in runs.items():
        row = {"variant": name, "final_loss": r["final_loss"], "wall_s": r["wall_s"], **r["overrides"]}
        if base:
            row["loss_vs_fp32_pct"] = 100 * (r["final_loss"] / base["final_loss"] - 1)
            row["traffic_x"] = base["bytes_per_replica"] / r["bytes_per_replica"]
        if "fp32_sgd" in runs:  # the codec's own penalty: fp32 with the same outer step
            row["loss_vs_fp32_sgd_pct"] = 100 * (r["final_loss"] / runs["fp32_sgd"]["final_loss"] - 1)
        row["payload_x"] = r["payload_compression"] or 1.0
        row["payload_bytes"] = r["sparse_payload_bytes"]
        rows.append(row)
    return sorted(rows, key=lambda x: x.get("traffic_x", 0))


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    out = [f"**{title}**", "", "| variant | density | chunk | bits | decay | warm-up | outer lr / mom | payload | "
           "payload × | traffic × | held-out loss | vs fp32 | vs fp32, same outer step | wall s |", "|" + "---|" * 14]
    for r in rows:
        if r["variant"].startswith("fp32"):
            outer = "0.7 / 0.9 (Nesterov)" if r["variant"] == "fp32" else \
                f"{r.get('outer_lr')} / {r.get('outer_momentum')}"
            knobs = f"— | — | 32 | — | — | {outer}"
        else:
            knobs = (f"{100 * r.get('sparse_density', 1 / 64):.2f}% | {r.get('sparse_chunk', 4096)} | "
                     f"{r.get('sparse_bits', 2)} | {r.get('sparse_decay', 0.95)} | {r.get('sparse_warmup_syncs', 0)} | "
                     f"{r.get('sparse_outer_lr', 1.0)} / {r.get('sparse_outer_momentum', 0.0)}")
        out.append(f"| {r['variant']} | {knobs} | {r['payload_bytes'] or 0:,.0f} B | {r['payload_x']:.1f} | "
                   f"{r.get('traffic_x', float('nan')):.1f} | {r['final_loss']:.4f} | "
                   f"{_pct(r.get('loss_vs_fp32_pct'))} | {_pct(r.get('loss_vs_fp32_sgd_pct'))} | {r['wall_s']:.0f} |")
    return "\n".join(out)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2f}%"


def plot(docs: list[tuple[str, list[dict[str, Any]]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (label, rows), color in zip(docs, ["tab:blue", "tab:orange", "tab:green"]):
        pts = [r for r in rows if not r["variant"].startswith("fp32") and "traffic_x" in r]
        ax.scatter([r["traffic_x"] for r in pts], [r["loss_vs_fp32_pct"] for r in pts], color=color,
                   label=f"{label}: vs fp32 DiLoCo (Nesterov outer)")
        same = [r for r in pts if "loss_vs_fp32_sgd_pct" in r]
        if same:
            ax.scatter([r["traffic_x"] for r in same], [r["loss_vs_fp32_sgd_pct"] for r in same], facecolors="none",
                       edgecolors=color, marker="s", label=f"{label}: vs fp32, same outer step (SGD lr 1)")
        for r in pts:
            ax.annotate(r["variant"], (r["traffic_x"], r["loss_vs_fp32_pct"]), textcoords="offset points",
                        xytext=(4, 3), fontsize=7)
        front, best = [], float("inf")
        for r in sorted(pts, key=lambda x: -x["traffic_x"]):
            if r["loss_vs_fp32_pct"] < best:
                best = r["loss_vs_fp32_pct"]
                front.append(r)
        ax.plot([r["traffic_x"] for r in front], [r["loss_vs_fp32_pct"] for r in front], color=color, alpha=0.5)
    ax.axhline(1.0, color="k", linestyle=":", label="+1% (done-when)")
    ax.axvline(50, color="gray", linestyle=":", label="50x traffic")
    ax.axhline(0.0, color="k", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("fewer bytes per replica per round than fp32 DiLoCo (x, W = 4)")
    ax.set_ylabel("held-out loss vs fp32 DiLoCo (%)")
    ax.set_title("sparse codec: compression vs loss penalty (stdlib corpus, sim engine)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--h", type=int, default=50)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--variants", nargs="*", default=["fp32", "sl_d3", "sl_d1", "sl_d2"], choices=sorted(VARIANTS))
    p.add_argument("--out-dir", default=os.path.join(conv.OUT_DIR, "sparse"))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--baseline-json", default=None,
                   help="take the fp32 run from a convergence.py JSON of the same settings (--methods diloco)")
    p.add_argument("--plot-with", nargs="*", default=[], help="other sweep JSONs to draw on the same plot")
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, f"sparse-h{a.h}-s{a.steps}.json")
    base, _ = conv.parse_args(["--corpus", "stdlib", "--engine", "sim", "--methods", "diloco", "--h", str(a.h),
                               "--steps", str(a.steps)])
    doc = json.load(open(path)) if os.path.exists(path) else {"h": a.h, "steps": a.steps, "runs": {}}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.baseline_json and "fp32" not in doc["runs"]:
        src = json.load(open(a.baseline_json))
        r = src["methods"][f"diloco_h{a.h}"]
        if (src["config"]["steps"], src["config"]["diloco_codec"]) != (a.steps, "fp32"):
            p.error(f"{a.baseline_json} is not an fp32 run of {a.steps} steps")
        doc["runs"]["fp32"] = {"name": "fp32", "overrides": VARIANTS["fp32"], "final_loss": r["curve"][-1][1],
                               "curve": r["curve"], "syncs": r["syncs"], "bytes_per_replica": r["bytes_per_replica"],
                               "sparse_payload_bytes": None, "payload_compression": None,
                               "wall_s": r["wall_s"], "numel": None}
    for name in [] if a.report_only else a.variants:
        if name in doc["runs"]:
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {VARIANTS[name]}", flush=True)
        doc["runs"][name] = run_variant(base, name, a.h)
        r = doc["runs"][name]
        print(f"  loss {r['final_loss']:.4f}, payload x {r['payload_compression'] or 1:.1f}, {r['wall_s']:.0f}s",
              flush=True)
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(path + ".tmp", path)
    rows = rows_of(doc)
    doc["rows"] = rows
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(markdown(rows, f"H = {a.h}, {a.steps} steps ({doc['runs'].get('fp32', {}).get('syncs', '?')} syncs), W = 4"))
    others = [(f"H = {d['h']}", rows_of(d)) for d in (json.load(open(x)) for x in a.plot_with)]
    png = os.path.join(a.out_dir, f"sparse-h{a.h}-s{a.steps}.png")
    plot([(f"H = {a.h}", rows)] + others, png)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
