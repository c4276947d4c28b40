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
    assert res.stdout.startswith("completed 3 ['succeeded', 'succeeded']"), res.stdout
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
OTHER_TOML = {("docs/trainer.md", 0): "teachers", ("docs/trainer.md", 1): "PRIME-RL's own trainer config"}


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
