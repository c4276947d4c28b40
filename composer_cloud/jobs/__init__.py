"""Executors: where replica jobs run. Looked up by name, imported lazily.

Modules: ``base`` (the :class:`ServerlessExecutor` protocol and its records),
``remote`` (the plumbing every remote executor shares), ``credentials`` (what an
executor's launch needs on this machine), ``environment`` (what a job's environment holds),
one module per backend (``local``, ``modal_jobs``, ``hf_jobs``), ``wheel``
(the package wheel HF Jobs install).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from composer_cloud.jobs.base import (
    CostEstimate,
    ExecutorError,
    JobHandle,
    LaunchPlan,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
    replica_command,
)
from composer_cloud.registry import load_object
from composer_cloud.spec import parse_executor

if TYPE_CHECKING:
    from composer_cloud.spec import RunSpec

logger = logging.getLogger(__name__)

EXECUTORS: dict[str, str] = {
    "local": "composer_cloud.jobs.local:LocalProcessExecutor",
    "modal": "composer_cloud.jobs.modal_jobs:ModalExecutor",
    "hf-jobs": "composer_cloud.jobs.hf_jobs:HFJobsExecutor",
}


def executor_class(name: str) -> type[ServerlessExecutor]:
    """The class of executor ``name``: what it needs (``sdk``, ``check_credentials``) and how it restarts
    (``relaunches``) are asked of it, never switched on by name. Imports its module, not its SDK."""
    if name not in EXECUTORS:
        raise ValueError(f"executor: unknown executor {name!r}; choose one of {sorted(EXECUTORS)}")
    cls: type[ServerlessExecutor] = load_object(EXECUTORS[name], setting="executor")
    return cls


def get_executor(name: str, spec: "RunSpec", *, run_key: str | None = None) -> ServerlessExecutor:
    """Instantiate executor ``name`` for ``spec`` (``cls(spec)``; ``cls(spec, run_key=...)`` for a signed run's
    launch: the executor delivers the key to its jobs as a secret)."""
    cls: Any = executor_class(name)
    return cls(spec) if run_key is None else cls(spec, run_key=run_key)


def trusted_handles(handles: "list[JobHandle]", spec: "RunSpec") -> "list[JobHandle]":
    """The handles (read from the untrusted store) that name a job this run's spec could have started: a rank
    of the run (a replica's or a rollout worker's), on the executor the spec assigns to that rank, one per rank. Others are dropped with a warning,
    so a forged ``executor/<rank>.json`` cannot make ``status``/``logs``/``cancel`` talk to another backend."""
    try:
        assigned = {rank: name for name, ranks in assign_jobs(spec) for rank in ranks}
    except ValueError:
        assigned = {}
    out: dict[int, JobHandle] = {}
    for h in handles:
        if assigned.get(h.rank) != h.executor or h.rank in out:
            logger.warning("ignoring the job handle of replica %d (executor %r): the run's spec assigns that rank "
                           "to %r", h.rank, h.executor[:40], assigned.get(h.rank))
            continue
        out[h.rank] = h
    return [out[r] for r in sorted(out)]


def assign_ranks(executor: str, replicas: int) -> list[tuple[str, list[int]]]:
    """Split ranks ``0..replicas-1`` over executors.

    ``"local"`` puts every rank on one executor; ``"local:1,hf-jobs:2"`` gives
    rank 0 to ``local`` and ranks 1-2 to ``hf-jobs`` (the counts must add up to
    ``replicas``).
    """
    shares = parse_executor(executor)
    for name, _ in shares:
        if name not in EXECUTORS:
            raise ValueError(f"executor: unknown executor {name!r}; choose one of {sorted(EXECUTORS)}")
    if shares[0].replicas is None:
        return [(shares[0].backend, list(range(replicas)))]
    out: list[tuple[str, list[int]]] = []
    next_rank = 0
    for name, count in shares:
        assert count is not None  # parse_executor: every share of a list has its count
        out.append((name, list(range(next_rank, next_rank + count))))
        next_rank += count
    if next_rank != replicas:
        raise ValueError(f"executor: counts in {executor!r} add up to {next_rank}, but replicas = {replicas}")
    return out


def assign_jobs(spec: "RunSpec") -> list[tuple[str, list[int]]]:
    """Every job of a run by executor: the replicas' ranks (:func:`assign_ranks`), then the rollout workers'
    (``spec.worker_ranks``, ``[rollouts] workers``) on ``rollouts.executor``, by default the backend of the run's
    first executor share. Raises ``ValueError`` naming the setting for an unknown executor."""
    out = assign_ranks(spec.executor, spec.replicas)
    workers = list(spec.worker_ranks)
    if workers:
        name = spec.rollouts.executor or out[0][0]
        if name not in EXECUTORS:
            raise ValueError(f"rollouts.executor: unknown executor {name!r}; choose one of {sorted(EXECUTORS)}")
        out.append((name, workers))
    return out


__all__ = [
    "EXECUTORS",
    "executor_class",
    "CostEstimate",
    "ExecutorError",
    "JobHandle",
    "LaunchPlan",
    "ReplicaState",
    "ReplicaStatus",
    "ServerlessExecutor",
    "assign_jobs",
    "assign_ranks",
    "get_executor",
    "replica_command",
    "trusted_handles",
]
