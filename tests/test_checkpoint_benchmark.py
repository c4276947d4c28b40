"""benchmarks/checkpoint.py on the tiny model: every phase runs against today's checkpoint API (and the 951ee6d
module it compares with), and the resume reads what it needs, once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_checkpoint_benchmark_tiny_runs_every_phase(tmp_path):
    out = tmp_path / "checkpoint.json"
    # The smallest run that still has every phase: one inner step per round, one world size (the resume's W),
    # a small calibration write.
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checkpoint.py"), "--models", "tiny", "--no-s3",
                           "--repeats", "1", "--rounds", "2", "--h", "1", "--world-sizes", "2", "--calibrate-mb", "8",
                           "--tmp", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert case.get("error") is None, case.get("error")
    read = case["phases"]["read"]
    # The launcher reads the checkpoint once; a replica reads the global state and its own state once.
    assert read["latest_checkpoint"]["x_needed"] == 1.0 and read["replica_startup"]["x_needed"] == 1.0
    assert read["load_global"]["verified"] and read["load_replica"]["verified"]
    assert "Resume read volume" in done.stdout
