"""``composer-cloud pairs``: teachers behind a local OpenAI-compatible server (tiny transformers models, loopback
only), including a teacher that times out and one that answers garbage; then a three-channel run on the pairs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_cloud.model import TinyModelConfig, load_model
from composer_cloud.trainer import TrainerContext, build_trainer
from composer_cloud.trainer.three_channel.replay import Pair, PairFilters, TraceStep, load_pairs, normalize_pairs
from composer_cloud.trainer.three_channel.tasks import PythonFunctionsTask
from composer_cloud.trainer.three_channel.teachers import (
    TeacherConfig,
    TeachersError,
    load_teachers,
    make_teacher_pairs,
)

sys.path.insert(0, str(Path(__file__).parent))
from openai_server import Garbage, GreedyModel, OpenAIServer, Slow  # noqa: E402

torch.set_num_threads(1)
SMALL = TinyModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64)
SECRET = "sk-test-d0n7-l3ak-m3"


@pytest.fixture(scope="module")
def server():
    model, tok = load_model("tiny", seed=0, tiny=SMALL)
    greedy = GreedyModel(model, tok)
    with OpenAIServer({"tiny-a": greedy, "tiny-b": greedy, "slow": Slow(3.0), "junk": Garbage()},
                      keys={"tiny-a": SECRET}) as s:
        yield s


def _trace(path: Path) -> list[dict]:
    rows = PythonFunctionsTask(n_train=6, n_eval=1, seed=0).examples("train")
    states = [{"prompt": r["prompt"], "student_action": " None\n", "meta": {"trace_id": "t", "step": i}}
              for i, r in enumerate(rows)]
    states.append(dict(states[0], meta={"trace_id": "t", "step": 99}))  # the same state again: a duplicate pair
    path.write_text("".join(json.dumps(s) + "\n" for s in states))
    return states


def _teachers_toml(path: Path, url: str, **prices: float) -> Path:
    a, b = prices.get("a", 1.0), prices.get("b", 2.0)
    path.write_text(f"""
[[teacher]]
name = "a"
base_url = "{url}"
model = "tiny-a"
api_key_env = "TEACHER_A_KEY"
input_price = {a}
output_price = {2 * a}
max_tokens = 8

[[teacher]]
name = "b"
base_url = "{url}"
model = "tiny-b"
api = "completions"
input_price = {b}
output_price = {b}
max_tokens = 8

[[teacher]]
name = "short"          # the same model, cut at 4 tokens: it disagrees with a and b
base_url = "{url}"
model = "tiny-b"
max_tokens = 4

[[teacher]]
name = "hung"
base_url = "{url}"
model = "slow"
timeout_s = 0.3
max_retries = 0
max_consecutive_failures = 2

[[teacher]]
name = "broken"
base_url = "{url}"
model = "junk"
max_retries = 0
""")
    return path


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "composer_cloud.cli", "pairs", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_pairs_from_teachers_then_a_three_channel_run_trains_on_them(server, tmp_path):
    states = _trace(tmp_path / "trace.jsonl")
    teachers = _teachers_toml(tmp_path / "teachers.toml", server.url)
    out, report_path = tmp_path / "pairs.jsonl", tmp_path / "report.json"
    env = dict(os.environ, TEACHER_A_KEY=SECRET, OMP_NUM_THREADS="1")
    res = _cli(str(tmp_path / "trace.jsonl"), "--teachers", str(teachers), "--out", str(out), "--max-cost", "1",
               "--threshold", "0.4", "--concurrency", "2", "--report", str(report_path), "--json", env=env)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report == json.loads(report_path.read_text())

    # a and b agree (2 of 5 >= 0.4), the short teacher disagrees, the failing ones abstain but count
    pairs = load_pairs(str(out))
    assert report["states"] == len(states) and report["pairs_written"] == len(pairs) == len(states) - 1
    assert report["outcomes"] == {"pair": len(states)} and report["dropped"] == {"duplicate": 1}
    assert report["agreement_mean"] == pytest.approx(0.4)
    for p, s in zip(pairs, states):
        assert p.prompt == s["prompt"] and p.rejected == " None\n" and p.chosen.strip()
        assert p.meta["teachers"] == ["a", "b"] and p.meta["n_teachers"] == 5 and p.meta["step"] == s["meta"]["step"]

    # a failing teacher costs its answers, not the command
    t = report["teachers"]
    assert t["a"]["answered"] == t["b"]["answered"] == t["short"]["answered"] == len(states)
    assert t["hung"]["answered"] == 0 and t["hung"]["down"] and t["hung"]["failures"]["APITimeoutError"] >= 2
    assert t["hung"]["skipped_down"] >= 1  # not asked again once down
    assert t["broken"]["answered"] == 0 and sum(t["broken"]["failures"].values()) >= 1

    # cost from the endpoint's reported usage at each teacher's prices (USD per million tokens)
    served_a = server.served["tiny-a"]
    want_a = sum(n_in * 1.0 + n_out * 2.0 for n_in, n_out in served_a) / 1e6
    assert t["a"]["cost_usd"] == pytest.approx(want_a) and t["a"]["input_tokens"] == sum(n for n, _ in served_a)
    assert report["cost_usd"] == pytest.approx(sum(x["cost_usd"] for x in t.values())) and report["cost_usd"] > 0
    assert not report["budget_exhausted"]

    # the key reached the endpoint and nothing else
    assert f"Bearer {SECRET}" in server.authorizations
    for text in (res.stdout, res.stderr, report_path.read_text(), out.read_text()):
        assert SECRET not in text

    # a three-channel run replays the pairs: channel 3 trains on them
    model, tok = load_model("tiny", seed=0, tiny=SMALL)
    ctx = TrainerContext(model=model, tokenizer=tok, rank=0, world_size=1, seed=0, device=torch.device("cpu"),
                         settings={"batch_size": 4, "num_generations": 2, "max_completion_length": 8,
                                   "sdpo_weight": 0.0, "dpo_weight": 1.0, "pairs": str(out), "replay_batch_size": 2,
                                   "eval_examples": 2},
                         inner_optimizer={"lr": 1e-2})
    tr = build_trainer("three-channel", ctx)
    assert len(tr.grpo.replay) == len(pairs)
    first, second = tr.step(), tr.step()
    assert first["dpo"] > 0 and second["dpo"] > 0 and first["dpo_margin"] != second["dpo_margin"]


def test_the_dollar_ceiling_is_never_exceeded(server, tmp_path):
    _trace(tmp_path / "trace.jsonl")
    from composer_cloud.trainer.three_channel.teachers import load_trace

    # $0.001 per prompt byte: a request's worst case is ~0.1-0.3 USD, so a 0.5 USD ceiling fits only a few
    teacher = TeacherConfig(name="pricey", base_url=server.url, model="tiny-b", input_price=1000.0,
                            output_price=1000.0, max_tokens=8)
    report = make_teacher_pairs(load_trace(str(tmp_path / "trace.jsonl")), [teacher], out=str(tmp_path / "p.jsonl"),
                                max_cost_usd=0.5, threshold=1.0, concurrency=3)
    s = report.teachers["pricey"]
    assert report.budget_exhausted and s.skipped_budget > 0 and s.answered >= 1
    assert report.cost_usd <= 0.5 and report.cost_usd == pytest.approx(s.cost_usd)
    assert s.asked + s.skipped_budget == report.states


def test_a_missing_key_or_a_bad_teachers_file_is_a_clear_error(server, tmp_path, monkeypatch):
    """Refusals before any request, run in this process (``composer-cloud pairs`` imports the trainer's stack)."""
    from support.cli import cli_here

    def pairs(*args: str, key: str | None) -> Any:
        if key is None:
            monkeypatch.delenv("TEACHER_A_KEY", raising=False)
        else:
            monkeypatch.setenv("TEACHER_A_KEY", key)
        return cli_here("pairs", *args, cwd=tmp_path)

    monkeypatch.setenv("COLUMNS", "200")  # the messages unwrapped
    _trace(tmp_path / "trace.jsonl")
    teachers = _teachers_toml(tmp_path / "teachers.toml", server.url)
    res = pairs(str(tmp_path / "trace.jsonl"), "--teachers", str(teachers), "--out", str(tmp_path / "p.jsonl"),
                "--max-cost", "1", key=None)
    assert res.exit_code == 2 and "teacher 'a': environment variable TEACHER_A_KEY" in res.stderr, res.output
    assert not (tmp_path / "p.jsonl").exists()
    (tmp_path / "bad.toml").write_text('[[teacher]]\nname = "x"\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\n'
                                       'input_price = -1\n')
    with pytest.raises(TeachersError, match=r"bad\.toml: teacher 'x': input_price: .*greater than or equal to 0"):
        load_teachers(str(tmp_path / "bad.toml"))
    (tmp_path / "trace.jsonl").write_text('{"prompt": "p", "action": "a"}\n')
    res = pairs(str(tmp_path / "trace.jsonl"), "--teachers", str(teachers), "--out", str(tmp_path / "p.jsonl"),
                "--max-cost", "1", key=SECRET)
    assert res.exit_code == 2, res.output
    assert "trace.jsonl:1: expected an object with 'prompt', 'student_action'" in res.stderr, res.stderr


def test_normalisation_filters_and_deduplicates():
    def pair(chosen: str, rejected: str = "x = 1", prompt: str = "p") -> Pair:
        return Pair(prompt, chosen, rejected)

    pairs = [pair("return a + b"), pair("return  a +  b "), pair(""), pair("x" * 50), pair("$$ %% && ||"),
             pair("return a - b", rejected="#@!"), pair("one two three four five"), pair("return a + b", prompt="q")]
    kept, dropped = normalize_pairs(pairs, PairFilters(max_chars=40, max_words=4, max_special_ratio=0.5))
    assert [(p.prompt, p.chosen) for p in kept] == [("p", "return a + b"), ("q", "return a + b")]
    assert dropped == {"duplicate": 1, "too_short": 1, "too_long": 1, "special_chars": 2, "too_many_words": 1}
    kept, dropped = normalize_pairs(pairs, PairFilters(min_chars=None, min_words=None, max_special_ratio=None))
    assert len(kept) == 7 and dropped == {"duplicate": 1}


def test_teacher_votes_decide_as_make_pairs_does():
    from composer_cloud.trainer.three_channel.replay import vote

    step = TraceStep("p", "wrong")
    assert vote(step, {"a": "x", "b": " x ", "c": None}, threshold=2 / 3).outcome == "pair"
    assert vote(step, {"a": "x", "b": "y", "c": None}, threshold=0.3).outcome == "tie"
    assert vote(step, {"a": "x", "b": None, "c": None}, threshold=0.5).outcome == "below_threshold"
    assert vote(step, {"a": "wrong", "b": "wrong"}, threshold=0.5).outcome == "student_agrees"
    assert vote(step, {"a": None}, threshold=0.5).outcome == "no_answer"


def test_the_documented_teachers_file_and_command_are_valid(tmp_path):
    import re

    from typer.testing import CliRunner

    from composer_cloud.cli import app

    doc = (Path(__file__).parents[1] / "docs" / "trainer.md").read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", doc, re.M | re.S)  # (language, body), in order
    block = next(b for lang, b in blocks if lang == "toml" and "[[teacher]]" in b)
    (tmp_path / "teachers.toml").write_text(block)
    teachers = load_teachers(str(tmp_path / "teachers.toml"))
    assert [t.name for t in teachers] == ["big", "local"] and teachers[1].api == "completions"
    command = next(b for lang, b in blocks if b.startswith("composer-cloud pairs"))
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    command += next(line for line in readme.splitlines() if line.startswith("composer-cloud pairs"))
    help_text = CliRunner().invoke(app, ["pairs", "--help"], env={"COLUMNS": "200"}).output
    for option in re.findall(r"(--[a-z-]+)", command):
        assert option in help_text, option
