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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_cloud.errors import ConfigError

from composer_cloud.runs.metrics import read_rows
from composer_cloud.storage.records.metrics import RoundRow, Row, StepRow
from composer_cloud.storage.run import Run

if TYPE_CHECKING:
    from composer_cloud.runs.status import RolloutFleet

INSTALL_HINT = "pip install 'composer-cloud[report]'"

#: (title, keys tried in order, y-axis label) of the report's panels; "train loss" is drawn per inner step
PANELS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("train loss", ("loss",), ""),  # label from the trainer: LOSS_UNITS
    ("reward (mean over the batch)", ("reward_mean",), "reward (task's scale; built-ins 0–1)"),
    ("held-out eval", ("eval_loss", "eval_reward_mean"), "nats/token (eval_loss) or reward"),
    ("sync time", ("sync_s",), "seconds per round"),
)
#: The train loss's y-axis label per trainer.
LOSS_UNITS = {"causal-lm": "cross-entropy, nats/token", "three-channel": "three-channel loss (weighted sum)"}


class ReportUnavailable(ConfigError, RuntimeError):
    """matplotlib is not installed."""


@dataclass(frozen=True)
class Report:
    png: Path
    html: Path
    rounds: int
    replicas: list[int]
    #: each replica's legend label (dead and restarted replicas say so)
    labels: dict[int, str] = field(default_factory=dict)
    #: the rollout worker fleet (``status``'s figures; None for a run without workers), shown on the page
    fleet: "RolloutFleet | None" = None


def _series(rows: Sequence[Row], keys: tuple[str, ...], *, x: str = "round"
            ) -> tuple[str | None, dict[int, list[tuple[int, float]]]]:
    """The first column any row has, and its (x, value) points per rank (x: the round counted from 1, or the
    global inner step of a step row)."""
    for key in keys:
        points: dict[int, list[tuple[int, float]]] = {}
        for r in rows:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                at = r.step if x == "step" and isinstance(r, StepRow) else r.round + 1
                points.setdefault(r.rank, []).append((at or 0, float(v)))
        if points:
            return key, points
    return None, {}


def replica_labels(run: Run, status: Any | None = None) -> dict[int, str]:
    """``r1 (failed, killed (SIGKILL))``, ``r0 (2 restarts)``: each replica's legend label, marking a dead or
    restarted one (from the run's status, executors polled, unless ``status`` is given)."""
    from composer_cloud.runs.status import exit_reason, run_status

    labels = {}
    for info in (status or run_status(run)).replicas:
        notes = []
        if info.state in ("failed", "cancelled"):
            code = info.exit_code
            notes.append(info.state + (f", {exit_reason(code, info.state)}" if code not in (None, 0) else ""))
        if info.restarts:
            notes.append(f"{info.restarts} restart{'s' if info.restarts != 1 else ''}")
        labels[info.rank] = f"r{info.rank}" + (f" ({'; '.join(notes)})" if notes else "")
    return labels


def default_out_dir(run: Run) -> Path:
    """Where a report goes without ``--out``: ``report/`` in a local run's folder, else ``./<run_id>-report``."""
    if run.uri.startswith("file://"):
        return Path(run.uri[len("file://"):]) / "report"
    return Path(f"{run.run_id}-report")


def write_report(run: Run, out_dir: str | Path | None = None) -> Report:
    """Write ``report.png`` and ``report.html`` for ``run`` under ``out_dir`` (default:
    :func:`default_out_dir`); return their paths. Train loss per inner step, the rest per round; a dead or
    restarted replica is marked in the legend (and drawn dashed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ReportUnavailable(f"the report needs matplotlib: {INSTALL_HINT}") from None
    every = read_rows(run.store)
    rows = [r for r in every if isinstance(r, RoundRow)]
    steps = [r for r in every if isinstance(r, StepRow) and r.step is not None]
    from composer_cloud.runs.status import RolloutFleet, run_status
    from composer_cloud.runs.summary import reason, replica_outcome

    status = run_status(run)
    fleet = RolloutFleet.from_status(status)
    labels = replica_labels(run, status)
    # Why the run ended short, on the figure and the page (a failed run's panels may all be empty).
    why = [f"r{i.rank} {replica_outcome(i)}: {reason(i)}" for i in status.replicas
           if i.state in ("failed", "cancelled") and reason(i)] + list(status.problems)
    out = Path(out_dir) if out_dir is not None else default_out_dir(run)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for ax, (title, keys, ylabel) in zip(axes.flat, PANELS):
        per_step = keys == ("loss",)
        key, points = _series(steps, keys, x="step") if per_step else _series(rows, keys)
        ax.set_title(title if key is None or len(keys) == 1 else f"{title}: {key}")
        ax.set_xlabel("inner step (all rounds)" if per_step else "round")
        ax.set_ylabel(LOSS_UNITS.get(run.spec.trainer.name, "loss") if per_step else ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not points:
            ax.text(0.5, 0.5, "not reported", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        for rank in sorted(points):
            xs, ys = zip(*points[rank])
            label = labels.get(rank, f"r{rank}")
            ax.plot(xs, ys, marker="" if per_step else "o", markersize=3, label=label,
                    linestyle="--" if label != f"r{rank}" else "-")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{run.run_id} ({status.state}): {run.spec.replicas} replicas, {run.spec.rounds} rounds x "
                 f"{run.spec.inner_steps} inner steps")
    if why:
        import textwrap

        fig.text(0.5, 0.5, "\n".join(textwrap.fill(w, 110) for w in why[:4]), ha="center", va="center",
                 fontsize="small", color="darkred", bbox={"facecolor": "white", "edgecolor": "darkred", "alpha": 0.9})
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    png = out / "report.png"
    png.write_bytes(buf.getvalue())
    page = out / "report.html"
    from composer_cloud.runs.samples import read_samples

    samples = read_samples(run.store, last_rounds=SAMPLE_ROUNDS)
    page.write_text(_html(run, rows, buf.getvalue(), state=status.state, why=why, samples=samples, fleet=fleet))
    return Report(png=png, html=page, rounds=len({r.round for r in rows}), replicas=sorted({r.rank for r in rows}),
                  labels=labels, fleet=fleet)


#: The report's page shows the sample completions of the last this-many rounds (``logs --samples``: all).
SAMPLE_ROUNDS = 3

_TABLE = ("round", "rank", "committed", "train_loss", "reward_mean", "eval_loss", "eval_reward_mean", "compute_s",
          "sync_s", "quorum_wait_s")


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else html.escape(str(v))


def _samples_html(samples: Sequence[Any]) -> str:
    """The sample completions as a table (every text escaped and made printable; newlines kept as line breaks)."""
    if not samples:
        return ""
    from composer_cloud.runs.logs import printable

    def text(t: str) -> str:
        return "<br>".join(html.escape(printable(line)) for line in t.splitlines()) or "&nbsp;"

    trs = "\n".join(f'<tr><td>{s.round}</td><td>r{s.rank}</td><td>{_cell(s.reward)}</td>'
                     f'<td class="t">{text(s.prompt)}</td><td class="t">{text(s.completion)}</td></tr>' for s in samples)
    return (f"<h2>Sample completions (last {SAMPLE_ROUNDS} rounds; trainer.log_samples per replica)</h2>\n"
            "<table><tr><th>round</th><th>replica</th><th>reward</th><th>prompt</th><th>completion</th></tr>\n"
            f"{trs}\n</table>")


def _fleet_html(fleet: "RolloutFleet | None") -> str:
    """The rollout worker fleet (``status``'s :class:`~composer_cloud.runs.status.RolloutFleet`, never re-read):
    its summary line, one row per worker, what the trainers did with the batches and the staleness histogram."""
    if fleet is None:
        return ""
    workers = "\n".join(f"<tr><td>{w.rank}</td><td>{_cell(w.state)}</td><td>{w.batches_published}</td>"
                        f"<td>{_cell(w.tokens_per_s)}</td></tr>" for w in fleet.workers)
    parts = [f"<h2>Rollout workers</h2>\n<p>{html.escape(fleet.line())}</p>",
             "<table><tr><th>job rank</th><th>state</th><th>batches published</th><th>tokens/s (sampling)</th></tr>\n"
             f"{workers}\n</table>"]
    use = fleet.use
    if use is not None:
        parts.append("<h3>What the trainers did with the batches (their step rows)</h3>\n<table><tr><th>used</th>"
                     "<th>refused as stale</th><th>sampled themselves</th></tr>\n"
                     f"<tr><td>{use.used}</td><td>{use.stale}</td><td>{use.fallbacks}</td></tr>\n</table>")
        behind = "".join(f"<tr><td>{v}</td><td>{n}</td></tr>" for v, n in use.staleness.items())
        parts.append("<h3>Policy versions behind (steps on a worker's batch)</h3>\n<table><tr><th>versions behind</th>"
                     f"<th>steps</th></tr>\n{behind}\n</table>")
    return "\n".join(parts)


def _html(run: Run, rows: Sequence[RoundRow], png: bytes, *, state: str = "", why: Sequence[str] = (),
          samples: Sequence[Any] = (), fleet: "RolloutFleet | None" = None) -> str:
    table = [r.to_json() for r in rows]
    cols = [c for c in _TABLE if any(c in r for r in table)]
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = "\n".join("<tr>" + "".join(f"<td>{_cell(r.get(c) if c != 'round' else r['round'] + 1)}</td>"
                                      for c in cols) + "</tr>" for r in table)
    title = html.escape(f"composer-cloud run {run.run_id}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}
td.t{{text-align:left;font-family:monospace;white-space:pre-wrap;max-width:40em}}</style></head>
<body><h1>{title}</h1>
<p>{html.escape(run.uri)} &mdash; {html.escape(state)}: {run.spec.replicas} replicas, {run.spec.rounds} rounds x {run.spec.inner_steps} inner steps</p>
{"".join(f'<p style="color:darkred">{html.escape(w)}</p>' for w in why)}
<img alt="loss, reward, eval and sync time per round and replica" src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Rounds (one row per replica)</h2>
<table><tr>{head}</tr>
{body}
</table>
{_fleet_html(fleet)}
{_samples_html(samples)}
</body></html>
"""


__all__ = ["INSTALL_HINT", "LOSS_UNITS", "Report", "ReportUnavailable", "default_out_dir", "replica_labels",
           "write_report"]
