"""benchmarks/convergence_decoupled.py drives the replica's own decoupled boundary: a two-replica run per codec."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import convergence_decoupled as bench  # noqa: E402


def test_both_codecs_run_the_same_merge_schedule_through_the_store(tmp_path):
    cfg, _ = bench.parse_args(["--steps", "4", "--h", "2", "--replicas", "2", "--hidden", "32", "--intermediate", "64",
                               "--vocab", "256", "--batch-size", "2", "--seq-len", "16", "--corpus-size", "200",
                               "--eval-rows", "8", "--warmup", "1", "--sparse-chunk", "1024"])
    runs = {c: bench.run_codec(cfg, c, f"file://{tmp_path}/store", drive_mode="interleaved", grace_s=60.0,
                               min_quorum=None) for c in ("fp32", "sparse")}
    for r in runs.values():
        assert r["syncs_per_replica"] == {0: 2, 1: 2} and r["inner_steps_total"] == 8
        assert r["final_version"] >= 2 and math.isfinite(r["final_heldout_loss"])
        assert all(m["reason"].startswith("quorum") for m in r["merges"])
    assert [(m["rank"], m["round"]) for m in runs["fp32"]["merges"]] == \
        [(m["rank"], m["round"]) for m in runs["sparse"]["merges"]]
    # Contributions are sparse payloads on the wire; the global versions stay dense fp32.
    assert runs["sparse"]["sparse"]["density"] == pytest.approx(1 / 64)
    fp32, sparse = (runs[c]["contribution_bytes_per_replica_round"] for c in ("fp32", "sparse"))
    assert fp32 > 20 * sparse
    assert runs["sparse"]["bytes_by_kind_per_replica_round"]["globals"][0] > 0
    assert runs["sparse"]["final_heldout_loss"] != runs["fp32"]["final_heldout_loss"]
