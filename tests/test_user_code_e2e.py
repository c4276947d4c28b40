"""A user's own task module, hint source and prompt file travel with the run (issue 12): launched from
an unrelated directory, the replicas import them from the run's store, not from any working directory."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from composer_cloud.runs import open_run
from composer_cloud.runs.metrics import read_metrics
from support.cli import cli
from support.hf_jobs import NAMESPACE
from support.local_jobs import replica_log
from support.specs import CAUSAL_LM, SMALL_RUN_TOML

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
    user = _user_project(tmp_path, model_dir=True)
    spec = SMALL_RUN_TOML.replace(CAUSAL_LM, 'name = "three-channel"\ntask = "my_tasks:make_task"\n'
                                  'hint_source = "my_tasks:make_hints"').replace(
                                      "[model]\n", '[model]\nname = "tiny-model"\n')  # relative to the spec
    (user / "spec.toml").write_text('replicas = 2\nrounds = 1\ninner_steps = 2\n[code]\ninclude = ["prompts.jsonl"]\n'
                                    + spec)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_uri = f"file://{tmp_path}/store/mine"
    res = _user_cli("launch", "--config", str(user / "spec.toml"), "--store", f"file://{tmp_path}/store",
                    "--run-id", "mine", cwd=elsewhere)
    assert res.returncode == 0, res.stdout + res.stderr
    launched = open_run(run_uri).spec
    assert launched.code.ref["modules"] == ["my_tasks"]
    assert launched.model.name == str(user / "tiny-model") and launched.code.files == {}
    log = replica_log(run_uri, 0)
    assert "user code ['my_tasks'] installed" in log, log[-2000:]
    assert f"loading model {user / 'tiny-model'} with transformers" in log


# ---------------------------------------------------------------------- HF Jobs + s3:// (issue 12, "done when")
AWS = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"]


def _user_project(root: Path, *, model_dir: bool) -> Path:
    """A user folder: task module + hint source, a prompts file, optionally a saved tiny model."""
    user = root / "project"
    user.mkdir()
    (user / "my_tasks.py").write_text(TASK)
    (user / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Question {i}: yes or no?"}) + "\n"
                                                for i in range(16)))
    if model_dir:
        from composer_cloud.model import TinyModelConfig, build_tiny_model, build_tokenizer

        tok = build_tokenizer()
        model = build_tiny_model(tok, seed=0, config=TinyModelConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=128))
        model.save_pretrained(user / "tiny-model")
        tok.save_pretrained(user / "tiny-model")
    return user


def _user_cli(*args: str, cwd: Path, **env_extra: str) -> subprocess.CompletedProcess:
    """The CLI without the user's folder on ``PYTHONPATH``: the replicas can only get user code from the store."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" or "project" not in v}
    return cli(*args, cwd=cwd, env={**env, **env_extra}, timeout=600)


@pytest.mark.slow
def test_user_task_prompts_hints_and_model_folder_travel_to_hf_jobs_through_s3(hf_env, wheel, s3_endpoint,
                                                                                tmp_path):
    """Launched from an unrelated folder; the model folder is renamed away right after launch, and the
    jobs run in their own folders: they can only have used the copies uploaded to the store."""
    import secrets as _secrets

    from composer_cloud.runs.lifecycle import wait
    from composer_cloud.storage.run import open_run

    user = _user_project(tmp_path, model_dir=True)
    (user / "spec.toml").write_text(f"""replicas = 2
rounds = 1
inner_steps = 2
[model]
name = "./tiny-model"
[code]
include = ["prompts.jsonl"]
[trainer]
name = "three-channel"
task = "my_tasks:make_task"
hint_source = "my_tasks:make_hints"
batch_size = 4
seq_len = 16
num_generations = 2
eval_examples = 2
[hf_jobs]
namespace = "{NAMESPACE}"
flavor = "cpu-basic"
secrets = {json.dumps(AWS)}
""")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = f"s3://cc-test/e2e-{_secrets.token_hex(3)}"
    res = _user_cli("launch", "--config", str(user / "spec.toml"), "--executor", "hf-jobs", "--store", store,
                    "--run-id", "mine", "--detach", cwd=elsewhere, COMPOSER_CLOUD_PREBUILT_WHEEL=str(wheel))
    assert res.returncode == 0, res.stdout + res.stderr
    (user / "tiny-model").rename(user / "moved-away")
    run_uri = f"{store}/mine"
    final = wait(run_uri, timeout_s=300)
    logs = _user_cli("logs", run_uri, "--replica", "0", cwd=elsewhere).stdout
    assert final.state == "completed", (final, logs[-3000:])
    spec = open_run(run_uri).spec
    assert spec.model.name == "./tiny-model" and spec.code.files["model.name"].startswith("dirs/")
    assert spec.code.ref["modules"] == ["my_tasks"]
    assert "local files of the spec fetched from the store" in logs and "user code ['my_tasks'] installed" in logs
    steps = read_metrics(open_run(run_uri).store, rank=0, kind="step")
    assert steps and all(r["dpo"] == 0.0 for r in steps)  # pairs auto: no demo pairs


@pytest.mark.jobs_hub
def test_hf_jobs_with_an_s3_store_and_no_secrets_exits_2_and_writes_nothing(tmp_path, s3_endpoint, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    store = "s3://cc-test/no-secrets"
    res = _user_cli("launch", "--executor", "hf-jobs", "--store", store, "--run-id", "x", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    # (the CLI prints errors as rich markup, which swallows "[hf_jobs]": match around it)
    assert "AWS_ACCESS_KEY_ID" in res.stderr and "secrets has no AWS credentials" in res.stderr
    import fsspec

    assert not fsspec.filesystem("s3").exists("cc-test/no-secrets/x")


def test_local_files_are_refused_or_checked_before_anything_is_written(tmp_path):
    from composer_cloud.runs.lifecycle import check_before_launch
    from composer_cloud.spec import SpecError, load_spec

    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(SpecError, match="model.name: .*no config.json"):
        check_before_launch(load_spec(None, {"model.name": "./not-a-model"}).with_run_id(), base_dir=tmp_path)
    with pytest.raises(SpecError, match=r"model.name = './missing': no such file or folder"):
        check_before_launch(load_spec(None, {"model.name": "./missing"}).with_run_id(), base_dir=tmp_path)
    with pytest.raises(SpecError, match=r"trainer.pairs = 'pairs.jsonl': no such file"):
        check_before_launch(load_spec(None, {"trainer.pairs": "pairs.jsonl"}).with_run_id(), base_dir=tmp_path)


def test_local_paths_become_absolute_for_local_replicas_and_keys_for_cloud_ones(tmp_path, monkeypatch):
    from composer_cloud.storage.store import Store
    from composer_cloud.spec import load_spec
    from composer_cloud.env import JobEnv
    from composer_cloud.replica.usercode import localize_spec
    from composer_cloud.runs.packaging import pack_path, spec_local_paths
    from composer_cloud.spec_paths import apply_spec_paths

    (tmp_path / "pairs.jsonl").write_text("{}\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"prompt": "p"}\n')
    found = spec_local_paths("org/model", {"pairs": "pairs.jsonl", "dataset": "json",
                                           "data_files": ["data/a.jsonl"]}, base_dir=tmp_path)
    assert [(p.setting, p.path) for p in found] == [("trainer.pairs", tmp_path / "pairs.jsonl"),
                                                    ("trainer.data_files.0", tmp_path / "data" / "a.jsonl")]
    assert spec_local_paths("org/model", {"pairs": "s3://b/p.jsonl", "dataset": "org/ds"}, base_dir=tmp_path) == []
    # cloud: the replica swaps in verified copies from the store
    store = Store(f"file://{tmp_path}/store/run")
    from composer_cloud.runs.packaging import put_verified

    files = {}
    for p in found:
        key, data, sha = pack_path(p.path)
        put_verified(store, key, data, sha)
        files[p.setting] = key
    spec = load_spec(None, {"trainer.pairs": "pairs.jsonl", "trainer.dataset": "json",
                            "trainer.data_files": ["data/a.jsonl"]})
    spec = spec.model_copy(update={"code": spec.code.model_copy(update={"files": files})})  # as launch sets it
    local = localize_spec(store, spec, cache_dir=tmp_path / "cache")  # no map from the launcher: the spec's
    settings = local.trainer.settings()
    assert settings["pairs"].startswith(str(tmp_path / "cache" / "files"))
    assert Path(settings["data_files"][0]).read_text() == '{"prompt": "p"}\n'
    assert apply_spec_paths({"model": {"name": "m"}, "trainer": {}}, {"model.name": "/abs"})["model"]["name"] == "/abs"
    # The launcher's map in the job environment wins over the store's copy of the spec (a forged key is not used).
    forged = spec.model_copy(update={"code": spec.code.model_copy(update={"files": {"trainer.pairs": "files/"
                                                                                    + "0" * 64 + "/x"}})})
    job_env = JobEnv.from_environ({"COMPOSER_CLOUD_FILES": json.dumps(files)})
    assert localize_spec(store, forged, cache_dir=tmp_path / "cache",
                         files=job_env.files).trainer.settings() == settings
    with pytest.raises(ValueError, match="invalid uploaded file entry"):
        localize_spec(store, spec, cache_dir=tmp_path / "cache", files={"sync.codec": files["trainer.pairs"]})


def test_a_model_name_that_is_no_folder_and_no_reachable_hub_model_warns(tmp_path, monkeypatch, caplog):
    from composer_cloud.runs.lifecycle import check_before_launch
    from composer_cloud.spec import load_spec

    with caplog.at_level("WARNING"):
        check_before_launch(load_spec(None, {"model.name": "my-modle"}).with_run_id(), base_dir=tmp_path)
    assert "model.name 'my-modle' is neither a folder under" in caplog.text
