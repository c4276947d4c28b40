"""What every executor of remote jobs does the same way (Modal, Hugging Face Jobs).

A remote executor knows its jobs only through a backend API. :class:`RemoteExecutor`
holds the plumbing around that API, so each backend writes only its calls and
its messages:

* **Terminal statuses are cached.** A job that finished never changes state,
  so :meth:`~RemoteExecutor.poll` asks the backend again only while the job is
  live (status and wait loops poll many times).
* **Cancel is idempotent.** A finished or vanished job is left alone; a cancel
  that fails because the job ended meanwhile is a success.
* **All-or-nothing launch.** :meth:`~RemoteExecutor._roll_back` cancels the
  jobs a failed launch already created, and tells the user how to stop any it
  could not, so no job runs without a record to find it by.
* **Refused before anything is written.** :meth:`~RemoteExecutor.preflight`
  raises one :class:`ExecutorError` listing every problem
  :meth:`~RemoteExecutor._preflight_problems` finds; a dry run shows the same
  problems as notes.
* **One retry policy.** Idempotent backend calls (status, cancel, listings)
  go through :meth:`~RemoteExecutor._call`: :data:`IDEMPOTENT_RETRY` with the
  backend's own transient classifier (``transient``). Creating a job is never
  retried: after a lost response a retry could start a duplicate.
"""

from __future__ import annotations

import abc
import logging
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

from composer_cloud.jobs.base import ExecutorError, JobHandle, ReplicaStatus
from composer_cloud.jobs.environment import job_env, job_secrets
from composer_cloud.retry import RetryPolicy

if TYPE_CHECKING:
    from composer_cloud.spec import RunSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Retries of idempotent backend calls (status, cancel, list, whoami): 4 calls, about 2 s at most.
IDEMPOTENT_RETRY = RetryPolicy(attempts=4, base_s=0.25, cap_s=4.0)

_EXIT_CODE = re.compile(r"exit(?:ed)?(?: with)? (?:status |code)[:= ]*(-?\d+)", re.IGNORECASE)


def parse_exit_code(message: str | None) -> int | None:
    """Find an exit code in a backend's failure message (``"... exit code: 3"``)."""
    if not message:
        return None
    m = _EXIT_CODE.search(message)
    return int(m.group(1)) if m else None


def scheme_of(uri: str) -> str:
    """``s3://b/p`` -> ``s3``; a path without a scheme is ``file``."""
    return uri.split("://", 1)[0] if "://" in uri else "file"


def never_transient(exc: BaseException) -> bool:
    """The classifier of a backend whose client retries by itself."""
    return False


class RemoteExecutor(abc.ABC):
    """Base of the executors whose jobs run elsewhere. Subclasses implement the backend hooks.

    Hooks (each backend's own calls and wording):

    * :meth:`_fetch_status`: one status read of a job (may use :meth:`_call`);
    * :meth:`_cancel_job`: the backend's cancel of one job;
    * :meth:`_error`: an :class:`ExecutorError` for a failed call, saying what to do;
    * :meth:`_preflight_problems`: why a launch could not work, as sentences;
    * :meth:`_manual_cancel_hint`: how a user stops a job a roll-back could not;
    * :meth:`_is_gone`: whether an error means the job no longer exists (default: never).

    Class attributes: ``name`` (the executor's registry name), ``transient``
    (the backend's classifier of retryable errors, a plain function of the
    exception) and ``retry`` (the policy, default :data:`IDEMPOTENT_RETRY`).
    """

    name: ClassVar[str]
    transient: ClassVar[Callable[[BaseException], bool]] = staticmethod(never_transient)
    retry: ClassVar[RetryPolicy] = IDEMPOTENT_RETRY

    def __init__(self, spec: "RunSpec", *, run_key: str | None = None) -> None:
        self.spec = spec
        self._run_key = run_key  # a signed run's key: sent as a backend secret, never stored or logged
        self._final: dict[str, ReplicaStatus] = {}  # job id -> terminal status (it never changes)

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _fetch_status(self, handle: JobHandle) -> ReplicaStatus:
        """One status read of the job from the backend; raises :class:`ExecutorError`."""

    @abc.abstractmethod
    def _cancel_job(self, handle: JobHandle) -> None:
        """The backend's cancel of one job; raises :class:`ExecutorError`."""

    def _error(self, what: str, exc: BaseException) -> ExecutorError:
        return ExecutorError(f"{self.name}: {what} failed ({type(exc).__name__}: {exc})")

    def _preflight_problems(self) -> list[str]:
        return [p for p in (self._store_problem(), self._credentials_problem()) if p]

    def _manual_cancel_hint(self, handle: JobHandle) -> str:
        return "stop it in the backend's console"

    def _is_gone(self, err: ExecutorError) -> bool:
        return False

    def _store_problem(self) -> str | None:
        """Why the jobs could not read the store, or None (default: a ``file://`` store is unreadable)."""
        if scheme_of(self.spec.store) == "file" and not self._shares_filesystem():
            return (f"store {self.spec.store} is a local directory, which {self._remote_readers()} cannot read; "
                    f"{self._local_store_fix()}")
        return None

    def _shares_filesystem(self) -> bool:
        """Whether the jobs see this machine's files (only a backend served from this machine)."""
        return False

    def _remote_readers(self) -> str:
        """Who runs the jobs, as in "a local directory, which <them> cannot read"."""
        return "remote jobs"

    def _local_store_fix(self) -> str:
        return "use an s3:// store"

    def _credentials_problem(self) -> str | None:
        return None

    def _needs_s3_credentials(self) -> bool:
        """An S3 store that is not public: the jobs need credentials, and get them only from secrets."""
        return scheme_of(self.spec.store) in ("s3", "s3a") and not self.spec.store_options.get("anon")

    # ------------------------------------------------------------------ shared plumbing
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` under :attr:`retry` with :attr:`transient`; a final failure becomes :meth:`_error`.

        Only for idempotent calls: never wrap the creation of a job in this.
        """
        try:
            return self.retry.call(f"{self.name}: {what}", fn, transient=type(self).transient)
        except ExecutorError:
            raise
        except Exception as exc:  # noqa: BLE001 - the last error, with what to do
            raise self._error(what, exc) from exc

    def job_env(self) -> dict[str, str]:
        """The environment each job gets (:func:`~composer_cloud.jobs.environment.job_env`, forwarded names too)."""
        return job_env(self.spec, forward=True)

    def job_secrets(self) -> dict[str, str]:
        """The secrets every job gets besides the spec's named ones
        (:func:`~composer_cloud.jobs.environment.job_secrets`)."""
        return job_secrets(self._run_key)

    def preflight(self, run_uri: str, ranks: Sequence[int]) -> None:
        """Refuse a launch that cannot work, before anything is built, staged or written.

        Raises one :class:`ExecutorError` naming every problem found and its fix;
        talks to nobody. :meth:`launch` calls it too.
        """
        problems = self._preflight_problems()
        if problems:
            raise ExecutorError(f"{self.name}: cannot launch: " + "; ".join(problems))

    def _problem_notes(self) -> list[str]:
        """The :meth:`preflight` problems as :class:`~composer_cloud.jobs.base.LaunchPlan` notes."""
        return [f"launch would fail: {problem}" for problem in self._preflight_problems()]

    def poll(self, handle: JobHandle) -> ReplicaStatus:
        """The job's status; a terminal one is cached and never fetched again."""
        cached = self._final.get(handle.job_id)
        if cached is not None:
            return cached
        status = self._fetch_status(handle)
        if status.state.finished:
            self._final[handle.job_id] = status
        return status

    def cancel(self, handle: JobHandle) -> None:
        """Stop the job. Idempotent: a finished or vanished job is left alone.

        The cached status is dropped first (the caller wants the truth now);
        a cancel that fails is re-checked, because the job may have ended
        between the status read and the cancel.
        """
        self._final.pop(handle.job_id, None)
        if self.poll(handle).state.finished:
            return
        try:
            self._cancel_job(handle)
        except ExecutorError as err:
            if self._is_gone(err):
                return
            self._final.pop(handle.job_id, None)
            if self.poll(handle).state.finished:  # lost a race with the job ending: nothing to cancel
                return
            raise
        logger.info("%s: cancelled job %s (rank %d)", self.name, handle.job_id, handle.rank)

    def _roll_back(self, handles: Sequence[JobHandle]) -> None:
        """Cancel the jobs of a launch that failed part-way; best effort, each failure logged with a fix.

        Calls the backend's cancel directly (no status read first): a job
        created a moment ago is live, and one read fewer is one failure fewer.
        """
        for h in handles:
            try:
                self._cancel_job(h)
            except Exception as exc:  # noqa: BLE001 - best effort; the launch error matters more
                logger.error("%s: could not cancel job %s of rank %d after a failed launch (%s); %s",
                             self.name, h.job_id, h.rank, exc, self._manual_cancel_hint(h))


__all__ = ["IDEMPOTENT_RETRY", "RemoteExecutor", "never_transient", "parse_exit_code", "scheme_of"]
