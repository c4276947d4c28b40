"""Replica jobs on Hugging Face Jobs, through ``huggingface_hub``'s Jobs API.

One HF Job per replica. The job runs on ``spec.hf_jobs.image`` (any image with
``python`` and ``pip`` or ``uv``; the default is Python 3.11 with uv,
:data:`composer_cloud.stack.HF_JOBS_DEFAULT_IMAGE`; see
``composer_cloud/images/Dockerfile`` for one with the dependencies
preinstalled) and its command is the bootstrap in
``composer_cloud/images/hf_bootstrap.py`` followed by the replica command: the
bootstrap installs this package from a wheel the launcher staged in the run's
store (:mod:`composer_cloud.jobs.wheel`) with the pinned versions of
``composer_cloud/images/requirements.txt`` as constraints (embedded in the
command by :func:`bootstrap_source`), so every replica runs the same numeric
stack (:mod:`composer_cloud.stack`), then ``exec``s the replica.

Invariants:

* **Secrets only through** ``secrets=``. Values of the environment variables
  named in ``spec.hf_jobs.secrets`` are read from the launcher's environment at
  launch and sent as HF job secrets; they never go into ``env=``, the command,
  a :class:`JobHandle`, a :class:`LaunchPlan` or a log line of ours.
* **All or nothing launch.** If creating the job of one rank fails, the jobs
  already created for the other ranks are cancelled before the error is raised,
  so no GPU job is left running without a record to find it by.
* **No blind retries of create.** ``run_job`` is a POST; retrying it after a
  timeout could start a duplicate job. Reads (inspect, list, whoami) and
  cancel are idempotent and are retried on transient errors (:func:`is_transient`:
  transport errors, 429, 5xx) with the package's one retry policy
  (:data:`~composer_cloud.jobs.remote.IDEMPOTENT_RETRY`).
* **Refused before anything is written.** :meth:`HFJobsExecutor.preflight`
  checks what a launch needs that the launcher can see (store reachable from
  the jobs, credentials for an S3 store among the secrets, secret values
  present) and raises before a wheel is staged or a record is written.
* **Re-attachable, never redirected.** A handle records the endpoint and
  namespace it was created with, for people reading it, but ``status``/``logs``/
  ``cancel`` talk only to the endpoint and namespace of *this process's*
  configuration (``HF_ENDPOINT``, ``[hf_jobs] namespace`` or the token's user):
  a handle read from the (untrusted) store never chooses where the token goes.
  A job is acted on only if its ``composer-cloud-run`` label names this run.
  The token is never stored (``HF_TOKEN`` or the saved login is used).
* **The run key is a job secret.** A signed run's key is sent in ``secrets=``
  with the spec's named secrets, never in ``env=``.

Status caching, idempotent cancel, roll-back and the preflight's frame are
:class:`~composer_cloud.jobs.remote.RemoteExecutor`'s. The launcher honours ``HF_ENDPOINT`` and ``HF_TOKEN`` (standard
``huggingface_hub`` behaviour). A ``file://`` store only works when the jobs
share the launcher's filesystem, i.e. with a Jobs server on this machine (the
tests' local server); for the real service use an ``s3://`` store and forward
its credentials as secrets (``[hf_jobs] secrets = ["AWS_ACCESS_KEY_ID", ...]``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

from composer_cloud import env as cc_env
from composer_cloud.images.container import FAILURE_TAIL_LINES, failure_message
from composer_cloud.jobs.base import (
    CostEstimate,
    ExecutorError,
    JobHandle,
    LaunchPlan,
    ReplicaState,
    ReplicaStatus,
    replica_command,
    run_id_of,
)
from composer_cloud.jobs.hf_flavors import flavor_gpus, resolve_flavor  # noqa: F401 - flavor_gpus re-exported
from composer_cloud.jobs.remote import RemoteExecutor, parse_exit_code
from composer_cloud.jobs.credentials import Check
from composer_cloud.jobs.wheel import WHEEL_PREFIX, StagedWheel, build_and_stage_wheel
from composer_cloud.storage.store import Store
from composer_cloud.spec import RunSpec

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
LABEL_RUN = "composer-cloud-run"
LABEL_RANK = "composer-cloud-rank"
BOOTSTRAP_PATH = Path(__file__).resolve().parent.parent / "images" / "hf_bootstrap.py"
REQUIREMENTS_PATH = BOOTSTRAP_PATH.with_name("requirements.txt")
#: The bootstrap line the launcher fills with the pinned constraints.
_CONSTRAINTS_LINE = "CONSTRAINTS = None"
#: Secrets (names) a job needs to read an s3:// store: HF job secrets are environment variables, and a job
#: has no credentials file, instance role or profile, so only the key pair works (plus AWS_SESSION_TOKEN
#: for temporary keys).
AWS_KEY_PAIR = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
#: Seconds in the unit of a Jobs hardware price (``JobHardwareInfo.unit_label``).
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600}
#: Shown instead of the bootstrap's source in a :class:`LaunchPlan`.
BOOTSTRAP_PLACEHOLDER = "<source of composer_cloud/images/hf_bootstrap.py>"

#: HF job stage -> replica state. Anything else is treated as PENDING (and logged).
STAGE_STATES: dict[str, ReplicaState] = {
    "SCHEDULING": ReplicaState.PENDING,
    "RUNNING": ReplicaState.RUNNING,
    "COMPLETED": ReplicaState.SUCCEEDED,
    "CANCELED": ReplicaState.CANCELLED,
    "ERROR": ReplicaState.FAILED,
    # A deleted job was stopped from outside (UI, CLI); it did not succeed and was not a crash.
    "DELETED": ReplicaState.CANCELLED,
}
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
#: The first huggingface_hub whose Jobs API has ``run_job(attempts=...)`` (the ``[hf]`` extra's floor;
#: composer-cloud's core needs less, so a plain install may have an older hub).
HUB_JOBS_MIN = "2.1"


def require_jobs_hub(found: str | None = None) -> None:
    """Raise :class:`ExecutorError` (one line: package, found, needed) when huggingface_hub predates :data:`HUB_JOBS_MIN`.

    ``found`` defaults to the installed distribution's version.
    """
    from importlib import metadata

    from packaging.version import Version

    if found is None:
        try:
            found = metadata.version("huggingface_hub")
        except metadata.PackageNotFoundError:
            found = "not installed"
    if found == "not installed" or Version(found) < Version(HUB_JOBS_MIN):
        raise ExecutorError(f"--executor hf-jobs needs huggingface_hub>={HUB_JOBS_MIN} (found {found}): "
                            f"pip install \"composer-cloud[hf]\"")
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")


def known_flavors() -> list[str]:
    """Flavors ``huggingface_hub`` knows about (the server may know more)."""
    from huggingface_hub import JobHardware

    return [f.value for f in JobHardware]


def constraints_text() -> str:
    """The pins jobs install with: ``$COMPOSER_CLOUD_CONSTRAINTS`` (a file) if set, else ``images/requirements.txt``."""
    override = os.environ.get(cc_env.CONSTRAINTS)
    path = Path(override) if override else REQUIREMENTS_PATH
    try:
        return path.read_text()
    except OSError as exc:
        raise ExecutorError(
            f"cannot read the constraints file {path} ({exc}); fix or unset {cc_env.CONSTRAINTS}") from exc


def bootstrap_source(*, constraints: str | None = None) -> str:
    """The bootstrap's source with the pinned constraints embedded (default: :func:`constraints_text`).

    The constraints travel inside the job's command, so they are read before
    anything is installed, and the job needs no second object from the store.
    """
    source = BOOTSTRAP_PATH.read_text()
    text = constraints_text() if constraints is None else constraints
    if source.count(_CONSTRAINTS_LINE) != 1:
        raise ExecutorError(f"{BOOTSTRAP_PATH} must contain the line {_CONSTRAINTS_LINE!r} exactly once "
                            "(the launcher fills in the pinned constraints there)")
    return source.replace(_CONSTRAINTS_LINE, f"CONSTRAINTS = {text!r}", 1)


def is_transient(exc: BaseException) -> bool:
    """The Hub's transient errors: 429 and 5xx answers, transport errors (connection, timeout)."""
    status = _status_code(exc)
    if status is not None:
        return status == 429 or status >= 500
    try:
        import httpx2

        if isinstance(exc, httpx2.TransportError):
            return True
    except ImportError:  # pragma: no cover - huggingface_hub depends on it
        pass
    return isinstance(exc, (ConnectionError, TimeoutError))


class HFJobsExecutor(RemoteExecutor):
    """Runs each replica as a Hugging Face Job.

    Args:
        spec: the run spec (``spec.hf_jobs`` and ``spec.max_restarts`` are used).
        endpoint: Hub endpoint; default ``$HF_ENDPOINT`` or ``https://huggingface.co``.
        token: Hub token; default ``$HF_TOKEN`` or the saved login (never stored).
        wheel: a prebuilt composer-cloud wheel to stage instead of building one
            (also ``$COMPOSER_CLOUD_PREBUILT_WHEEL``).
        replica_argv: ``(run_uri, rank) -> argv`` run after the bootstrap; the
            default is :func:`replica_command`. Tests substitute small commands.
    """

    name: ClassVar[str] = "hf-jobs"
    sdk: ClassVar[tuple[str, str] | None] = ("httpx", "hf")
    transient = staticmethod(is_transient)

    @classmethod
    def check_credentials(cls) -> list[Check]:
        """A Hugging Face token where the Hub client finds one (``HF_TOKEN`` or the saved login)."""
        from huggingface_hub import get_token

        if get_token():
            return [Check("hf-jobs: token", True, "a Hugging Face token (HF_TOKEN or the saved login)")]
        return [Check("hf-jobs: token", False, "no Hugging Face token: export HF_TOKEN=hf_... (a token that may run "
                                               "jobs) or run `hf auth login`")]

    @classmethod
    def relaunches(cls, spec: RunSpec) -> int:
        """The Jobs server starts a failed job again ``max_restarts`` times (sent as ``attempts = n + 1``)."""
        return spec.max_restarts

    def __init__(
        self,
        spec: RunSpec,
        *,
        endpoint: str | None = None,
        token: str | None = None,
        wheel: str | os.PathLike[str] | None = None,
        replica_argv: Callable[[str, int], list[str]] = replica_command,
        run_key: str | None = None,
    ) -> None:
        super().__init__(spec, run_key=run_key)
        # Read HF_ENDPOINT now, not huggingface_hub.constants.ENDPOINT (frozen when that module was imported).
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self._token = token
        self._wheel = wheel
        self._replica_argv = replica_argv
        self._apis: dict[str, Any] = {}
        self._namespace: str | None = spec.hf_jobs.namespace
        self._staged: dict[str, StagedWheel] = {}
        self._hardware: dict[str, Any] | None = None  # flavor -> JobHardwareInfo, read once
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing
    def _api(self, endpoint: str | None = None) -> Any:
        require_jobs_hub()
        from huggingface_hub import HfApi

        ep = (endpoint or self.endpoint).rstrip("/")
        with self._lock:
            if ep not in self._apis:
                self._apis[ep] = HfApi(endpoint=ep, token=self._token)
            return self._apis[ep]

    def namespace(self) -> str:
        """``spec.hf_jobs.namespace``, else the token's user name (one ``whoami`` call, cached)."""
        if self._namespace is None:
            who = self._call("whoami", lambda: self._api().whoami())
            self._namespace = str(who["name"])
        return self._namespace

    def _error(self, what: str, exc: BaseException) -> ExecutorError:
        status = _status_code(exc)
        if status == 401:
            hint = "the token was rejected: set HF_TOKEN or run `hf auth login`"
        elif status == 403:
            hint = (f"the token may not run jobs in namespace {self._namespace!r}: use a token with write access "
                    "to it, or set [hf_jobs] namespace")
        elif status == 402:
            hint = "Jobs need a paid account or organization with a payment method"
        else:
            hint = f"check HF_ENDPOINT ({self.endpoint}) and your network"
        return ExecutorError(f"hf-jobs: {what} failed: {_describe(exc)}; {hint}")

    # ------------------------------------------------------------------ launch
    def flavor(self) -> str:
        """The flavor each job runs on: ``[hf_jobs] flavor`` for ``gpus_per_replica`` GPUs
        (:func:`~composer_cloud.jobs.hf_flavors.resolve_flavor`; raises :class:`ExecutorError` naming both
        fields when they disagree or the family has no such flavor)."""
        return resolve_flavor(self.spec.hf_jobs.flavor, self.spec.gpus_per_replica)

    def _resolution_note(self) -> list[str]:
        flavor = self.flavor()
        if flavor == self.spec.hf_jobs.flavor:
            return []
        return [f"hf_jobs.flavor {self.spec.hf_jobs.flavor!r} with gpus_per_replica = {self.spec.gpus_per_replica} "
                f"runs on {flavor!r}"]

    def _flavor_notes(self) -> list[str]:
        flavor = self.flavor()
        if flavor not in known_flavors():
            return [f"flavor {flavor!r} is not in huggingface_hub's list ({', '.join(known_flavors())}); "
                    "the server decides whether it exists"]
        return []

    def _shares_filesystem(self) -> bool:
        return urlparse(self.endpoint).hostname in _LOOPBACK  # a Jobs server on this machine

    def _remote_readers(self) -> str:
        return f"jobs on {self.endpoint}"

    def _local_store_fix(self) -> str:
        return "use an s3:// store (a file:// store only works with a Jobs server on this machine)"

    def _job_env(self, staged: StagedWheel | None) -> dict[str, str]:
        env = self.job_env()
        env[cc_env.WHEEL_URI] = staged.uri if staged else "<staged at launch>"
        env[cc_env.WHEEL_SHA256] = staged.sha256 if staged else "<staged at launch>"
        return env

    def _credentials_problem(self) -> str | None:
        """Why jobs would have no credentials for an s3:// store, or None.

        Jobs start with a clean environment: the only credentials they get are
        the job secrets, so both names of :data:`AWS_KEY_PAIR` must be among
        them; ``store_options.anon = true`` (a public bucket) needs none.
        """
        if not self._needs_s3_credentials():
            return None
        missing = [n for n in AWS_KEY_PAIR if n not in self.spec.hf_jobs.secrets]
        if not missing:
            return None
        return (f"store {self.spec.store} is S3, but [hf_jobs] secrets has no AWS credentials for the jobs "
                f"(missing {', '.join(missing)}): add secrets = [\"AWS_ACCESS_KEY_ID\", \"AWS_SECRET_ACCESS_KEY\"] "
                "(plus AWS_ENDPOINT_URL / AWS_DEFAULT_REGION if your store needs them) and export them here; "
                "their values are sent as HF job secrets, never stored")

    def _preflight_problems(self) -> list[str]:
        problems = super()._preflight_problems()
        missing = [n for n in self.spec.hf_jobs.secrets if n not in os.environ]
        if missing:
            problems.append(
                f"hf_jobs.secrets names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not set "
                f"in this environment; export {missing[0]}=... before launching (values are sent as HF job "
                "secrets, never stored) or remove the name from [hf_jobs] secrets")
        return problems

    def preflight(self, run_uri: str, ranks: Sequence[int]) -> None:
        """Refuse a launch that cannot work, before anything is built, staged or written.

        Checks what the launcher can see without talking to anyone: the jobs
        can reach the store, an S3 store's credentials are among the secrets,
        every secret named in the spec has a value here, the flavor offers
        ``gpus_per_replica`` GPUs, huggingface_hub is new enough (:func:`require_jobs_hub`).
        Raises :class:`ExecutorError` naming each missing setting.
        """
        require_jobs_hub()
        self.flavor()  # raises on a flavor that does not fit gpus_per_replica
        super().preflight(run_uri, ranks)

    def _secret_values(self) -> dict[str, str]:
        """Values of the secrets named in the spec, read from this process's environment (after :meth:`preflight`),
        and the run key of a signed run."""
        return {**{n: os.environ[n] for n in self.spec.hf_jobs.secrets}, **self.job_secrets()}

    def _command(self, run_uri: str, rank: int, *, bootstrap: str) -> list[str]:
        return ["python", "-c", bootstrap, *self._replica_argv(run_uri, rank)]

    def hardware_prices(self) -> dict[str, Any]:
        """Flavor name -> ``huggingface_hub.JobHardwareInfo`` from the server (read once per executor).

        One attempt, no retries: a price is decoration on a dry run, not worth a wait.
        """
        if self._hardware is None:
            try:
                infos = self._api().list_jobs_hardware()
            except Exception as exc:  # noqa: BLE001 - reported with what to do
                raise self._error("listing job hardware", exc) from exc
            self._hardware = {str(h.name): h for h in infos}
        return self._hardware

    def cost_estimate(self, jobs: int) -> CostEstimate:
        """Dollars for ``jobs`` jobs of :meth:`flavor` from the server's ``unit_cost_usd`` (the flavor's
        listed price covers all its GPUs).

        Never raises on a price it cannot read: without one the estimate is empty and its basis says why.
        """
        hf = self.spec.hf_jobs
        flavor = self.flavor()
        attempts = self.relaunches(self.spec) + 1  # starts of one job at most, the first included
        source = f"{self.endpoint}/api/jobs/hardware"
        try:
            info = self.hardware_prices().get(flavor)
        except ExecutorError as err:
            return CostEstimate.of(jobs=jobs, price_per_job_hour_usd=None, timeout_s=hf.timeout_s,
                                   attempts=attempts, basis=f"no price: {err}")
        unit_s = _UNIT_SECONDS.get(str(getattr(info, "unit_label", "")).lower()) if info is not None else None
        if info is None or unit_s is None or info.unit_cost_usd is None:
            why = (f"flavor {flavor!r} is not listed" if info is None
                   else f"unknown price unit {info.unit_label!r} for {flavor}")
            return CostEstimate.of(jobs=jobs, price_per_job_hour_usd=None, timeout_s=hf.timeout_s,
                                   attempts=attempts, basis=f"no price: {why} at {source}")
        per_hour = float(info.unit_cost_usd) * 3600 / unit_s
        return CostEstimate.of(
            jobs=jobs, price_per_job_hour_usd=per_hour, timeout_s=hf.timeout_s, attempts=attempts,
            basis=(f"{source} (read at plan time): {flavor} ${float(info.unit_cost_usd):g}/{info.unit_label} "
                   f"= ${per_hour:.2f}/h per job; estimate = {jobs} job(s) x timeout {hf.timeout_s / 3600:g} h, "
                   f"max x {attempts} attempt(s)"))

    def plan(self, run_uri: str, ranks: Sequence[int]) -> LaunchPlan:
        """What :meth:`launch` would do. No wheel is built, nothing is created.

        The only request is a read of the hardware price list
        (``GET /api/jobs/hardware``) for the cost estimate.
        """
        hf = self.spec.hf_jobs
        ranks = list(ranks)
        flavor = self.flavor()
        gpus = flavor_gpus(flavor)
        notes = [
            f"one HF Job per rank on {self.endpoint} in namespace "
            f"{hf.namespace or '<your user, from the token>'} (command shown for rank {ranks[0] if ranks else 0})",
            f"a wheel of this checkout is built and staged at {run_uri.rstrip('/')}/{WHEEL_PREFIX}/<sha256>/; "
            "the bootstrap installs it with the pinned versions of composer_cloud/images/requirements.txt as "
            "constraints (torch and the rest, unless the image has them) before the replica starts",
            f"estimated_gpu_hours is an upper bound: {len(ranks)} job(s) x {gpus} GPU(s) x timeout "
            f"{hf.timeout_s / 3600:g} h; jobs are billed until they exit",
            *self._resolution_note(),
            *self._flavor_notes(),
        ]
        if self.relaunches(self.spec):
            notes.append(f"attempts={self.relaunches(self.spec) + 1} per job (max_restarts)")
        notes.extend(self._problem_notes())
        cost = self.cost_estimate(len(ranks))
        return LaunchPlan(
            executor=self.name,
            ranks=ranks,
            image=hf.image,
            command=self._command(run_uri, ranks[0] if ranks else 0, bootstrap=BOOTSTRAP_PLACEHOLDER),
            env_names=sorted(self._job_env(None)),
            secret_names=[*hf.secrets, *self.job_secrets()],
            gpu=f"{flavor} ({gpus} GPU{'s' if gpus != 1 else ''})",
            gpus_per_replica=gpus,
            estimated_gpu_hours=len(ranks) * gpus * hf.timeout_s / 3600,
            notes=notes,
            **cost.plan_fields(),
        )

    def stage(self, run_uri: str) -> StagedWheel:
        """Build (or take the prebuilt) wheel and put it in the run's store. Idempotent per run."""
        if run_uri not in self._staged:
            store = Store(run_uri, storage_options=self.spec.store_options)
            self._staged[run_uri] = build_and_stage_wheel(store, wheel=self._wheel)
        return self._staged[run_uri]

    def launch(self, run_uri: str, ranks: Sequence[int]) -> list[JobHandle]:
        """Create one HF Job per rank; returns handles in ``ranks`` order.

        Order: cheap checks (:meth:`preflight`, flavor) first, then the wheel
        is staged, then jobs are created. A failure while creating jobs
        cancels the ones already created (see module docstring).
        """
        hf = self.spec.hf_jobs
        self.preflight(run_uri, ranks)
        flavor = self.flavor()
        for note in self._resolution_note():
            logger.info("hf-jobs: %s", note)
        for note in self._flavor_notes():
            warnings.warn(note, stacklevel=2)
            logger.warning("hf-jobs: %s", note)
        secrets = self._secret_values()
        namespace = self.namespace()
        staged = self.stage(run_uri)
        env = self._job_env(staged)
        bootstrap = bootstrap_source()
        run_id = run_id_of(run_uri)
        attempts = self.relaunches(self.spec) + 1 if self.relaunches(self.spec) else None
        api = self._api()
        handles: list[JobHandle] = []
        for rank in ranks:
            job_name = _NAME_UNSAFE.sub("-", f"{run_id}-r{rank}")
            try:
                info = api.run_job(
                    image=hf.image,
                    command=self._command(run_uri, rank, bootstrap=bootstrap),
                    env=env,
                    secrets=secrets or None,
                    flavor=flavor,
                    timeout=hf.timeout_s,
                    attempts=attempts,
                    name=job_name,
                    labels={LABEL_RUN: run_id, LABEL_RANK: str(rank)},
                    namespace=namespace,
                )
            except Exception as exc:  # noqa: BLE001 - roll back, then report
                self._roll_back(handles)
                raise self._error(f"creating the job for rank {rank}", exc) from exc
            handle = JobHandle(
                executor=self.name,
                rank=rank,
                job_id=str(info.id),
                data={
                    "endpoint": self.endpoint,
                    "namespace": namespace,
                    "url": getattr(info, "url", ""),
                    "name": job_name,
                    "flavor": flavor,
                    "image": hf.image,
                    "secret_names": list(hf.secrets),
                    "wheel_sha256": staged.sha256,
                },
            )
            logger.info("hf-jobs: rank %d -> job %s (%s)", rank, handle.job_id, handle.data["url"])
            handles.append(handle)
        return handles

    def _manual_cancel_hint(self, handle: JobHandle) -> str:
        return f"cancel it by hand: hf jobs cancel {handle.job_id}"

    # ------------------------------------------------------------------ re-attach
    def _where(self, handle: JobHandle) -> tuple[Any, str]:
        """The API client and namespace to reach ``handle``'s job: this process's configuration, never the
        handle's ``endpoint``/``namespace`` (the handle came from the store; the token must not follow it)."""
        if handle.data.get("endpoint") not in (None, self.endpoint):
            logger.warning("hf-jobs: the handle of replica %d names endpoint %r; using the configured %s "
                           "(a handle in the store never chooses where the token goes)", handle.rank,
                           str(handle.data.get("endpoint"))[:80], self.endpoint)
        return self._api(), self.namespace()

    def _check_run_label(self, handle: JobHandle, info: Any) -> None:
        """Refuse a job that is not labelled as this run's (a handle copied from another run, or forged)."""
        labels = getattr(info, "labels", None) or {}
        if self.spec.run_id and labels.get(LABEL_RUN) != self.spec.run_id:
            raise ExecutorError(f"hf-jobs: job {handle.job_id} is not a job of run {self.spec.run_id} (its label "
                                f"{LABEL_RUN} is {str(labels.get(LABEL_RUN))[:80]!r}); the handle of replica "
                                f"{handle.rank} in the store was altered or copied; refusing to act on it")

    def _fetch_status(self, handle: JobHandle) -> ReplicaStatus:
        """Map the job's stage to a :class:`ReplicaStatus`.

        A failed job's message carries the server's message and the job's last
        log lines; its exit code is parsed from the message when the server
        gives one.
        """
        api, namespace = self._where(handle)
        try:
            info = self._call(f"inspecting job {handle.job_id}",
                              lambda: api.inspect_job(job_id=handle.job_id, namespace=namespace))
        except ExecutorError as err:
            if self._is_gone(err):
                return ReplicaStatus(ReplicaState.FAILED, None,
                                     f"job {handle.job_id} not found in namespace {namespace!r} at "
                                     f"{handle.data.get('endpoint', self.endpoint)}; it was deleted, or the token "
                                     "cannot see that namespace")
            raise
        self._check_run_label(handle, info)
        stage = str(getattr(info.status.stage, "value", info.status.stage))
        message = info.status.message or ""
        state = STAGE_STATES.get(stage)
        if state is None:
            logger.warning("hf-jobs: job %s has unknown stage %r; treating it as pending", handle.job_id, stage)
            return ReplicaStatus(ReplicaState.PENDING, None, f"unknown stage {stage}: {message}".strip())
        if state is ReplicaState.SUCCEEDED:
            return ReplicaStatus(state, 0, message)
        if state is ReplicaState.FAILED:
            return ReplicaStatus(state, parse_exit_code(message),
                                 failure_message(f"HF job {handle.job_id} failed: {message or 'no message'}",
                                                 self._tail(handle)))
        if state is ReplicaState.CANCELLED:
            return ReplicaStatus(state, None, message or f"job {stage.lower()}")
        return ReplicaStatus(state, None, message)

    def _tail(self, handle: JobHandle, n: int = FAILURE_TAIL_LINES) -> list[str]:
        api, namespace = self._where(handle)
        try:
            lines = list(api.fetch_job_logs(job_id=handle.job_id, namespace=namespace, follow=False, tail=n))
        except Exception as exc:  # noqa: BLE001 - the status matters more than its decoration
            logger.debug("hf-jobs: no logs for job %s (%s)", handle.job_id, _describe(exc))
            return []
        out = [ln for line in lines for ln in line.splitlines()]
        return out[-n:]

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        """The job's output lines; with ``follow``, until the job ends (only a job labelled as this run's)."""
        api, namespace = self._where(handle)
        self._check_run_label(handle, self._call(f"inspecting job {handle.job_id}",
                                                 lambda: api.inspect_job(job_id=handle.job_id, namespace=namespace)))
        try:
            for line in api.fetch_job_logs(job_id=handle.job_id, namespace=namespace, follow=follow):
                yield from (line.splitlines() or [""])
        except Exception as exc:  # noqa: BLE001
            raise self._error(f"fetching logs of job {handle.job_id}", exc) from exc

    def _cancel_job(self, handle: JobHandle) -> None:
        api, namespace = self._where(handle)
        self._call(f"cancelling job {handle.job_id}", lambda: api.cancel_job(job_id=handle.job_id, namespace=namespace))

    def _is_gone(self, err: ExecutorError) -> bool:
        from huggingface_hub.errors import JobNotFoundError

        return isinstance(err.__cause__, JobNotFoundError)

    def find(self, run_uri: str) -> list[JobHandle]:
        """Handles of this run's jobs, found by label (for when records were lost), by rank."""
        api = self._api()
        namespace = self.namespace()
        run_id = run_id_of(run_uri)
        infos = self._call("listing jobs", lambda: list(api.list_jobs(labels={LABEL_RUN: run_id},
                                                                          namespace=namespace)))
        handles = []
        for info in infos:
            labels = info.labels or {}
            if labels.get(LABEL_RUN) != run_id or not str(labels.get(LABEL_RANK, "")).isdigit():
                continue
            handles.append(JobHandle(executor=self.name, rank=int(labels[LABEL_RANK]), job_id=str(info.id),
                                     data={"endpoint": self.endpoint, "namespace": namespace,
                                           "url": getattr(info, "url", ""), "flavor": info.flavor or ""}))
        return sorted(handles, key=lambda h: (h.rank, h.job_id))


# ---------------------------------------------------------------------- helpers
def _status_code(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
