"""Experiment tracking: a run's metrics as TensorBoard event files and trackio runs, offline-first.

``report_to`` follows TRL's convention (``"tensorboard"``, ``"trackio"``, ``"wandb"``, ``"mlflow"``; the last
two in :mod:`composer_cloud.runs.tracking_sinks`). The
replicas do not log to a tracker themselves: a replica on Modal or HF Jobs has no
disk the user can read and no reason to hold tracker credentials. They write
their rows to the store (:mod:`composer_cloud.runs.metrics`), and this module
turns those rows into tracker series on the machine that asks, offline:

* one series per replica: every numeric field of its step rows
  (``train/loss``, ``train/grad_norm``, ``train/pg``, ``train/reward_mean``, ...)
  against the run's global inner step;
* the run's round metrics: per committed round (counted from 1), the mean over
  replicas of ``train_loss``, ``eval_loss``, ``reward_mean``, ``eval_reward_mean``,
  ``sync_s``, ``compute_s`` and the bytes moved (``round/...``);
* each replica's sample completions (:mod:`composer_cloud.runs.samples`, ``trainer.log_samples`` per round) at
  the round's last inner step: a TensorBoard text ``samples`` (a markdown table), a trackio table ``samples``
  (columns ``round``, ``prompt``, ``completion``, ``reward``; TRL's ``log_completions`` layout).

TensorBoard: ``<logdir>/<run_id>/replica-<r>/`` and ``<logdir>/<run_id>/rounds/``
(``tensorboard --logdir <logdir>``); earlier event files of the same run are
replaced, so writing again never doubles a series. trackio: project ``project``
(default ``composer-cloud``), runs ``<run_id>-replica-<r>`` and ``<run_id>-rounds``
grouped by run id, in trackio's local store (``TRACKIO_DIR``; ``trackio show``),
written again from scratch each time. ``launch`` with ``report_to`` set writes
them when the run ends; ``composer-cloud track RUN`` at any time.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_cloud.runs.metrics import read_rows
from composer_cloud.runs.samples import SampleRow, read_samples
from composer_cloud.storage.records.metrics import NOT_SERIES, RoundRow, Row, StepRow
from composer_cloud.storage.run import Run

logger = logging.getLogger(__name__)

REPORT_TO = ("tensorboard", "trackio", "wandb", "mlflow")
#: The extra that installs each tracker's client.
EXTRAS = {"tensorboard": "tracking", "trackio": "tracking", "wandb": "wandb", "mlflow": "mlflow"}
#: Row fields that are coordinates or bookkeeping, not series: the schema's (``NOT_SERIES``), and ``version``
#: (a trainer figure of that name was never plotted).
_NOT_SERIES = NOT_SERIES | {"version"}
#: Round-row fields averaged over replicas into the run's round series.
ROUND_SERIES = ("train_loss", "eval_loss", "reward_mean", "eval_reward_mean", "sync_s", "compute_s")


@dataclass(frozen=True)
class TrackingResult:
    """What :func:`write_tracking` wrote: the trackers, where, and how many points."""

    report_to: list[str]
    replicas: list[int]
    rounds: int
    step_points: int
    tensorboard_dir: str | None = None
    trackio_project: str | None = None
    trackio_runs: list[str] = field(default_factory=list)
    wandb_runs: list[str] = field(default_factory=list)
    mlflow_runs: list[str] = field(default_factory=list)


def _numeric(row: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k not in _NOT_SERIES and isinstance(v, (int, float))
            and not isinstance(v, bool) and v == v}


def replica_series(rows: Sequence[Row]) -> dict[int, list[tuple[int, dict[str, float]]]]:
    """rank -> [(global inner step, {"train/<field>": value})], from the step rows."""
    out: dict[int, list[tuple[int, dict[str, float]]]] = defaultdict(list)
    for r in rows:
        if isinstance(r, StepRow) and r.step is not None:
            out[r.rank].append((r.step, {f"train/{k}": v for k, v in _numeric(r.to_json()).items()}))
    return {rank: sorted(points, key=lambda p: p[0]) for rank, points in sorted(out.items())}


def round_series(rows: Sequence[Row]) -> list[tuple[int, dict[str, float]]]:
    """[(round counted from 1, {"round/<field>": mean over replicas})] over committed rounds (a row that does not
    say counts as committed)."""
    by_round: dict[int, list[RoundRow]] = defaultdict(list)
    for r in rows:
        if isinstance(r, RoundRow) and r.committed is not False:
            by_round[r.round].append(r)
    out = []
    for rnd, group in sorted(by_round.items()):
        point: dict[str, float] = {}
        for key in ROUND_SERIES:
            vals = [float(v) for g in group if isinstance(v := g.get(key), (int, float))]
            if vals:
                point[f"round/{key}"] = sum(vals) / len(vals)
        point["round/store_mb"] = sum(g.bytes_moved for g in group) / 1e6
        point["round/replicas"] = float(len(group))
        out.append((rnd + 1, point))
    return out


#: rank -> [(the run's inner step, that round's samples)]
Samples = dict[int, list[tuple[int, list[SampleRow]]]]


def sample_series(samples: Sequence[SampleRow]) -> Samples:
    """rank -> [(inner step, the samples of the round that ended there)], in step order."""
    out: dict[int, dict[int, list[SampleRow]]] = defaultdict(dict)
    for s in samples:
        out[s.rank].setdefault(s.step, []).append(s)
    return {rank: sorted(steps.items()) for rank, steps in sorted(out.items())}


def _markdown(samples: Sequence[SampleRow]) -> str:
    """The samples as a markdown table (TensorBoard renders it); cells printable, one line, ``|`` escaped."""
    from composer_cloud.runs.samples import one_line

    def cell(t: str) -> str:
        return one_line(t, width=500).replace("|", "\\|")

    lines = ["| round | reward | prompt | completion |", "|---|---|---|---|"]
    lines += [f"| {s.round} | {'-' if s.reward is None else f'{s.reward:.3f}'} | {cell(s.prompt)} | "
              f"{cell(s.completion)} |" for s in samples]
    return "\n".join(lines)


def _tensorboard(root: Path, per_replica: dict[int, list[tuple[int, dict[str, float]]]],
                 rounds: list[tuple[int, dict[str, float]]], samples: Samples | None = None) -> None:
    from torch.utils.tensorboard import SummaryWriter

    if root.exists():
        shutil.rmtree(root)  # this run's earlier snapshot: replaced, never doubled
    series = {f"replica-{rank}": points for rank, points in per_replica.items()} | {"rounds": rounds}
    for name, points in series.items():
        with SummaryWriter(log_dir=str(root / name)) as writer:
            for step, values in points:
                for tag, value in values.items():
                    writer.add_scalar(tag, value, global_step=step)
            rank = int(name.removeprefix("replica-")) if name != "rounds" else None
            for step, group in (samples or {}).get(rank, []) if rank is not None else []:
                writer.add_text("samples", _markdown(group), global_step=step)


def _trackio(project: str, run_id: str, config: dict[str, Any],
             per_replica: dict[int, list[tuple[int, dict[str, float]]]],
             rounds: list[tuple[int, dict[str, float]]], samples: Samples | None = None) -> list[str]:
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    names = []
    with contextlib.redirect_stdout(sys.stderr):  # trackio prints its banner: keep stdout for --json
        _trackio_runs(trackio, SQLiteStorage, project, run_id, config, per_replica, rounds, names, samples or {})
    return names


def _trackio_runs(trackio: Any, storage: Any, project: str, run_id: str, config: dict[str, Any],
                  per_replica: dict[int, list[tuple[int, dict[str, float]]]],
                  rounds: list[tuple[int, dict[str, float]]], names: list[str], samples: Samples) -> None:
    series = {f"{run_id}-replica-{rank}": points for rank, points in per_replica.items()} | {f"{run_id}-rounds": rounds}
    for name, points in series.items():
        if name in storage.get_runs(project):
            storage.delete_run(project, name)  # an earlier snapshot: replaced, never doubled
        trackio.init(project=project, name=name, group=run_id, config=config, auto_log_gpu=False,
                     auto_log_cpu=False, embed=False)
        rank = int(name.rsplit("-", 1)[1]) if name != f"{run_id}-rounds" else None
        texts = dict(samples.get(rank, [])) if rank is not None else {}
        try:
            for step, values in points:
                if step in texts:  # the round's samples, at its last inner step (TRL's completions table)
                    values = {**values, "samples": trackio.Table(
                        columns=["round", "prompt", "completion", "reward"],
                        data=[[s.round, s.prompt, s.completion, s.reward] for s in texts.pop(step)])}
                trackio.log(values, step=step)
        finally:
            trackio.finish()
        names.append(name)


def write_tracking(run: Run, *, report_to: Sequence[str], logdir: str | Path = "tracking",
                   project: str = "composer-cloud", mlflow_tracking_uri: str | None = None) -> TrackingResult:
    """Write the run's metrics to each tracker in ``report_to`` (see the module docstring); raises
    ``ValueError`` naming an unknown tracker and ``ImportError`` with the extra to install.

    ``logdir`` holds TensorBoard's event files and wandb's run files; ``project`` is the trackio and wandb
    project and the MLflow experiment; ``mlflow_tracking_uri``: MLflow's (default: its own, from
    ``MLFLOW_TRACKING_URI``)."""
    unknown = sorted(set(report_to) - set(REPORT_TO))
    if unknown:
        raise ValueError(f"report_to: unknown tracker {unknown[0]!r}; choose from {list(REPORT_TO)}")
    rows = read_rows(run.store)
    per_replica, rounds = replica_series(rows), round_series(rows)
    samples = sample_series(read_samples(run.store))
    spec = run.spec
    config = {"run_id": spec.run_id, "run_uri": run.uri, "replicas": spec.replicas, "rounds": spec.rounds,
              "inner_steps": spec.inner_steps, "trainer": spec.trainer.name, "model": spec.model.name,
              "sync_mode": spec.sync.mode, "codec": spec.sync.codec}
    tb_dir = trackio_runs = None
    series = {f"{spec.run_id}-replica-{rank}": points for rank, points in per_replica.items()} | {
        f"{spec.run_id}-rounds": rounds}
    named_samples = {f"{spec.run_id}-replica-{rank}": dict(steps) for rank, steps in samples.items()}
    sinks: dict[str, list[str]] = {}
    for tracker in dict.fromkeys(report_to):
        try:
            if tracker == "tensorboard":
                tb_dir = Path(logdir) / spec.run_id
                _tensorboard(tb_dir, per_replica, rounds, samples)
            elif tracker == "trackio":
                trackio_runs = _trackio(project, spec.run_id, config, per_replica, rounds, samples)
            elif tracker == "wandb":
                from composer_cloud.runs.tracking_sinks import write_wandb

                Path(logdir).mkdir(parents=True, exist_ok=True)
                sinks[tracker] = write_wandb(project, spec.run_id, config, series, named_samples, logdir=str(logdir))
            else:
                from composer_cloud.runs.tracking_sinks import write_mlflow

                sinks[tracker] = write_mlflow(project, spec.run_id, config, series, named_samples,
                                              tracking_uri=mlflow_tracking_uri)
        except ImportError as exc:
            raise ImportError(f"report_to {tracker!r} needs {exc.name or tracker}: "
                              f'pip install "composer-cloud[{EXTRAS[tracker]}]"') from None
    logger.info("tracking for %s written to %s", spec.run_id, ", ".join(report_to))
    return TrackingResult(report_to=list(dict.fromkeys(report_to)), replicas=sorted(per_replica),
                          rounds=len(rounds), step_points=sum(len(p) for p in per_replica.values()),
                          tensorboard_dir=None if tb_dir is None else str(tb_dir),
                          trackio_project=project if trackio_runs is not None else None,
                          trackio_runs=trackio_runs or [], wandb_runs=sinks.get("wandb", []),
                          mlflow_runs=sinks.get("mlflow", []))


__all__ = ["EXTRAS", "REPORT_TO", "ROUND_SERIES", "TrackingResult", "replica_series", "round_series", "sample_series",
           "write_tracking"]
