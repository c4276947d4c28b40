"""benchmarks/gpu_check.sh: the one-command GPU check, rehearsed on a CPU (``--cpu``), and its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check_steps as steps  # noqa: E402

STAGES = ["install", "e2e-demo", "e2e-qwen-lora", "fast-rollout", "gpu-bench"]
# The --cpu timeouts are sized for an idle 2-core machine; a loaded CI worker gets room (the stages' work is fixed).
ROOMY = {f"GPU_CHECK_TIMEOUT_{s.upper().replace('-', '_')}": "420" for s in STAGES}


def _check(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    # The script's work folder is under the usual $TMPDIR (it removes it): the rehearsals of this module then
    # share one local fork server (its key includes TMPDIR), started once rather than per test.
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=2400, env={**os.environ, "OUT": str(out), **env})
    return done, json.loads((out / "gpu_check.json").read_text())


def _assert_rows_in_order(report: dict) -> None:
    rows = report["rows"]
    assert [r["stage"] for r in rows] == STAGES
    times = [r["t"] for r in rows]
    assert times == sorted(times) and len(set(times)) == len(times)
    for r in rows:
        assert r["started"] <= r["finished"] and r["seconds"] >= 0
        assert r["status"] in ("ok", "failed", "timeout", "skipped")
        if r["status"] == "skipped":
            assert r["reason"]


@pytest.mark.slow
def test_cpu_rehearsal_runs_every_stage(tmp_path):
    done, report = _check(tmp_path, **ROOMY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["mode"] == "cpu" and report["complete"]
    _assert_rows_in_order(report)
    rows = {r["stage"]: r for r in report["rows"]}
    # The wheels are installed only on the GPU machine; here the stage checks the imports and versions.
    assert rows["install"]["status"] in ("ok", "skipped")
    assert rows["install"]["versions"]["torchft"] != "not installed"
    for stage in ("e2e-demo", "e2e-qwen-lora"):
        r = rows[stage]
        assert r["status"] == "ok", r.get("error_tail")
        assert r["rounds"] == 3 and len(r["round_s"]) == 3 and all(s > 0 for s in r["round_s"])
        assert r["replicas"] == 2 and r["export_logits_finite"]
    # The LoRA run's export is the merged model: adapters folded in, as many parameters as the saved base.
    lora = rows["e2e-qwen-lora"]
    assert lora["model_shape"] == "tiny" and lora["export_params"] == lora["model_params"]
    fast = rows["fast-rollout"]
    if (ROOT / "benchmarks" / "rollout_speed.py").exists():
        assert fast["status"] == "ok", fast.get("error_tail")
        assert fast["hf_tokens_per_s"] > 0 and fast["hf-fast_tokens_per_s"] > 0 and fast["fast_vs_hf"] > 0
    else:
        assert fast["status"] == "skipped" and fast["reason"] == "rollout_speed.py not available"
    bench = rows["gpu-bench"]
    assert bench["status"] == "ok", bench.get("error_tail")
    assert bench["complete"]
    assert {(r["mode"], r["rollout"], r["impl"]) for r in bench["rows"]} >= {
        (m, "hf", i) for m in ("full", "lora") for i in ("composer-cloud", "trl")}
    for r in bench["rows"]:
        assert r["step_s"] > 0 and r["sync_s"] > 0 and 0 < r["sync_share_h50"] < 1
    # gpu.py's own report (this stage is the smoke run of benchmarks/gpu.py on CPU: both trainers, full and LoRA).
    gpu_rows = json.loads((tmp_path / "out" / "gpu.json").read_text())["rows"]
    assert {(r["mode"], r["impl"]) for r in gpu_rows} >= {(m, i) for m in ("full", "lora")
                                                          for i in ("composer-cloud", "trl")}
    for r in gpu_rows:
        assert 0 <= r["rollout_s"] <= r["step_s"] and r["tokens_per_s"] > 0
        assert r["peak_mem_gib"] is None and r["mfu"] is None  # CPU: no GPU memory, no peak FLOPs
    lora = next(r for r in gpu_rows if r["mode"] == "lora")
    full = next(r for r in gpu_rows if r["mode"] == "full")
    assert lora["synced_mib"] < full["synced_mib"] == full["full_mib"]
    # The store's counters: a LoRA round moves a fraction of a full round's bytes, close to the synced share.
    assert full["store_vs_full"] == 1.0 and lora["store_vs_full"] < 1.0
    assert lora["store_vs_full"] == pytest.approx(lora["synced_ratio"], rel=0.5)


@pytest.mark.slow
def test_a_stage_killed_by_its_timeout_keeps_the_other_rows(tmp_path):
    # Only the stage that times out and one after it (the rehearsal above runs them all).
    done, report = _check(tmp_path, GPU_CHECK_STAGES="e2e-demo,fast-rollout", GPU_CHECK_TIMEOUT_E2E_DEMO="1",
                          GPU_CHECK_TIMEOUT_FAST_ROLLOUT="420")
    assert done.returncode == 1  # a stage timed out
    assert report["complete"]
    _assert_rows_in_order(report)
    rows = {r["stage"]: r for r in report["rows"]}
    assert rows["e2e-demo"]["status"] == "timeout" and rows["e2e-demo"]["timeout_s"] == 1
    assert "error_tail" in rows["e2e-demo"]
    assert rows["fast-rollout"]["status"] in ("ok", "skipped")  # ran after the timed-out stage
    if rows["fast-rollout"]["status"] == "ok":
        assert rows["fast-rollout"]["hf_tokens_per_s"] > 0
    for stage in ("install", "e2e-qwen-lora", "gpu-bench"):
        assert rows[stage]["status"] == "skipped" and "GPU_CHECK_STAGES" in rows[stage]["reason"]


def _row(report_path: Path, stage: str, rc: int, started: float, numbers: dict | None, log: str = "") -> None:
    num = report_path.with_name(f"{stage}.numbers.json")
    if numbers is not None:
        num.write_text(json.dumps(numbers))
    log_path = report_path.with_name(f"{stage}.log")
    log_path.write_text(log)
    assert steps.main(["row", "--json", str(report_path), "--stage", stage, "--rc", str(rc), "--started",
                       str(started), "--timeout", "5", "--log", str(log_path), "--numbers", str(num)]) == 0


def test_report_is_rewritten_after_every_row(tmp_path):
    report = tmp_path / "gpu_check.json"
    assert steps.main(["init", "--json", str(report), "--mode", "cpu", "--stages", "a,b,c,d"]) == 0
    _row(report, "a", 0, 1.0, {"tokens_per_s": 12.5})
    first = json.loads(report.read_text())
    assert [r["stage"] for r in first["rows"]] == ["a"] and not first["complete"]
    assert first["rows"][0]["status"] == "ok" and first["rows"][0]["tokens_per_s"] == 12.5
    assert "error_tail" not in first["rows"][0]
    _row(report, "b", 124, 2.0, None, log="x" * 5000 + "the end")
    _row(report, "c", steps.SKIP_RC, 3.0, {"reason": "rollout_speed.py not available"})
    _row(report, "d", 1, 4.0, {}, log="Traceback: boom")
    rows = json.loads(report.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "timeout", "skipped", "failed"]
    assert rows[1]["error_tail"].endswith("the end") and len(rows[1]["error_tail"]) == steps.TAIL_CHARS
    assert rows[2]["reason"] == "rollout_speed.py not available" and "error_tail" not in rows[2]
    assert rows[3]["error_tail"] == "Traceback: boom"
    assert steps.main(["finish", "--json", str(report)]) == 1  # a stage failed or timed out
    assert json.loads(report.read_text())["complete"]


def test_status_of_exit_codes():
    assert [steps.status_of(rc) for rc in (0, 1, 2, 3, 124, 137)] == [
        "ok", "failed", "failed", "skipped", "timeout", "timeout"]


def test_round_times_take_the_slowest_replica_per_round():
    rows = [{"kind": "round", "round": r, "rank": k, "wall_s": 1.0 + r + k, "sync_s": 0.5} for r in range(3)
            for k in range(2)]
    got = steps.round_times(rows)
    assert got["rounds"] == 3 and got["round_s"] == [2.0, 3.0, 4.0] and got["replicas"] == 2
    assert got["round_s_median"] == 3.0 and got["sync_s_median"] == 0.5


def test_rollout_rows_read_a_rows_list_or_a_modes_table():
    listed = {"rows": [{"rollout": "hf", "tokens_per_s": 10}, {"mode": "hf-fast", "tokens_per_s": 60}]}
    assert {k: v["tokens_per_s"] for k, v in steps._rollout_rows(listed).items()} == {"hf": 10, "hf-fast": 60}
    table = {"modes": {"hf": {"tokens_per_s": 1}, "hf-fast": {"tokens_per_s": 7}}}
    assert set(steps._rollout_rows(table)) == {"hf", "hf-fast"}
    assert steps._rollout_rows([1, 2]) == {}


def test_wheel_listing_names_requirements_without_a_wheel(tmp_path):
    for name in ("trl-1.16.0-py3-none-any.whl", "torchft-0.1.0-cp312-cp312-manylinux_2_17_x86_64.whl",
                 "typing_extensions-4.16.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"x" * 1024)
    (tmp_path / "requirements.txt").write_text("trl==1.16.0\ntorchft==0.2.0\ntyping-extensions\ndatasets\n")
    got = steps.wheel_listing(tmp_path)
    assert got["wheels"] == 3 and got["wheels_missing"] == ["torchft==0.2.0", "datasets"]
