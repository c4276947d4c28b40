"""Datasets without code (issue 12.2): ``[trainer] dataset`` + a column mapping + a built-in reward.

A local JSONL / CSV / saved dataset with other column names trains the three-channel trainer in
process; a missing column is refused before launch (exit 2, nothing written); the demo's replay
pairs are not used with a dataset or a custom task unless asked for; one end-to-end launch.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_cloud.runs import open_run
from composer_cloud.runs.metrics import read_metrics
from composer_cloud.spec import SpecError, load_spec
from composer_cloud.trainer.three_channel.dataset_task import (
    DatasetTask,
    contains,
    exact_match,
    extract_answer,
    missing_columns,
)
from composer_cloud.trainer.three_channel.settings import ThreeChannelSettings
from support.specs import CAUSAL_LM, SMALL_RUN_TOML

ROWS = [{"question": f"What is {a} plus {b}?", "solution": str(a + b), "note": f"n{a}"}
        for a in range(6) for b in range(4)]


def write_jsonl(path: Path, rows=ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, rows=ROWS) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


# ---------------------------------------------------------------------- rewards
def test_answers_are_extracted_and_normalized():
    assert extract_answer("so the answer is \\boxed{42}.") == "42"
    assert extract_answer("work...\n#### 1,000") == "1,000"
    assert extract_answer("\n  7\nmore") == "  7"
    rows = [{"answer": "1000"}, {"answer": "Paris"}, {"answer": "3"}, {"answer": None}]
    assert exact_match(["#### 1,000", "paris.", "33", "x"], rows) == [1.0, 1.0, 0.0, None]
    assert contains(["it is 1000 ok", "I think PARIS", "12", "x"], rows) == [1.0, 1.0, 0.0, None]


def test_missing_columns_name_the_column_and_the_available_ones():
    problems = missing_columns({"prompt": "question", "answer": "answr"}, ["question", "solution"], needed=["answer"])
    assert problems == ["trainer.columns.answer = 'answr' is not in the dataset (its columns: question, solution)"]
    (p,) = missing_columns({}, ["question", "solution"], needed=[])
    assert "column 'prompt'" in p and "trainer.columns.prompt = " in p


# ---------------------------------------------------------------------- settings
def test_pairs_auto_uses_the_demo_pairs_only_with_the_demo_task():
    assert ThreeChannelSettings().effective_pairs == "builtin"
    assert ThreeChannelSettings(task="my_tasks:make").effective_pairs == "none"
    assert ThreeChannelSettings(dataset="data.jsonl").effective_pairs == "none"
    assert ThreeChannelSettings(task="my_tasks:make", pairs="builtin").effective_pairs == "builtin"  # asked for
    assert ThreeChannelSettings(dataset="d", pairs="s3://b/p.jsonl").effective_pairs == "s3://b/p.jsonl"


@pytest.mark.parametrize("settings, match", [
    ({"columns": {"prompt": "q"}}, "trainer.columns applies to a dataset run"),
    ({"reward": "exact_match"}, "trainer.reward applies to a dataset run"),
    ({"dataset": "d.jsonl", "columns": {"question": "q"}}, "trainer.columns.question: the mapping's keys"),
    ({"dataset": "d.jsonl", "reward": "bleu"}, "trainer.reward: unknown reward 'bleu'"),
    ({"dataset": "d.jsonl", "task": "my_tasks:make"}, "a dataset run uses the built-in dataset task"),
])
def test_dataset_settings_are_checked_by_name(settings, match):
    with pytest.raises(ValueError, match=match):
        ThreeChannelSettings.from_settings(settings)


# ---------------------------------------------------------------------- loading
@pytest.mark.parametrize("fmt", ["jsonl", "csv", "saved"])
def test_local_dataset_loads_with_a_column_mapping_and_a_held_out_part(tmp_path, fmt):
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "qa.jsonl")
    elif fmt == "csv":
        path = write_csv(tmp_path / "qa.csv")
    else:
        from datasets import Dataset

        path = tmp_path / "saved"
        Dataset.from_list(ROWS).save_to_disk(str(path))
    task = DatasetTask(dataset=str(path), columns={"prompt": "question", "answer": "solution"}, eval_fraction=0.25)
    train, held = task.examples("train"), task.examples("eval")
    assert len(train) == 18 and len(held) == 6
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held)
    row = train[0]
    assert row["prompt"].startswith("What is") and str(row["answer"]) == str(row["solution"]) == row["reference"]  # csv infers ints
    assert row["note"].startswith("n")  # unmapped columns stay
    # deterministic: the same split in another process / replica
    again = DatasetTask(dataset=str(path), columns={"prompt": "question", "answer": "solution"}, eval_fraction=0.25)
    assert again.examples("eval") == held
    assert task.reward([str(r["answer"]) for r in held], held) == [1.0] * 6


def test_the_launch_check_reads_columns_without_importing_torch(tmp_path):
    """``dataset_columns`` (launch's check) of a local jsonl, csv and parquet file in a fresh interpreter: the
    column names, and torch never imported (datasets' streaming would import it); a dataset streamed afterwards
    is a torch ``IterableDataset`` as datasets makes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "qa.parquet")
    files = [str(write_jsonl(tmp_path / "qa.jsonl")), str(write_csv(tmp_path / "qa.csv")), str(tmp_path / "qa.parquet")]
    code = ("import json, sys\n"
            "from composer_cloud.trainer.data import dataset_columns\n"
            "cols = [dataset_columns(f, 'train') for f in sys.argv[1:]]\n"
            "torch_after_check = 'torch' in sys.modules\n"
            "import datasets, torch.utils.data\n"
            "later = datasets.load_dataset('json', data_files=sys.argv[1], split='train', streaming=True)\n"
            "print(json.dumps([cols, torch_after_check, isinstance(later, torch.utils.data.IterableDataset)]))")
    out = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [[list(ROWS[0])] * 3, False, True]


def test_dataset_trains_the_three_channel_trainer_in_process(tmp_path):
    import torch

    from composer_cloud.model import TinyModelConfig, load_model
    from composer_cloud.trainer import TrainerContext, build_trainer

    path = write_jsonl(tmp_path / "qa.jsonl")
    model, tok = load_model("tiny", seed=0, tiny=TinyModelConfig(hidden_size=32, num_hidden_layers=2,
                                                                  num_attention_heads=2, num_key_value_heads=1,
                                                                  intermediate_size=64))
    ctx = TrainerContext(
        model=model, tokenizer=tok, rank=0, world_size=1, seed=0, device=torch.device("cpu"),
        settings={"batch_size": 4, "seq_len": 32, "num_generations": 2, "max_completion_length": 6,
                  "eval_examples": 4, "dataset": str(path), "reward": "contains",
                  # a random model scores 0 everywhere (no GRPO signal) and never stops within 6 tokens:
                  # the answer as channel 2's hint, and truncated completions kept, give it a gradient
                  "mask_truncated_completions": False,
                  "columns": {"prompt": "question", "answer": "solution", "hint": "solution"}},
        inner_optimizer={"lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.95], "grad_clip": 1.0},
    )
    tr = build_trainer("three-channel", ctx)
    assert type(tr.task).__name__ == "DatasetTask"
    assert tr.grpo.replay is None  # pairs = "auto": the demo's pairs are not replayed on a dataset
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        out = tr.step()
        assert {"loss", "pg", "sdpo", "dpo", "reward_mean"} <= set(out)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    ev = tr.evaluate()
    assert ev["eval_examples"] == 2 and ev["eval_loss"] > 0  # 10 % of 24 rows held out, answers scored


# ---------------------------------------------------------------------- preflight
def test_missing_column_is_refused_before_anything_is_written(tmp_path):
    from composer_cloud.runs.lifecycle import check_before_launch

    write_jsonl(tmp_path / "qa.jsonl")
    spec = load_spec(None, {"trainer.dataset": "qa.jsonl", "trainer.columns": {"prompt": "question",
                                                                               "answer": "answer"}})
    with pytest.raises(SpecError, match=r"trainer.columns: .*'answer' is not in the dataset \(its columns: "
                                        r"question, solution, note\)"):
        check_before_launch(spec.with_run_id(), base_dir=tmp_path)
    spec = load_spec(None, {"trainer.dataset": "qa.jsonl", "trainer.columns": {"answer": "solution"}})
    with pytest.raises(SpecError, match=r"column 'prompt' is not in the dataset"):
        check_before_launch(spec.with_run_id(), base_dir=tmp_path)
    spec = load_spec(None, {"trainer.dataset": "./nope.jsonl"})
    with pytest.raises(SpecError, match=r"trainer.dataset = './nope.jsonl': no such file"):
        check_before_launch(spec.with_run_id(), base_dir=tmp_path)


def test_cli_exit_2_and_an_empty_store_for_a_missing_column(tmp_path):
    write_jsonl(tmp_path / "qa.jsonl")
    (tmp_path / "spec.toml").write_text(SMALL_RUN_TOML.replace(CAUSAL_LM, (
        'name = "three-channel"\ndataset = "qa.jsonl"\nreward = "exact_match"'))
        + '[trainer.columns]\nprompt = "question"\n')
    res = subprocess.run([sys.executable, "-m", "composer_cloud.cli", "launch", "--config", "spec.toml",
                          "--store", f"file://{tmp_path}/store", "--run-id", "bad"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "'answer' is not in the dataset" in res.stdout + res.stderr
    assert not (tmp_path / "store" / "bad").exists()


# ---------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_launch_from_a_local_dataset_path_completes(tmp_path):
    user = tmp_path / "project"
    (user / "data").mkdir(parents=True)
    write_jsonl(user / "data" / "qa.jsonl")
    (user / "spec.toml").write_text("replicas = 2\nrounds = 1\ninner_steps = 2\n" + SMALL_RUN_TOML.replace(
        CAUSAL_LM, 'name = "three-channel"\ndataset = "data/qa.jsonl"\nreward = "contains"\n'
        'num_generations = 2\nmax_completion_length = 6\neval_examples = 4')
        + '[trainer.columns]\nprompt = "question"\nanswer = "solution"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = subprocess.run([sys.executable, "-m", "composer_cloud.cli", "launch", "--config", str(user / "spec.toml"),
                          "--store", f"file://{tmp_path}/store", "--run-id", "ds"], cwd=elsewhere,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    spec_json = json.loads((tmp_path / "store/ds/spec.json").read_bytes()[16:])
    assert spec_json["trainer"]["dataset"] == str(user / "data" / "qa.jsonl")  # made absolute at launch
    rows = read_metrics(open_run(f"file://{tmp_path}/store/ds").store, rank=0)
    assert any("eval_loss" in r for r in rows)
    assert all(r["dpo"] == 0.0 for r in rows if r["kind"] == "step")  # no demo pairs replayed


def test_an_unreachable_hub_dataset_is_a_warning_not_an_error(tmp_path, monkeypatch, caplog):
    from composer_cloud.runs.lifecycle import check_before_launch

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    spec = load_spec(None, {"trainer.dataset": "org/some-dataset", "trainer.columns": {"prompt": "q"}})
    with caplog.at_level("WARNING"):
        check_before_launch(spec.with_run_id(), base_dir=tmp_path)
    assert "columns not checked before launch" in caplog.text


def test_python_tests_reward_and_a_custom_reward_function(tmp_path, monkeypatch):
    rows = [{"head": "def inc(x):\n    return", "checks": "assert inc(1) == 2\nassert inc(-1) == 0"},
            {"head": "def dbl(x):\n    return", "checks": ["assert dbl(2) == 4", "assert dbl(0) == 0"]}]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    task = DatasetTask(dataset=str(path), columns={"prompt": "head", "tests": "checks"}, reward_name="python_tests",
                       eval_fraction=0.0)
    train = task.examples("train")
    by_name = {r["prompt"]: r for r in train}
    inc, dbl = by_name[rows[0]["head"]], by_name[rows[1]["head"]]
    assert task.reward([" x + 1\n", " x - 1\n", " x * 2\n"], [inc, inc, dbl]) == [1.0, 0.0, 1.0]

    (tmp_path / "my_reward.py").write_text("def score(completions, rows):\n"
                                           "    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = DatasetTask(dataset=str(path), columns={"prompt": "head"}, reward_name="my_reward:score")
    assert custom.reward(["ab", ""], train[:2]) == [2.0, 0.0]
