"""Issue 34, item 6: the plan `launch --dry-run` prints shows the trainer side, resolved as the replicas will
resolve it: the trainer, its loss channels and their inputs, the rollout mode on the replicas' device,
generations per prompt, batch sizes, inner steps per round, precision and LoRA. Before, it showed only the
executors' image, command and price, and one line of rounds x inner steps."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from composer_cloud.cli import app
from composer_cloud.runs.training_plan import training_plan
from composer_cloud.spec import RunSpec
from composer_cloud.trainer.plugin import TrainerPlugin


def _dry(tmp_path, monkeypatch, *args: str):
    monkeypatch.chdir(tmp_path)
    return CliRunner().invoke(app, ["launch", "--dry-run", "--store", f"file://{tmp_path}/store", "--run-id", "p",
                                    *args], env={"COLUMNS": "200"})


def test_the_dry_run_prints_the_three_channel_trainers_plan(tmp_path, monkeypatch):
    args = ("--trainer", "three-channel", "--set", "device=cpu", "--inner-steps", "7",
            "--set", "trainer.num_generations=2", "--set", "trainer.batch_size=6", "--set", "trainer.dpo_weight=0",
            "--set", "model.lora.r=8", "--set", "model.precision=bf16")
    res = _dry(tmp_path, monkeypatch, *args)
    assert res.exit_code == 0, res.output
    assert "training plan" in res.output and "three-channel" in res.output  # printed, as a table
    # The rows' values (the table wraps them at the terminal's width: read them from --json).
    res = _dry(tmp_path, monkeypatch, *args, "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["training"]
    out = " | ".join(f"{k}: {v}" for k, v in plan.items())
    assert plan["rollout"] == "hf (rollout = 'auto' on cpu)"  # "auto" resolved for the device the replicas get
    assert "2 (temperature 1)" in out and "6 completions per micro-batch" in out and "3 prompts x 2" in out
    assert "off (dpo_weight = 0)" in out and "hints: default" in out and "task python-functions" in out
    assert "7 per round" in out and "bf16" in out and "r 8, alpha 32" in out, out


def test_the_dry_runs_json_carries_the_training_plan(tmp_path, monkeypatch):
    res = _dry(tmp_path, monkeypatch, "--trainer", "causal-lm", "--json", "--set", "trainer.batch_size=4")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["training"]
    assert plan["trainer"] == "causal-lm" and plan["batch"].startswith("4 rows x 64 tokens")
    assert plan["LoRA"].startswith("off") and plan["precision"].startswith("fp32")
    assert not (tmp_path / "store").exists()  # still a dry run


def test_the_rollout_is_resolved_per_device_when_executors_differ():
    spec = RunSpec.model_validate({"trainer": {"name": "three-channel"}})
    rows = dict(training_plan(spec, {"modal": "cuda", "local": "cpu"}))
    assert rows["rollout"] == ("hf-fast (rollout = 'auto' on cuda) (modal); hf (rollout = 'auto' on cpu) (local)")
    assert rows["device"] == "cuda (modal), cpu (local)"
    one = dict(training_plan(spec, {"local": "cuda"}))
    assert one["rollout"] == "hf-fast (rollout = 'auto' on cuda)"


def test_a_decoupled_plan_counts_its_budget_and_a_trainer_that_declares_nothing_still_gets_the_spec_rows():
    spec = RunSpec.model_validate({"replicas": 2, "rounds": 3, "inner_steps": 5, "sync": {"mode": "decoupled"},
                                   "trainer": {"name": "causal-lm"}})
    rows = dict(training_plan(spec, {"local": "cpu"}))
    assert rows["inner steps"].startswith("5 per contribution; the fleet's budget: 6 contributions")
    assert TrainerPlugin().training_plan("cuda") == []  # a user trainer need not declare a plan


def test_rollout_workers_are_planned_as_workers_with_their_own_row(tmp_path, monkeypatch):
    """Issue 36, item 5: the dry run names the worker fleet apart from the trainer replicas (before: a second,
    unlabelled table of the same executor, and no word of the workers in the training plan)."""
    res = _dry(tmp_path, monkeypatch, "--replicas", "2", "--set", "rollouts.workers=3", "--set",
               "rollouts.max_staleness=0", "--set", "rollouts.on_deadline=wait")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "local: ranks [0, 1] (trainer replicas)" in out and "local: ranks [2, 3, 4] (rollout workers)" in out, out
    res = _dry(tmp_path, monkeypatch, "--replicas", "2", "--set", "rollouts.workers=3", "--set",
               "rollouts.max_staleness=0", "--set", "rollouts.on_deadline=wait", "--json")
    row = json.loads(res.stdout)["training"]["rollout workers"]
    assert "3 on local (job ranks 2..4)" in row and "global model of round t - 0" in row and "keeps waiting" in row
    plain = _dry(tmp_path, monkeypatch, "--replicas", "2", "--run-id", "q")
    assert plain.exit_code == 0 and "rollout workers" not in plain.output and "(trainer replicas)" not in plain.output
