"""Opening a run: the one way to get from a run URI to its store and spec.

A run lives at ``<store>/<run_id>``; its ``spec.json`` (written once, at
launch) says everything else, including the ``store_options`` needed to reach
the store. Every reader (replicas, ``status``, ``logs``, ``resume``,
``export``) opens the run through :func:`open_run`, so the options a spec
carries reach all of them. Options needed *before* the spec can be read (an
``endpoint_url``) come from the caller or from ``$COMPOSER_CLOUD_STORE_OPTIONS``
(JSON), which every executor sets for its replica jobs.

**Signed runs.** A run launched with ``COMPOSER_CLOUD_RUN_KEY`` set is signed:
its spec says so (``signed: true``) and every object is HMAC-signed
(:mod:`composer_cloud.storage.framing`). A process without the key refuses to
open a signed run, and a process with a key refuses an unsigned one, each with
a :class:`~composer_cloud.errors.RunKeyError` naming the variable: a replica
started without the secret stops before it writes anything, instead of writing
unsigned objects that keyed readers reject, and a reader without the key never
accepts a signed run's objects on their crc alone.

Also here: the run's launch records (job handles) and the cancel request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_cloud import env
from composer_cloud.env import JobEnv
from composer_cloud.errors import (
    BadObject,
    ChecksumMismatch,
    ObjectNotFound,
    RunKeyError,
    RunNotFound,
    SignatureMismatch,
    SpecError,
    StoreConfigError,
    StoreError,
)
from composer_cloud.spec import DEFAULT_STORE, RunSpec, spec_from_dict
from composer_cloud.storage import layout
from composer_cloud.storage.framing import derive_signing_key, is_signed, run_key_bytes, unframe
from composer_cloud.storage.records import CancelRecord, JobHandle
from composer_cloud.storage.runkeys import load_record, spec_digest
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """An opened run.

    Attributes:
        uri: the run's URI (``<store>/<run_id>``; ``file://`` URIs are absolute).
        store: the run's store, opened with the spec's ``store_options``.
        spec: the spec as launched (or as last resumed).
        run_key: the run key this process opened it with (``$COMPOSER_CLOUD_RUN_KEY`` or the launcher's
            record, :mod:`~composer_cloud.storage.runkeys`); a secret, never in ``repr``.
        spec_sha256: sha256 of the spec's canonical JSON as read (:func:`~composer_cloud.storage.runkeys.spec_digest`).
    """

    uri: str
    store: Store
    spec: RunSpec
    run_key: str | None = field(default=None, repr=False)
    spec_sha256: str = ""

    @property
    def run_id(self) -> str:
        return self.spec.run_id


def normalize_run_uri(uri: str) -> str:
    """Accept a plain local path where a run URI is expected (``runs/x`` -> ``file:///abs/runs/x``).

    A bare run id (no ``/``) that is not a local folder names a run under the
    default store (``./runs/<id>``), where a no-flag launch puts it.
    """
    uri = uri.strip()
    if "://" in uri:
        return uri
    if "/" not in uri and uri not in (".", "..") and not _is_local_path(uri):
        uri = str(Path(DEFAULT_STORE.removeprefix("file://")) / uri)
    return f"file://{Path(uri).resolve()}"


def _is_local_path(name: str) -> bool:
    """Whether ``name`` exists here; a name the file system cannot even look up (too long) does not."""
    try:
        return Path(name).exists()
    except OSError:
        return False


def run_signing_key(run_id: str, run_key: str | None, salt: str = "") -> bytes | None:
    """The per-run HMAC key of ``run_key`` (``$COMPOSER_CLOUD_RUN_KEY``, a secret, never stored), else None.

    ``salt`` is the spec's ``run_salt``: the key is bound to the run id and to this launch of it.
    """
    return None if run_key is None else derive_signing_key(run_key_bytes(run_key), run_id, salt)


def _claimed_salt(raw: bytes) -> str:
    """The ``run_salt`` that the framed ``spec.json`` in ``raw`` claims, before anything is verified (``""``:
    none, or not a spec). Safe to use unverified: it only chooses the key the spec is then verified under, and
    the spec's signature covers it."""
    try:
        data = json.loads(bytes(unframe(layout.SPEC, raw)))
    except (ChecksumMismatch, UnicodeDecodeError, ValueError):
        return ""
    salt = data.get("run_salt") if isinstance(data, dict) else None
    return salt if isinstance(salt, str) and len(salt) == 32 and all(c in "0123456789abcdef" for c in salt) else ""


def open_run(uri: str, *, storage_options: Mapping[str, Any] | None = None, outage_s: float = 0.0,
             job_env: JobEnv | None = None) -> Run:
    """Open the run at ``uri`` and read its spec.

    Args:
        uri: ``<store>/<run_id>``, or a local path.
        storage_options: fsspec options needed to reach the store before the
            spec is read (default: ``$COMPOSER_CLOUD_STORE_OPTIONS``); they
            override the spec's ``store_options`` for this process.
        job_env: this process's environment, already read (default: read it now).

    Raises:
        RunNotFound: no run at ``uri``.
        StoreConfigError: the store cannot be reached with these options.
        SpecError: the stored spec is invalid (names the field).

    ``outage_s``: how long store calls ride out an outage (0 for one-shot
    commands: fail within seconds; replicas pass ``sync.store_outage_s``).

    A signed run needs ``$COMPOSER_CLOUD_RUN_KEY`` (every object is then signed
    and verified); an unsigned run must be opened without it. Either mismatch
    raises :class:`~composer_cloud.errors.RunKeyError` before anything is written.
    """
    uri = normalize_run_uri(uri)
    job_env = JobEnv.from_environ() if job_env is None else job_env
    given = dict(storage_options) if storage_options is not None else dict(job_env.store_options)
    store = Store(uri, storage_options=given, outage_s=outage_s)
    record = load_record(store.uri)  # a run this machine launched: its key (unless set) and salt are recorded
    run_key = job_env.run_key
    if run_key is None:
        run_key = record.run_key if record is not None else None
    try:
        raw = store.get_plain(layout.SPEC)
    except ObjectNotFound:
        raise RunNotFound(f"{uri} is not a composer-cloud run (it has no {layout.SPEC}); "
                          "check the URI, or list runs with `composer-cloud ls STORE`") from None
    except StoreError as exc:
        raise StoreConfigError(f"cannot read run {uri}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - an unreachable endpoint, bad credentials: say which store
        raise StoreConfigError(f"cannot read run {uri}: {type(exc).__name__}: {exc}") from None
    salt = _claimed_salt(raw)
    if record is not None and record.run_salt and salt != record.run_salt:
        raise RunKeyError(f"run {uri}: its {layout.SPEC} is another launch's (its run_salt is not the one this "
                          "machine launched the run with): a spec copied over this run's in the store; refusing to "
                          "use anything in it")
    key = run_signing_key(uri.rstrip("/").rsplit("/", 1)[-1], run_key, salt)
    if key is not None:
        store = Store(uri, storage_options=given, outage_s=outage_s, signing_key=key)
    spec, digest = _read_spec(uri, raw, key, keyed_by=env.RUN_KEY if job_env.run_key else
                              f"this machine's launch record ({env.keys_dir()})")
    if job_env.spec_sha256 is not None and digest != job_env.spec_sha256:
        raise RunKeyError(f"run {uri}: its {layout.SPEC} is not the spec this job was launched with (sha256 "
                          f"{digest[:12]}..., the launcher wrote {job_env.spec_sha256[:12]}...): it was replaced in "
                          "the store; refusing to use anything in it")
    if key is None and (spec.signed or is_signed(raw)):
        raise RunKeyError(f"run {uri} is signed: set {env.RUN_KEY} to its run key (a secret, passed like the store "
                          "credentials) to read or write it; nothing was read from it or written to it")
    options = {**spec.store_options, **given}
    if options != given:
        store = Store(uri, storage_options=options, outage_s=outage_s, signing_key=key)
    return Run(uri=store.uri, store=store, spec=spec, run_key=run_key, spec_sha256=digest)


def _read_spec(uri: str, raw: bytes, key: bytes | None, *, keyed_by: str) -> tuple[RunSpec, str]:
    """The spec in ``raw`` (the framed ``spec.json``), verified under ``key`` when there is one, and its digest.
    ``keyed_by`` says where the key came from (for messages; never the key)."""
    if key is not None and not is_signed(raw):
        raise RunKeyError(f"run {uri}: its {layout.SPEC} is not signed, but a run key is set ({keyed_by}): the run "
                          "was launched without a key (unset it to open the run), or someone without the key replaced "
                          "the spec")
    try:
        data = json.loads(bytes(unframe(layout.SPEC, raw, signing_key=key)))
    except SignatureMismatch:
        raise RunKeyError(f"run {uri}: its {layout.SPEC} does not verify under {env.RUN_KEY}; set it to the key "
                          "the run was launched with") from None
    except ChecksumMismatch as exc:
        raise RunNotFound(f"{uri}: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunNotFound(f"{uri}: {layout.SPEC} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise RunNotFound(f"{uri}: {layout.SPEC} is not a JSON object")
    return spec_from_dict(data, source=f"{uri}/{layout.SPEC}"), spec_digest(data)


# ---------------------------------------------------------------- launch records
def save_handles(store: Store, handles: list[JobHandle]) -> None:
    for h in handles:
        store.put_json(layout.handle_key(h.rank), h.to_json())


def load_handles(store: Store) -> list[JobHandle]:
    """The run's job handles, by rank. Objects that are not handles are skipped with a warning."""
    out = []
    for key in store.list(layout.HANDLES):
        if layout.parse_handle_key(key) is None:
            continue
        try:
            out.append(JobHandle.from_json(store.get_json(key)))
        except (BadObject, ObjectNotFound, KeyError, TypeError, ValueError) as exc:
            logger.warning("ignoring %s: not a valid job handle (%s)", key, exc)
    return sorted(out, key=lambda h: h.rank)


def request_cancel(store: Store) -> None:
    """Record that the run was cancelled (write-once; status reads it). An object already there that is not
    a valid (in a signed run: authentic) cancel record is replaced."""
    record = CancelRecord(time=time.time()).to_json()
    if not store.create_json(layout.CANCEL, record) and not cancel_requested(store):
        store.put_json(layout.CANCEL, record)


def cancel_requested(store: Store) -> bool:
    """Whether the run holds a valid cancel record: read, verified and parsed, never judged by existence."""
    try:
        CancelRecord.from_json(store.get_json(layout.CANCEL), key=layout.CANCEL)
    except ObjectNotFound:
        return False
    except BadObject as exc:
        logger.warning("ignoring %s: not a valid cancel record (%s)", layout.CANCEL, exc)
        return False
    return True


__all__ = ["Run", "RunNotFound", "SpecError", "load_handles", "normalize_run_uri", "open_run",
           "request_cancel", "run_signing_key", "save_handles"]
