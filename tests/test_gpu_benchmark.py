"""benchmarks/gpu.py --tiny: the GPU benchmark's whole path (both trainers, full and LoRA, the sync) on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_benchmark_tiny_runs_end_to_end(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["mode"], r["impl"]) for r in rows} == {(m, i) for m in ("full", "lora")
                                                       for i in ("composer-cloud", "trl")}
    for r in rows:
        assert r["step_s"] > 0 and 0 <= r["rollout_s"] <= r["step_s"] and r["tokens_per_s"] > 0
        assert r["sync_s"] > 0 and 0 < r["sync_share_h50"] < 1
        assert r["peak_mem_gib"] is None and r["mfu"] is None  # CPU: no GPU memory, no peak FLOPs
    lora = next(r for r in rows if r["mode"] == "lora")
    full = next(r for r in rows if r["mode"] == "full")
    assert lora["synced_mib"] < full["synced_mib"] == full["full_mib"]
    # The store's counters: a LoRA round moves a fraction of a full round's bytes, close to the synced share.
    assert full["store_vs_full"] == 1.0 and lora["store_vs_full"] < 1.0
    assert lora["store_vs_full"] == pytest.approx(lora["synced_ratio"], rel=0.5)
    assert "vs TRL" in done.stdout and "sync@H50" in done.stdout
