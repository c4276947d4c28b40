"""Bad input at launch (issue 37, item 6): settings that can only be a mistake, stores the jobs cannot share,
credentials in any URI form, and malformed library arguments are refused by name (exit 2 / a
:class:`~composer_cloud.errors.ComposerCloudError`), never a traceback, never echoing a secret."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import composer_cloud as cc
from composer_cloud.cli import app
from composer_cloud.errors import SpecError, redact, url_has_credentials

runner = CliRunner()

SECRET = "wJalr/XUtnFEMI+K7MDENG:bP@xRfiCYCANARY"  # "/", ":", "@" and "+" inside, as AWS secret keys can hold

OUT_OF_BOUNDS = [
    (["inner_optimizer.lr=1e6"], "inner_optimizer.lr"),
    (["inner_optimizer.weight_decay=1e6"], "inner_optimizer.weight_decay"),
    (["inner_optimizer.lr=0.5", "inner_optimizer.weight_decay=2"], "inner_optimizer.weight_decay"),
    (["outer_optimizer.lr=1e6"], "outer_optimizer.lr"),
    (["trainer.batch_size=1000000000"], "trainer.batch_size"),
    (["trainer.replay_batch_size=1000000000"], "trainer.replay_batch_size"),
    (["trainer.gradient_accumulation_steps=1000000000"], "trainer.gradient_accumulation_steps"),
    (["trainer.name=causal-lm", "trainer.batch_size=1000000000"], "trainer.batch_size"),
    (['sync.codec="sparse"', "sync.sparse.density=1e-9"], "sync.sparse.density"),
    (['sync.codec="sparse"', "sync.sparse.chunk=2"], "sync.sparse.chunk"),
    (["progress_every_s=1e-6"], "progress_every_s"),
    (["sync.store_outage_s=1e12"], "sync.store_outage_s"),
]


def _launch(tmp_path, *args: str, store: str | None = None):
    return runner.invoke(app, ["launch", "--store", store or f"file://{tmp_path}/store", "--run-id", "bounded",
                               *args])


@pytest.mark.parametrize("pairs,field", OUT_OF_BOUNDS, ids=[" ".join(p) for p, _ in OUT_OF_BOUNDS])
def test_settings_beyond_their_bounds_are_refused_naming_the_field(tmp_path, monkeypatch, pairs, field):
    monkeypatch.chdir(tmp_path)
    res = _launch(tmp_path, *[a for pair in pairs for a in ("--set", pair)])
    assert res.exit_code == 2, res.output
    assert field in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("pairs", [["inner_optimizer.lr=1.0", "inner_optimizer.weight_decay=0.5"],
                                   ["inner_optimizer.weight_decay=1", "inner_optimizer.lr=1e-4"],
                                   ["trainer.batch_size=1048576"], ["progress_every_s=0.1"],
                                   ["sync.store_outage_s=604800"],
                                   ['sync.codec="sparse"', "sync.sparse.chunk=64", "sync.sparse.density=0.01"]])
def test_settings_at_their_bounds_are_accepted(tmp_path, monkeypatch, pairs):
    monkeypatch.chdir(tmp_path)
    res = _launch(tmp_path, "--dry-run", *[a for pair in pairs for a in ("--set", pair)])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("executor", ["local", "modal", "hf-jobs"])
def test_a_memory_store_is_refused_for_executors_whose_replicas_are_processes(tmp_path, monkeypatch, executor):
    monkeypatch.chdir(tmp_path)
    res = _launch(tmp_path, "--set", f'executor="{executor}"', store="memory://composer-cloud/runs")
    assert res.exit_code == 2, res.output
    assert "store" in res.output and "memory://" in res.output and "one process" in res.output, res.output


@pytest.mark.parametrize("path", ["a" * 5000, "a/" * 2500])
def test_a_store_path_of_thousands_of_characters_is_a_named_error(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    for extra in ([], ["--dry-run"]):
        res = _launch(tmp_path, *extra, store=f"file://{tmp_path}/{path}")
        assert res.exit_code == 2, res.output
        assert isinstance(res.exception, SystemExit), res.exception  # a named error, not a traceback
        assert "store" in res.output and "bytes long" in res.output, res.output


@pytest.mark.parametrize("overrides", [{None: 1}, {1: 2}, {"": 1}, {"sync..codec": "bf16"}, ["sync.codec"]])
def test_malformed_overrides_are_a_spec_error_naming_them(tmp_path, overrides):
    with pytest.raises(SpecError, match="overrides"):
        cc.launch(overrides=overrides)
    with pytest.raises(SpecError, match="overrides"):
        cc.check_launch(overrides=overrides)


# ------------------------------------------------------------------ credentials in any URI form
CREDENTIAL_URIS = [
    f"s3://AKIACANARY:{SECRET}@bucket/runs",
    "s3://AKIACANARY:wJalr/XUtnCANARY@bucket/runs",
    "s3://AKIACANARY:p@ssCANARY@bucket/runs",
    "s3://CANARYTOKEN@bucket/runs",
    "s3://bucket/runs?X-Amz-Signature=CANARY&X-Amz-Expires=60",
    "s3://bucket/runs?token=CANARY",
]


@pytest.mark.parametrize("uri", CREDENTIAL_URIS)
def test_credentials_are_recognised_in_any_uri_form_and_redacted(uri):
    assert url_has_credentials(uri)
    assert "CANARY" not in redact(f"error: cannot open {uri} (retry)") and "retry" in redact(f"x {uri} (retry)")
    for plain in ("s3://bucket/runs", "file:///tmp/a@b/runs", "s3://bucket/v@2/runs", "http://[::1]:9000/x?part=1"):
        assert not url_has_credentials(plain) and redact(plain) == plain


@pytest.mark.parametrize("uri", CREDENTIAL_URIS[:3] + CREDENTIAL_URIS[4:5])
@pytest.mark.parametrize("command", ["launch", "status", "doctor"])
def test_status_launch_and_doctor_never_echo_credentials_of_a_uri(tmp_path, monkeypatch, command, uri):
    monkeypatch.chdir(tmp_path)
    args = {"launch": ["launch", "--store", uri, "--dry-run"], "status": ["status", f"{uri}/run-x"],
            "doctor": ["doctor", uri]}[command]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "CANARY" not in res.output and "XUtn" not in res.output, res.output


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9/?X-Amz-Security-Token=CANARY",
                                      "http://127.0.0.1:9/bucket?sig=CANARY", "http://u:p/w@127.0.0.1:9"])
def test_store_options_with_a_secret_in_an_endpoints_query_are_refused_by_name(tmp_path, monkeypatch, endpoint):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(f'store = "s3://bucket/runs"\n[store_options]\nendpoint_url = "{endpoint}"\n')
    res = runner.invoke(app, ["launch", "--config", str(tmp_path / "c.toml"), "--dry-run"])
    assert res.exit_code == 2, res.output
    assert "store_options" in res.output and "endpoint_url" in res.output, res.output
    assert "CANARY" not in res.output and "p/w" not in res.output, res.output


@pytest.mark.parametrize("command", ["status", "logs"])
def test_a_run_name_too_long_for_the_file_system_is_a_named_error(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, [command, "a" * 5000])
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), res.exception
    assert "cannot read run" in res.output, res.output
