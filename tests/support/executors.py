"""Executor test helpers: specs for one executor section, small job commands, waiting for a job."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from composer_cloud.jobs.base import JobHandle, ReplicaState, ReplicaStatus, ServerlessExecutor
from composer_cloud.spec import RunSpec, spec_from_dict


def executor_spec(section: str, *, store: str, run_id: str, replicas: int = 2, gpus_per_replica: int = 1,
                  **options: Any) -> RunSpec:
    """A spec whose ``[section]`` (``modal``, ``hf_jobs``) holds ``options``."""
    return spec_from_dict({"run_id": run_id, "store": store, "replicas": replicas,
                           "gpus_per_replica": gpus_per_replica, section: options})


def code_argv(code: str, *, python: str = "python") -> Callable[[str, int], list[str]]:
    """A ``replica_argv`` that runs ``code`` with ``sys.argv[1:] == [run_uri, rank]`` instead of a replica."""
    return lambda run_uri, rank: [python, "-c", code, run_uri, str(rank)]


def wait_finished(ex: ServerlessExecutor, handle: JobHandle, *, timeout: float = 120.0,
                  interval: float = 0.1) -> ReplicaStatus:
    """Poll until the job finished; its last status. Fails after ``timeout`` seconds with the last status."""
    deadline = time.monotonic() + timeout
    while not (status := ex.poll(handle)).state.finished:
        assert time.monotonic() < deadline, f"job {handle.job_id} still {status} after {timeout}s"
        time.sleep(interval)
    return status


def wait_state(ex: ServerlessExecutor, handle: JobHandle, state: ReplicaState, *, timeout: float = 60.0) -> None:
    """Poll until the job is in ``state``; fails if it finishes in another state first."""
    deadline = time.monotonic() + timeout
    while (status := ex.poll(handle)).state is not state:
        assert not status.state.finished, status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
