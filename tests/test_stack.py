"""The run's numeric stack: what a replica reports, and how replicas' reports are compared."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib import metadata

import torch

from composer_cloud import stack


def test_runtime_versions_describe_this_process():
    v = stack.runtime_versions()
    assert list(v) == list(stack.KEYS)
    assert all(isinstance(x, str) and x for x in v.values())
    assert v["python"] == platform.python_version()
    assert v["torch"] == torch.__version__
    assert v["cuda"] == (torch.version.cuda or "none")
    assert v["transformers"] == metadata.version("transformers")
    assert v["trl"] == metadata.version("trl")
    if not torch.cuda.is_available():
        assert v["device"] == "cpu"
    assert stack.runtime_versions(device="cpu")["device"] == "cpu"
    json.dumps(v)  # heartbeat-ready


def test_runtime_versions_from_the_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "composer_cloud.stack"], capture_output=True, text=True, check=True)
    assert f"torch: {torch.__version__}" in out.stdout


def _rec(rank, **over):
    base = {"python": "3.11.7", "torch": "2.13.0+cu130", "cuda": "13.0", "transformers": "5.23.0",
            "trl": "1.16.0", "composer-cloud": "0.1.0", "device": "NVIDIA H100 80GB HBM3"}
    return {"rank": rank, "versions": {**base, **over}}


def test_no_skew_when_replicas_agree():
    assert stack.version_skew([_rec(0), _rec(1), _rec(2)]) == []
    # The same torch with another local label, and another CUDA minor, is the same stack.
    assert stack.version_skew([_rec(0), _rec(1, torch="2.13.0+cu131", cuda="13.1")]) == []
    assert stack.version_skew([]) == []


def test_skew_names_the_key_the_values_and_the_ranks():
    skew = stack.version_skew([_rec(0), _rec(1), _rec(2, torch="2.7.1+cu126", cuda="12.6")])
    assert skew == ["torch differs: 2.13.0 (ranks 0, 1), 2.7.1 (rank 2)",
                    "cuda major differs: 13 (ranks 0, 1), 12 (rank 2)"]
    cpu = stack.version_skew([_rec(0), _rec(1, torch="2.13.0+cpu", cuda="none", device="cpu")])
    assert "cuda major differs: 13 (rank 0), none (rank 1)" in cpu
    assert any(line.startswith("device differs") for line in cpu)


def test_skew_accepts_flat_records_and_skips_records_without_versions():
    flat = [{**_rec(0)["versions"]}, {**_rec(1, trl="1.15.0")["versions"]}, {"rank": 7}]
    assert stack.version_skew(flat) == ["trl differs: 1.15.0 (rank 1), 1.16.0 (rank 0)"]
    assert stack.version_skew([{"rank": 0, "versions": None}, _rec(1)]) == []


def test_stack_mismatch_against_the_default_images():
    assert stack.stack_mismatch(_rec(0)["versions"]) == []
    assert stack.stack_mismatch({"python": "3.11.9", "torch": "2.13.0+cpu", "cuda": "none"}) == []
    problems = stack.stack_mismatch({"python": "3.12.1", "torch": "2.7.1+cu126", "cuda": "12.6"})
    assert [p.split()[0] for p in problems] == ["python", "torch", "CUDA"]
