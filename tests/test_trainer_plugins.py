"""The trainer is a plug-in: ``runs/`` asks the registered trainer's settings class what it knows.

The settings that name code are declared once (``TrainerPlugin.CODE_SETTINGS`` / ``names_code``), and both
``launch`` (what it packages) and ``runs/signing`` (what an unvouched spec may not set) use that declaration:
``trainer.hint_source = "column:hint"`` names a dataset column, so launch neither looks for a module
``column`` nor does signing count it as code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_cloud.runs.signing import _names_code
from composer_cloud.spec import RunSpec
from composer_cloud.trainer.plugin import TrainerPlugin
from composer_cloud.trainer.settings import TRAINERS, code_references, declared_settings, settings_class
from support.cli import cli
from support.specs import CAUSAL_LM, SMALL_RUN_TOML

ROWS = [{"question": f"What is {a} plus {b}?", "solution": str(a + b), "hint": f"{a} + {b} = {a + b}"}
        for a in range(6) for b in range(4)]


def hinted_spec(tmp_path: Path) -> Path:
    """A three-channel run on a JSONL dataset that has a ``hint`` column (hint_source left to ``--set``)."""
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    body = SMALL_RUN_TOML.replace(CAUSAL_LM, (
        'name = "three-channel"\ndataset = "qa.jsonl"\nreward = "exact_match"\nnum_generations = 2\n'
        "max_completion_length = 4\neval_examples = 2\n"))
    path = tmp_path / "spec.toml"
    path.write_text("replicas = 1\nrounds = 1\ninner_steps = 1\n" + body +
                    '[trainer.columns]\nprompt = "question"\nanswer = "solution"\n')
    return path


@pytest.mark.parametrize("value, names_code", [("column:hint", False), ("default", False), ("none", False),
                                                ("my_hints:make_hints", True)])
def test_a_hint_source_names_code_only_when_it_is_a_module_reference(value, names_code):
    refs = code_references("three-channel", {"hint_source": value, "task": "python-functions"})
    assert ("trainer.hint_source" in refs) is names_code
    spec = RunSpec.model_validate({"trainer": {"hint_source": value}})
    assert ("trainer.hint_source" in _names_code(spec)) is names_code  # signing asks the same declaration


def test_signing_counts_a_user_trainer_and_its_task_without_importing_them():
    spec = RunSpec.model_validate({"trainer": {"name": "no_such_pkg.mod:Settings", "task": "x:y"}})
    assert _names_code(spec) == ["trainer.name"]  # the class is user code: not imported to ask it anything
    spec = RunSpec.model_validate({"trainer": {"task": "my_tasks:make", "reward": "my_rewards:score"}})
    assert _names_code(spec) == ["trainer.reward", "trainer.task"]


def test_every_registered_trainer_is_a_plugin_and_a_user_trainer_need_not_be():
    for name in TRAINERS:
        assert issubclass(settings_class(name), TrainerPlugin), name
    quiet = declared_settings("no_such_pkg.mod:Settings", {})  # never imported by the client
    assert type(quiet) is TrainerPlugin and quiet.silence_reasons([{"grad_norm": 0.0}]) == []


def test_launch_takes_a_column_hint_source_from_the_command_line(tmp_path):
    """The documented ``hint_source = "column:hint"`` used to be refused as a module that cannot be found."""
    res = cli("launch", "--config", str(hinted_spec(tmp_path)), "--store", f"file://{tmp_path}/store",
              "--run-id", "r", "--set", "trainer.hint_source=column:hint", "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "module 'column'" not in res.stderr
    assert not (tmp_path / "store" / "r").exists()  # a dry run writes nothing


@pytest.mark.slow
def test_a_local_run_with_a_column_hint_source_completes(tmp_path):
    store = f"file://{tmp_path}/store"
    res = cli("launch", "--config", str(hinted_spec(tmp_path)), "--store", store, "--run-id", "r",
              "--set", "trainer.hint_source=column:hint", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    st = cli("status", f"{store}/r", "--json", cwd=tmp_path)
    assert json.loads(st.stdout)["state"] == "completed", st.stdout
