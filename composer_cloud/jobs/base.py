"""The ``ServerlessExecutor`` protocol: launch replica jobs, find them again later.

An executor turns "run replica ``rank`` of run ``run_uri``" into a job on some
backend (a local process, a Modal function call, a Hugging Face Job). The job
runs ``python -m composer_cloud.replica --run RUN_URI --rank R``; everything
else the replica needs comes from the store.

Handles are plain JSON (:class:`JobHandle`) and are stored at
``<run>/executor/<rank>.json``, so a different process on a different machine
(``composer-cloud status|logs|cancel``) can re-attach to the jobs of a run.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from composer_cloud.errors import ExecutorError  # noqa: F401 - what executors raise
from composer_cloud.jobs.credentials import Check
from composer_cloud.storage.records import JobHandle  # noqa: F401 - the record a launch returns


class ReplicaState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (ReplicaState.SUCCEEDED, ReplicaState.FAILED, ReplicaState.CANCELLED)


@dataclass(frozen=True)
class ReplicaStatus:
    """What an executor knows about one replica job right now.

    ``restarts`` is how often the executor relaunched the replica so far, when
    the executor tracks it itself (None: see the handle's ``restarts``).
    """

    state: ReplicaState
    exit_code: int | None = None
    message: str = ""
    restarts: int | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """What ``launch`` would do, for ``--dry-run``. Secret *names* only, never values.

    Costs are US dollars for this executor's ranks, from the backend's prices
    (``cost_basis`` says which and when; ``None`` when no price is known):

    * ``replica_hour_cost_usd``: one replica's job for one hour (all its
      ``gpus_per_replica`` GPUs: N x the per-GPU price, or the flavor's price),
    * ``hourly_cost_usd``: while all of this plan's jobs run (multiply by a
      run's expected duration for a planned-rounds estimate),
    * ``estimated_cost_usd``: every job running until its timeout once, the
      same bound as ``estimated_gpu_hours`` (jobs are billed until they exit),
    * ``max_cost_usd``: the timeout bound with every restart the spec allows.
    """

    executor: str
    ranks: list[int]
    image: str
    command: list[str]
    env_names: list[str]
    secret_names: list[str]
    gpu: str
    estimated_gpu_hours: float | None
    notes: list[str] = field(default_factory=list)
    #: GPUs each replica's job gets (0: CPU only); the replica runs ``spec.gpus_per_replica`` local ranks.
    gpus_per_replica: int = 0
    replica_hour_cost_usd: float | None = None
    hourly_cost_usd: float | None = None
    estimated_cost_usd: float | None = None
    max_cost_usd: float | None = None
    cost_basis: str = ""


@dataclass(frozen=True)
class CostEstimate:
    """Dollars for ``jobs`` jobs of one executor (the cost fields of a :class:`LaunchPlan`).

    Attributes:
        per_job_hour_usd: one job (one replica, all its GPUs) running for one hour.
        hourly_usd: all jobs running for one hour.
        estimated_usd: all jobs running until their timeout, once.
        max_usd: all jobs running until their timeout on every attempt.
        basis: where the price came from (and when), or why there is none.
    """

    hourly_usd: float | None
    estimated_usd: float | None
    max_usd: float | None
    basis: str
    per_job_hour_usd: float | None = None

    @classmethod
    def of(cls, *, jobs: int, price_per_job_hour_usd: float | None, timeout_s: float, attempts: int,
           basis: str) -> "CostEstimate":
        if price_per_job_hour_usd is None:
            return cls(None, None, None, basis)
        hourly = jobs * price_per_job_hour_usd
        once = hourly * timeout_s / 3600
        return cls(hourly, once, once * max(1, attempts), basis, price_per_job_hour_usd)

    def plan_fields(self) -> dict[str, Any]:
        """Keyword arguments for :class:`LaunchPlan`."""
        return {"replica_hour_cost_usd": self.per_job_hour_usd, "hourly_cost_usd": self.hourly_usd, "estimated_cost_usd": self.estimated_usd,
                "max_cost_usd": self.max_usd, "cost_basis": self.basis}


def replica_command(run_uri: str, rank: int, *, python: str = "python") -> list[str]:
    """The command every executor runs for one replica."""
    return [python, "-m", "composer_cloud.replica", "--run", run_uri, "--rank", str(rank)]


def run_id_of(run_uri: str) -> str:
    """``s3://bucket/prefix/run-1`` -> ``run-1`` (the run directory's name; names jobs, apps, job dirs)."""
    tail = run_uri.rstrip("/").rsplit("/", 1)[-1]
    return tail.split("://", 1)[-1]


@runtime_checkable
class ServerlessExecutor(Protocol):
    """A backend that runs replica jobs. Implementations must be safe to
    re-create from a stored :class:`JobHandle` in another process."""

    name: ClassVar[str]
    #: ``(module, extra)``: the SDK the launcher needs for this executor and the ``composer-cloud[extra]`` that
    #: installs it; None: nothing beyond the core install.
    sdk: ClassVar[tuple[str, str] | None]

    @classmethod
    def check_credentials(cls) -> list[Check]:
        """Whether this machine holds what the backend's SDK would send (never the values); no backend call."""
        ...

    @classmethod
    def relaunches(cls, spec: Any) -> int:
        """How many times this backend starts a failed replica job of ``spec`` again (``max_restarts`` mapped
        onto the backend's own mechanism: the local supervisor, HF Jobs' ``attempts``, ``modal.Retries``)."""
        ...

    def plan(self, run_uri: str, ranks: Sequence[int]) -> LaunchPlan:
        """Describe the launch without doing it. Problems :meth:`preflight` would raise are notes here."""
        ...

    def preflight(self, run_uri: str, ranks: Sequence[int]) -> None:
        """Refuse a launch that cannot work, before anything is built, staged or written.

        Checks only what this process can see without starting anything
        (settings, credentials named in the spec, whether the jobs can reach
        the store). Raises :class:`ExecutorError` naming each problem and its
        fix. The launcher calls it for every executor of a run before the
        first record is written; :meth:`launch` calls it again.
        """
        ...

    def launch(self, run_uri: str, ranks: Sequence[int]) -> list[JobHandle]:
        """Start one job per rank; return their handles (in ``ranks`` order)."""
        ...

    def poll(self, handle: JobHandle) -> ReplicaStatus:
        """Current status of a job. Never blocks for long."""
        ...

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        """Lines of the job's output; with ``follow``, until the job ends."""
        ...

    def cancel(self, handle: JobHandle) -> None:
        """Stop the job (and its children). Idempotent: a finished or vanished job is left alone."""
        ...
