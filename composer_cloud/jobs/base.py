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
from typing import ClassVar, Protocol, runtime_checkable

from composer_cloud.errors import ExecutorError  # noqa: F401 - what executors raise
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
    hourly_cost_usd: float | None = None
    estimated_cost_usd: float | None = None
    max_cost_usd: float | None = None
    cost_basis: str = ""


def replica_command(run_uri: str, rank: int, *, python: str = "python") -> list[str]:
    """The command every executor runs for one replica."""
    return [python, "-m", "composer_cloud.replica", "--run", run_uri, "--rank", str(rank)]


@runtime_checkable
class ServerlessExecutor(Protocol):
    """A backend that runs replica jobs. Implementations must be safe to
    re-create from a stored :class:`JobHandle` in another process."""

    name: ClassVar[str]

    def plan(self, run_uri: str, ranks: Sequence[int]) -> LaunchPlan:
        """Describe the launch without doing it."""
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
        """Stop the job (and its children). Idempotent."""
        ...
