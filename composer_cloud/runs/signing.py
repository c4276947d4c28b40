"""Signed by default: the run key a launch uses, where the launcher keeps it, and the spec ``resume`` trusts.

``launch`` signs every run unless its spec says ``signed = false`` or the
launcher sets ``COMPOSER_CLOUD_UNSIGNED=1`` (both warned about). The key is
``$COMPOSER_CLOUD_RUN_KEY`` when set, else a fresh 32-byte secret. It reaches
the jobs through each executor's secret mechanism
(:func:`composer_cloud.jobs.environment.job_secrets`) and this machine's
later commands through the launcher's record
(:mod:`composer_cloud.storage.runkeys`); never the store, a record or a log.

Each signed launch writes a fresh ``run_salt`` into the spec: the signing key
is derived from the run key, the run id and that salt
(:func:`~composer_cloud.storage.framing.derive_signing_key`), so a run key
given to several runs signs each with its own key.

``resume`` uses a spec only once it is vouched for: a signed run's spec
verified under the run key (:func:`~composer_cloud.storage.run.open_run`), an
unsigned run's spec equal to the digest this machine's launcher recorded. An
unsigned spec nobody vouches for is refused when it names code to run (a code
bundle, uploaded files, ``module:attr`` settings), since a bucket writer could
have planted it.
"""

from __future__ import annotations

import logging
import secrets

from composer_cloud import env
from composer_cloud.env import JobEnv
from composer_cloud.errors import RunKeyError, SpecError
from composer_cloud.spec import RunSpec
from composer_cloud.storage.framing import new_run_salt
from composer_cloud.storage.run import Run, run_signing_key
from composer_cloud.storage.runkeys import RunRecord, load_record, save_record, spec_digest
from composer_cloud.trainer.settings import code_references

logger = logging.getLogger(__name__)


def launch_key(spec: RunSpec) -> tuple[RunSpec, str | None]:
    """``spec`` with ``signed`` decided, and the run key to sign with (None: unsigned, opted out).

    Raises :class:`SpecError` (field ``signed``) for an opt-out while ``$COMPOSER_CLOUD_RUN_KEY`` is set: a
    keyed process refuses an unsigned run, so that combination could never be opened again.
    """
    job_env = JobEnv.from_environ()
    if spec.signed is not None:
        signed = spec.signed
    else:  # a key that is set always signs; else the default (signed) unless the launcher opted out
        signed = job_env.run_key is not None or not env.unsigned_by_default()
    if not signed:
        if job_env.run_key is not None:
            raise SpecError("signed", f"the run opts out of signing, but {env.RUN_KEY} is set; unset it, or drop the "
                            f"opt-out (signed = false / {env.UNSIGNED}=1)")
        logger.warning("run %s is UNSIGNED (%s): anyone who can write its store can forge its records and "
                       "steer it; launch without the opt-out to sign it", spec.run_id,
                       "signed = false" if spec.signed is False else f"{env.UNSIGNED}=1")
        return spec.model_copy(update={"signed": False, "run_salt": ""}), None
    run_key = job_env.run_key or secrets.token_hex(32)
    # A fresh salt for every launch, whatever the config said: two runs given one key never share a signing key.
    return spec.model_copy(update={"signed": True, "run_salt": new_run_salt()}), run_key


def signing_key(spec: RunSpec, run_key: str | None) -> bytes | None:
    """The per-run HMAC key of ``run_key`` for ``spec``'s run id and salt (None for an unsigned run)."""
    return run_signing_key(spec.run_id, run_key, spec.run_salt)


def remember(run_uri: str, spec: RunSpec, run_key: str | None) -> None:
    """Record the run key and the spec's digest for this machine's later commands (0600; never the store).

    A key the user set (``$COMPOSER_CLOUD_RUN_KEY``) is theirs to keep and is not written here, unless this
    record already kept it. A failure to write is a warning: the run works, but later commands need the key set.
    """
    given = JobEnv.from_environ().run_key
    if given is not None and run_key == given:
        previous = load_record(run_uri)
        run_key = run_key if previous is not None and previous.run_key == given else None
    try:
        path = save_record(RunRecord(uri=run_uri, spec_sha256=spec_digest(spec.to_json_dict()), run_key=run_key,
                                     run_salt=spec.run_salt))
    except OSError as exc:
        logger.warning("could not keep the run record of %s under %s (%s); later commands need %s set to the run's "
                       "key", run_uri, env.keys_dir(), exc, env.RUN_KEY)
        return
    if run_key is not None and given is None:
        logger.info("run %s is signed with a new run key, kept for this machine's commands in %s; to use the "
                    "run elsewhere, copy that file's run_key into %s there", run_uri, path, env.RUN_KEY)


def _names_code(spec: RunSpec) -> list[str]:
    """The settings of ``spec`` that choose code a replica imports or files it reads (imports no user code)."""
    out = ["code.ref"] if spec.code.ref else []
    out += ["code.files"] if spec.code.files else []
    return out + sorted(code_references(spec.trainer.name, spec.trainer.settings()))


def vouched_spec(run: Run) -> None:
    """Refuse to act on ``run``'s spec unless something other than the store vouches for it.

    A signed run's spec was verified when the run was opened. An unsigned run's spec must match this
    machine's launch record; without a record, a spec that names code to run is refused (:class:`RunKeyError`).
    """
    if run.store.signed:
        if run.run_key is None:
            raise RunKeyError(f"run {run.uri} is signed, but this Run carries no run key to give its new jobs; open "
                              f"it with open_run (which reads {env.RUN_KEY} or this machine's launch record)")
        return
    record = load_record(run.uri)
    if record is not None:
        if record.spec_sha256 != run.spec_sha256:
            raise RunKeyError(f"run {run.uri} is unsigned and its spec.json is not the one this machine launched "
                              "(it was replaced in the store); refusing to resume from it")
        return
    names = _names_code(run.spec)
    if names:
        raise RunKeyError(f"run {run.uri} is unsigned and this machine did not launch it, so nothing vouches for "
                          f"its spec.json, which chooses code to run ({', '.join(names)}); resume it from the "
                          "machine that launched it, or launch it again signed")
    logger.warning("run %s is unsigned and this machine did not launch it: its spec.json is taken from the store "
                   "unverified", run.uri)


__all__ = ["launch_key", "remember", "signing_key", "vouched_spec"]
