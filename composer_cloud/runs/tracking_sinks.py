"""The Weights & Biases and MLflow sinks of ``report_to`` (:mod:`composer_cloud.runs.tracking` owns the series).

Each sink takes the series :mod:`~composer_cloud.runs.tracking` built from the store (one per replica, one for
the rounds, each replica's sample completions) and writes them through the tracker's own client, on the machine
that asks; the replicas never talk to a tracker.

* **wandb** (``pip install "composer-cloud[wandb]"``): one wandb run per series (``<run_id>-replica-<r>``,
  ``<run_id>-rounds``) grouped by the run id, in project ``project``, files under ``<logdir>/``. Where it goes
  is wandb's own choice: ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it later), otherwise
  the logged-in account. wandb keeps every run it was given: writing again adds runs to the group.
* **mlflow** (``pip install "composer-cloud[mlflow]"``): one MLflow run per series (run name as above, tag
  ``composer_cloud.run_id``) in experiment ``project``, at ``tracking_uri`` (default: MLflow's own,
  ``MLFLOW_TRACKING_URI`` or ``./mlruns``). Earlier runs of the same name in the experiment are deleted first,
  so writing again replaces a series, never doubles it. Samples are a table artifact per round
  (``completions/step-<step>.json``).

Neither reads a credential itself: each tracker's client finds its own (``WANDB_API_KEY``, ``MLFLOW_TRACKING_*``),
and nothing here logs one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

Points = list[tuple[int, dict[str, float]]]
#: The sample table's columns (TRL's ``log_completions`` layout).
SAMPLE_COLUMNS = ["round", "prompt", "completion", "reward"]


def _table_rows(samples: Sequence[Any]) -> list[list[Any]]:
    return [[s.round, s.prompt, s.completion, s.reward] for s in samples]


def write_wandb(project: str, run_id: str, config: dict[str, Any], series: Mapping[str, Points],
                samples: Mapping[str, Mapping[int, Sequence[Any]]], *, logdir: str) -> list[str]:
    """One wandb run per series (``name -> [(step, values)]``); ``samples``: ``name -> {step: samples}``.
    Returns the run names written."""
    import wandb

    names = []
    for name, points in series.items():
        run = wandb.init(project=project, name=name, group=run_id, config=config, dir=logdir, reinit="create_new")
        try:
            texts = dict(samples.get(name, {}))
            for step, values in points:
                if step in texts:
                    values = {**values, "samples": wandb.Table(columns=SAMPLE_COLUMNS,
                                                               data=_table_rows(texts.pop(step)))}
                run.log(values, step=step)
        finally:
            run.finish()
        names.append(name)
    return names


def write_mlflow(project: str, run_id: str, config: dict[str, Any], series: Mapping[str, Points],
                 samples: Mapping[str, Mapping[int, Sequence[Any]]], *, tracking_uri: str | None = None) -> list[str]:
    """One MLflow run per series in experiment ``project`` (earlier runs of the same name deleted first).
    Returns the run names written."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(project)
    exp_id = experiment.experiment_id if experiment is not None else client.create_experiment(project)
    params = [Param(k, str(v)) for k, v in config.items()]
    names = []
    for name, points in series.items():
        for old in client.search_runs([exp_id], filter_string=f"tags.mlflow.runName = '{name}'"):
            client.delete_run(old.info.run_id)  # an earlier snapshot: replaced, never doubled
        run = client.create_run(exp_id, run_name=name, tags={"composer_cloud.run_id": run_id})
        rid = run.info.run_id
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for step, values in points for key, value in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit: 1000 metrics per call
            client.log_batch(rid, metrics=metrics[i:i + 1000], params=params if i == 0 else [])
        if not metrics:
            client.log_batch(rid, params=params)
        for step, group in sorted(samples.get(name, {}).items()):
            rows = _table_rows(group)
            client.log_table(rid, data={c: [r[j] for r in rows] for j, c in enumerate(SAMPLE_COLUMNS)},
                             artifact_file=f"completions/step-{step:08d}.json")
        client.set_terminated(rid)
        names.append(name)
    return names


__all__ = ["SAMPLE_COLUMNS", "write_mlflow", "write_wandb"]
