"""`report_to` wandb and mlflow (issue 34, What to build 5), offline: wandb in offline mode under a tmp dir, MLflow
at a file:// tracking URI in tmp; each read back (skipped where the extra is not installed)."""

from __future__ import annotations

import time

import pytest

from composer_cloud.replica.telemetry import MetricsLog, Telemetry
from composer_cloud.runs.tracking import write_tracking
from composer_cloud.spec import RunSpec
from composer_cloud.storage.run import Run
from composer_cloud.storage.store import Store
from support.metrics import log_round, log_step


def _run(tmp_path) -> Run:
    store = Store(f"file://{tmp_path}/store/t")
    for rank in (0, 1):
        log = MetricsLog(store, rank, launch=0)
        for r in range(2):
            for i in range(2):
                log_step(log, r, 2 * r + i + 1, loss=1.0 + rank - 0.1 * (2 * r + i))
            log_round(log, r, committed=True, train_loss=1.0 - 0.1 * r, sync_s=0.5)
        Telemetry(store, rank, rounds=2, inner_steps=2, progress_every_s=60).samples(
            1, 4, [{"prompt": "p", "completion": f"answer of r{rank}", "reward": 0.5}])
    return Run(uri=store.uri, store=store, spec=RunSpec(run_id="t", rounds=2, report_to=["wandb", "mlflow"]))


def test_mlflow_gets_every_series_and_the_samples_and_writing_again_replaces_them(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    from mlflow import MlflowClient

    run, uri = _run(tmp_path), f"file://{tmp_path}/mlruns"
    for _ in range(2):
        res = write_tracking(run, report_to=["mlflow"], project="cc-test", mlflow_tracking_uri=uri)
    assert res.mlflow_runs == ["t-replica-0", "t-replica-1", "t-rounds"]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("cc-test")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == res.mlflow_runs  # twice written, once there
    by_name = {r.info.run_name: r for r in runs}
    history = client.get_metric_history(by_name["t-replica-1"].info.run_id, "train/loss")
    assert [(m.step, round(m.value, 6)) for m in sorted(history, key=lambda m: m.step)] == [
        (1, 2.0), (2, 1.9), (3, 1.8), (4, 1.7)]
    rounds = client.get_metric_history(by_name["t-rounds"].info.run_id, "round/train_loss")
    assert sorted((m.step, round(m.value, 6)) for m in rounds) == [(1, 1.0), (2, 0.9)]
    assert by_name["t-rounds"].data.params["run_id"] == "t"
    art = [f.path for f in client.list_artifacts(by_name["t-replica-1"].info.run_id, "completions")]
    assert art == ["completions/step-00000004.json"]
    table = (tmp_path / "mlruns").rglob("step-00000004.json")
    assert any("answer of r1" in p.read_text() for p in table)


def test_wandb_offline_writes_one_run_per_series_with_the_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = _run(tmp_path)
    res = write_tracking(run, report_to=["wandb"], logdir=tmp_path / "tracking", project="cc-test")
    assert res.wandb_runs == ["t-replica-0", "t-replica-1", "t-rounds"]
    offline = sorted((tmp_path / "tracking" / "wandb").glob("offline-run-*"))
    assert len(offline) == 3

    def logged() -> list[bytes]:  # wandb's own transaction logs (its service may still be flushing the last one)
        return [b"".join(p.read_bytes() for p in d.glob("*.wandb")) for d in offline]

    for _ in range(120):  # at most ~60 s: a hang guard, not a timing assertion
        if sum(b"round/train_loss" in b for b in logged()) == 1:
            break
        time.sleep(0.5)
    assert sum(b"round/train_loss" in b for b in logged()) == 1
    assert sum(b"train/loss" in b for b in logged()) == 2
    tables = [p.read_text() for d in offline for p in d.rglob("samples_*.table.json")]
    assert sorted(t.count("answer of r") for t in tables) == [1, 1]  # each replica's table of the round's samples


def test_a_missing_tracker_client_names_its_extra(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_wandb(name, *a, **kw):
        if name == "wandb":
            raise ImportError("no wandb", name="wandb")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match=r'composer-cloud\[wandb\]'):
        write_tracking(_run(tmp_path), report_to=["wandb"], logdir=tmp_path)
