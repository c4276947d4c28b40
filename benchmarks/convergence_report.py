"""Tables, JSON rows and the plot of ``benchmarks/convergence.py``."""

from __future__ import annotations

import math
import shutil
from typing import Any

from convergence import Config, sync_every


def summarize(cfg: Config, results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    base = results.get("sync")
    rows = []
    for name, r in results.items():
        final = r["curve"][-1][1]
        row = {"method": name, "H": sync_every(name), "final_heldout_loss": final,
               "final_heldout_ppl": math.exp(final), "syncs": r["syncs"],
               "bytes_per_replica": r["bytes_per_replica"], "wall_s": r["wall_s"],
               "train_loss_last50": r["train_loss_last50"]}
        if base is not None:
            b = base["curve"][-1][1]
            row["loss_vs_sync_pct"] = 100 * (final - b) / b
            # How fast: first evaluated step at which held-out loss is within 3% of sync's final loss.
            row["steps_to_within_3pct_of_sync_final"] = next(
                (s for s, v in r["curve"] if v <= 1.03 * b), None)
            row["bytes_reduction_vs_sync"] = (base["bytes_per_replica"] / r["bytes_per_replica"]
                                              if r["bytes_per_replica"] else None)
        rows.append(row)
    return rows


def print_table(cfg: Config, rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ["method", "held-out loss", "vs sync", "ppl", "syncs", "bytes/replica", "less than sync",
                "steps to 1.03x sync final", "wall s"]:
        t.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    for r in rows:
        red = r.get("bytes_reduction_vs_sync")
        t.add_row(r["method"], f"{r['final_heldout_loss']:.4f}",
                  f"{r['loss_vs_sync_pct']:+.2f}%" if "loss_vs_sync_pct" in r else "-",
                  f"{r['final_heldout_ppl']:.3f}", str(r["syncs"]), human_bytes(r["bytes_per_replica"]),
                  f"{red:.2f}x" if red else "-", str(r.get("steps_to_within_3pct_of_sync_final") or "-"),
                  f"{r['wall_s']:.0f}")
    Console(width=max(150, shutil.get_terminal_size().columns)).print(t)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def plot(cfg: Config, results: dict[str, dict[str, Any]], rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    styles = {"sync": ("k", "-"), "single": ("tab:gray", ":")}
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    di = 0
    colors = {}
    for name, r in results.items():
        if name in styles:
            c, ls = styles[name]
        else:
            c, ls = palette[di % len(palette)], "-"
            di += 1
        colors[name] = c
        xs = [s for s, _ in r["curve"]][1:]
        ys = [v for _, v in r["curve"]][1:]
        ax.plot(xs, ys, color=c, linestyle=ls, marker="o" if len(xs) <= 30 else None, markersize=3,
                label=f"{name} ({ys[-1]:.3f})")
    ax.set_xlabel("inner step (per replica)")
    ax.set_ylabel("held-out loss")
    ax.set_yscale("log")
    ax.set_title(f"{cfg.corpus} corpus, {cfg.replicas} replicas, {cfg.steps} steps, {cfg.engine} engine")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    for r in rows:
        if r["bytes_per_replica"]:
            bx.scatter(r["bytes_per_replica"], r["final_heldout_loss"], color=colors[r["method"]], s=40)
            bx.annotate(r["method"], (r["bytes_per_replica"], r["final_heldout_loss"]),
                        textcoords="offset points", xytext=(5, 5), fontsize=9)
    single = next((r for r in rows if r["method"] == "single"), None)
    if single:
        bx.axhline(single["final_heldout_loss"], color="tab:gray", linestyle=":", label="single (0 bytes)")
        bx.legend()
    bx.set_xscale("log")
    bx.set_xlabel("bytes communicated per replica")
    bx.set_ylabel("final held-out loss")
    bx.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
