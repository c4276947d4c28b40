"""Every error composer-cloud raises on purpose, in one tree.

::

    ComposerCloudError
    ├── ConfigError            bad input: the message says what to fix; nothing was written (CLI exit 2)
    │   ├── SpecError          a run spec setting (``field`` names it)
    │   ├── StoreConfigError   a store URI, its options or credentials
    │   │   └── RunKeyError    a signed run opened without the run key, or an unsigned one with it
    │   ├── BadReference       a ``"module:attr"`` setting that does not resolve
    │   ├── RunNotFound        no run at a URI
    │   ├── RunExists          a run id that is taken
    │   └── (elsewhere: DatasetError, TeachersError, TRLCompatibilityError (an ImportError too),
    │        ReportUnavailable, UserCodeError)
    ├── StoreError             the store during a run (CLI exit 1)
    │   ├── StoreUnavailable   unreachable for the whole outage budget: propagates, never tolerated
    │   ├── StoreTimeout       a wait passed its deadline
    │   ├── ObjectNotFound     a key that does not exist
    │   ├── BadObject          an object read from the store is unusable (corrupt, forged, foreign, malformed)
    │   │   ├── ChecksumMismatch   its bytes fail the frame's magic, length or crc32
    │   │   │   └── SignatureMismatch  unsigned or mis-signed under the run key
    │   │   ├── CorruptCheckpoint  a checkpoint object is missing, damaged or disagrees with its marker
    │   │   └── PayloadError, SparsePayloadError  an encoded payload its codec would not write (ValueErrors too)
    │   └── SyncError          a sync could not complete (a round's deadline, a heal without state)
    ├── ExecutorError          a backend refused or failed an operation
    │   ├── LaunchError        a backend failed while replica jobs were being started
    │   └── (elsewhere: PartialSpawnError, ReplicaFailed)
    └── MalformedResponse      a teacher endpoint answered, but not with a completion

Every public exception class of the package is in this tree (``tests/test_packaging.py`` walks the package);
the exceptions are ``LaunchInterrupted`` (a ``KeyboardInterrupt``: no ``except Exception`` may swallow a
Ctrl-C) and private control-flow signals that never leave their module (``_Deadline``, ``_StillAlive``,
``_ManifestExists``).

Readers that tolerate bad objects catch :class:`BadObject` (and
:class:`ObjectNotFound` where absence is fine); :class:`StoreUnavailable` is a
sibling, so an outage always propagates to the caller, who rides it out or
fails the run. Modules add narrower classes (``RoundTimeout``, ``PayloadError``,
``UserCodeError``) under these branches, never beside them.
"""

from __future__ import annotations

import re


class ComposerCloudError(Exception):
    """Base class of every error composer-cloud raises on purpose."""


# --------------------------------------------------------------------------- configuration
class ConfigError(ComposerCloudError):
    """Bad input (a setting, a URI, credentials); the message names it and says what to do."""


class SpecError(ConfigError, ValueError):
    """A run spec is invalid. ``field`` is the dotted name of the offending field ("" for the whole spec)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class StoreConfigError(ConfigError):
    """The store URI, its options or its credentials cannot work; the message says how to fix it."""


class RunKeyError(StoreConfigError):
    """The run key (``COMPOSER_CLOUD_RUN_KEY``) does not fit the run: missing for a signed run, set for an
    unsigned one, or too short. Nothing was read from or written to the run."""


class BadReference(ConfigError, ValueError, LookupError):
    """A ``"module:attr"`` setting does not resolve; the message names the setting."""


class RunNotFound(ConfigError, LookupError):
    """The URI names no composer-cloud run (no readable ``spec.json``)."""


class RunExists(ConfigError, FileExistsError):
    """A run with this id already exists in the store; continue it with ``resume``."""


# --------------------------------------------------------------------------- the store at run time
class StoreError(ComposerCloudError, RuntimeError):
    """The store failed during a run (an outage, a timeout, a missing or bad object)."""


class StoreUnavailable(StoreError):
    """The store kept failing with transient errors (unreachable, 5xx, throttled) for the whole outage budget.

    ``__cause__`` is the last backend error; ``waited_s`` is how long the outage had lasted.
    """

    def __init__(self, store: str, what: str, waited_s: float, exc: BaseException) -> None:
        self.store = store
        self.what = what
        self.waited_s = waited_s
        super().__init__(f"store {store} unavailable: {what} failed for {waited_s:.1f}s "
                         f"({type(exc).__name__}: {exc}); check the endpoint and the network")


class StoreTimeout(StoreError):
    """A wait on the store passed its deadline."""

    def __init__(self, key: str, waited_s: float) -> None:
        self.key = key
        self.waited_s = waited_s
        super().__init__(f"timed out after {waited_s:.1f}s waiting for {key}")


class ObjectNotFound(StoreError, KeyError):
    """No object at ``key``."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"object not found: {key}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class BadObject(StoreError):
    """An object read from the store is unusable: ``key`` names it, ``reason`` says which check failed.

    The bucket is not trusted, so this is an expected failure: a reader skips the
    object (or aborts what it was doing) and never uses its content.
    """

    def __init__(self, key: str, reason: str, *, message: str | None = None) -> None:
        self.key = key
        self.reason = reason
        super().__init__(message or f"{key}: {reason}; it was not used")


class ChecksumMismatch(BadObject):
    """A stored object failed verification (bad magic, length or crc32, or not JSON)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason, message=f"object {key} is corrupt ({reason}); it was not used")


class LinkOutsideStore(ChecksumMismatch):
    """A ``file://`` store key whose path leads out of the store through a symbolic link (planted by someone
    who can write the store folder): never read, written or deleted."""

    def __init__(self, key: str) -> None:
        BadObject.__init__(self, key, "a symbolic link out of the store", message=f"object {key} leads out of the "
                           "store through a symbolic link; refused (nothing outside the store is read or written)")


class SignatureMismatch(ChecksumMismatch):
    """A stored object is unsigned or its HMAC does not verify under the run key: forged, moved or foreign."""

    def __init__(self, key: str, reason: str) -> None:
        BadObject.__init__(self, key, reason, message=f"object {key} is not authentic ({reason}); it was not used")


class CorruptCheckpoint(BadObject):
    """A checkpoint object is missing, damaged or inconsistent with its marker or manifest."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason, message=f"{key}: {reason}")


class SyncError(StoreError):
    """A sync could not complete: a round's deadline passed, or no committed state could be healed from."""


# --------------------------------------------------------------------------- executors
class ExecutorError(ComposerCloudError, RuntimeError):
    """A backend refused or failed an operation; the message says what to do."""


class LaunchError(ExecutorError):
    """A backend failed while replica jobs were being started; the message says which and why."""


# ---------------------------------------------------------------- credentials in URLs
# A URL as it appears in text: a scheme, "://", then everything up to whitespace or a quote. The userinfo is not
# parsed by RFC 3986 rules on purpose: a secret key may hold "/", ":" or "@" (AWS secret keys hold "/" and "+"),
# and a strict parser would then read part of it as the host or the path.
_URL = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s'\"<>]*)")
# Query parameters whose value is a credential (presigned-URL signatures, tokens, keys, passwords).
_SECRET_PARAM = re.compile(r"(secret|token|passw|pwd|credential|signature|^sig$|key|session|auth)", re.IGNORECASE)


def _userinfo_end(rest: str) -> int:
    """Where the userinfo of a URL's text after ``://`` ends (the index of its last ``@``), or -1 for none.

    An ``@`` after ``://`` is userinfo unless the text before it holds a ``/`` and no ``:`` (``bucket/v@2``: a
    path); a URL whose text starts with ``/`` has no authority (``file:///x@y``).
    """
    head = rest.split("?", 1)[0].split("#", 1)[0]
    at = head.rfind("@")
    if at <= 0 or head.startswith("/"):
        return -1
    userinfo = head[:at]
    return at if (":" in userinfo or "/" not in userinfo) else -1


def _secret_params(rest: str) -> list[tuple[int, int]]:
    """``(start, end)`` in ``rest`` of every query value whose parameter name looks like a credential."""
    q = rest.find("?")
    if q < 0:
        return []
    spans, pos = [], q + 1
    for part in rest[q + 1:].split("#", 1)[0].split("&"):
        name, eq, value = part.partition("=")
        if eq and value and _SECRET_PARAM.search(name):
            start = pos + len(name) + 1
            spans.append((start, start + len(value)))
        pos += len(part) + 1
    return spans


def url_has_credentials(url: str) -> bool:
    """Whether ``url`` (or a URL in it) carries credentials: a userinfo (``user[:password]@``, whatever
    characters the password holds) or a query parameter named like one (``?X-Amz-Signature=``, ``?token=``)."""
    return any(_userinfo_end(m["rest"]) >= 0 or _secret_params(m["rest"]) for m in _URL.finditer(url))


def redact(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced by ``***@`` and secret query values by ``***``."""
    def one(m: re.Match[str]) -> str:
        rest = m["rest"]
        for start, end in reversed(_secret_params(rest)):
            rest = rest[:start] + "***" + rest[end:]
        at = _userinfo_end(rest)
        return m["scheme"] + ("***" + rest[at:] if at >= 0 else rest)
    return _URL.sub(one, text)


__all__ = ["BadObject", "BadReference", "ChecksumMismatch", "ComposerCloudError", "ConfigError", "CorruptCheckpoint",
           "ExecutorError", "LaunchError", "LinkOutsideStore", "ObjectNotFound", "RunExists", "RunKeyError", "RunNotFound", "SignatureMismatch",
           "SpecError", "StoreConfigError", "StoreError", "StoreTimeout", "StoreUnavailable", "SyncError",
           "redact", "url_has_credentials"]
