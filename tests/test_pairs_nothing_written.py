"""Issue 34, finding 6: `composer-cloud pairs` with no teacher answering wrote an empty `pairs.jsonl` (which a
launch could only refuse later). When no pair comes out it now writes nothing, names the cause and what to
change, and exits 1; the report (table, --json, --report) still says what was asked and spent."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from composer_cloud.cli import app
from composer_cloud.trainer.three_channel.teachers import NoPairsError, TeacherConfig, make_teacher_pairs
from composer_cloud.trainer.three_channel.replay import TraceStep

sys.path.insert(0, str(Path(__file__).parent))
from openai_server import OpenAIServer  # noqa: E402

TRACE = [TraceStep("def add(a, b):", "return a - b", {"step": 0}), TraceStep("def neg(a):", "return a", {"step": 1})]


def _closed_port_url() -> str:
    """A loopback URL nothing listens on: every request is refused at once (never sent, never billed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_no_teacher_answering_writes_nothing_and_exits_1_naming_each_teachers_error(tmp_path):
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps({"prompt": s.prompt, "student_action": s.student_action})
                                                  + "\n" for s in TRACE))
    url = _closed_port_url()
    (tmp_path / "teachers.toml").write_text(
        "".join(f'[[teacher]]\nname = "{n}"\nbase_url = "{url}"\nmodel = "m"\nmax_retries = 0\n' for n in "ab"))
    out, report = tmp_path / "pairs.jsonl", tmp_path / "report.json"
    args = [str(tmp_path / "trace.jsonl"), "--teachers", str(tmp_path / "teachers.toml"), "--out", str(out),
            "--max-cost", "1", "--report", str(report)]
    res = CliRunner().invoke(app, ["pairs", *args], env={"COLUMNS": "200"})
    assert res.exit_code == 1, res.output
    assert not out.exists()  # before: an empty pairs.jsonl
    assert f"nothing was written to --out {out}" in res.output and "no teacher answered any of the 2 states" \
        in res.output and "a: APIConnectionError" in res.output and "b: APIConnectionError" in res.output, res.output
    assert json.loads(report.read_text())["pairs_written"] == 0  # what was asked is still reported


def test_a_ceiling_below_one_request_is_named_with_the_cheapest_requests_cost(tmp_path):
    pricey = TeacherConfig(name="pricey", base_url=_closed_port_url(), model="m", input_price=1000.0,
                           output_price=1000.0, max_tokens=8)
    with pytest.raises(NoPairsError, match=r"--max-cost 0.01 USD is below the worst case of any one request "
                                           r"\(the cheapest: \d+\.\d{4} USD, teacher 'pricey'\)") as err:
        make_teacher_pairs(TRACE, [pricey], out=str(tmp_path / "p.jsonl"), max_cost_usd=0.01)
    assert not (tmp_path / "p.jsonl").exists() and err.value.report.budget_exhausted
    assert err.value.report.teachers["pricey"].asked == 0


def test_teachers_that_agree_with_the_student_everywhere_make_no_file_and_say_so(tmp_path):
    out = tmp_path / "p.jsonl"
    out.write_text('{"prompt": "kept", "chosen": "a", "rejected": "b"}\n')  # an earlier file is left as it is
    before = out.read_text()
    same = [TraceStep("p1", "x = 1"), TraceStep("p2", "x = 1")]
    with OpenAIServer({"echo": lambda prompt, max_tokens: ("x = 1", 3, 3)}) as server:
        teachers = [TeacherConfig(name=n, base_url=server.url, model="echo") for n in ("a", "b")]
        with pytest.raises(NoPairsError) as err:
            make_teacher_pairs(same, teachers, out=str(out), max_cost_usd=1.0)
    msg = str(err.value)
    assert "the teachers answered, but no state gave a pair (outcomes: student_agrees 2)" in msg, msg
    assert "the student's action was already theirs" in msg and out.read_text() == before
