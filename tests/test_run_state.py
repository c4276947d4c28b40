"""``RunState``: the one vocabulary of ``status``, ``ls`` and the API; its JSON is the strings it replaced."""

from __future__ import annotations

import json

from composer_cloud.cli import STATE_EXIT
from composer_cloud.runs import RunState


def test_a_state_writes_and_compares_as_the_string_it_replaced():
    assert json.dumps({"state": RunState.NOT_STARTED}) == '{"state": "not started"}'
    assert RunState("completed") is RunState.COMPLETED and RunState.COMPLETED == "completed"
    assert f"{RunState.RUNNING} — round 1/2" == "running — round 1/2"  # the CLI's titles


def test_every_state_has_an_exit_code_and_only_running_is_not_terminal():
    assert set(STATE_EXIT) == set(RunState)
    assert [s for s in RunState if not s.is_terminal] == [RunState.RUNNING]
    assert {s for s in RunState if STATE_EXIT[s] == 0} == {RunState.RUNNING, RunState.COMPLETED, RunState.NOT_STARTED}
