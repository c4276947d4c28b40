"""Settings that used to be accepted at launch and failed later in the replicas: each is refused by
``launch`` with exit 2, naming the field, and nothing is written."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from composer_cloud.cli import app

runner = CliRunner()

REFUSED = [
    (["inner_optimizer.betas=[2.0, -1.0]"], "inner_optimizer.betas"),
    (["inner_optimizer.betas=[0.9, 1.0]"], "inner_optimizer.betas"),
    (["model.num_attention_heads=3"], "model.num_attention_heads"),  # 256 is not a multiple of 3
    (["model.num_key_value_heads=3"], "model.num_key_value_heads"),  # 4 heads, 3 key/value heads
    (["trainer.seq_len=100000000"], "trainer.seq_len"),
    (["model.hidden_size=4000000", "model.num_attention_heads=4"], "model.hidden_size"),
    (["model.intermediate_size=100000000"], "model.intermediate_size"),
    (['code.ref={"key": "code/x.zip", "sha256": "00"}'], "code.ref"),
    (['code.files={"model.name": "files/x"}'], "code.files"),
    (["trainer.task=os:system"], "trainer.task"),
    (["trainer.reward=subprocess:run"], "trainer.reward"),
    (["trainer.hint_source=builtins:eval"], "trainer.hint_source"),
    (["device=cuda"], "device"),  # this test's machine has no CUDA GPU (made so below)
    (["device=cuda", "executor=hf-jobs", "hf_jobs.flavor=cpu-basic"], "hf_jobs.flavor"),
    # A healer would void the round before its survivors finish it (default heal_timeout_s 600: waits 300 s).
    (["sync.quorum_timeout_s=400"], "sync.quorum_timeout_s"),
    (["sync.quorum_timeout_s=90", "sync.round_timeout_s=60"], "sync.quorum_timeout_s"),
]


@pytest.mark.parametrize("pairs,field", REFUSED, ids=[f for _, f in REFUSED])
def test_launch_refuses_settings_the_replicas_cannot_run_naming_the_field(tmp_path, monkeypatch, pairs, field):
    monkeypatch.chdir(tmp_path)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["launch", "--store", f"file://{tmp_path}/store", "--run-id", "bounded"]
    for pair in pairs:
        args += ["--set", pair]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert field in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "store").exists()  # nothing written


@pytest.mark.parametrize("pairs", [["inner_optimizer.betas=[0.0, 0.999]"], ["model.num_attention_heads=8"],
                                   ["model.num_key_value_heads=4"], ["trainer.seq_len=4096"],
                                   ["trainer.task=my_tasks:make_task"],
                                   ["sync.quorum_timeout_s=400", "sync.heal_timeout_s=800"],
                                   ["sync.quorum_timeout_s=400", "sync.mode=\"decoupled\""]])
def test_settings_inside_the_bounds_are_accepted(tmp_path, monkeypatch, pairs):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_tasks.py").write_text("def make_task(**kw):\n    raise RuntimeError('not called here')\n")
    args = ["launch", "--dry-run", "--store", f"file://{tmp_path}/store", "--run-id", "inside"]
    for pair in pairs:
        args += ["--set", pair]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
