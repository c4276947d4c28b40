"""The shared test helpers (tests/support): test modules stay independent, baselines are built once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from support.processes import run_processes
from support.resume import Baselines, same_weights
from support.specs import RESUME_SPEC, with_sync

TESTS = Path(__file__).parent


def test_no_test_module_imports_another_test_module():
    """Shared helpers live in tests/support; a test module importing another one couples their runs."""
    modules = {p.stem for p in TESTS.glob("test_*.py")}
    offenders = []
    for path in [*TESTS.glob("*.py"), *(TESTS / "support").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in modules | {"conftest"}]
    assert offenders == []


def test_with_sync_replaces_and_adds_settings_only_in_the_sync_table():
    spec = with_sync(RESUME_SPEC, quorum_timeout_s=15, heal_timeout_s=30)
    sync = spec.split("[sync]\n", 1)[1].split("[", 1)[0]
    assert "quorum_timeout_s = 15" in sync and "heal_timeout_s = 30" in sync and "round_timeout_s = 120" in sync
    assert "quorum_timeout_s = 60" not in spec and spec.endswith(RESUME_SPEC.split("[model]", 1)[1])
    with pytest.raises(ValueError, match="no \\[sync\\]"):
        with_sync("replicas = 2\n", quorum_timeout_s=1)


def _build_concurrently(q, index, cache: str, tmp: str) -> None:
    """One xdist worker asking for the baseline; the build writes a marker so the test can count builds."""
    calls = Path(tmp) / f"build-{index}"

    def build(tmp_path, path):
        calls.write_text(str(tmp_path))
        save_file({"w": torch.full((3,), 7.0)}, str(path))

    baselines = Baselines(Path(cache))
    baselines._build = build  # the run and export are what this stands in for
    work = Path(tmp) / f"w{index}"
    work.mkdir()
    q.put((index, baselines.get(work)["w"].tolist()))


def test_a_baseline_is_built_once_by_concurrent_workers(tmp_path):
    results = run_processes(_build_concurrently, [(str(tmp_path / "cache"), str(tmp_path))] * 3, timeout=120)
    assert results == [[7.0, 7.0, 7.0]] * 3
    assert len(list(tmp_path.glob("build-*"))) == 1  # the others waited on the lock and read its file


def test_same_weights_is_bitwise():
    a = {"w": torch.tensor([1.0, 2.0])}
    assert same_weights(a, {"w": torch.tensor([1.0, 2.0])})
    assert not same_weights(a, {"w": torch.nextafter(a["w"], torch.tensor(3.0))})  # one ulp off
    assert not same_weights(a, {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)})
    assert not same_weights(a, {"v": torch.tensor([1.0, 2.0])})


def test_run_processes_fails_fast_when_a_worker_dies(tmp_path):
    with pytest.raises(RuntimeError, match="died before reporting: exit codes \\{1: 3\\}"):
        run_processes(_dies_or_waits, [(str(tmp_path),)] * 2, timeout=60)


def _dies_or_waits(q, index, tmp: str) -> None:
    import os
    import time

    if index == 1:
        os._exit(3)
    time.sleep(30)  # would hold the wait for its whole timeout without the dead-worker check
    q.put((index, None))


def test_a_command_run_in_this_process_that_hangs_fails_after_its_timeout(tmp_path, monkeypatch):
    """cli_here's guard: a hung in-process command (an attached resume of a run that never ends) fails the test
    with a TimeoutError instead of holding its xdist worker; the alarm is off again afterwards."""
    import signal
    import time

    import composer_cloud.cli as cli_module
    from support.cli import cli_here

    monkeypatch.setattr(cli_module, "_open", lambda *a, **k: time.sleep(60))
    started = time.monotonic()
    res = cli_here("status", f"file://{tmp_path}/run", cwd=tmp_path, timeout=0.5)
    assert isinstance(res.exception, TimeoutError) and "still running after" in str(res.exception)
    assert time.monotonic() - started < 30
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
