"""The diagnosis short of grad_norm = 0 (issue 34, What to build 5): truncation rate, zero-variance groups and mean
completion length, reported by the trainer on every step and shown, first → last round, in the run summary."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

from rich.console import Console

from composer_cloud.replica.telemetry import MetricsLog
from composer_cloud.runs.summary import summarize
from composer_cloud.trainer.three_channel.settings import ThreeChannelSettings
from composer_cloud.trainer.three_channel.signal import DIAGNOSIS
from composer_cloud.spec import RunSpec
from composer_cloud.storage.run import Run
from composer_cloud.storage.store import Store
from support.metrics import log_round, log_step
from support.trainer import tiny_context


def test_the_trainer_reports_the_diagnosis_on_every_step_consistently():
    from composer_cloud.trainer.three_channel.adapter import build_three_channel_trainer

    tr = build_three_channel_trainer(tiny_context({"batch_size": 4, "num_generations": 2, "log_samples": 0,
                                                   "max_completion_length": 5, "eval_examples": 0}))
    for out in (tr.step(), tr.step()):
        assert set(DIAGNOSIS) <= set(out), out
        assert 0.0 <= out["clipped_ratio"] <= 1.0 and 0.0 <= out["frac_reward_zero_std"] <= 1.0
        assert 1.0 <= out["completion_length"] <= 5.0
        if out["clipped_ratio"] == 1.0:  # every completion hit the limit: their mean length is the limit
            assert out["completion_length"] == 5.0


def _run(tmp_path, rounds: list[dict[str, float]]) -> Run:
    store = Store(f"file://{tmp_path}/run")
    for rank in (0, 1):
        log = MetricsLog(store, rank, launch=0)
        for r, fields in enumerate(rounds):
            for i in range(2):
                log_step(log, r, 2 * r + i + 1, loss=1.0, grad_norm=0.5, pg=0.1, sdpo=0.1, dpo=0.1,
                         **{k: v + 0.1 * rank for k, v in fields.items()})
            log_round(log, r, committed=True, train_loss=1.0)
    return Run(uri=store.uri, store=store, spec=RunSpec(run_id="d", rounds=len(rounds)))


def test_the_summary_shows_first_and_last_round_and_says_what_to_change(tmp_path):
    run = _run(tmp_path, [{"clipped_ratio": 0.2, "frac_reward_zero_std": 0.3, "completion_length": 10.0},
                          {"clipped_ratio": 0.7, "frac_reward_zero_std": 0.8, "completion_length": 30.0}])
    status = SimpleNamespace(rounds_committed=2, replicas=[], state="completed")
    s = summarize(run, status)
    # Means over both replicas (rank 1 reports +0.1) of the first and of the last committed round.
    assert abs(s.diagnosis["clipped_ratio"][0] - 0.25) < 1e-9 and abs(s.diagnosis["clipped_ratio"][1] - 0.75) < 1e-9
    assert abs(s.diagnosis["completion_length"][1] - 30.05) < 1e-9
    assert s.warnings == []  # gradients flowed: no "no training signal" warning, yet the diagnosis speaks
    assert any("85% of GRPO groups had equal rewards" in n for n in s.notes), s.notes
    assert any("75% of completions hit trainer.max_completion_length" in n for n in s.notes), s.notes
    from composer_cloud import cli_views

    out = io.StringIO()
    cli_views.print_summary(Console(file=out, width=200), Console(file=io.StringIO()), run, status)
    assert re.search(r"truncation rate \(completions that hit max_completion_length\) +│ 0\.25 → 0\.75", out.getvalue())
    assert "mean completion length (tokens)" in out.getvalue()


def test_no_note_for_a_healthy_round_and_none_for_a_trainer_without_the_fields(tmp_path):
    settings = ThreeChannelSettings.from_settings({})
    assert settings.diagnosis_notes({"frac_reward_zero_std": (0.9, 0.2), "clipped_ratio": (0.9, 0.1)}) == []
    run = _run(tmp_path, [{}])
    assert summarize(run, SimpleNamespace(rounds_committed=1, replicas=[], state="completed")).diagnosis == {}
