"""A user's own task module, hint source and prompt file travel with the run (issue 12): launched from
an unrelated directory, the replicas import them from the run's store, not from any working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SMALL_RUN_TOML

TASK = '''
"""A user task: answer "yes"; prompts come from a file next to this module."""
import json
from pathlib import Path

PROMPTS = Path(__file__).with_name("prompts.jsonl")


class YesTask:
    name = "say-yes"

    def examples(self, split):
        rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
        return rows if split == "train" else rows[:2]

    def reward(self, completions, rows):
        return [1.0 if "yes" in c.lower() else 0.0 for c in completions]

    def default_hints(self):
        return None


class Hints:
    def hints(self, rows):
        return ["say yes" for _ in rows]


def make_task(**options):
    return YesTask()


def make_hints():
    return Hints()
'''


@pytest.mark.slow
def test_user_task_from_an_unrelated_directory_runs_on_the_local_executor(tmp_path):
    user = tmp_path / "project"
    user.mkdir()
    (user / "my_tasks.py").write_text(TASK)
    (user / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Question {i}: yes or no?"}) + "\n"
                                                for i in range(16)))
    spec = SMALL_RUN_TOML.replace('name = "causal-lm"', 'name = "three-channel"\ntask = "my_tasks:make_task"\n'
                                  'hint_source = "my_tasks:make_hints"\npairs = "none"')
    (user / "spec.toml").write_text('replicas = 2\nrounds = 1\ninner_steps = 2\n[code]\ninclude = ["prompts.jsonl"]\n'
                                    + spec)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" or "project" not in v}
    res = subprocess.run([sys.executable, "-m", "composer_cloud.cli", "launch", "--config", str(user / "spec.toml"),
                          "--store", f"file://{tmp_path}/store", "--run-id", "mine"], cwd=elsewhere,
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    spec_json = json.loads((tmp_path / "store/mine/spec.json").read_bytes()[16:])
    assert spec_json["code"]["ref"]["modules"] == ["my_tasks"]
    log = (tmp_path / "store/mine/jobs/0/replica.log").read_text()
    assert "user code ['my_tasks'] installed" in log, log[-2000:]
