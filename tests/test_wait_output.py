"""Issue 34's newcomer walk: `composer-cloud wait RUN > file` (a pipe, a CI log) left its last line without a
newline (rich's Live, not on a terminal), so the next output ran into the table's last reason line."""

from __future__ import annotations

from typer.testing import CliRunner

import composer_cloud.cli as cli_module
from composer_cloud import cli_watch
from composer_cloud.runs.status import ReplicaInfo, RunStatus


def test_wait_to_a_pipe_ends_its_output_with_a_newline(monkeypatch):
    done = RunStatus(run_id="r", run_uri="file:///x/r", state="completed", rounds=2, rounds_committed=2,
                     replicas=[ReplicaInfo(0, "local", "succeeded", 2, step=4)], last_durable_round=1,
                     warnings=["no training signal in round 2: grad_norm was 0"])
    monkeypatch.setattr(cli_module, "_open", lambda uri, options: object())
    monkeypatch.setattr(cli_watch.runs, "get_status", lambda run: done)
    monkeypatch.setattr(cli_watch.runs, "wait", lambda run, on_update: (on_update(done), done)[1])
    res = CliRunner().invoke(cli_module.app, ["wait", "file:///x/r"])
    assert res.exit_code == 0, res.output
    assert res.output.endswith("grad_norm was 0\n"), repr(res.output[-80:])
