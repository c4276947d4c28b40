"""A user's first hour (issue 23): own data that learns or says why; a dry run that tells the truth.

Each test replays a finding of the issue as a user meets it (CLI in a subprocess where that is what the
user runs) and asserts what they should see instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_cloud.runs.signal import diagnose_rounds
from composer_cloud.storage.records.metrics import parse_row
from composer_cloud.trainer.settings import declared_settings
from composer_cloud.spec import SpecError, load_spec
from composer_cloud.trainer.three_channel.dataset_task import AnswerHints, DatasetTask
from support.cli import cli, cli_here, status_here
from support.specs import CAUSAL_LM, SMALL_RUN_TOML

QA = [{"question": f"What is {a} plus {b}?", "solution": str(a + b)} for a in range(6) for b in range(4)]


def write_qa(path: Path, rows=QA) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_spec(tmp_path: Path, extra: str = "", **top: object) -> Path:
    """The issue's scenario: a JSONL of question/answer rows, a freshly initialised model, exact_match."""
    write_qa(tmp_path / "qa.jsonl")
    head = "".join(f"{k} = {v}\n" for k, v in {"replicas": 1, "rounds": 2, "inner_steps": 2, **top}.items())
    body = SMALL_RUN_TOML.replace(CAUSAL_LM, (
        'name = "three-channel"\ndataset = "qa.jsonl"\nreward = "exact_match"\nnum_generations = 2\n'
        f'max_completion_length = 4\neval_examples = 2\n{extra}'))
    path = tmp_path / "spec.toml"
    path.write_text(head + body + '[trainer.columns]\nprompt = "question"\nanswer = "solution"\n')
    return path


# ---------------------------------------------------------------------- 1. own data learns or says why
def test_a_dataset_without_a_hint_column_distils_from_its_answers():
    """Finding 1: no hint column meant no channel 2; the reference answer is now the privileged hint."""
    task = DatasetTask(dataset="unused", columns={"prompt": "question", "answer": "solution"})
    task._splits = {"train": [task._rename(r) for r in QA], "eval": []}
    source = task.default_hints()
    assert isinstance(source, AnswerHints)
    assert source.hints([{"answer": "7"}, {"answer": None}]) == ["Answer: 7", None]
    trainer = declared_settings("three-channel", {"dataset": "x", "columns": {"answer": "solution"}})
    (note,) = trainer.launch_notes(["question", "solution"])
    assert "reference answer (column 'solution')" in note


def test_answer_hints_give_a_fresh_model_a_gradient(tmp_path):
    """With the answer as hint (and truncated completions kept) the issue's model and data move the weights."""
    from composer_cloud.trainer import build_trainer
    from support.trainer import tiny_context

    path = write_qa(tmp_path / "qa.jsonl")
    ctx = tiny_context({"batch_size": 4, "seq_len": 32, "num_generations": 2, "max_completion_length": 6,
                        "eval_examples": 2, "dataset": str(path), "reward": "exact_match",
                        "mask_truncated_completions": False,
                        "columns": {"prompt": "question", "answer": "solution"}})
    tr = build_trainer("three-channel", ctx)
    out = tr.step()
    assert out["sdpo"] != 0.0 and out["grad_norm"] > 0.0
    assert out["frac_reward_zero_std"] == 1.0 and "clipped_ratio" in out  # GRPO alone had nothing


def test_a_spec_in_which_no_channel_can_learn_is_refused_with_what_to_change(tmp_path, monkeypatch):
    settings = {"dataset": "qa.jsonl", "pg_weight": 0.0, "hint_source": "none", "pairs": "none",
                "columns": {"prompt": "question", "answer": "solution"}}
    def launch_refusal(settings: dict, columns: list[str]) -> str | None:
        return declared_settings("three-channel", settings).launch_refusal(columns)

    message = launch_refusal(settings, ["question", "solution"])
    assert message is not None and "no channel can produce a gradient" in message
    assert "trainer.pg_weight = 0" in message and "trainer.hint_source = 'none'" in message
    assert launch_refusal({**settings, "hint_source": "default"}, ["question", "solution"]) is None
    assert "neither a hint nor an answer" in launch_refusal(
        {**settings, "hint_source": "default", "columns": {"prompt": "question"}}, ["question", "x"])
    # the CLI (in this process, as the dry-run tests below): launch and the dry run refuse it alike, exit 2,
    # nothing written
    from typer.testing import CliRunner

    from composer_cloud.cli import app

    monkeypatch.chdir(tmp_path)
    spec = qa_spec(tmp_path, extra='pg_weight = 0.0\nhint_source = "none"\n')
    for dry in ([], ["--dry-run"]):
        res = CliRunner().invoke(app, ["launch", "--config", str(spec), "--store", f"file://{tmp_path}/store",
                                       "--run-id", "r", *dry])
        assert res.exit_code == 2, res.output
        assert "no channel can produce a gradient" in res.stderr
        assert not (tmp_path / "store" / "r").exists()


def test_rounds_without_a_gradient_are_diagnosed_per_channel():
    step = {"kind": "step", "grad_norm": 0.0, "pg": 0.0, "sdpo": 0.0, "dpo": 0.0, "frac_reward_zero_std": 1.0,
            "reward_mean": 0.0, "clipped_ratio": 1.0}
    rows = [{**step, "round": r, "rank": k} for r in range(2) for k in range(2)]

    def typed(rows: list[dict]) -> list:  # the rows as the reader parses them
        return [parse_row(r, key="test") for r in rows]

    (msg,) = diagnose_rounds(typed(rows), declared_settings("three-channel", {"max_completion_length": 4}))
    assert msg.startswith("no training signal in every round")
    assert "frac_reward_zero_std 1.0" in msg and "max_completion_length (4)" in msg and "no pairs" in msg
    rows[0] = {**rows[0], "grad_norm": 0.5}  # round 1 moved: only round 2 is flagged, counted from 1
    (msg,) = diagnose_rounds(typed(rows))
    assert "no training signal in round 2:" in msg and "grad_norm 0 on every step" in msg  # no trainer: no claim
    assert diagnose_rounds(typed([{**r, "grad_norm": 1.0} for r in rows])) == []
    assert diagnose_rounds(typed([{"kind": "step", "rank": 0, "round": 0, "loss": 1.0}])) == []  # no grad_norm


@pytest.mark.slow
def test_the_issues_jsonl_run_says_it_trained_nothing(tmp_path):
    """The scenario of finding 1, end to end: no longer a silent "completed" — the summary and status say why."""
    spec = qa_spec(tmp_path)
    store = f"file://{tmp_path}/store"
    res = cli("launch", "--config", str(spec), "--store", store, "--run-id", "qa", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no training signal in every round" in res.stderr
    assert "every completion hit max_completion_length (4)" in res.stderr
    assert "channel 2's hint: the reference answer (column 'solution')" in res.stdout
    assert "channel 1 (GRPO policy gradient)" in res.stdout  # per-channel means, named
    st = cli("status", f"{store}/qa", "--json", cwd=tmp_path)
    assert any("no training signal" in w for w in json.loads(st.stdout)["warnings"])


def test_the_check_is_part_of_launchs_checks(tmp_path):
    from composer_cloud.runs.lifecycle import check_before_launch

    write_qa(tmp_path / "qa.jsonl")
    spec = load_spec(None, {"trainer.name": "three-channel", "trainer.dataset": "qa.jsonl",
                            "trainer.columns": {"prompt": "question", "answer": "solution"},
                            "trainer.pg_weight": 0.0, "trainer.dpo_weight": 0.0, "trainer.sdpo_weight": 0.0})
    with pytest.raises(SpecError, match="no channel can produce a gradient"):
        check_before_launch(spec.with_run_id(), base_dir=tmp_path)


# ---------------------------------------------------------------------- 2. the dry run tells the truth
def _dry(tmp_path: Path, *args: str, env: dict | None = None):
    from typer.testing import CliRunner

    from composer_cloud.cli import app

    return CliRunner().invoke(app, ["launch", "--dry-run", "--store", f"file://{tmp_path}/store", *args], env=env)


@pytest.mark.parametrize("args,needle", [
    (["--set", "trainer.batchsize=3", "--trainer", "three-channel"], "did you mean trainer.batch_size"),
    (["--trainer", "three-chanel"], "unknown trainer 'three-chanel'"),
    (["--trainer", "three-channel", "--set", "trainer.dataset=qa.jsonl"], "column 'prompt' is not in the dataset"),
    (["--executor", "modal", "--replicas", "1"], "a local directory, which Modal containers cannot read"),
    # finding 3: typos that used to launch doomed runs
    (["--model", "models/my-modle/"], "model.name = 'models/my-modle/': no such file or folder"),
    (["--trainer", "three-channel", "--set", "trainer.dataset=data/qa.jsonl"],
     "trainer.dataset = 'data/qa.jsonl': no such file or folder"),
    (["--trainer", "three-channel", "--set", "trainer.dataset=qa.jsonl", "--set", "trainer.columns.prompt=q",
      "--set", "trainer.reward=my_rewards:scroe"], "defines no 'scroe'; did you mean my_rewards:score?"),
])
def test_the_dry_run_refuses_what_launch_refuses_with_exit_2(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qa.jsonl").write_text('{"q": "1+1", "answer": "2"}\n')
    (tmp_path / "my_rewards.py").write_text("def score(completions, rows):\n    return [0.0] * len(completions)\n")
    dry = _dry(tmp_path, *args)
    assert dry.exit_code == 2 and needle in dry.output, dry.output
    from typer.testing import CliRunner

    from composer_cloud.cli import app

    real = CliRunner().invoke(app, ["launch", "--store", f"file://{tmp_path}/store", "--detach", *args])
    assert real.exit_code == 2 and needle in real.output, real.output  # the same refusal, the same words
    assert not (tmp_path / "store").exists()  # nothing written by either


def test_the_dry_run_refuses_a_taken_run_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "store" / "taken").mkdir(parents=True)
    from composer_cloud.storage.store import Store

    Store(f"file://{tmp_path}/store/taken").put_json("spec.json", {"x": 1})
    res = _dry(tmp_path, "--run-id", "taken")
    assert res.exit_code == 2 and "already exists" in res.output, res.output
    ok = _dry(tmp_path, "--run-id", "fresh", "--json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["ok"] is True and not (tmp_path / "store" / "fresh").exists()


@pytest.mark.jobs_hub
def test_hf_jobs_example_without_its_secrets_fails_the_dry_run(tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    example = Path(__file__).parent.parent / "examples" / "hf-jobs.toml"
    res = cli("launch", "--dry-run", "--config", str(example), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "AWS_ACCESS_KEY_ID" in res.stderr


def test_doctor_checks_each_executors_credentials(tmp_path, monkeypatch):
    """Modal token, HF token, AWS credentials: found the way each SDK finds them; exit 2 and the fix when not."""
    home = tmp_path / "home"
    home.mkdir()
    base = {k: v for k, v in __import__("os").environ.items()
            if not k.startswith(("MODAL_", "AWS_", "HF_")) and k != "HOME"}
    base.update(HOME=str(home), HF_HOME=str(home / "hf"), AWS_CONFIG_FILE=str(home / "none"),
                AWS_SHARED_CREDENTIALS_FILE=str(home / "none"), AWS_EC2_METADATA_DISABLED="true")
    bare = cli("doctor", "--executor", "modal", "--executor", "hf-jobs", "--json", cwd=tmp_path, env=base)
    assert bare.returncode == 2, bare.stdout + bare.stderr
    checks = {c["name"]: c for c in json.loads(bare.stdout)["credentials"]}
    assert not checks["modal: token"]["ok"] and "modal token new" in checks["modal: token"]["detail"]
    assert not checks["hf-jobs: token"]["ok"] and "HF_TOKEN" in checks["hf-jobs: token"]["detail"]
    secret = "as-canary-never-printed"
    good = cli("doctor", "--executor", "modal", "--executor", "hf-jobs", cwd=tmp_path,
               env={**base, "MODAL_TOKEN_ID": "ak-123456789", "MODAL_TOKEN_SECRET": secret, "HF_TOKEN": "hf_" + secret})
    assert good.returncode == 0, good.stdout + good.stderr
    assert secret not in good.stdout + good.stderr
    s3 = cli("doctor", "--executor", "local", "s3://bucket/prefix", "--json", cwd=tmp_path, env=base)
    assert s3.returncode == 2 and "no AWS credentials" in s3.stdout, s3.stdout + s3.stderr


# ---------------------------------------------------------------------- 3. export from the store alone
def _saved_model(folder: Path) -> None:
    from composer_cloud.model import TinyModelConfig, load_model

    model, tok = load_model("tiny", seed=0, tiny=TinyModelConfig(hidden_size=64, num_hidden_layers=2,
                                                                  num_attention_heads=2, num_key_value_heads=1,
                                                                  intermediate_size=128))
    model.save_pretrained(folder)
    tok.init_kwargs["padding_side"] = "left"
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A folder with a finished run, ``store/zz-done`` (1 replica, 1 round of 2 steps), of a model the user saved
    to ``./my-model``: one launch for the export test and the resume-guard test (each asserts its own findings on
    it; the export test then moves the model folder away, as the user tidies up)."""
    root = tmp_path_factory.mktemp("finished")
    _saved_model(root / "my-model")
    spec = root / "spec.toml"
    spec.write_text("replicas = 1\nrounds = 1\ninner_steps = 2\n[model]\nname = \"./my-model\"\n"
                    "[trainer]\nname = \"causal-lm\"\nbatch_size = 2\nseq_len = 16\n")
    res = cli("launch", "--config", str(spec), "--store", f"file://{root}/store", "--run-id", "zz-done", cwd=root,
              timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return root


@pytest.mark.slow
def test_export_needs_neither_the_model_folder_nor_the_hub(finished_run):
    """Finding 4: export rebuilt the model from the original folder (gone: HFValidationError), wrote 0600
    weights, lost the tokenizer's left padding and wrote no model card."""
    import stat

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_path = finished_run
    store = f"file://{tmp_path}/store"
    if (tmp_path / "my-model").exists():
        (tmp_path / "my-model").rename(tmp_path / "moved")  # the user tidies up
    assert not (tmp_path / "my-model").exists()
    out = tmp_path / "exported"
    ex = cli("export", f"{store}/zz-done", "--out", str(out), "--round", "1", "--json", cwd=tmp_path,
             env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert ex.returncode == 0, ex.stdout + ex.stderr
    assert json.loads(ex.stdout)["round"] == 1  # counted from 1, like --round
    mode = stat.S_IMODE((out / "model.safetensors").stat().st_mode)
    assert mode & 0o044 == 0o044, oct(mode)  # readable by others, like any file the user writes
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.padding_side == "left"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 64
    card = (out / "README.md").read_text()
    assert "library_name: transformers" in card and "rounds | 1 of 1" in card and "`my-model (a local file of the run)` |" in card
    # no checkpoint (round 2 never ran): a clear error, exit 1, no traceback (in this process: nothing escaped)
    bad = cli_here("export", f"{store}/zz-done", "--out", str(tmp_path / "x"), "--round", "2", cwd=tmp_path)
    assert bad.exit_code == 1 and "no global state for round 2 (available: [1])" in bad.stderr, bad.output
    assert not isinstance(bad.exception, Exception), bad.exception


def test_the_launchers_tiny_model_files_are_those_of_the_model_the_replicas_build(tmp_path):
    """The launcher writes the tiny model's config files without building its weights: they must be the files
    of the model a replica builds (export rebuilds the model from them), for any shape the spec sets."""
    from composer_cloud.model import load_spec_model
    from composer_cloud.runs.export import model_files

    spec = load_spec(None, {"model.hidden_size": 48, "model.num_hidden_layers": 3, "model.intermediate_size": 96})
    files = model_files(spec)
    model, tokenizer = load_spec_model(spec.model, seed=spec.seed)
    model.config.save_pretrained(tmp_path)
    model.generation_config.save_pretrained(tmp_path)
    for name in ("config.json", "generation_config.json"):
        assert files[name] == (tmp_path / name).read_bytes(), name
    assert json.loads(files["config.json"])["hidden_size"] == 48 and "tokenizer.json" in files


def test_export_of_a_run_without_a_checkpoint_and_an_unwritable_out(tmp_path):
    from composer_cloud.storage import layout
    from composer_cloud.storage.store import Store

    spec = load_spec(None, {"run_id": "empty", "model.name": "org/gone-model"})
    Store(f"file://{tmp_path}/store/empty").create_json(layout.SPEC, spec.to_json_dict())
    res = cli_here("export", f"file://{tmp_path}/store/empty", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert res.exit_code == 1 and "has no checkpoint to export yet" in res.stderr, res.output
    assert not isinstance(res.exception, Exception), res.exception  # no traceback: nothing escaped the command
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        res = cli_here("export", f"file://{tmp_path}/store/empty", "--out", str(locked / "m"), cwd=tmp_path)
    finally:
        locked.chmod(0o700)
    if __import__("os").geteuid() != 0:  # root writes anywhere
        assert res.exit_code == 2 and "cannot write there" in res.stderr, res.output


# ---------------------------------------------------------------------- 4/5. resume guard, ls = status
@pytest.mark.slow
def test_resume_guard_ls_agrees_with_status_and_a_lost_supervisor(finished_run):
    """Finding 5: resume killed a live run's replicas and reshaped a completed run; finding 6: ls disagreed
    with status and sorted by id; a killed supervisor whose replica finished read "failed"."""
    tmp_path = finished_run
    store = f"file://{tmp_path}/store"
    cfg = tmp_path / "live.toml"
    cfg.write_text("replicas = 1\n" + SMALL_RUN_TOML)
    # "zz-done" (finished_run) sorts after "aa-live" by id, but was created first
    reshape = cli("resume", f"{store}/zz-done", "--replicas", "3", cwd=tmp_path)
    assert reshape.returncode == 2 and "resume cannot change its replicas" in reshape.stderr, reshape.stderr
    assert "composer-cloud launch --model ./zz-done-model --replicas 3" in reshape.stderr
    assert json.loads((tmp_path / "store/zz-done/spec.json").read_bytes()[16:])["replicas"] == 1  # untouched
    live = cli("launch", "--config", str(cfg), "--store", store, "--run-id", "aa-live", "--rounds", "1",
               "--inner-steps", "100000", "--detach", cwd=tmp_path)
    assert live.returncode == 0, live.stdout + live.stderr
    try:
        refused = cli("resume", f"{store}/aa-live", cwd=tmp_path)
        assert refused.returncode == 2 and "still running" in refused.stderr and "--force" in refused.stderr
        listed = json.loads(cli("ls", store, "--json", cwd=tmp_path).stdout)
        assert [r["run_id"] for r in listed] == ["aa-live", "zz-done"]  # newest first by creation
        for r in listed:
            assert r["state"] == status_here(r["uri"], tmp_path)["state"]
    finally:
        assert cli("cancel", f"{store}/aa-live", cwd=tmp_path).returncode == 0
    rep = cli("report", f"{store}/aa-live", "--json", cwd=tmp_path)  # next to the run; the dead replica marked
    assert rep.returncode == 0, rep.stderr
    rep = json.loads(rep.stdout)
    assert rep["png"] == str(tmp_path / "store/aa-live/report/report.png") and rep["labels"] == {"0": "r0 (cancelled, killed (SIGTERM))"}
    ours = cli("logs", f"{store}/zz-done", "--tail", "3", cwd=tmp_path).stdout.splitlines()
    assert len(ours) == 3 and all(line.startswith("[r0] 20") and " r0 " not in line for line in ours), ours
    assert all("composer_cloud" in line or "WARNING" in line or "ERROR" in line for line in ours), ours
    # the local supervisor of the finished run dies before recording the exit: the replica said it completed
    from composer_cloud.jobs.local import job_dir

    exit_json = job_dir(f"{store}/zz-done", 0) / "exit.json"
    assert exit_json.exists()
    exit_json.unlink()
    st = status_here(f"{store}/zz-done", tmp_path)
    assert st["state"] == "completed" and st["replicas"][0]["state"] == "succeeded", st


def test_cancel_that_found_no_job_handle_exits_1(tmp_path):
    from composer_cloud.runs import cancel, open_run
    from composer_cloud.storage import layout
    from composer_cloud.storage.store import Store

    for run_id in ("api", "cli"):
        spec = load_spec(None, {"run_id": run_id})
        store = Store(f"file://{tmp_path}/store/{run_id}")
        store.create_json(layout.SPEC, spec.to_json_dict())
        # a replica reported (so the run was started), but no job handle is in the store
        store.put_json(layout.heartbeat_key(0), {"rank": 0, "state": "running", "time": 0.0})
    result = cancel(open_run(f"file://{tmp_path}/store/api"))
    assert result.cancelled == [] and "no replica job handle" in result.warnings[0]
    res = cli("cancel", f"file://{tmp_path}/store/cli", cwd=tmp_path)
    assert res.returncode == 1 and "no job was stopped" in res.stdout, res.stdout + res.stderr


def test_exit_reasons_for_people():
    from composer_cloud.runs.status import exit_reason

    assert exit_reason(-9, "failed") == "killed (SIGKILL)" and exit_reason(1, "failed") == "1"
    assert exit_reason(None, "failed") == "unknown" and exit_reason(None, "running") == "-"


def test_ls_of_a_bucket_that_does_not_exist_is_a_clear_error(tmp_path, s3_endpoint):
    res = cli("ls", "s3://no-such-bucket/runs", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "cannot list runs under s3://no-such-bucket/runs" in res.stderr and "Traceback" not in res.stderr


# ---------------------------------------------------------------------- 7. extras named where needed
def test_a_missing_executor_sdk_names_the_extra(tmp_path, monkeypatch):
    """Finding 7: the Modal example crashed with `No module named 'modal'` after the README's install."""
    import importlib.util

    from composer_cloud.runs import doctor

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "modal" else real(name, *a))
    (msg,) = doctor.missing_sdks(["modal"], "s3://bucket/x")
    assert 'pip install "composer-cloud[modal,s3]"' in msg
    example = Path(__file__).parent.parent / "examples" / "modal-8xh100.toml"
    assert 'pip install "composer-cloud[modal,s3]"' in example.read_text()
    from composer_cloud.runs.lifecycle import check_before_launch

    spec = load_spec(example, {}).with_run_id()
    with pytest.raises(SpecError, match=r'executor: --executor modal needs the modal package.*composer-cloud\[modal,s3\]'):
        check_before_launch(spec, base_dir=tmp_path)


def test_dependency_floors_provide_what_the_code_calls():
    """modal>=1.5 allowed 1.5.0–1.5.2, which lack FunctionCall.logs (first in 1.5.3)."""
    import tomllib

    deps = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    modal = next(d for d in deps["optional-dependencies"]["modal"] if d.startswith("modal"))
    assert "modal>=1.5.3" in modal
    import modal as sdk

    assert hasattr(sdk.FunctionCall, "logs")  # what jobs/modal_jobs.py calls, in the installed SDK


# ---------------------------------------------------------------------- 6. tracking, read back
def _run_with_metrics(tmp_path: Path):
    """A run in the store with the rows two replicas write for two rounds of two steps (the replica's writer)."""
    from composer_cloud.replica.telemetry import MetricsLog
    from composer_cloud.runs import open_run
    from composer_cloud.storage import layout
    from composer_cloud.storage.store import Store
    from support.metrics import log_round, log_step

    uri = f"file://{tmp_path}/store/tracked"
    spec = load_spec(None, {"run_id": "tracked", "report_to": ["tensorboard"]})
    store = Store(uri)
    store.create_json(layout.SPEC, spec.to_json_dict())
    for rank in (0, 1):
        log = MetricsLog(store, rank)
        for rnd in (0, 1):
            for i in (1, 2):
                step = rnd * 2 + i
                log_step(log, rnd, step, loss=1.0 / step + rank, grad_norm=0.5, pg=0.1)
            log_round(log, rnd, committed=True, train_loss=2.0 - rnd + rank, sync_s=0.25, bytes_read=1000,
                      bytes_written=1000)
    return open_run(uri)


def test_tracking_writes_one_series_per_replica_and_the_rounds(tmp_path):
    """Finding 7: no experiment tracking. The event files and trackio's store are read back."""
    pytest.importorskip("tensorboard", reason="the [tracking] extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run_with_metrics(tmp_path)
    env = {**__import__("os").environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    res = cli("track", run.uri, "--to", "tensorboard", "--to", "trackio", "--logdir", str(tmp_path / "tb"),
              "--project", "t", "--json", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["replicas"] == [0, 1] and out["rounds"] == 2 and out["step_points"] == 8
    series = {}
    for name in ("replica-0", "replica-1", "rounds"):
        acc = EventAccumulator(str(tmp_path / "tb" / "tracked" / name))
        acc.Reload()
        series[name] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert series["replica-1"]["train/loss"] == [(1, 2.0), (2, 1.5), (3, pytest.approx(1 + 1 / 3)), (4, 1.25)]
    assert series["rounds"]["round/train_loss"] == [(1, 2.5), (2, 1.5)]  # mean over replicas, rounds from 1
    assert series["rounds"]["round/store_mb"] == [(1, pytest.approx(0.004)), (2, pytest.approx(0.004))]
    again = cli("track", run.uri, "--to", "tensorboard", "--to", "trackio", "--logdir", str(tmp_path / "tb"),
                "--project", "t", cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr
    acc = EventAccumulator(str(tmp_path / "tb" / "tracked" / "replica-0"))
    acc.Reload()
    assert len(acc.Scalars("train/loss")) == 4  # written again: replaced, not doubled
    read = ("from trackio.sqlite_storage import SQLiteStorage as S; import json\n"
            "print(json.dumps({r: [(x['step'], x.get('train/loss', x.get('round/train_loss'))) "
            "for x in S.get_logs('t', r)] for r in S.get_runs('t')}))")
    back = __import__("subprocess").run([__import__("sys").executable, "-c", read], env=env, capture_output=True,
                                        text=True, timeout=120)
    assert back.returncode == 0, back.stderr
    logs = json.loads(back.stdout)
    assert sorted(logs) == ["tracked-replica-0", "tracked-replica-1", "tracked-rounds"]
    assert [v for _, v in logs["tracked-replica-0"]] == [1.0, 0.5, pytest.approx(1 / 3), 0.25]
    assert logs["tracked-rounds"] == [[1, 2.5], [2, 1.5]]
    bad = cli_here("track", run.uri, "--to", "comet", cwd=tmp_path)  # refused before any import: in this process
    assert bad.exit_code == 2 and "unknown tracker 'comet'" in bad.stderr, bad.output


def test_logs_show_our_lines_by_default_and_the_rank_once():
    """Finding 6: `logs --tail 5` was mostly torchft internals and showed the rank twice."""
    from composer_cloud.runs.logs import _stamped, without_rank

    lines = ["2026-11-24T16:00:00.100Z r1 INFO torchft.manager: quorum 3 joined",
             "2026-11-24T16:00:00.200Z r1 INFO composer_cloud.replica.telemetry: round 1 step 3 loss 2.1",
             "2026-11-24T16:00:00.300Z r1 DEBUG urllib3.connectionpool: GET /x",
             "2026-11-24T16:00:00.400Z r1 WARNING transformers.modeling_utils: something odd",
             "2026-11-24T16:00:00.500Z r1 ERROR composer_cloud.replica.runtime: replica failed",
             "Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: boom"]
    shown = [ll.line for ll in _stamped(1, iter(lines), [None], verbose=False)]
    assert shown == lines[1:2] + lines[3:]
    assert [ll.line for ll in _stamped(1, iter(lines), [None])] == lines  # --verbose: everything
    assert without_rank(lines[1]) == "2026-11-24T16:00:00.200Z INFO composer_cloud.replica.telemetry: round 1 step 3 loss 2.1"
    assert without_rank("Traceback (most recent call last):") == "Traceback (most recent call last):"


def test_report_draws_steps_and_goes_next_to_the_run(tmp_path):
    pytest.importorskip("matplotlib", reason="the [report] extra")
    from composer_cloud.runs.report import write_report

    run = _run_with_metrics(tmp_path)
    rep = write_report(run)
    assert rep.png == tmp_path / "store" / "tracked" / "report" / "report.png" and rep.png.stat().st_size > 10_000
    assert rep.rounds == 2 and rep.replicas == [0, 1]


# ---------------------------------------------------------------------- 1b. causal-LM fine-tuning on own data
def test_the_causal_lm_trainer_fine_tunes_on_a_users_dataset(tmp_path):
    """Finding 1: `trainer.dataset is not a causal-lm setting`. Now: text column, or prompt + answer."""
    from composer_cloud.trainer import build_trainer
    from support.trainer import tiny_context

    qa = write_qa(tmp_path / "qa.jsonl", QA * 4)
    first = tiny_context({})
    model, tok = first.model, first.tokenizer

    def trainer(settings):
        return build_trainer("causal-lm", tiny_context({"batch_size": 4, "seq_len": 16, **settings}, lr=3e-3,
                                                       model=model, tokenizer=tok))

    tr = trainer({"dataset": str(qa), "columns": {"prompt": "question", "answer": "solution"}})
    before = tr.evaluate()["eval_loss"]
    for _ in range(15):
        tr.step()
    assert tr.evaluate()["eval_loss"] < before  # it learns the user's rows (held-out 10 % of them)
    text = tmp_path / "notes.jsonl"
    text.write_text("".join(json.dumps({"body": f"note {i}: the sum of {i} and 1 is {i + 1}."}) + "\n"
                            for i in range(40)))
    assert trainer({"dataset": str(text), "columns": {"text": "body"}}).step()["loss"] > 0  # a text column, mapped
    with pytest.raises(ValueError, match=r"trainer.columns.hint: the causal-lm trainer's columns are text, prompt"):
        trainer({"dataset": str(qa), "columns": {"hint": "solution"}})


def test_launch_checks_a_causal_lm_datasets_columns(tmp_path):
    from composer_cloud.runs.lifecycle import check_before_launch

    write_qa(tmp_path / "qa.jsonl")
    spec = load_spec(None, {"trainer.name": "causal-lm", "trainer.dataset": "qa.jsonl"})
    with pytest.raises(SpecError, match=r"needs a 'text' column, or 'prompt' and 'answer' \(its columns: question, "
                                        r"solution\)"):
        check_before_launch(spec.with_run_id(), base_dir=tmp_path)
    ok = load_spec(None, {"trainer.name": "causal-lm", "trainer.dataset": "qa.jsonl",
                          "trainer.columns": {"prompt": "question", "answer": "solution"}})
    check_before_launch(ok.with_run_id(), base_dir=tmp_path)


@pytest.mark.slow
def test_a_causal_lm_run_on_a_users_jsonl_completes(tmp_path):
    write_qa(tmp_path / "qa.jsonl", QA * 4)
    spec = tmp_path / "spec.toml"
    spec.write_text("replicas = 1\nrounds = 2\ninner_steps = 3\nreport_to = [\"tensorboard\"]\n" + SMALL_RUN_TOML.replace(
        'seq_len = 32', 'seq_len = 16\ndataset = "qa.jsonl"') + '[trainer.columns]\nprompt = "question"\nanswer = "solution"\n')
    res = cli("launch", "--config", str(spec), "--store", f"file://{tmp_path}/store", "--run-id", "ft", "--json",
              cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(res.stdout)["summary"]
    assert summary["loss_name"] == "next-token cross-entropy, nats/token" and summary["warnings"] == []
    assert summary["eval_loss_first"] is not None and summary["loss_last"] < summary["loss_first"]
    # report_to: the attached launch wrote the TensorBoard series when the run ended
    assert any((tmp_path / "tracking" / "ft" / "replica-0").glob("events.out.tfevents.*"))
    assert any((tmp_path / "tracking" / "ft" / "rounds").glob("events.out.tfevents.*"))


# ------------------------------------------- issue 34, finding 1: the replicas' own checks at --dry-run
def _replica_refusals_in_code() -> list[str]:
    """Every ``raise ValueError("model.<field>: ..." / "trainer.rollout: ...")`` of the code a replica runs while
    it builds its model and trainer (model.py, lora.py, trainer/): the constant text of each message."""
    import ast

    import composer_cloud

    root = Path(composer_cloud.__file__).parent
    found = []
    for path in [root / "model.py", root / "lora.py", *sorted((root / "trainer").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", None) == "ValueError" and node.exc.args):
                continue
            arg = node.exc.args[0]
            parts = [arg] if isinstance(arg, ast.Constant) else list(getattr(arg, "values", []))
            if isinstance(arg, ast.BinOp):  # "a" "b" f"c" concatenations
                parts = [n for n in ast.walk(arg) if isinstance(n, ast.Constant)]
            text = "".join(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str))
            if text.startswith(("model.", "trainer.rollout:")):
                found.append(text)
    return found


def _entry_for(message: str) -> str | None:
    from composer_cloud.runs.preflight import REPLICA_REFUSALS

    field = message.partition(":")[0]
    for key in REPLICA_REFUSALS:
        kfield, _, words = key.partition(": ")
        if kfield == field and all(w in message for w in words.split()):
            return key
    return None


def test_every_replica_side_settings_refusal_is_listed_with_what_launch_does():
    """Finding 1's enumeration: a new replica-side refusal must be added to REPLICA_REFUSALS (checked at launch,
    or why not), so the dry run cannot silently fall behind the replicas."""
    from composer_cloud.runs.preflight import REPLICA_REFUSALS

    messages = _replica_refusals_in_code()
    assert len(messages) >= 6, messages  # the scan found the refusals at all
    unlisted = [m for m in messages if _entry_for(m) is None]
    assert not unlisted, unlisted
    assert {_entry_for(m) for m in messages} == set(REPLICA_REFUSALS)  # no stale entry either
    assert all(v.startswith(("launch", "cannot")) for v in REPLICA_REFUSALS.values())


#: A spec that the replicas refuse, per REPLICA_REFUSALS entry (launch side): overrides and the fake GPU it needs.
_REFUSED_BY_REPLICAS = {
    "model.attention: flash_attention_2 needs a CUDA GPU": (
        {"model.precision": "bf16", "model.attention": "flash_attention_2"}, None),
    "model.attention: flash_attention_2 computes in half precision": ({"model.attention": "flash_attention_2"}, None),
    "model.attention: flash_attention_2 needs the flash-attn package": (
        {"model.precision": "bf16", "model.attention": "flash_attention_2"}, "A100"),
    "model.precision: has no bfloat16 support": ({"model.precision": "bf16"}, "Tesla T4"),
    "model.precision: use": ({"model.precision": "fp16"}, None),
    "model.lora.target_modules: matches no module of this model": (
        {"model.lora.r": 8, "model.lora.target_modules": ["q_prj"]}, None),
    "model.lora.dropout: the three-channel trainer runs without dropout": (
        {"model.lora.r": 8, "model.lora.dropout": 0.1}, None),
    "trainer.rollout: needs": ({"trainer.rollout": "vllm"}, None),
    "trainer.rollout: should be": ({"trainer.rollout": "fast"}, None),
}


@pytest.mark.parametrize("entry", sorted(_REFUSED_BY_REPLICAS))
def test_each_replica_refusal_is_a_launch_refusal(entry, tmp_path, monkeypatch):
    """Finding 1: bf16 + flash_attention_2 on a CPU-only local run, LoRA dropout with the three-channel trainer,
    target modules the demo model lacks (and the rest of the table) are refused by the dry run, exit 2, with the
    replica's own words, and nothing is written."""
    import torch

    from composer_cloud.runs.lifecycle import check_launch

    overrides, gpu = _REFUSED_BY_REPLICAS[entry]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
    # A GPU machine has its device files: without them the launcher knows there is no GPU without torch.
    monkeypatch.setattr("composer_cloud.forking.gpu_device_nodes", lambda: ["/dev/nvidia0"] if gpu else [])
    if gpu is not None:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: gpu != "Tesla T4")
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: gpu)
        monkeypatch.setattr("composer_cloud.model.flash_attention_installed", lambda: False)
    field, _, words = entry.partition(": ")
    with pytest.raises(SpecError) as refused:
        check_launch(overrides={"store": f"file://{tmp_path}/store", **overrides})
    message = str(refused.value)
    assert field in message and all(w in message for w in words.split()), message
    assert not (tmp_path / "store").exists()


def test_the_issues_three_dry_runs_exit_2(tmp_path, monkeypatch):
    """Finding 1 as the user met it: each of the three reproduced `--dry-run`s exited 0, then the replicas refused."""
    monkeypatch.chdir(tmp_path)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args, needle in [
        (["--set", "model.precision=bf16", "--set", "model.attention=flash_attention_2"], "needs a CUDA GPU"),
        (["--set", "model.lora.r=8", "--set", "model.lora.dropout=0.1"], "model.lora.dropout"),
        (["--set", "model.lora.r=8", "--set", 'model.lora.target_modules=["q_prj"]'], "'q_proj'"),
    ]:
        res = _dry(tmp_path, *args)
        assert res.exit_code == 2 and needle in res.output, res.output
    ok = _dry(tmp_path, "--set", "model.lora.r=8", "--set", 'model.lora.target_modules=["q_proj", "v_proj"]')
    assert ok.exit_code == 0, ok.output


def test_the_exported_model_card_records_no_absolute_path_or_store_uri(tmp_path):
    """Issue 34 finding 5: the card recorded the machine's absolute dataset path and the store URI."""
    from composer_cloud.runs.export import write_model_card
    from composer_cloud.spec import spec_from_dict
    from composer_cloud.storage.run import Run
    from composer_cloud.storage.store import Store

    secret_dir = tmp_path / "home" / "someone" / "private"
    spec = spec_from_dict({"run_id": "card", "store": f"file://{secret_dir}/runs",
                           "trainer": {"name": "three-channel", "dataset": f"{secret_dir}/qa.jsonl"}}, source="test")
    store = Store(f"file://{secret_dir}/runs/card")
    write_model_card(Run(uri=store.uri, store=store, spec=spec), tmp_path, round=0)
    card = (tmp_path / "README.md").read_text()
    assert str(secret_dir) not in card and "file://" not in card, card
    assert "qa.jsonl" in card and "card" in card


# ------------------------------------------- issue 34, finding 6: the smaller ones
def test_unknown_keys_are_blamed_on_their_source_with_a_suggestion_and_every_error_is_reported(tmp_path):
    with pytest.raises(SpecError) as given:
        load_spec(None, {"sync.codek": "bf16"})
    assert "given by --set" in str(given.value) and "did you mean sync.codec?" in str(given.value)
    path = tmp_path / "qa.toml"
    path.write_text("inner_step = 10\n")
    with pytest.raises(SpecError) as in_file:
        load_spec(path, {})
    assert f"given by {path}" in str(in_file.value) and "did you mean inner_steps?" in str(in_file.value)
    with pytest.raises(SpecError) as several:
        load_spec(None, {"replicas": 0, "rounds": -1, "inner_step": 10})
    assert all(f in str(several.value) for f in ("replicas:", "rounds:", "inner_step:")), str(several.value)
    with pytest.raises(SpecError) as validator:
        load_spec(None, {"model.lora.target_modules": []})
    assert "Value error" not in str(validator.value)


def test_an_unknown_hint_source_lists_every_value_the_setting_takes():
    from composer_cloud.trainer import check_settings

    with pytest.raises(ValueError) as refused:
        check_settings("three-channel", {"hint_source": "bogus"})
    assert all(v in str(refused.value) for v in ('"default"', "'none'", '"column:NAME"', "module:attribute"))


def test_doctor_of_a_misspelt_local_store_does_not_create_it(tmp_path):
    from typer.testing import CliRunner

    from composer_cloud.cli import app

    typo = tmp_path / "tpyo" / "runs"
    res = CliRunner().invoke(app, ["doctor", f"file://{typo}"])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "tpyo").exists() and "does not exist" in res.output


def test_empty_pairs_and_broken_datasets_are_refused_once_with_the_line_number(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.jsonl").write_text("")
    res = _dry(tmp_path, "--set", "trainer.pairs=pairs.jsonl")
    assert res.exit_code == 2 and "trainer.pairs" in res.output and "empty" in res.output, res.output
    (tmp_path / "empty.jsonl").write_text("")
    res = _dry(tmp_path, "--set", "trainer.dataset=empty.jsonl")
    assert res.exit_code == 2 and "is empty (0 bytes)" in res.output, res.output
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": "b"}\n{bad\n')
    res = _dry(tmp_path, "--set", "trainer.dataset=broken.jsonl")
    assert res.exit_code == 2 and "line 2 is not JSON" in res.output, res.output
    assert res.output.count("{bad") == 1 and "row 1" not in res.output, res.output


def test_a_gpu_type_for_no_gpu_executor_and_more_replicas_than_cores_are_warned(tmp_path):
    import os

    from composer_cloud.runs.lifecycle import launch_warnings

    spec = load_spec(None, {"replicas": (os.cpu_count() or 1) + 1})
    warned = launch_warnings(spec, given={"modal.gpu": "H100"})
    assert any("--gpu H100" in w for w in warned) and any("CPU core" in w for w in warned), warned
    assert launch_warnings(load_spec(None, {"replicas": 1}), given={}) == []


def test_the_metrics_table_never_cuts_a_number(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import composer_cloud.cli as cli_module
    from composer_cloud.cli import app
    from composer_cloud.spec import RunSpec
    from composer_cloud.storage.run import Run
    from composer_cloud.storage.store import Store

    store = Store(f"file://{tmp_path}/r")
    monkeypatch.setattr(cli_module, "_open", lambda uri, options: Run(uri=store.uri, store=store,
                                                                    spec=RunSpec(run_id="r")))
    row = {"kind": "round", "round": 0, "rank": 0, "committed": True, "train_loss": 0.000123456, "reward_mean": 0.5,
           "eval_loss": 3.14159, "eval_reward_mean": 0.25, "compute_s": 12345.678, "sync_s": 0.000987654,
           "superseded": False}
    monkeypatch.setattr(cli_module.runs, "read_metrics", lambda *a, **k: [row, {**row, "rank": 1}])
    res = CliRunner().invoke(app, ["metrics", "r"], terminal_width=60)
    assert res.exit_code == 0, res.output
    assert "…" not in res.output and "0.0001235" in res.output and "0.0009877" in res.output, res.output


def test_no_doubled_prefixes_in_launch_errors(tmp_path, monkeypatch):
    """`modal: modal: cannot launch ...` and `error: code: trainer.reward: ...` named their field twice."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qa.jsonl").write_text('{"q": "1+1", "answer": "2"}\n')
    (tmp_path / "my_rewards.py").write_text("x = 1\n")
    res = _dry(tmp_path, "--set", "trainer.dataset=qa.jsonl", "--set", "trainer.columns.prompt=q",
               "--set", "trainer.reward=my_rewards:scroe")
    assert res.exit_code == 2 and "error: trainer.reward:" in res.output and "code: trainer" not in res.output, \
        res.output
    pytest.importorskip("modal")
    res = _dry(tmp_path, "--executor", "modal", "--replicas", "1")
    assert res.exit_code == 2 and "modal: modal:" not in res.output, res.output


def test_no_is_gradient_checkpointing_future_warning_in_replica_logs(tmp_path):
    """Issue 34 finding 6: `FutureWarning: is_gradient_checkpointing` in every replica log and export (TRL reads
    it at each generation, PEFT at each adapter). A fresh interpreter, as a replica starts."""
    import subprocess
    import sys

    code = ("from composer_cloud.model import build_tiny_model, build_tokenizer\n"
            "m = build_tiny_model(build_tokenizer(), seed=0)\n"
            "print(m.is_gradient_checkpointing)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr
    assert "FutureWarning" not in res.stderr, res.stderr
