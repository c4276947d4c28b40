"""Every Python block in README.md and docs/ runs as written, in a fresh interpreter (issue 23, finding 7).

A block that cannot run here (it needs a cloud account or stands for the user's own functions) is
named in :data:`NOT_OFFLINE` with the reason; a new block must either run or be named there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: (file, index of the python block in it) -> why it cannot run offline
NOT_OFFLINE = {
    ("docs/trainer.md", 0): "stands for the user's own teacher callables (`for ...`) and writes to s3://",
}


def blocks(lang: str) -> dict[tuple[str, int], str]:
    """(file, index among its ``lang`` blocks) -> the block, over README.md and docs/."""
    out = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        rel = str(path.relative_to(ROOT))
        for i, block in enumerate(re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)):
            out[(rel, i)] = block
    return out


def python_blocks() -> dict[tuple[str, int], str]:
    return blocks("python")


def run_block(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_every_block_runs_or_says_why_not():
    blocks = python_blocks()
    assert set(NOT_OFFLINE) <= set(blocks), f"stale NOT_OFFLINE entries: {set(NOT_OFFLINE) - set(blocks)}"
    assert ("docs/metrics.md", 0) in blocks and ("README.md", 0) in blocks


def test_the_sparse_example_runs_in_a_fresh_interpreter(tmp_path):
    res = run_block(python_blocks()[("docs/sparse.md", 0)], tmp_path)
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
def test_the_readme_and_metrics_examples_run_in_a_fresh_interpreter(tmp_path):
    """The README's library example launches the demo under ./runs; docs/metrics.md then reads that run."""
    blocks = python_blocks()
    res = run_block(blocks[("README.md", 0)], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("completed 2 ['succeeded', 'succeeded']"), res.stdout
    (run_id,) = [p.name for p in (tmp_path / "runs").iterdir()]
    code = blocks[("docs/metrics.md", 0)].replace("<run_id>", run_id)
    res = run_block(code + "\nassert len(df) and {'round', 'rank', 'kind'} <= set(df.columns), df.columns\n"
                    "print(len(rows))", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert int(res.stdout.split()[-1]) > 0
    others = set(blocks) - set(NOT_OFFLINE) - {("README.md", 0), ("docs/metrics.md", 0), ("docs/sparse.md", 0)}
    for key in sorted(others):  # any block added later runs here too
        res = run_block(blocks[key], tmp_path)
        assert res.returncode == 0, f"{key}: {res.stderr[-2000:]}"


#: TOML blocks that are not run specs: what they are.
OTHER_TOML = {("docs/trainer.md", 1): "teachers", ("docs/trainer.md", 2): "PRIME-RL's own trainer config"}


def toml_blocks() -> dict[tuple[str, int], str]:
    return blocks("toml")


@pytest.mark.parametrize("key", sorted(toml_blocks()), ids=lambda k: f"{k[0]}#{k[1]}")
def test_every_documented_spec_passes_launchs_settings_checks(key, tmp_path):
    """The docs are the contract: each TOML block is a valid spec (strict fields) and valid trainer settings
    (the same checks launch and --dry-run run first)."""
    from composer_cloud.spec import load_spec
    from composer_cloud.trainer import check_settings

    path = tmp_path / "spec.toml"
    path.write_text(toml_blocks()[key])
    if key in OTHER_TOML:
        kind = OTHER_TOML[key]
        if kind == "teachers":  # composer-cloud pairs --teachers FILE: checked by its own loader
            from composer_cloud.trainer.three_channel.teachers import load_teachers

            assert load_teachers(str(path))
        return
    spec = load_spec(path, {})
    check_settings(spec.trainer.name, spec.trainer.settings())


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.toml")))
def test_every_example_spec_passes_launchs_settings_checks(example):
    from composer_cloud.spec import load_spec
    from composer_cloud.trainer import check_settings

    spec = load_spec(ROOT / "examples" / example, {})
    check_settings(spec.trainer.name, spec.trainer.settings())


def test_every_launch_flag_the_docs_show_exists():
    """Each `composer-cloud launch ...` line in README.md and docs/ uses only flags `launch` has (a renamed or
    removed flag fails here, not in a user's terminal)."""
    import typer.main

    from composer_cloud.cli import app

    launch = typer.main.get_command(app).commands["launch"]
    known = {opt for param in launch.params for opt in (*param.opts, *param.secondary_opts)}
    shown = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for line in path.read_text().splitlines():
            for tail in line.split("composer-cloud launch")[1:]:
                command = re.split(r"composer-cloud |#|`", tail)[0]
                shown += [(path.name, flag) for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", command)]
    assert ("README.md", "--gpus-per-replica") in shown and ("modal.md", "--gpus-per-replica") in shown
    assert [(name, flag) for name, flag in shown if flag not in known] == []


# ------------------------------------------- issue 34, finding 5: inline commands that a user can copy
def shown_commands() -> list[tuple[str, str]]:
    """(file, command) for every ``composer-cloud <subcommand> ...`` a user can copy from README.md and docs/:
    lines of bash blocks and inline code spans. Placeholders become values (``<run_id>`` -> ``r1``, ``$PWD`` ->
    ``/tmp``), optional ``[...]`` parts are dropped and ``a|b`` alternatives take the first."""
    import typer.main

    from composer_cloud.cli import app

    names = set(typer.main.get_command(app).commands)
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        spans = re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S)
        candidates = [line for block in spans for line in block.replace("\\\n", " ").splitlines()]
        # inline: a whole command (a bare `composer-cloud resume` in prose names the command, it is no recipe)
        candidates += [c for c in re.findall(r"`(composer-cloud [^`]+)`", text) if len(c.split()) >= 3]
        for line in candidates:
            for part in re.split(r"&&|;", line):
                part = part.split(" #")[0].strip()
                words = part.split()
                if len(words) >= 2 and words[0] == "composer-cloud" and words[1] in names and "/" not in words[2:3]:
                    out.append((str(path.relative_to(ROOT)), part))
    return out


def _concrete(command: str) -> list[str]:
    import shlex

    command = re.sub(r"\[[^\]]*\]", "", command)
    command = re.sub(r"<[^>]+>", "r1", command).replace("$PWD", "/tmp").replace("...", "x")
    command = re.sub(r"(--[a-z-]+ )(\w+)\|\w+", r"\1\2", command)
    args = shlex.split(command)[1:]
    return [a for a in args if a not in (">", "m.csv")]


#: Commands the docs show that name things the reader must have (their own files): they are parsed, not run.
def test_every_command_the_docs_show_parses(tmp_path):
    """Every `composer-cloud ...` a user can copy names a real command and only its real options, with values
    of the right type (click parses it exactly as the terminal would, without running it)."""
    import typer.main

    from composer_cloud.cli import app

    group = typer.main.get_command(app)
    shown = shown_commands()
    bad = []
    for where, command in shown:
        args = _concrete(command)
        try:
            ctx = group.make_context("composer-cloud", list(args), resilient_parsing=False)
            name, cmd, rest = group.resolve_command(ctx, args)
            cmd.make_context(name, rest, parent=ctx)
        except Exception as exc:  # noqa: BLE001 - click's UsageError/BadParameter (typer vendors click)
            if not hasattr(exc, "format_message"):
                raise
            bad.append(f"{where}: {command}: {exc.format_message()}")
    assert len(shown) >= 30, shown
    assert not bad, "\n".join(bad)


def _offline_launch_checks(monkeypatch, tmp_path):
    """`launch --dry-run` with what needs the network or an account stubbed: the store probe (a local store
    instead), SDK and credential checks, executors' preflights, the Hub. Every settings check still runs."""
    import composer_cloud.runs.doctor as doctor
    import composer_cloud.runs.lifecycle as lifecycle
    from composer_cloud.storage.store import Store, join_uri

    monkeypatch.setattr(lifecycle, "_open_store_for",
                        lambda spec, signing_key: Store(join_uri(f"file://{tmp_path}/probe", spec.run_id)))
    monkeypatch.setattr(doctor, "missing_sdks", lambda *a, **k: [])
    monkeypatch.setattr(doctor, "spec_credentials", lambda spec: [])
    monkeypatch.setattr(lifecycle, "check_hub_model", lambda *a, **k: None)
    from composer_cloud.jobs import hf_jobs, local, modal_jobs

    for module in (hf_jobs, local, modal_jobs):
        for cls in vars(module).values():
            if isinstance(cls, type) and "preflight" in vars(cls):
                monkeypatch.setattr(cls, "preflight", lambda self, *a, **k: None)


def test_every_launch_the_docs_show_passes_its_dry_run(tmp_path, monkeypatch):
    """Finding 5: the README's `launch --executor modal --gpu H100 --gpus-per-replica 8 --parallelism fsdp
    --dry-run` and the docs' gpus_per_replica snippets failed with the default trainer. Each launch line is run
    as a dry run (offline: the store probe, SDKs and credentials stubbed) from the repository root."""
    from typer.testing import CliRunner

    from composer_cloud.cli import app

    _offline_launch_checks(monkeypatch, tmp_path)
    monkeypatch.chdir(ROOT)
    failed = []
    for where, command in shown_commands():
        args = _concrete(command)
        if args[:1] != ["launch"]:
            continue
        args = [a for a in args if a not in ("--detach", "--dry-run")] + ["--dry-run", "--run-id", "docs-check"]
        if "--store" not in args:
            args += ["--store", f"file://{tmp_path}/store"]
        with monkeypatch.context() as m:
            if "device=cuda" in args:  # a line for a GPU machine: dry-run it as there (the GPU check's launch)
                import torch

                m.setattr(torch.cuda, "is_available", lambda: True)
                m.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
                m.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
            res = CliRunner().invoke(app, args)
        if res.exit_code != 0:
            failed.append(f"{where}: {command}\n  -> {res.output.strip().splitlines()[-1:]}")
    assert not failed, "\n".join(failed)


def test_the_causal_lm_trainers_keys_are_documented():
    """Finding 5: the causal-lm trainer's `[trainer]` keys were documented only in a docstring."""
    import dataclasses

    from composer_cloud.trainer.settings import CausalLMSettings

    text = (ROOT / "docs" / "trainer.md").read_text()
    section = text.split("The causal-LM trainer's `[trainer]` keys", 1)[1].split("\n## ", 1)[0]
    missing = [f.name for f in dataclasses.fields(CausalLMSettings) if f"`{f.name}`" not in section]
    assert not missing, missing


def test_no_doc_activates_a_venv_at_a_machines_absolute_path_and_sparse_is_offered():
    """Finding 5: docs/chaos.md and docs/convergence.md began with `source /work/main/.venv/...` and
    `source /tmp/venv/...`; `sparse` was missing from `--codec`'s help and examples/demo.toml."""
    from typer.testing import CliRunner

    from composer_cloud.cli import app

    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        assert not re.search(r"(source|\.) /\S*/bin/activate", path.read_text()), path
    assert "sparse" in " ".join(CliRunner().invoke(app, ["launch", "--help"], terminal_width=200).output.split())
    assert re.search(r"codec = .*sparse", (ROOT / "examples" / "demo.toml").read_text())


def test_launch_takes_store_option_as_the_readme_says(tmp_path, monkeypatch):
    """Finding 5: the README's `--store-option endpoint_url=...` was not a `launch` option."""
    from typer.testing import CliRunner

    from composer_cloud.cli import app

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["launch", "--dry-run", "--json", "--store", f"file://{tmp_path}/s",
                                   "--store-option", "auto_mkdir=true"])
    assert res.exit_code == 0, res.output
    import json

    assert json.loads(res.stdout)["spec"]["store_options"] == {"auto_mkdir": "true"}
