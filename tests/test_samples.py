"""Sample completions per round (issue 34, What to build 5): the trainer keeps a bounded few, the replica writes
them under ``samples/``, and ``logs --samples``, the report and the tracking sinks show them, printable."""

from __future__ import annotations

import json
import math

import pytest

from composer_cloud.errors import BadObject
from composer_cloud.replica.telemetry import Telemetry
from composer_cloud.runs.samples import one_line, read_samples
from composer_cloud.storage import layout
from composer_cloud.storage.records import RoundSamples
from composer_cloud.storage.records.samples import MAX_SAMPLES, MAX_TEXT_CHARS
from composer_cloud.storage.store import Store
from support.trainer import tiny_context

EVIL = "\x1b]52;c;cGF3bmVk\x07\x1b[2Jok\rdone"


def test_the_trainer_keeps_log_samples_of_the_last_generation_and_hands_them_over_once():
    from composer_cloud.trainer.three_channel.adapter import build_three_channel_trainer

    tr = build_three_channel_trainer(tiny_context({"batch_size": 8, "num_generations": 4, "log_samples": 3,
                                                   "max_completion_length": 6, "eval_examples": 0}))
    tr.step()
    got = tr.take_samples()
    assert len(got) == 3 and tr.take_samples() == []
    prompts = {r["prompt"] for r in tr.task.examples("train")}
    for s in got:
        assert s["prompt"] in prompts and isinstance(s["completion"], str)
        assert s["reward"] is None or math.isfinite(s["reward"])
    # Spread over the generation batch: the 8 completions are 2 groups of 4, and both show.
    assert len({s["prompt"] for s in got}) == 2
    off = build_three_channel_trainer(tiny_context({"batch_size": 8, "num_generations": 4, "log_samples": 0,
                                                    "max_completion_length": 6, "eval_examples": 0}))
    off.step()
    assert off.take_samples() == []


def test_log_samples_is_bounded_by_the_setting():
    from composer_cloud.trainer import check_settings

    with pytest.raises(ValueError, match="trainer.log_samples"):
        check_settings("three-channel", {"log_samples": MAX_SAMPLES + 1})
    with pytest.raises(ValueError, match="trainer.log_samples"):
        check_settings("three-channel", {"log_samples": -1})


def _write(store: Store, rank: int, round: int, texts: list[tuple[str, str, float | None]]) -> str:
    tel = Telemetry(store, rank, rounds=4, inner_steps=2, progress_every_s=60)
    key = tel.samples(round, (round + 1) * 2, [{"prompt": p, "completion": c, "reward": r} for p, c, r in texts])
    assert key is not None
    return key


def test_samples_are_written_bounded_redacted_and_read_back_per_round(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    secret_url = "see https://user:hunter2@example.com/x"
    key = _write(store, 0, 0, [("p" * (MAX_TEXT_CHARS + 50), secret_url, 0.5)] * (MAX_SAMPLES + 5))
    assert layout.parse_samples_key(key)[:2] == (0, 0)
    _write(store, 1, 1, [("q", "a", None)])
    rows = read_samples(store)
    assert [(r.rank, r.round) for r in rows][:1] == [(0, 1)] and len(rows) == MAX_SAMPLES + 1
    assert len(rows[0].prompt) == MAX_TEXT_CHARS and "hunter2" not in rows[0].completion
    assert rows[-1].round == 2 and rows[-1].step == 4 and rows[-1].reward is None
    assert [r.round for r in read_samples(store, last_rounds=1)] == [2]


def test_a_resume_supersedes_the_samples_of_the_rounds_it_re_ran(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    for r in range(3):
        _write(store, 0, r, [(f"p{r}", "launch0", 0.0)])
    store.put_json(layout.resume_key(0), {"from_round": 0})
    Telemetry(store, 0, rounds=4, inner_steps=2, progress_every_s=60)  # launch 1's writer
    tel = Telemetry(store, 0, rounds=4, inner_steps=2, progress_every_s=60)
    tel.samples(1, 4, [{"prompt": "p1", "completion": "launch1", "reward": 1.0}])
    assert [(r.round, r.completion) for r in read_samples(store)] == [(1, "launch0"), (2, "launch1")]


def test_bad_sample_records_are_refused_by_name():
    key = layout.samples_key(0, 3, layout.new_writer_id(0))
    good = {"rank": 0, "round": 3, "step": 8, "samples": [{"prompt": "p", "completion": "c", "reward": 1}]}
    assert RoundSamples.from_json(good, key=key, rank=0, round=3).samples[0].reward == 1.0
    for bad, field in [({**good, "round": 2}, "round"),
                       ({**good, "samples": [{"prompt": "p", "completion": 3, "reward": 1}]}, "completion"),
                       ({**good, "samples": [{"prompt": "p", "completion": "c", "reward": "x"}]}, "reward"),
                       ({**good, "samples": [good["samples"][0]] * (MAX_SAMPLES + 1)}, "samples"),
                       ({**good, "samples": [{"prompt": "x" * (MAX_TEXT_CHARS + 1), "completion": "", "reward": 0}]},
                        "prompt")]:
        with pytest.raises(BadObject, match=field):
            RoundSamples.from_json(bad, key=key, rank=0, round=3)


def test_one_line_strips_terminal_escapes():
    out = one_line(EVIL + "\nline two")
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "\n" not in out
    assert out.endswith("okdone ⏎ line two")


def test_logs_samples_report_and_tracking_show_them_printable(tmp_path):
    from typer.testing import CliRunner

    from composer_cloud.cli import app
    from composer_cloud.runs.report import _samples_html
    from composer_cloud.runs.samples import SampleRow
    from composer_cloud.runs.tracking import _markdown, sample_series
    from composer_cloud.spec import RunSpec

    store = Store(f"file://{tmp_path}/store/s")
    assert store.create_json(layout.SPEC, RunSpec(run_id="s", signed=False).to_json_dict())
    runner = CliRunner()
    empty = runner.invoke(app, ["logs", store.uri, "--samples"])
    assert empty.exit_code == 1 and "trainer.log_samples" in empty.output
    _write(store, 0, 0, [("What is 2+2?", EVIL, 0.25)])
    res = runner.invoke(app, ["logs", store.uri, "--samples"])
    assert res.exit_code == 0, res.output
    assert "[r0] round 1 step 2 reward 0.250" in res.output and "What is 2+2?" in res.output
    assert "\x1b" not in res.output and "\x07" not in res.output and "\r" not in res.output
    line = runner.invoke(app, ["logs", store.uri, "--samples", "--json"]).output.splitlines()[0]
    assert json.loads(line)["completion"] == EVIL  # --json: the stored text, JSON-escaped
    samples = read_samples(store)
    page = _samples_html(samples)
    assert "What is 2+2?" in page and "\x1b" not in page and "Sample completions" in page
    assert "<script>" not in _samples_html([SampleRow(0, 1, 2, "<script>", "c", None)])
    md = _markdown(sample_series(samples)[0][0][1])
    assert "| 1 | 0.250 | What is 2+2? |" in md and "\x1b" not in md
