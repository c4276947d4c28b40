"""Replica jobs on Modal: one ``FunctionCall`` per replica in a detached app.

Layout: every Modal SDK call lives in :class:`ModalSDKSeam` (spawn, state,
logs, cancel). :class:`ModalExecutor` holds everything around it -- launch
options from the spec, handles, the state mapping, roll-back, error messages --
and is tested with a fake seam. The code that runs *inside* the container is
:func:`composer_cloud.images.container.run_replica_body`, an ordinary function
that tests run locally (re-exported here with :class:`ReplicaFailed`). Imports
go one way, ``jobs -> images``: the Modal app module never imports this one.

Invariants:

* **Secrets by name only.** ``spec.modal.secrets`` are names of Modal secrets
  (``modal secret create NAME KEY=VALUE ...``), attached to the function with
  ``modal.Secret.from_name``. This process never reads a secret value, so none
  can reach a spawn argument, a :class:`JobHandle`, a :class:`LaunchPlan` or a
  log line.
* **One spawn per replica** (``Function.spawn``, not ``spawn_map``, which
  returns nothing to re-attach to) inside ``app.run(detach=True)``: the calls
  outlive the launcher, and each ``FunctionCall`` id goes into the rank's
  handle so ``status``/``logs``/``cancel`` re-attach from any machine with
  ``modal.FunctionCall.from_id``.
* **All or nothing launch.** If spawning rank k fails, the calls already
  spawned are cancelled before the error is raised.
* **Reads and cancels are retried**, on the errors :func:`is_transient`
  names (a lost connection to Modal), with the package's one policy; a
  spawn never is (a retry after a lost answer could start a second call).
* **Failures carry their cause.** A replica that exits non-zero raises
  :class:`ReplicaFailed` in the container (so Modal's retry policy applies);
  its message has the exit code and the last output lines, which
  :meth:`ModalExecutor.poll` surfaces.

Status caching, idempotent cancel, roll-back and the preflight's frame are
:class:`~composer_cloud.jobs.remote.RemoteExecutor`'s.
"""

from __future__ import annotations

import datetime as _dt
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from composer_cloud.images.container import ReplicaFailed, run_replica_body  # noqa: F401 - re-exported
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
from composer_cloud.jobs.remote import RemoteExecutor, parse_exit_code
from composer_cloud.jobs.credentials import Check, install_hint, sdk_installed
from composer_cloud.spec import RunSpec

logger = logging.getLogger(__name__)

#: GPU types Modal documents; others are passed through with a warning (Modal decides).
KNOWN_GPUS = ("T4", "L4", "A10", "A10G", "A100", "A100-40GB", "A100-80GB", "L40S", "H100", "H100!", "H200", "B200")
_NO_GPU = ("", "cpu", "none")
#: The most retries ``modal.Retries`` accepts.
MODAL_MAX_RETRIES = 10
_APP_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9._-]")
#: Errors of the Modal client (``modal.exception``) that a later identical call can succeed on.
_TRANSIENT_MODAL_ERRORS = frozenset({"ConnectionError", "InternalFailure"})

#: Modal's published per-second price of one GPU (USD), by GPU type, and whether we could confirm it.
#: Taken 2026-11-23. modal.com/pricing itself was not readable from here; the confirmed numbers are
#: those a third-party summary quotes as "verified on May 7, 2026 from official vendor pricing"
#: (H100 $0.001097/s = $3.9492/h, A100-80GB $2.4984/h, L40S $1.9512/h, T4 $0.5904/h, L4 $0.7992/h).
#: The unconfirmed ones are Modal's earlier list prices; check modal.com/pricing before relying on them.
#: CPU and memory of the container are billed on top and are not included.
MODAL_GPU_PRICES_TAKEN = "2026-11-23"
MODAL_GPU_PRICE_PER_S: dict[str, tuple[float, bool]] = {
    "H100": (0.001097, True),
    "A100-80GB": (0.000694, True),
    "L40S": (0.000542, True),
    "L4": (0.000222, True),
    "T4": (0.000164, True),
    "A100-40GB": (0.000583, False),
    "A10": (0.000306, False),
    "H200": (0.001261, False),
    "B200": (0.001736, False),
}
_GPU_ALIASES = {"A100": "A100-40GB", "A10G": "A10", "H100!": "H100", "B200+": "B200"}
#: Most GPUs of one type in one Modal container (after :data:`_GPU_ALIASES`). Source: Modal's GPU guide,
#: modal.com/docs/guide/gpu ("Specifying GPU count"), read 2026-11-24: "B200, H200, H100, A100, L4, T4 and
#: L40S instances support up to 8 GPUs ... and A10 instances support up to 4 GPUs". Types it does not name
#: (RTX-PRO-6000, new ones) have no limit here: Modal decides.
MODAL_MAX_GPUS_PER_CONTAINER: dict[str, int] = {
    "B200": 8, "H200": 8, "H100": 8, "A100-40GB": 8, "A100-80GB": 8, "L4": 8, "T4": 8, "L40S": 8, "A10": 4,
}


# ---------------------------------------------------------------------- seam types
@dataclass(frozen=True)
class FunctionOptions:
    """Per-launch options of the replica function (``Function.with_options``)."""

    gpu: str | None  # "H100", "H100:4", or None for CPU only
    timeout_s: int
    retries: int  # Modal retries after a failure (0: none)
    secret_names: tuple[str, ...]
    #: Secret values created for this launch (the run key of a signed run), attached as a ``modal.Secret``
    #: built from them; never stored, logged or shown (``repr`` hides them).
    secret_values: Mapping[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class SpawnRequest:
    """One replica to spawn: its argv and extra (non-secret) environment."""

    rank: int
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class SpawnResult:
    app_id: str
    call_ids: list[str]  # same order as the requests


CallKind = Literal["pending", "running", "succeeded", "failed", "init_failed", "cancelled", "timed_out", "expired"]


@dataclass(frozen=True)
class CallState:
    """What the seam learned about one FunctionCall."""

    kind: CallKind
    result: Any = None
    message: str = ""


class PartialSpawnError(ExecutorError):
    """Spawning stopped part-way; ``call_ids`` were spawned and must be cleaned up."""

    def __init__(self, app_id: str | None, call_ids: list[str], cause: BaseException) -> None:
        self.app_id = app_id
        self.call_ids = list(call_ids)
        self.cause = cause
        super().__init__(f"spawned {len(call_ids)} call(s) before {type(cause).__name__}: {cause}")


class ModalSeam(Protocol):
    """The Modal SDK calls ModalExecutor needs. Raise on client-side errors (auth, network)."""

    def spawn(self, *, app_name: str, options: FunctionOptions, requests: Sequence[SpawnRequest]) -> SpawnResult:
        """Run the app detached and spawn one call per request; raise PartialSpawnError part-way."""
        ...

    def state(self, call_id: str) -> CallState: ...

    def logs(self, call_id: str, *, since: _dt.datetime, follow: bool) -> Iterator[str]: ...

    def cancel(self, call_id: str) -> None: ...


# ---------------------------------------------------------------------- the real SDK
class ModalSDKSeam:
    """:class:`ModalSeam` on the ``modal`` SDK. The only code here that talks to Modal.

    Args:
        show_progress: show Modal's output while the app starts (image build
            steps, mounts, function creation) on this process's terminal, via
            ``modal.enable_output()``. The replicas' own logs are not streamed
            here (``composer-cloud logs`` fetches them).
    """

    def __init__(self, *, show_progress: bool = True) -> None:
        self.show_progress = show_progress

    @staticmethod
    def with_options_kwargs(options: FunctionOptions) -> dict[str, Any]:
        """``Function.with_options`` arguments for ``options`` (builds SDK objects, calls nothing)."""
        import modal

        kwargs: dict[str, Any] = {
            "timeout": options.timeout_s,
            # Resolved by name when the app starts: a missing secret fails the launch, not the replica.
            "secrets": [modal.Secret.from_name(n) for n in options.secret_names]
            + ([modal.Secret.from_dict(dict(options.secret_values))] if options.secret_values else []),
        }
        if options.gpu:
            kwargs["gpu"] = options.gpu
        if options.retries:
            # Modal caps delays at 60 s: 10 s, 20 s, 40 s, 60 s, 60 s, ...
            kwargs["retries"] = modal.Retries(max_retries=options.retries, backoff_coefficient=2.0,
                                              initial_delay=10.0, max_delay=60.0)
        return kwargs

    def spawn(self, *, app_name: str, options: FunctionOptions, requests: Sequence[SpawnRequest]) -> SpawnResult:
        import contextlib

        import modal

        from composer_cloud.images import modal_image

        kwargs = self.with_options_kwargs(options)
        app = modal_image.app
        call_ids: list[str] = []
        # enable_output: the first launch builds the image (minutes); show its steps rather than hang silently.
        progress = modal.enable_output() if self.show_progress else contextlib.nullcontext()
        # detach=True: leaving the block does not stop the app; the spawned calls run on.
        with progress, app.run(detach=True, name=app_name):
            fn = modal_image.replica.with_options(**kwargs)
            for req in requests:
                try:
                    call = fn.spawn(argv=req.argv, env=req.env)
                except Exception as exc:  # noqa: BLE001 - the caller cleans up what was spawned
                    raise PartialSpawnError(app.app_id, call_ids, exc) from exc
                call_ids.append(call.object_id)
            return SpawnResult(app_id=str(app.app_id), call_ids=call_ids)

    def state(self, call_id: str) -> CallState:
        import modal
        from modal import exception as mexc

        call = modal.FunctionCall.from_id(call_id)
        try:
            return CallState("succeeded", result=call.get(timeout=0))
        except mexc.FunctionTimeoutError as exc:
            return CallState("timed_out", message=str(exc))
        except mexc.OutputExpiredError as exc:
            return CallState("expired", message=str(exc) or "output expired")
        except TimeoutError:  # builtin: no output yet
            return CallState(self._pending_or_running(call))
        except mexc.InputCancellation as exc:
            return CallState("cancelled", message=str(exc))
        except (mexc.AuthError, mexc.ConnectionError, mexc.NotFoundError, mexc.InvalidError, mexc.ServiceError):
            raise  # client-side problems, not the replica's
        except Exception as exc:  # noqa: BLE001 - the remote function's failure
            status = self._input_status(call)
            kind: CallKind = {"TERMINATED": "cancelled", "INIT_FAILURE": "init_failed",
                              "TIMEOUT": "timed_out"}.get(status or "", "failed")  # type: ignore[assignment]
            message = str(exc) if isinstance(exc, ReplicaFailed) else f"{type(exc).__name__}: {exc}"
            return CallState(kind, message=message)

    @staticmethod
    def _call_graph(call: Any) -> list[Any]:
        try:
            return [i for i in call.get_call_graph() if i.function_call_id == call.object_id]
        except Exception as exc:  # noqa: BLE001 - best effort (Modal says so too)
            logger.debug("modal: no call graph for %s (%s)", call.object_id, exc)
            return []

    def _pending_or_running(self, call: Any) -> CallKind:
        graph = self._call_graph(call)
        if graph and not any(i.task_id for i in graph):
            return "pending"
        return "running"  # also when the (best-effort) call graph is unavailable

    def _input_status(self, call: Any) -> str | None:
        graph = self._call_graph(call)
        return graph[-1].status.name if graph else None

    def logs(self, call_id: str, *, since: _dt.datetime, follow: bool) -> Iterator[str]:
        import modal

        call = modal.FunctionCall.from_id(call_id)
        entries = call.logs.fetch(since=since)
        for entry in entries:
            yield from _lines(entry.message)
        if follow:
            # stream() yields entries newer than its start and ends when the call has ended.
            for entry in call.logs.stream():
                yield from _lines(entry.message)

    def cancel(self, call_id: str) -> None:
        import modal

        modal.FunctionCall.from_id(call_id).cancel(terminate_containers=True)


def _lines(message: str) -> list[str]:
    return message.splitlines()


def is_transient(exc: BaseException) -> bool:
    """Modal's transient errors: ``modal.exception.ConnectionError`` (the client could not reach Modal after
    its own retries), ``InternalFailure`` (Modal's "retriable internal error"), and the builtin connection
    and timeout errors. Matched by name, so this module needs no ``modal`` import."""
    cls = type(exc)
    if cls.__module__ == "modal.exception" and cls.__name__ in _TRANSIENT_MODAL_ERRORS:
        return True
    return isinstance(exc, (ConnectionError, TimeoutError))


# ---------------------------------------------------------------------- executor
class ModalExecutor(RemoteExecutor):
    """Runs each replica as a Modal FunctionCall.

    Args:
        spec: the run spec (``spec.modal`` and ``spec.max_restarts`` are used).
        seam: the Modal SDK boundary (default :class:`ModalSDKSeam`).
        replica_argv: ``(run_uri, rank) -> argv`` the function runs; default
            :func:`replica_command`.
    """

    name: ClassVar[str] = "modal"
    sdk: ClassVar[tuple[str, str] | None] = ("modal", "modal")
    transient = staticmethod(is_transient)

    @classmethod
    def check_credentials(cls) -> list[Check]:
        """A Modal token where the SDK finds one (``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET`` or ``~/.modal.toml``)."""
        if not sdk_installed("modal"):
            return [Check("modal: modal SDK", False, f"modal is not installed; {install_hint('modal', 's3')}")]
        from modal.config import config

        if config.get("token_id") and config.get("token_secret"):
            return [Check("modal: token", True, f"token id {config.get('token_id')[:6]}… (profile or MODAL_TOKEN_ID)")]
        return [Check("modal: token", False, "no Modal token: run `modal token new`, or export MODAL_TOKEN_ID and "
                                             "MODAL_TOKEN_SECRET")]

    @classmethod
    def relaunches(cls, spec: RunSpec) -> int:
        """Modal's retry policy (``modal.Retries``): the larger of ``[modal] retries`` and ``max_restarts``, so that
        ``max_restarts`` means at least what it says, capped at the :data:`MODAL_MAX_RETRIES` Modal accepts."""
        return min(MODAL_MAX_RETRIES, max(spec.modal.retries, spec.max_restarts))

    def __init__(self, spec: RunSpec, *, seam: ModalSeam | None = None, run_key: str | None = None,
                 replica_argv: Callable[[str, int], list[str]] = replica_command) -> None:
        super().__init__(spec, run_key=run_key)
        self.seam: ModalSeam = seam or ModalSDKSeam()
        self._replica_argv = replica_argv

    # ------------------------------------------------------------------ options
    def function_options(self) -> FunctionOptions:
        """GPU ``TYPE[:N]`` (N = ``gpus_per_replica``), timeout, retries and secret names from the spec.

        Retries are :meth:`relaunches` (``max(modal.retries, max_restarts)``, at most 10).
        """
        m = self.spec.modal
        empty = [n for n in m.secrets if not n.strip()]
        if empty:
            raise ExecutorError("modal.secrets has an empty name; list Modal secret names "
                                "(see `modal secret list`)")
        return FunctionOptions(gpu=self._gpu(), timeout_s=m.timeout_s,
                               retries=self.relaunches(self.spec),
                               secret_names=tuple(m.secrets), secret_values=self.job_secrets())

    def _gpu(self) -> str | None:
        """``modal.gpu``'s type with ``gpus_per_replica`` GPUs (None: CPU only). A count written in
        ``modal.gpu`` must agree; a count above what Modal puts in one container is refused."""
        m = self.spec.modal
        n = self.spec.gpus_per_replica
        gpu_type, sep, written = m.gpu.strip().partition(":")
        if gpu_type.lower() in _NO_GPU:
            return None  # gpus_per_replica CPU processes (gloo)
        if sep and written.strip() != str(n):
            raise ExecutorError(f"modal.gpu {m.gpu!r} asks for {written.strip() or 'no'} GPUs but gpus_per_replica "
                                f"= {n}; write modal.gpu = {gpu_type!r} and set gpus_per_replica (it sets both "
                                "the GPUs of each call and the replica's local ranks)")
        key = _GPU_ALIASES.get(gpu_type.upper(), gpu_type.upper())
        limit = MODAL_MAX_GPUS_PER_CONTAINER.get(key)
        if limit is not None and n > limit:
            allowed = ", ".join(t for t, most in MODAL_MAX_GPUS_PER_CONTAINER.items() if most >= n)
            raise ExecutorError(f"gpus_per_replica = {n}: Modal puts at most {limit} {gpu_type} GPUs in one "
                                f"container (modal.com/docs/guide/gpu); use gpus_per_replica <= {limit} or a "
                                f"modal.gpu type with {n}: {allowed}")
        return gpu_type if n == 1 else f"{gpu_type}:{n}"

    def gpus_per_replica(self) -> int:
        opts = self.function_options()
        if opts.gpu is None:
            return 0
        return int(opts.gpu.split(":", 1)[1]) if ":" in opts.gpu else 1

    def _gpu_notes(self) -> list[str]:
        gpu = self.spec.modal.gpu.split(":", 1)[0].strip()
        if gpu.lower() in _NO_GPU:
            return []
        notes = []
        if gpu.upper() not in KNOWN_GPUS:
            notes.append(f"GPU type {gpu!r} is not one Modal documents ({', '.join(KNOWN_GPUS)}); Modal decides")
        if self.spec.device == "cpu":
            notes.append(f'device = "cpu": the {self.spec.gpus_per_replica} {gpu} GPU(s) of each call go unused; '
                         'set modal.gpu = "cpu" for CPU-only calls')
        return notes

    def _remote_readers(self) -> str:
        return "Modal containers"

    def _local_store_fix(self) -> str:
        return "use an s3:// store and attach its credentials as a Modal secret"

    def _credentials_problem(self) -> str | None:
        """An S3 store with no Modal secret attached (containers get credentials only from secrets)."""
        if self._needs_s3_credentials() and not self.spec.modal.secrets:
            return (f"store {self.spec.store} is S3 but modal.secrets is empty, so containers would have no "
                    "credentials: `modal secret create NAME AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...` "
                    "and set [modal] secrets = [\"NAME\"]")
        return None

    def preflight(self, run_uri: str, ranks: Sequence[int]) -> None:
        """Refuse a launch that cannot work, before anything is written; talks to nobody.

        Checks the options (GPU count, secret names) and that containers can
        reach the store: an S3 store needs at least one Modal secret (containers
        get credentials only from secrets; a public bucket sets
        ``store_options.anon = true``). What a named secret holds is known to
        Modal alone, and a missing secret fails the launch by name. Raises
        :class:`ExecutorError`.
        """
        self.function_options()  # raises on a GPU count Modal cannot give or an empty secret name
        super().preflight(run_uri, ranks)

    def cost_estimate(self, jobs: int) -> CostEstimate:
        """Dollars for ``jobs`` calls from :data:`MODAL_GPU_PRICE_PER_S` (GPU time only): a call costs
        ``gpus_per_replica`` x the per-GPU price. Raises only on options :meth:`function_options` refuses."""
        opts = self.function_options()
        attempts = self.relaunches(self.spec) + 1  # starts of one call at most, the first included
        if opts.gpu is None:
            return CostEstimate.of(jobs=jobs, price_per_job_hour_usd=None, timeout_s=opts.timeout_s,
                                   attempts=attempts, basis="no GPU price: CPU-only calls (CPU and memory are "
                                   "billed per second, see modal.com/pricing)")
        gpu_type, _, _ = opts.gpu.partition(":")
        key = _GPU_ALIASES.get(gpu_type.upper(), gpu_type.upper())
        if key not in MODAL_GPU_PRICE_PER_S:
            return CostEstimate.of(jobs=jobs, price_per_job_hour_usd=None, timeout_s=opts.timeout_s,
                                   attempts=attempts, basis=f"no price for GPU {gpu_type!r} in the table "
                                   f"taken {MODAL_GPU_PRICES_TAKEN}; see modal.com/pricing")
        per_s, confirmed = MODAL_GPU_PRICE_PER_S[key]
        count = self.gpus_per_replica()
        per_hour = per_s * 3600 * count
        return CostEstimate.of(
            jobs=jobs, price_per_job_hour_usd=per_hour, timeout_s=opts.timeout_s, attempts=attempts,
            basis=(f"Modal's published GPU price table in composer_cloud/jobs/modal_jobs.py (taken "
                   f"{MODAL_GPU_PRICES_TAKEN}{'' if confirmed else '; this price unconfirmed'}): {key} "
                   f"${per_s:g}/s x {count} GPU(s) = ${per_hour:.2f}/h per call, GPU only; estimate = {jobs} "
                   f"call(s) x timeout {opts.timeout_s / 3600:g} h, max x {attempts} attempt(s)"))

    def app_name(self, run_uri: str) -> str:
        return _APP_NAME_UNSAFE.sub("-", f"{self.spec.modal.app_name}-{run_id_of(run_uri)}")[:64]

    # ------------------------------------------------------------------ protocol
    def plan(self, run_uri: str, ranks: Sequence[int]) -> LaunchPlan:
        """What :meth:`launch` would do. Talks to nothing."""
        from composer_cloud.images import modal_image

        ranks = list(ranks)
        opts = self.function_options()
        gpus = self.gpus_per_replica()
        notes = [
            f"one FunctionCall per rank of {modal_image.__name__}.{modal_image.FUNCTION_NAME} in detached app "
            f"{self.app_name(run_uri)!r} (command shown for rank {ranks[0] if ranks else 0})",
            f"timeout {opts.timeout_s} s, retries {opts.retries}",
            f"estimated_gpu_hours is an upper bound: {len(ranks)} call(s) x {gpus} GPU(s) x timeout "
            f"{opts.timeout_s / 3600:g} h; Modal bills per second while a container runs",
            *self._gpu_notes(),
            *self._problem_notes(),
        ]
        cost = self.cost_estimate(len(ranks))
        return LaunchPlan(
            executor=self.name,
            ranks=ranks,
            image=(f"modal: debian_slim python {modal_image.PYTHON_VERSION} + "
                   f"{len(modal_image.pinned_requirements())} pinned packages (uv) "
                   "(composer_cloud/images/requirements.txt) + local composer_cloud source"),
            command=list(self._replica_argv(run_uri, ranks[0] if ranks else 0)),
            env_names=sorted(self.job_env()),
            secret_names=list(opts.secret_names),
            gpu=opts.gpu or "none (CPU)",
            gpus_per_replica=gpus,
            estimated_gpu_hours=len(ranks) * gpus * opts.timeout_s / 3600,
            notes=notes,
            **cost.plan_fields(),
        )

    def launch(self, run_uri: str, ranks: Sequence[int]) -> list[JobHandle]:
        """Spawn one FunctionCall per rank in a detached app; handles in ``ranks`` order."""
        self.preflight(run_uri, ranks)
        opts = self.function_options()
        for note in self._gpu_notes():
            warnings.warn(note, stacklevel=2)
            logger.warning("modal: %s", note)
        env = self.job_env()
        ranks = list(ranks)
        requests = [SpawnRequest(rank=r, argv=list(self._replica_argv(run_uri, r)), env=dict(env)) for r in ranks]
        app_name = self.app_name(run_uri)
        launched_at = _dt.datetime.now(_dt.timezone.utc)
        try:
            result = self.seam.spawn(app_name=app_name, options=opts, requests=requests)
        except PartialSpawnError as exc:
            self._roll_back(self._handles(ranks, exc.call_ids))
            raise ExecutorError(
                f"modal: spawning replicas failed after {len(exc.call_ids)} of {len(ranks)} "
                f"({type(exc.cause).__name__}: {exc.cause}); the spawned calls were cancelled. "
                f"{_hint(exc.cause)}") from exc.cause
        except Exception as exc:  # noqa: BLE001 - nothing was spawned
            raise ExecutorError(f"modal: launching app {app_name!r} failed ({type(exc).__name__}: {exc}). "
                                f"{_hint(exc)}") from exc
        if len(result.call_ids) != len(ranks):
            self._roll_back(self._handles(ranks, result.call_ids))
            raise ExecutorError(f"modal: expected {len(ranks)} FunctionCall ids, got {len(result.call_ids)}; "
                                "the spawned calls were cancelled")
        handles = []
        for rank, call_id in zip(ranks, result.call_ids):
            handles.append(JobHandle(executor=self.name, rank=rank, job_id=call_id, data={
                "app_id": result.app_id,
                "app_name": app_name,
                "function": "replica",
                "gpu": opts.gpu or "",
                "timeout_s": opts.timeout_s,
                "retries": opts.retries,
                "secret_names": list(opts.secret_names),
                "launched_at": launched_at.isoformat(),
            }))
            logger.info("modal: rank %d -> FunctionCall %s (app %s)", rank, call_id, result.app_id)
        return handles

    def _handles(self, ranks: Sequence[int], call_ids: Sequence[str]) -> list[JobHandle]:
        """Bare handles of calls spawned for ``ranks`` (in order), for a roll-back."""
        return [JobHandle(executor=self.name, rank=rank, job_id=call_id) for rank, call_id in zip(ranks, call_ids)]

    def _manual_cancel_hint(self, handle: JobHandle) -> str:
        return "stop the app in the Modal dashboard or with `modal app stop`"

    def _error(self, what: str, exc: BaseException) -> ExecutorError:
        return ExecutorError(f"modal: {what} ({type(exc).__name__}: {exc}). {_hint(exc)}")

    def _fetch_status(self, handle: JobHandle) -> ReplicaStatus:
        """Map the FunctionCall's state to a :class:`ReplicaStatus`."""
        st = self._call(f"cannot get the state of FunctionCall {handle.job_id}",
                        lambda: self.seam.state(handle.job_id))
        return self._map(handle, st)

    def _map(self, handle: JobHandle, st: CallState) -> ReplicaStatus:
        call = handle.job_id
        if st.kind == "pending":
            return ReplicaStatus(ReplicaState.PENDING, None, st.message or "waiting for a container")
        if st.kind == "running":
            return ReplicaStatus(ReplicaState.RUNNING, None, st.message)
        if st.kind == "succeeded":
            code = st.result.get("exit_code", 0) if isinstance(st.result, Mapping) else 0
            if code == 0:
                return ReplicaStatus(ReplicaState.SUCCEEDED, 0, "")
            return ReplicaStatus(ReplicaState.FAILED, int(code), f"replica exited with code {code}")
        if st.kind == "failed":
            return ReplicaStatus(ReplicaState.FAILED, parse_exit_code(st.message),
                                 f"Modal call {call} failed: {st.message or 'no message'}")
        if st.kind == "init_failed":
            return ReplicaStatus(ReplicaState.FAILED, None,
                                 f"Modal call {call}: the container failed to start (image build, import or "
                                 f"missing secret): {st.message or 'no message'}")
        if st.kind == "timed_out":
            timeout = handle.data.get("timeout_s", self.spec.modal.timeout_s)
            return ReplicaStatus(ReplicaState.FAILED, None,
                                 f"Modal call {call} ran past its timeout ({timeout} s, modal.timeout_s)")
        if st.kind == "cancelled":
            return ReplicaStatus(ReplicaState.CANCELLED, None, st.message or "cancelled")
        if st.kind == "expired":
            return ReplicaStatus(ReplicaState.FAILED, None,
                                 f"Modal no longer keeps the result of call {call} (results expire); "
                                 "the run's commit records in the store say how far it got")
        raise ExecutorError(f"modal: unknown call state {st.kind!r} for {call}")

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        """Output lines of the call (fetched from Modal's log service)."""
        raw = handle.data.get("launched_at")
        start = _dt.datetime.fromisoformat(raw) if raw else _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(days=7)
        since = start - _dt.timedelta(minutes=1)  # clock skew between this machine and Modal
        try:
            yield from self.seam.logs(handle.job_id, since=since, follow=follow)
        except Exception as exc:  # noqa: BLE001
            raise ExecutorError(f"modal: cannot fetch logs of FunctionCall {handle.job_id} "
                                f"({type(exc).__name__}: {exc}). {_hint(exc)}") from exc

    def _cancel_job(self, handle: JobHandle) -> None:
        """Cancel the call and terminate its container."""
        self._call(f"cannot cancel FunctionCall {handle.job_id}", lambda: self.seam.cancel(handle.job_id))


def _hint(exc: BaseException) -> str:
    name = type(exc).__name__
    text = str(exc).lower()
    if name == "AuthError" or "token" in text:
        return "Check your Modal credentials: `modal token new`, or MODAL_TOKEN_ID / MODAL_TOKEN_SECRET."
    if name == "NotFoundError" and "secret" in text:
        return "Create the secret first: `modal secret create NAME KEY=VALUE ...` (names in modal.secrets)."
    if name == "NotFoundError":
        return "The call or app no longer exists (wrong workspace or environment, or it was deleted)."
    return "Check your network and `modal profile current`."
