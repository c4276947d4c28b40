"""Issue 34, finding 3 (decoupled): a decoupled run is shown as contributions and merges against the fleet's
budget, never in rounds. The launch summary's header said "first round → last round" and the other displays
(the dry run's last line, `resume`, `export`, the model card, the no-signal warning) counted rounds too."""

from __future__ import annotations

import io

from rich.console import Console

from composer_cloud import cli_views
from composer_cloud.runs.export import card_progress_row
from composer_cloud.runs.signal import diagnose_rounds
from composer_cloud.runs.status import ReplicaInfo, RunStatus
from composer_cloud.spec import RunSpec
from composer_cloud.storage.records.metrics import parse_row
from composer_cloud.storage.run import Run
from composer_cloud.storage.store import Store


def _spec(mode: str) -> RunSpec:
    return RunSpec.model_validate({"run_id": "d", "replicas": 2, "rounds": 3, "inner_steps": 10,
                                   "sync": {"mode": mode}})


def _summary(tmp_path, mode: str) -> str:
    spec = _spec(mode)
    st = RunStatus(run_id="d", run_uri=f"file://{tmp_path}/d", state="completed", rounds=3, rounds_committed=7,
                   replicas=[ReplicaInfo(0, "local", "succeeded", 3, step=30),
                             ReplicaInfo(1, "local", "succeeded", 3, step=30)],
                   last_durable_round=6, sync_mode=mode)
    out = io.StringIO()
    console = Console(file=out, width=120)
    cli_views.print_summary(console, console, Run(uri=st.run_uri, store=Store(st.run_uri), spec=spec), st)
    return out.getvalue()


def test_the_launch_summary_of_a_decoupled_run_counts_contributions_and_merges(tmp_path):
    text = _summary(tmp_path, "decoupled")
    table = text.split("run URI:")[0]
    assert "round" not in table, table
    assert "first contribution → last" in table and "contributions 6/6, 7 merges" in table, table
    lockstep = _summary(tmp_path, "lockstep")
    assert "first round → last round" in lockstep and "rounds committed" in lockstep  # lock-step unchanged


def test_the_dry_runs_work_line_resume_and_export_name_no_round_for_a_decoupled_run():
    dec, lock = _spec("decoupled"), _spec("lockstep")
    out = io.StringIO()
    cli_views.print_plan(Console(file=out, width=200), dec, [])
    assert "a budget of 6 contributions (2 replicas x 3) of 10 inner steps each" in out.getvalue(), out.getvalue()
    assert "round" not in out.getvalue()
    assert cli_views.work_budget(lock) == "3 rounds x 10 inner steps"
    assert cli_views.resume_point(dec, 7) == "global version 7" and cli_views.resume_point(dec, -1) == "the start"
    assert cli_views.resume_point(lock, 1) == "the end of round 2/3"
    assert cli_views.resume_point_json(dec, 7) == {"from_version": 7}
    assert cli_views.resume_point_json(lock, 1) == {"after_round": 2}
    assert cli_views.resume_point_json(lock, -1) == {"after_round": None}
    assert cli_views.exported_point(dec, 7) == "global version 7"
    assert cli_views.exported_point(lock, 2) == "after round 3/3"
    row = card_progress_row(dec, 7)
    assert "round" not in row and "global version 7" in row and "6 contributions" in row, row
    row = card_progress_row(lock, 1)
    assert row.startswith("| rounds | 2 of 3"), row


def test_the_no_signal_warning_of_a_decoupled_run_names_contributions():
    rows = [{"kind": "step", "round": r, "rank": 0, "grad_norm": 0.0} for r in (0, 1)]
    rows.append({"kind": "step", "round": 2, "rank": 0, "grad_norm": 1.0})
    rows = [parse_row(r, key="test") for r in rows]  # as the reader parses them
    (msg,) = diagnose_rounds(rows, decoupled=True)
    assert msg.startswith("no training signal in contributions 1, 2:"), msg
    (msg,) = diagnose_rounds(rows)
    assert msg.startswith("no training signal in rounds 1, 2:"), msg
    (msg,) = diagnose_rounds(rows[1:])  # the walk's "no training signal in rounds 2"
    assert msg.startswith("no training signal in round 2:"), msg
