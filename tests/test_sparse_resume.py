"""A lock-step run with the sparse codec, SIGKILLed in round 2 and resumed, ends bitwise where it would have.

The error-feedback accumulators are training state: they travel in each replica's checkpoint and are
restored bitwise; a resume that restarted them from zero would send other payloads and diverge.
"""

from __future__ import annotations


import pytest
from safetensors.torch import load

from composer_cloud.storage import layout
from composer_cloud.storage.store import Store
from support.cli import cli_here, status_here
from support.resume import export_weights, kill_run_at, launch_and_wait, same_weights
from support.specs import SMALL_RUN_TOML, SPARSE_SPEC
from support.stores import store_uri_for

#: The two-level exchange forced on two replicas (one group of 2: re-sparsified sum, residual fed back).
TWO_LEVEL_SPEC = SPARSE_SPEC + "exchange = \"two_level\"\ngroup_size = 2\n"


def _uninterrupted(tmp_path, spec: str) -> dict:
    store = store_uri_for("file", tmp_path)
    launch_and_wait(tmp_path, store, "uninterrupted", spec)
    return export_weights(tmp_path, f"{store}/uninterrupted", "model")


@pytest.fixture(scope="module")
def sparse_baseline(tmp_path_factory, baselines) -> dict:
    """The uninterrupted sparse run's exported weights: what every kill-and-resume below must end on.

    One baseline on file:// serves the S3 case too: a run's model does not depend on its store. It is the
    session's (test_signature_binding.py's sparse replay compares against the same run).
    """
    return baselines.of(SPARSE_SPEC).get(tmp_path_factory.mktemp("sparse-baseline"))


def _resume_matches(expected: dict, kind: str, phase: str, tmp_path, spec: str = SPARSE_SPEC) -> None:
    store = store_uri_for(kind, tmp_path)
    kill_run_at(tmp_path, store, "killed", phase, spec=spec)
    run = Store(f"{store}/killed")
    assert not run.exists(layout.outcome_key(3, 0))  # killed before the end
    # The replica checkpoints hold the error feedback (non-zero: the unsent residual).
    blob = load(bytes(run.get(layout.replica_blob_key(1, 1))))
    acc = [t for name, t in blob.items() if "codec" in name]
    assert acc and any(t.abs().sum() > 0 for t in acc), sorted(blob)
    res = cli_here("resume", f"{store}/killed", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    got = export_weights(tmp_path, f"{store}/killed", "resumed")
    assert same_weights(got, expected), f"sparse resume after a kill at {phase} diverged"


@pytest.mark.slow
def test_sparse_run_killed_in_round_2_resumes_bitwise(tmp_path, sparse_baseline):
    """Killed mid inner loop: the accumulators come back from the checkpoint, bitwise. (A kill inside the
    exchange is the two-level test's, at ``reduce``; the dense matrix covers every phase.)"""
    _resume_matches(sparse_baseline, "file", "inner_step", tmp_path)


@pytest.mark.slow
def test_two_level_sparse_run_killed_in_round_2_resumes_bitwise(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    _resume_matches(_uninterrupted(base, TWO_LEVEL_SPEC), "file", "reduce", tmp_path, TWO_LEVEL_SPEC)
    run = Store(f"{store_uri_for('file', tmp_path)}/killed")
    assert run.exists(layout.sparse_group_digest_key(3, 0, 0))  # the last round went through a group sum


@pytest.mark.slow
def test_sparse_run_killed_in_round_2_resumes_bitwise_on_s3(tmp_path, s3_endpoint, sparse_baseline):
    _resume_matches(sparse_baseline, "s3", "inner_step", tmp_path)


DECOUPLED_SPARSE_SPEC = """
replicas = 2
rounds = 3
inner_steps = 3
checkpoint_every = 1
[sync]
mode = "decoupled"
codec = "sparse"
min_quorum = 2
grace_min_s = 0.5
grace_max_s = 10
[sync.sparse]
density = 0.0625
chunk = 1024
""" + SMALL_RUN_TOML


@pytest.mark.slow
def test_decoupled_sparse_run_completes_with_sparse_contributions_and_error_feedback(tmp_path):
    store = f"file://{tmp_path}/store"
    launch_and_wait(tmp_path, store, "dec", DECOUPLED_SPARSE_SPEC)
    st = status_here(f"{store}/dec", tmp_path)
    assert st["state"] == "completed", st
    run = Store(f"{store}/dec")
    # Every replica that contributed wrote its inner state (checkpoint_every = 1), and that state carries its
    # accumulator: its contributions went through the sparse codec (a dense one keeps no state;
    # tests/test_sparse_exchange.py checks the blobs' sizes). A replica that started late under load may find
    # the fleet's budget already spent by the other and contribute nothing: the budget is work, not per-rank.
    contributed = 0
    for rank in range(2):
        seqs = sorted(k for k in run.list(layout.decoupled_replica_prefix(rank)) if k.endswith(".safetensors"))
        if not seqs:
            continue
        contributed += 1
        blob = load(bytes(run.get(seqs[-1])))
        assert any("codec" in name and t.abs().sum() > 0 for name, t in blob.items()), sorted(blob)
    assert contributed >= 1
    assert export_weights(tmp_path, f"{store}/dec", "model")
