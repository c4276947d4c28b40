"""Every ``COMPOSER_CLOUD_*`` environment variable, defined once, and the one reader of the environment.

Launchers set them for replica jobs; replicas, supervisors and bootstraps read
them. None of them carries a secret value except :data:`RUN_KEY`, which
travels like the store credentials (the executors' own secret mechanisms,
next to the standard ``AWS_*`` / ``HF_TOKEN`` variables) and is never written
to the store, a record or a log.

A replica reads its environment once, at its entry point, into a
:class:`JobEnv`; everything below gets what it needs from that object, never
from ``os.environ``. Launchers build a job's environment with
:meth:`JobEnv.to_environ`. The few other readers (the store's S3 endpoint, the
caches) call the functions at the end of this module.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_cloud.errors import ConfigError

#: Log level of a replica process (``INFO`` by default).
LOG_LEVEL = "COMPOSER_CLOUD_LOG"
#: torch intra-op threads of a replica process (the local executor splits the cores).
THREADS = "COMPOSER_CLOUD_THREADS"
#: ``0``: the local executor starts every supervisor as its own interpreter instead of forking them from one
#: preloaded process (:mod:`composer_cloud.jobs.local_fork`), and a replica starts its local ranks as new
#: interpreters instead of forking them (:mod:`composer_cloud.replica.launch`).
LOCAL_FORK = "COMPOSER_CLOUD_LOCAL_FORK"
#: Seconds the local executor's fork server (imports shared by launches) waits for the next launch; 0: none.
LOCAL_FORK_SERVER_IDLE_S = "COMPOSER_CLOUD_LOCAL_FORK_SERVER_IDLE_S"
#: Non-secret JSON of ``spec.store_options`` for code that must open the store
#: before it can read the spec (the HF bootstrap, the replica).
STORE_OPTIONS = "COMPOSER_CLOUD_STORE_OPTIONS"
#: Crash-test fault injection: ``phase:round:rank`` to stall at (:mod:`composer_cloud.replica.faults`).
STALL_AT = "COMPOSER_CLOUD_STALL_AT"
#: File the stalled replica creates when it reaches the stall point.
STALL_MARKER = "COMPOSER_CLOUD_STALL_MARKER"
#: Slow-hardware fault injection: ``rank:factor[,rank:factor...]``; replica ``rank`` sleeps
#: ``(factor - 1) x`` the compute time of each inner step after it (:mod:`composer_cloud.replica.faults`).
SLOW = "COMPOSER_CLOUD_SLOW"
#: Where composer-cloud caches downloads and derived data (default ``$XDG_CACHE_HOME/composer-cloud``,
#: i.e. ``~/.cache/composer-cloud``): user code and files of runs, the stdlib corpus's tokenizer, the built-in
#: model's config and tokenizer files.
CACHE = "COMPOSER_CLOUD_CACHE"
#: HF Jobs bootstrap: where the staged wheel of composer-cloud lies, and its sha256.
WHEEL_URI = "COMPOSER_CLOUD_WHEEL_URI"
WHEEL_SHA256 = "COMPOSER_CLOUD_WHEEL_SHA256"
#: Extra ``pip install`` arguments for the HF Jobs bootstrap (e.g. ``--no-index``).
PIP_ARGS = "COMPOSER_CLOUD_PIP_ARGS"
#: A prebuilt wheel to stage instead of building one from this checkout.
PREBUILT_WHEEL = "COMPOSER_CLOUD_PREBUILT_WHEEL"
#: Opt-in live tests against a real Modal account, and the GPU they ask for.
LIVE_MODAL = "COMPOSER_CLOUD_LIVE_MODAL"
LIVE_MODAL_GPU = "COMPOSER_CLOUD_LIVE_MODAL_GPU"
#: Launcher side: a requirements file whose pins the HF Jobs bootstrap installs with (``-c``)
#: instead of ``composer_cloud/images/requirements.txt`` (another stack on purpose, or a test
#: environment whose versions differ from the shipped pins).
CONSTRAINTS = "COMPOSER_CLOUD_CONSTRAINTS"
#: JSON of the run's :class:`~composer_cloud.storage.records.CodeRef` (key, sha256, bytes, modules). Set by the
#: launcher on each job, so a replica checks the code bundle against a digest that did not come from the store.
CODE_REF = "COMPOSER_CLOUD_CODE_REF"
#: JSON ``{setting: store key}`` of the local files a spec names, uploaded at launch (keys carry their sha256).
#: Set by the launcher on cloud jobs, so the digests a replica checks did not come from the store.
FILES = "COMPOSER_CLOUD_FILES"
#: The run key (a secret): objects in the store are signed with an HMAC derived from it, and unsigned
#: or mis-signed objects are rejected (:mod:`composer_cloud.storage.framing`). Whether a run is signed is
#: recorded in its spec at launch; a process must have the key to open a signed run, and must not have it
#: to open an unsigned one (:func:`composer_cloud.storage.run.open_run`). Unset or empty: no key.
RUN_KEY = "COMPOSER_CLOUD_RUN_KEY"
#: The key (hex, a secret like :data:`RUN_KEY`) of a local job's records (``supervisor.json``, ``exit.json``,
#: ``cancel``; :mod:`composer_cloud.jobs.jobfiles`), given to the local executor's supervisors of a signed run.
JOB_RECORDS_KEY = "COMPOSER_CLOUD_JOB_RECORDS_KEY"
#: sha256 of the spec (canonical JSON) the launcher wrote for a job: a replica refuses a ``spec.json`` that
#: differs (it was replaced in the store after the launch), signed run or not.
SPEC_SHA256 = "COMPOSER_CLOUD_SPEC_SHA256"
#: Launcher side: ``1`` makes runs whose spec does not set ``signed`` unsigned (an explicit opt-out, warned
#: about at launch). By default ``launch`` signs every run, creating a run key when none is set.
UNSIGNED = "COMPOSER_CLOUD_UNSIGNED"
#: Launcher side: the folder where ``launch`` keeps the run keys it created (0600 files keyed by run URI;
#: default ``$XDG_CONFIG_HOME/composer-cloud/run-keys``), so later commands on this machine find them.
KEYS = "COMPOSER_CLOUD_KEYS"
#: The standard AWS variables naming an S3-compatible endpoint (MinIO, R2, SeaweedFS), most specific first.
AWS_ENDPOINTS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")




def _json_object(environ: Mapping[str, str], name: str) -> dict[str, Any] | None:
    raw = environ.get(name)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"${name} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"${name} must be a JSON object")
    return value


@dataclass(frozen=True)
class JobEnv:
    """What a replica job (or any composer-cloud process) takes from its environment, read once.

    Attributes:
        log_level: :data:`LOG_LEVEL`.
        threads: :data:`THREADS`, torch intra-op threads.
        store_options: :data:`STORE_OPTIONS`, fsspec options needed before the spec can be read.
        code_ref: :data:`CODE_REF`, the code bundle's digest as the launcher computed it (None: take the spec's).
        files: :data:`FILES`, ``{setting: store key}`` of uploaded local files (None: take the spec's).
        run_key: :data:`RUN_KEY` (a secret: never in ``repr``, a log or the store).
        spec_sha256: :data:`SPEC_SHA256`, the digest of the spec the launcher wrote (None: not checked).
        stall_at, stall_marker, slow: crash-test fault injection (:mod:`composer_cloud.replica.faults`).
        cache_dir: :data:`CACHE`, else ``$XDG_CACHE_HOME/composer-cloud``.
        fork: :data:`LOCAL_FORK` is not ``0``: processes may be forked from a preloaded one where no GPU is in
            reach (the local executor's supervisors, a replica's local ranks).
    """

    log_level: str = "INFO"
    threads: int = 1
    store_options: dict[str, Any] = field(default_factory=dict)
    code_ref: dict[str, Any] | None = None
    files: dict[str, str] | None = None
    run_key: str | None = field(default=None, repr=False)
    spec_sha256: str | None = None
    stall_at: str | None = None
    stall_marker: str | None = None
    slow: str | None = None
    cache_dir: Path = field(default_factory=lambda: cache_root({}))
    fork: bool = True

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "JobEnv":
        """Parse ``environ``; raises :class:`ConfigError` naming a malformed variable."""
        threads = environ.get(THREADS) or "1"
        try:
            n_threads = int(threads)
        except ValueError:
            raise ConfigError(f"${THREADS} must be an integer, got {threads!r}") from None
        return cls(log_level=environ.get(LOG_LEVEL) or "INFO", threads=max(1, n_threads),
                   store_options=_json_object(environ, STORE_OPTIONS) or {},
                   code_ref=_json_object(environ, CODE_REF), files=_json_object(environ, FILES),
                   run_key=environ.get(RUN_KEY) or None, spec_sha256=environ.get(SPEC_SHA256) or None,
                   stall_at=environ.get(STALL_AT) or None,
                   stall_marker=environ.get(STALL_MARKER) or None, slow=environ.get(SLOW) or None,
                   cache_dir=cache_root(environ), fork=fork_allowed(environ))

    def to_environ(self) -> dict[str, str]:
        """The variables that give a job this environment (the run key excluded: it travels as a secret)."""
        out: dict[str, str] = {}
        if self.log_level != "INFO":
            out[LOG_LEVEL] = self.log_level
        if self.threads != 1:
            out[THREADS] = str(self.threads)
        for name, value in ((STORE_OPTIONS, self.store_options), (CODE_REF, self.code_ref), (FILES, self.files)):
            if value:
                out[name] = json.dumps(value, sort_keys=True)
        for name, text in ((SPEC_SHA256, self.spec_sha256), (STALL_AT, self.stall_at),
                           (STALL_MARKER, self.stall_marker), (SLOW, self.slow)):
            if text:
                out[name] = text
        if not self.fork:
            out[LOCAL_FORK] = "0"
        return out


def fork_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """:data:`LOCAL_FORK` is not ``0`` (unset: forking allowed)."""
    return environ.get(LOCAL_FORK, "1") != "0"


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """:data:`CACHE`, else ``$XDG_CACHE_HOME/composer-cloud`` (``~/.cache/composer-cloud``)."""
    if environ.get(CACHE):
        return Path(environ[CACHE])
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "composer-cloud"


def keys_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """:data:`KEYS`, else ``$XDG_CONFIG_HOME/composer-cloud/run-keys`` (``~/.config/composer-cloud/run-keys``)."""
    if environ.get(KEYS):
        return Path(environ[KEYS])
    return Path(environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "composer-cloud" / "run-keys"


def unsigned_by_default(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether :data:`UNSIGNED` opts this launcher out of signing runs whose spec does not say."""
    return (environ.get(UNSIGNED) or "").strip().lower() in ("1", "true", "yes")


def run_key(environ: Mapping[str, str] = os.environ) -> str | None:
    """The run key as set (never logged), or None when unset or empty."""
    return environ.get(RUN_KEY) or None


def job_records_key(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The local job records' key (:data:`JOB_RECORDS_KEY`), or None when unset, empty or not hex."""
    try:
        return bytes.fromhex(environ.get(JOB_RECORDS_KEY) or "") or None
    except ValueError:
        return None


def s3_endpoint(environ: Mapping[str, str] = os.environ) -> str | None:
    """The S3 endpoint the standard AWS variables name, or None (the provider's default)."""
    return next((environ[n] for n in AWS_ENDPOINTS if environ.get(n)), None)


def present(names: tuple[str, ...], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``{name: value}`` of those ``names`` set (non-empty) in ``environ``: what a launcher forwards to its jobs."""
    return {name: environ[name] for name in names if environ.get(name)}


def single_threaded_tokenizers() -> None:
    """Ask HF ``tokenizers`` for one thread (unless the user chose), so trained merges never depend on timing."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
