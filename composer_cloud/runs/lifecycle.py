"""Launch, resume, cancel, inspect and wait for runs: the library API under the CLI.

Every function takes keyword-only options and returns a dataclass, so the
same calls work from a script or a notebook::

    import composer_cloud as cc
    run = cc.launch(overrides={"replicas": 2, "rounds": 2})
    final = cc.wait(run)
    print(final.state, final.rounds_committed)

Errors (:mod:`composer_cloud.errors`): a :class:`~composer_cloud.errors.ConfigError`
(``SpecError``, ``StoreConfigError``, ``RunNotFound``, ``RunExists``) is bad input and
nothing was written (CLI exit code 2). A backend that fails while jobs are being started
raises :class:`~composer_cloud.errors.LaunchError` (exit code 1).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_cloud.errors import (
    ConfigError,
    ExecutorError,
    LaunchError,
    RunExists,
    SpecError,
    StoreConfigError,
    StoreError,
)
from composer_cloud.jobs import JobHandle, LaunchPlan, assign_jobs, get_executor, trusted_handles
from composer_cloud.rollouts.batches import discard_rollouts_after
from composer_cloud.runs import signing, sync_state
from composer_cloud.runs.interrupts import LaunchInterrupted, sigint_after
from composer_cloud.runs.preflight import (
    check_dataset,
    check_hub_model,
    check_local_data_file,
    check_model_dir,
    check_replica_build,
    launch_warnings,
    leaves_no_new_folders,
    replica_device,
)
from composer_cloud.runs.waiting import wait
from composer_cloud.runs.states import RunState
from composer_cloud.runs.status import RunStatus, run_status
from composer_cloud.runs.training_plan import training_plan
from composer_cloud.spec import RunSpec, check_device, load_spec, spec_from_dict
from composer_cloud.spec_paths import with_paths
from composer_cloud.storage import layout
from composer_cloud.storage.records import CodeRef, ResumeRecord
from composer_cloud.storage.run import (
    Run,
    load_handles,
    normalize_run_uri,
    open_run,
    request_cancel,
    save_handles,
)
from composer_cloud.storage.store import Store, join_uri
from composer_cloud.sync.checkpoint.manifests import Checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeResult:
    """What :func:`resume` did. ``from_round`` is the checkpoint resumed from (-1: the start)."""

    run: Run
    from_round: int
    handles: list[JobHandle]
    warnings: list[str] = field(default_factory=list)
    #: set when nothing was done, saying why (e.g. the run already completed)
    noop: str = ""


@dataclass(frozen=True)
class CancelResult:
    """What :func:`cancel` did: the ranks whose jobs were asked to stop, and any that could not be."""

    run: Run
    cancelled: list[int]
    warnings: list[str] = field(default_factory=list)
    #: set when nothing was done, saying why (the run had already finished)
    noop: str = ""


RunRef = Run | str


def _as_run(ref: RunRef, storage_options: Mapping[str, Any] | None) -> Run:
    return ref if isinstance(ref, Run) else open_run(ref, storage_options=storage_options)


# ---------------------------------------------------------------- specs and plans
def _checked_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """``overrides`` as a dict, once every key is a dotted setting name; else :class:`SpecError` (``overrides``)."""
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise SpecError("overrides", f"must map dotted setting names to values (e.g. {{\"sync.codec\": \"bf16\"}}), "
                        f"got a {type(overrides).__name__}")
    for key in overrides:
        if not isinstance(key, str) or not all(part.strip() for part in key.split(".")):
            raise SpecError("overrides", f"key {key!r} is not a dotted setting name (e.g. \"inner_optimizer.lr\")")
    return dict(overrides)


#: Store schemes that live inside one process: every executor runs its replicas in processes of their own.
_IN_PROCESS_STORES = ("memory",)


def _check_store_shared(spec: RunSpec) -> None:
    """A store the replica jobs can all reach: fsspec's ``memory://`` exists only in the process that made it."""
    scheme = spec.store.split("://", 1)[0] if "://" in spec.store else "file"
    if scheme in _IN_PROCESS_STORES:
        raise SpecError("store", f"{scheme}:// lives inside one process, and the {spec.executor} executor runs each "
                        "replica in a process of its own, so they could not share it; use file:// (one machine) or "
                        "an object store (s3://...)")


def build_spec(*, config: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> RunSpec:
    """The spec a launch would use: ``config`` (TOML) or defaults, then dotted ``overrides``, with a run id.

    Raises :class:`SpecError` naming the field for anything invalid, including the executor mix.
    """
    spec = load_spec(config, _checked_overrides(overrides)).with_run_id()
    if spec.store.startswith("file://"):
        # Absolute, so the run can be opened (status, export, resume) from any directory.
        spec = spec.model_copy(update={"store": "file://" + os.path.abspath(spec.store[len("file://"):])})
    _check_jobs(spec)
    return spec


def _check_jobs(spec: RunSpec) -> None:
    """The executor mix (replicas and rollout workers) names known executors whose counts add up; else a
    :class:`SpecError` naming ``executor`` or ``rollouts.executor``."""
    try:
        assign_jobs(spec)
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        raise SpecError(field if field in ("executor", "rollouts.executor") else "executor", message) from None


def plan(spec: RunSpec) -> list[LaunchPlan]:
    """What :func:`launch` would start, per executor, without starting or writing anything."""
    run_uri = join_uri(spec.store, spec.run_id)
    plans = []
    for name, ranks in assign_jobs(spec):
        try:
            plans.append(get_executor(name, spec).plan(run_uri, ranks))
        except (ExecutorError, ValueError) as exc:
            raise SpecError("executor", f"{name}: {str(exc).removeprefix(name + ': ')}") from None
    return plans


def _open_store_for(spec: RunSpec, *, signing_key: bytes | None) -> Store:
    """The run's store, after proving the store provides what a run needs.

    The conformance probe (reachability and credentials, write-once create,
    read/list-after-write, delete; :mod:`composer_cloud.storage.conformance`)
    writes only under its own scratch prefix and removes it; a store that fails
    is refused with :class:`StoreConfigError` naming the property and the store.
    """
    from composer_cloud.storage.conformance import require_conformance

    report = require_conformance(spec.store, storage_options=spec.store_options)
    return Store(join_uri(report.store, spec.run_id), storage_options=spec.store_options, signing_key=signing_key)


def _require_conforming_store(run: Run) -> None:
    """The conformance probe ``launch`` runs, for the store holding ``run`` (once per store and process).

    Every command that writes to a run calls it before its first write: a run copied onto a store
    without write-once create (or one that serves partial objects) is refused with
    :class:`StoreConfigError` naming the missing properties, and nothing is written.
    """
    from composer_cloud.storage.conformance import require_conformance

    require_conformance(run.uri.rsplit("/", 1)[0], storage_options=run.store.storage_options)


def _start_jobs(store: Store, spec: RunSpec, run_key: str | None) -> list[JobHandle]:
    """Start the jobs; a signed run's key goes to each executor, which delivers it to its jobs as a secret.

    Ctrl-C lands between executors, never between starting jobs and recording their handles."""
    handles: list[JobHandle] = []
    for name, assigned in assign_jobs(spec):
        with sigint_after():
            try:
                launched = get_executor(name, spec, run_key=run_key).launch(store.uri, assigned)
            except (ExecutorError, StoreError, OSError) as exc:
                raise LaunchError(f"launch of ranks {assigned} on {name} failed: {exc}") from None
            save_handles(store, launched)
        handles.extend(launched)
    return handles


# ---------------------------------------------------------------- lifecycle
def _has_cloud_executor(spec: RunSpec) -> bool:
    return any(name != "local" for name, _ in assign_jobs(spec))


def _spec_paths(spec: RunSpec, base_dir: Path | None) -> list[Any]:
    """The local files and folders the spec names (``usercode.spec_local_paths``), errors as SpecError."""
    from composer_cloud.runs.packaging import UserCodeError, spec_local_paths

    try:
        return spec_local_paths(spec.model.name, spec.trainer.settings(), base_dir=base_dir or Path.cwd())
    except UserCodeError as exc:
        field, _, rest = str(exc).partition(" ")
        raise SpecError(field if field.startswith(("model.", "trainer.")) else "", str(exc)) from None


def _check_device(spec: RunSpec) -> None:
    """``device = "cuda"`` only where the replicas will have a GPU (names the field otherwise)."""
    executors = [name for name, _ in assign_jobs(spec)]
    local_cuda = False
    if spec.device == "cuda" and "local" in executors:
        import torch

        local_cuda = torch.cuda.is_available()
    check_device(spec, executors=executors, local_cuda=local_cuda)


def check_before_launch(spec: RunSpec, *, base_dir: Path | None = None) -> Any:
    """Everything checkable before anything is written; returns the user-code bundle (or None).

    Trainer settings (names ``trainer.<key>``), user code named by
    ``"module:factory"`` settings and ``[code] include`` (must be found, relative
    to ``base_dir`` or on ``sys.path``, and is packaged), local paths the spec names (exist; under the upload
    limit when a cloud executor will fetch them; a local model folder has a ``config.json`` with a
    ``model_type``), a dataset's columns against ``trainer.columns`` and the reward (a hub dataset that cannot
    be reached from here is a warning), each executor's own preflight (credentials, reachable store), and,
    when replicas run locally, this environment's packages against composer-cloud's requirements
    (:func:`composer_cloud.stack.check_packages`: one line naming a package that is too old).
    Raises :class:`SpecError` naming the field.
    """
    from composer_cloud.runs.packaging import UserCodeError, collect_code
    from composer_cloud.trainer.parallel import check_local_ranks
    from composer_cloud.trainer.plugin import TrainerPlugin
    from composer_cloud.trainer.settings import code_references, settings_class

    _check_store_shared(spec)
    _check_device(spec)
    check_local_ranks(spec)  # what a multi-GPU replica cannot run yet (the replica checks again)
    from composer_cloud.runs.doctor import missing_sdks

    missing = missing_sdks([name for name, _ in assign_jobs(spec)], spec.store)
    if missing:
        raise SpecError("executor", "; ".join(missing))
    if any(name == "local" for name, _ in assign_jobs(spec)):
        # Local replicas run this environment's packages: one too old fails each of them at start; say it now.
        from composer_cloud.stack import PackageTooOldError, check_packages

        try:
            check_packages(spec)
        except PackageTooOldError as exc:
            raise SpecError("", str(exc)) from None
    settings = spec.trainer.settings()
    try:
        parsed = settings_class(spec.trainer.name).from_settings(settings)
        trainer = parsed if isinstance(parsed, TrainerPlugin) else TrainerPlugin()  # a user trainer may declare none
        trainer.check_launch(spec)
    except ValueError as exc:
        raise SpecError("", str(exc)) from None
    references = code_references(spec.trainer.name, settings, import_user_class=True) | \
        {"trainer.name": spec.trainer.name}
    try:
        bundle = collect_code(references, include=spec.code.include, base_dir=base_dir or Path.cwd())
    except UserCodeError as exc:
        named = re.match(r"^((?:trainer|model|code)\.[\w.]+): (.*)$", str(exc), flags=re.S)
        raise (SpecError(named.group(1), named.group(2)) if named else SpecError("code", str(exc))) from None
    paths = _spec_paths(spec, base_dir)
    if _has_cloud_executor(spec):
        from composer_cloud.runs.packaging import MAX_FILE_BYTES, path_size

        for p in paths:
            size = path_size(p.path)
            if size > MAX_FILE_BYTES:
                raise SpecError(p.setting, f"{p.given!r} is {size} bytes, over the {MAX_FILE_BYTES}-byte limit for "
                                "files shipped through the store to cloud replicas; publish it (e.g. to the "
                                "Hugging Face Hub) and name it by id, or put it in the store yourself (s3://...)")
    local = {p.setting: p.path for p in paths}
    if "model.name" in local:
        check_model_dir(local["model.name"])
    elif spec.model.name != "tiny":
        check_hub_model(spec.model.name, base_dir or Path.cwd())
    devices = {p.executor: replica_device(spec, p.executor, p.gpus_per_replica) for p in plan(spec)}
    check_replica_build(spec, devices, local.get("model.name"))  # what the replicas check as they start
    if "trainer.pairs" in local:
        check_local_data_file(local["trainer.pairs"], "trainer.pairs")  # e.g. `pairs` that no teacher answered
    columns = check_dataset(settings, local, trainer) if settings.get("dataset") else None
    refusal = trainer.launch_refusal(columns)
    if refusal:
        raise SpecError("trainer", refusal)
    run_uri = join_uri(spec.store, spec.run_id)
    for name, ranks in assign_jobs(spec):
        try:
            get_executor(name, spec).preflight(run_uri, ranks)
        except ExecutorError as exc:  # its message may name the executor itself: never "modal: modal: ..."
            raise SpecError(name.replace("-", "_"), str(exc).removeprefix(f"{name}: ")) from None
    return None if bundle.empty else bundle


@dataclass(frozen=True)
class LaunchCheck:
    """What :func:`check_launch` found: the spec as ``launch`` would store it, the run's URI, the plans (per
    executor) and the training plan (``(label, value)`` rows, :func:`~.training_plan.training_plan`)."""

    spec: RunSpec
    run_uri: str
    plans: list[LaunchPlan]
    training: list[tuple[str, str]] = field(default_factory=list)


def _spec_of(spec: RunSpec | None, config: str | Path | None, overrides: Mapping[str, Any] | None) -> RunSpec:
    if spec is None:
        spec = build_spec(config=config, overrides=overrides)
    elif config is not None or overrides:
        raise SpecError("spec", "give either a spec or config/overrides, not both")
    return spec.with_run_id()


def _prepare(spec: RunSpec, base_dir: str | Path | None
             ) -> tuple[RunSpec, Any, list[tuple[str, bytes, str]], Store, str | None]:
    """Every check of a launch, in launch's order; writes nothing but the store probe's scratch objects.

    Returns the spec as it will be stored, the user-code bundle, the packed local files, the run's
    store and the run key (None for an unsigned run; never stored). Raises what launch raises for bad input (:class:`SpecError`, :class:`StoreConfigError`,
    :class:`RunExists` for a taken run id). ``launch`` and ``check_launch`` (``--dry-run``) both call it:
    one code path, so the dry run refuses exactly what launch refuses.
    """
    base = Path(base_dir) if base_dir is not None else None
    bundle = check_before_launch(spec, base_dir=base)
    # Local files the spec names: absolute for local replicas; uploaded (content-addressed) for cloud ones.
    packed: list[tuple[str, bytes, str]] = []
    paths = _spec_paths(spec, base)
    if paths and _has_cloud_executor(spec):
        from composer_cloud.runs.packaging import UserCodeError, pack_path

        files: dict[str, str] = {}
        for p in paths:
            try:
                key, data, sha = pack_path(p.path, given=p.given)
            except UserCodeError as exc:
                raise SpecError(p.setting, str(exc)) from None
            packed.append((key, data, sha))
            files[p.setting] = key
        spec = spec.model_copy(update={"code": spec.code.model_copy(update={"files": files})})
    elif paths:
        spec = with_paths(spec, {p.setting: str(p.path) for p in paths}, source="spec with absolute paths")
    spec, run_key = signing.launch_key(spec)
    store = _open_store_for(spec, signing_key=signing.signing_key(spec, run_key))
    if bundle is not None:  # the digest is fixed before the spec is stored; jobs get it in their environment
        ref = CodeRef(key=layout.code_key(bundle.sha256), sha256=bundle.sha256, bytes=bundle.size,
                      modules=bundle.modules)
        spec = spec.model_copy(update={"code": spec.code.model_copy(update={"ref": ref.to_json()})})
    if store.exists(layout.SPEC):
        raise RunExists(f"run {store.uri} already exists; continue it with `composer-cloud resume {store.uri}`, "
                        "or pick another --run-id")
    return spec, bundle, packed, store, run_key


def _store_model_files(store: Store, spec: RunSpec) -> None:
    """What export needs besides the weights (runs/export.py); a failure here costs export its independence
    from the original model folder, never the launch."""
    from composer_cloud.runs.export import store_model_files

    try:
        store_model_files(store, spec)
    except StoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - a tokenizer that cannot be re-saved: export falls back
        logger.warning("model files not stored with the run (%s: %s); export will load [model] name again",
                       type(exc).__name__, exc)


def check_launch(spec: RunSpec | None = None, *, config: str | Path | None = None,
                 overrides: Mapping[str, Any] | None = None, base_dir: str | Path | None = None) -> LaunchCheck:
    """Run every check :func:`launch` runs and return what it would start, starting and storing nothing.

    Raises exactly what ``launch`` would raise for bad input (the ``--dry-run`` of the CLI: exit 2).
    """
    if base_dir is None and config is not None:
        base_dir = Path(config).resolve().parent
    spec = _spec_of(spec, config, overrides)
    with leaves_no_new_folders(spec.store):  # a dry run writes nothing, not even the probe's folder
        spec, _, _, store, _ = _prepare(spec, base_dir)
        plans = plan(spec)
        devices = {p.executor: replica_device(spec, p.executor, p.gpus_per_replica) for p in plans}
        return LaunchCheck(spec=spec, run_uri=store.uri, plans=plans, training=training_plan(spec, devices))


def launch(spec: RunSpec | None = None, *, config: str | Path | None = None,
           overrides: Mapping[str, Any] | None = None, base_dir: str | Path | None = None) -> Run:
    """Launch a new run and return it once its replica jobs were started (it does not wait).

    Args:
        spec: a full spec; otherwise one is built from ``config`` and ``overrides``
            (dotted names, e.g. ``{"replicas": 4, "sync.codec": "bf16"}``).
        base_dir: where user code (``module:factory`` settings, ``[code] include``) is
            looked for first; default: the spec file's directory, else the current one.

    Raises:
        SpecError, StoreConfigError: bad input; nothing was written.
        RunExists: the run id is taken; nothing was written.
        LaunchError: a backend failed; what this launch wrote was removed again
            if no job had started, else the run stays for ``resume``/``cancel``.
    """
    from composer_cloud.runs.packaging import put_verified, upload_code

    if base_dir is None and config is not None:
        base_dir = Path(config).resolve().parent
    spec, bundle, packed, store, run_key = _prepare(_spec_of(spec, config, overrides), base_dir)
    uploads = (layout.CODE, layout.FILES, layout.DIRS, layout.MODEL_FILES)
    # What the replicas need is uploaded before the spec (the claim on the run id) is written: a run in the
    # store always has its code, files and model files, so one interrupted before its jobs started can be
    # started by `resume` ("not started" in status).
    try:
        if bundle is not None:
            upload_code(store, bundle)
        for key, data, sha in packed:
            put_verified(store, key, data, sha)
        _store_model_files(store, spec)
    except (StoreError, KeyboardInterrupt) as exc:
        if not store.exists(layout.SPEC):  # another launch may have claimed the id meanwhile: leave its files
            for prefix in uploads:
                store.delete(prefix, recursive=True)
        if isinstance(exc, KeyboardInterrupt):
            raise LaunchInterrupted(store.uri, written=False, started=False) from None
        raise LaunchError(f"{exc} (nothing was left in the store; fix it and launch again)") from None
    # Write-once: two launches racing on one run id cannot both start.
    if store.exists(layout.SPEC) or not store.create_json(layout.SPEC, spec.to_json_dict()):
        raise RunExists(f"run {store.uri} already exists; continue it with `composer-cloud resume {store.uri}`")
    signing.remember(store.uri, spec, run_key)
    try:
        _start_jobs(store, spec, run_key)
    except KeyboardInterrupt:
        # Written, so the run is "not started" (no job) or running (some jobs): say which and what to do.
        raise LaunchInterrupted(store.uri, written=True, started=bool(store.list(layout.HANDLES))) from None
    except (LaunchError, StoreError) as exc:
        if not store.list(layout.HANDLES):
            # No job started: roll back, so the id is free again and nothing claims to be running.
            for prefix in uploads:
                store.delete(prefix, recursive=True)
            store.delete(layout.SPEC)
            raise LaunchError(f"{exc} (nothing was left in the store; fix it and launch again)") from None
        raise LaunchError(f"{exc} (jobs that did start are recorded; `composer-cloud cancel {store.uri}` "
                          "stops them)") from None
    logger.info("launched %d replicas of run %s at %s", spec.replicas, spec.run_id, store.uri)
    return Run(uri=store.uri, store=store, spec=spec, run_key=run_key)


def resume(run: RunRef, *, executor: str | None = None, replicas: int | None = None, force: bool = False,
           storage_options: Mapping[str, Any] | None = None, rounds: int | None = None) -> ResumeResult:
    """Continue a run from its latest valid checkpoint, optionally elsewhere or with another replica count.

    Stops whatever is left of the previous launch first, then discards round
    records and checkpoints newer than the checkpoint (they belong to rounds
    that will be recomputed) and relaunches.

    Refuses (:class:`ConfigError`, nothing done) a run that is still running
    unless ``force`` (resuming kills its live replicas and redoes the rounds
    since its checkpoint), and a completed run with another executor or
    replica count (its rounds are done; the message says how to start a new
    run from its weights instead).

    ``rounds``: the run's new round count (more than it has; lock-step only). A completed run is extended
    as if it had been launched with ``rounds``, bitwise: nothing in training depends on the round count
    (constant inner and outer learning rates, no schedule over rounds; the last round's forced checkpoint
    changes no state), and the inner and outer optimizers' states come from the checkpoint. A decoupled
    run's round count is its fleet's contribution budget, which its final merge has closed: refused.
    """
    run = _as_run(run, storage_options)
    _require_conforming_store(run)
    signing.vouched_spec(run)  # nothing in an unvouched spec may choose the code the new jobs run
    spec = run.spec
    latest: Checkpoint | None = None
    current = run_status(run)
    finished = current.state == RunState.COMPLETED
    if current.state == RunState.RUNNING and not force:
        alive = [i.rank for i in current.replicas if i.state in ("running", "pending")]
        raise ConfigError(f"run {run.run_id} is still running (replicas {alive or 'starting'}); resuming would "
                          f"stop them and redo the rounds since its last checkpoint. Wait for it "
                          f"(`composer-cloud status {run.uri}`), cancel it first, or pass --force")
    changes = {k: v for k, v in (("executor", executor), ("replicas", replicas))
               if v is not None and v != getattr(spec, k)}
    extend = _check_new_rounds(spec, rounds)
    if finished and changes:
        raise ConfigError(
            f"run {run.run_id} completed {_all_work(spec)}; resume cannot change its "
            f"{' and '.join(changes)}. To train on from its weights, start a new run: "
            f"`composer-cloud export {run.uri} --out ./{run.run_id}-model` then `composer-cloud launch "
            f"--model ./{run.run_id}-model" + "".join(f" --{k} {v}" for k, v in changes.items()) + "`")
    if finished:  # nothing runs: the checkpoint cannot change under us
        latest = sync_state.latest_checkpoint(run.store, spec)  # verified: every object read once
    if finished and not extend:
        last = sync_state.final_round(spec, sync_state.progress(run.store, spec))  # status's answer too
        if latest is not None and latest.round == last:
            return ResumeResult(run=run, from_round=latest.round, handles=[], noop=(
                f"run {run.run_id} already completed {_all_work(spec)}; nothing to resume"))
    updates: dict[str, Any] = {"rounds": rounds} if extend else {}
    if executor is not None:
        updates["executor"] = executor
    if replicas is not None:
        updates["replicas"] = replicas
        updates["min_replicas"] = min(spec.min_replicas, replicas)
    new_spec = spec_from_dict(spec.to_json_dict() | updates, source="resume options")
    _check_jobs(new_spec)
    store = run.store
    # Stop whatever is left of the previous launch before touching its rounds.
    warnings = _cancel_jobs(run)[1]
    warnings = [f"could not cancel a job of the previous launch: {w}" for w in warnings]
    if not finished:
        latest = sync_state.latest_checkpoint(store, spec)  # after the cancel: nothing writes checkpoints any more
    from_round = latest.round if latest else -1
    sync_state.discard_after(store, from_round)
    if "replicas" in changes:  # each replica's prompts change with the replica count: so do later rollouts
        discard_rollouts_after(store, from_round)
    store.delete(layout.CANCEL)
    store.delete(layout.HANDLES, recursive=True)
    store.delete(layout.HEARTBEATS, recursive=True)
    store.put_json(layout.SPEC, new_spec.to_json_dict())
    signing.remember(store.uri, new_spec, run.run_key)
    n = len(store.list_dirs(layout.RESUMES))
    store.put_json(layout.resume_key(n), ResumeRecord(from_round=from_round, executor=new_spec.executor,
                                                      replicas=new_spec.replicas, time=time.time()).to_json())
    resumed = Run(uri=run.uri, store=store, spec=new_spec)
    handles = _start_jobs(store, new_spec, run.run_key)
    return ResumeResult(run=resumed, from_round=from_round, handles=handles, warnings=warnings)


def _all_work(spec: RunSpec) -> str:
    """``all 4 rounds``; decoupled: ``its budget of 6 contributions`` (a decoupled run has no rounds to count)."""
    if spec.sync.mode == "decoupled":
        return f"its budget of {spec.replicas * spec.rounds} contributions"
    return f"all {spec.rounds} rounds"


def _check_new_rounds(spec: RunSpec, rounds: int | None) -> bool:
    """Whether ``resume --rounds`` extends the run; :class:`ConfigError` for a count it cannot take."""
    if rounds is None or rounds == spec.rounds:
        return False
    if spec.sync.mode == "decoupled":
        raise ConfigError(f"--rounds {rounds}: a decoupled run's rounds are its fleet's contribution budget "
                          f"(replicas × rounds), closed by its final merge; it cannot be extended. Export it and "
                          "launch a new run from its weights")
    if rounds < spec.rounds:
        raise ConfigError(f"--rounds {rounds}: the run has {spec.rounds} rounds; resume only extends a run "
                          f"(give more than {spec.rounds})")
    return True


def _cancel_jobs(run: Run) -> tuple[list[int], list[str]]:
    cancelled, warnings = [], []
    executors: dict[str, Any] = {}
    for h in trusted_handles(load_handles(run.store), run.spec):
        try:
            ex = executors.get(h.executor) or executors.setdefault(h.executor, get_executor(h.executor, run.spec, run_key=run.run_key))
            ex.cancel(h)
            cancelled.append(h.rank)
        except Exception as exc:  # noqa: BLE001 - cancel the others anyway, and say which failed
            warnings.append(f"replica {h.rank} ({h.executor} {h.job_id}): {exc}")
    return cancelled, warnings


def _cancel_not_started(run: Run) -> CancelResult:
    """Cancel of a run no job was started for: recorded (status: cancelled), nothing deleted. Deleting is
    `composer-cloud rm`'s, asked for by name: never a decision read from the store, which a bucket writer
    without the key could empty of handles and heartbeats."""
    _require_conforming_store(run)
    request_cancel(run.store)
    return CancelResult(run=run, cancelled=[], noop=(
        f"run {run.run_id} had no replica job; marked cancelled (delete it with `composer-cloud rm {run.uri}`)"))


@dataclass(frozen=True)
class RemoveResult:
    """What :func:`remove` did: the run's objects deleted, and whether this machine's run key record went too."""

    run_uri: str
    key_removed: bool
    cancelled: list[int] = field(default_factory=list)


def _delete_run_objects(run: Run) -> None:
    """Every object of the run, ``spec.json`` last (until then the run is still listed and can be removed again)."""
    store = run.store
    for name in store.list_dirs():
        store.delete(name, recursive=True)
    store.delete(layout.SPEC)
    if run.uri.startswith("file://"):  # the emptied run folder of a local store
        try:
            Path(run.uri[len("file://"):]).rmdir()
        except OSError:
            pass


def remove(run: RunRef, *, force: bool = False, storage_options: Mapping[str, Any] | None = None) -> RemoveResult:
    """Delete a run: every object under its URI and this machine's record of its run key.

    Refuses (:class:`ConfigError`, nothing deleted) a running run unless ``force`` (its jobs are cancelled
    first). Irreversible: export what you want to keep first.
    """
    from composer_cloud.storage.runkeys import delete_record

    run = _as_run(run, storage_options)
    current = run_status(run)
    cancelled: list[int] = []
    if current.state == RunState.RUNNING:
        if not force:
            raise ConfigError(f"run {run.run_id} is still running; cancel it first (`composer-cloud cancel "
                              f"{run.uri}`) or pass --force to cancel and remove it")
        cancelled = cancel(run).cancelled
    _require_conforming_store(run)
    _delete_run_objects(run)
    return RemoveResult(run_uri=run.uri, key_removed=delete_record(run.uri), cancelled=cancelled)


def cancel(run: RunRef, *, storage_options: Mapping[str, Any] | None = None) -> CancelResult:
    """Record the cancellation and stop every replica job of the run."""
    run = _as_run(run, storage_options)
    current = run_status(run)
    if current.state == "not started":
        return _cancel_not_started(run)
    if current.state != RunState.RUNNING:
        return CancelResult(run=run, cancelled=[], noop=f"run {run.run_id} already {current.state}; nothing to cancel")
    _require_conforming_store(run)
    request_cancel(run.store)
    cancelled, warnings = _cancel_jobs(run)
    if not cancelled and not warnings:  # nothing to stop was found: say so (exit 1), never "cancelled"
        warnings = ["no replica job handle was found in the store, so no job was stopped; the cancel request is "
                    "recorded and replicas stop at their next round boundary (check `composer-cloud status`)"]
    return CancelResult(run=run, cancelled=cancelled, warnings=warnings)


def get_status(run: RunRef, *, storage_options: Mapping[str, Any] | None = None,
               poll_executors: bool = True) -> RunStatus:
    """The run's state now: rounds committed, and each replica's job state and last round."""
    return run_status(_as_run(run, storage_options), poll_executors=poll_executors)


__all__ = ["LaunchCheck", "LaunchInterrupted", "RemoveResult", "remove", "launch_warnings", "leaves_no_new_folders", "check_launch", "CancelResult", "LaunchError", "ResumeResult", "RunExists", "build_spec", "cancel", "get_status",
           "launch", "normalize_run_uri", "plan", "resume", "wait", "StoreConfigError"]
