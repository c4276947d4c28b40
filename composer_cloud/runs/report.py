"""``composer-cloud report``: a PNG and an HTML page of a run's metrics, per round and replica.

Needs matplotlib (``pip install 'composer-cloud[report]'``); nothing else in
composer-cloud does.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_cloud.runs.metrics import read_metrics
from composer_cloud.storage.run import Run

INSTALL_HINT = "pip install 'composer-cloud[report]'"

#: (title, keys tried in order) of the report's panels
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train loss", ("train_loss",)),
    ("reward (mean)", ("reward_mean",)),
    ("held-out eval", ("eval_loss", "eval_reward_mean")),
    ("sync time (s)", ("sync_s",)),
)


class ReportUnavailable(RuntimeError):
    """matplotlib is not installed."""


@dataclass(frozen=True)
class Report:
    png: Path
    html: Path
    rounds: int
    replicas: list[int]


def _series(rows: Sequence[dict[str, Any]], keys: tuple[str, ...]) -> tuple[str | None, dict[int, list[tuple[int, float]]]]:
    """The first key any row has, and its (round, value) points per rank."""
    for key in keys:
        points: dict[int, list[tuple[int, float]]] = {}
        for r in rows:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                points.setdefault(r["rank"], []).append((r["round"] + 1, float(v)))
        if points:
            return key, points
    return None, {}


def write_report(run: Run, out_dir: str | Path) -> Report:
    """Write ``report.png`` and ``report.html`` for ``run`` under ``out_dir``; return their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ReportUnavailable(f"the report needs matplotlib: {INSTALL_HINT}") from None
    rows = read_metrics(run.store, kind="round")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        key, points = _series(rows, keys)
        ax.set_title(title if key is None or len(keys) == 1 else f"{title}: {key}")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not points:
            ax.text(0.5, 0.5, "not reported", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        for rank in sorted(points):
            xs, ys = zip(*points[rank])
            ax.plot(xs, ys, marker="o", markersize=3, label=f"r{rank}")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{run.run_id}: {run.spec.replicas} replicas, {run.spec.rounds} rounds x {run.spec.inner_steps} "
                 f"inner steps")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    png = out / "report.png"
    png.write_bytes(buf.getvalue())
    page = out / "report.html"
    page.write_text(_html(run, rows, buf.getvalue()))
    return Report(png=png, html=page, rounds=len({r["round"] for r in rows}), replicas=sorted({r["rank"] for r in rows}))


_TABLE = ("round", "rank", "committed", "train_loss", "reward_mean", "eval_loss", "eval_reward_mean", "compute_s",
          "sync_s", "quorum_wait_s")


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else html.escape(str(v))


def _html(run: Run, rows: Sequence[dict[str, Any]], png: bytes) -> str:
    cols = [c for c in _TABLE if any(c in r for r in rows)]
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = "\n".join("<tr>" + "".join(f"<td>{_cell(r.get(c) if c != 'round' else r['round'] + 1)}</td>"
                                      for c in cols) + "</tr>" for r in rows)
    title = html.escape(f"composer-cloud run {run.run_id}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style></head>
<body><h1>{title}</h1>
<p>{html.escape(run.uri)} &mdash; {run.spec.replicas} replicas, {run.spec.rounds} rounds x {run.spec.inner_steps} inner steps</p>
<img alt="loss, reward, eval and sync time per round and replica" src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Rounds (one row per replica)</h2>
<table><tr>{head}</tr>
{body}
</table></body></html>
"""


__all__ = ["INSTALL_HINT", "Report", "ReportUnavailable", "write_report"]
