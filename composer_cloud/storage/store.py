"""An object store over fsspec with the guarantees the all-reduce needs.

Invariants (see ``docs/store.md``):

* **Atomic objects.** :meth:`Store.put` never exposes a partial object. On a
  local filesystem it writes a temporary file in the same directory and
  renames it over the key; on S3 a single PUT is atomic.
* **Verified objects.** Every object is framed as ``MAGIC | crc32 | length |
  payload`` (:mod:`composer_cloud.storage.framing`). :meth:`Store.get` checks
  all three and raises :class:`ChecksumMismatch` naming the key; a damaged
  payload is never returned.
* **Authentic objects** (with a signing key). The frame also carries an
  HMAC-SHA256 over the key and the payload; unsigned or mis-signed objects
  raise :class:`SignatureMismatch`, so a bucket writer without the run key
  cannot inject or move an object.
* **Write-once records.** :meth:`Store.create` succeeds for exactly one of any
  number of racing writers (how each backend does it, and its quirks:
  :mod:`composer_cloud.storage.backends`). A create whose response was lost
  is settled by comparing the stored bytes with ours.
* **Deadlines, not hangs.** :meth:`Store.wait_get` polls with capped
  exponential backoff until a deadline and raises :class:`StoreTimeout`.
* **No pickle.** The store moves bytes; callers encode tensors with
  safetensors and metadata with JSON.

Transient backend errors (connection refused/reset, timeouts, HTTP 5xx, S3
``SlowDown``) are retried by :class:`~composer_cloud.retry.RetryPolicy` only:
s3fs and botocore are configured not to retry (:mod:`~composer_cloud.storage.backends`).
``Store(outage_s=...)`` sets how long a store may be unreachable before a call
fails with :class:`StoreUnavailable`: ``0`` (default) gives up after a few seconds of retries (one-shot
commands), replicas pass ``spec.sync.store_outage_s`` to ride out an outage.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from composer_cloud import env
from composer_cloud.errors import (
    ChecksumMismatch,
    ObjectNotFound,
    StoreConfigError,
    StoreTimeout,
    StoreUnavailable,
    redact,
    url_has_credentials,
)
from composer_cloud.retry import Outage, PollPolicy, RetryPolicy, is_transient, poll_until
from composer_cloud.storage.backends import Backend, open_backend
from composer_cloud.storage.framing import MIN_SIGNING_KEY_BYTES, SIGNED_HEADER_BYTES, frame, unframe
from composer_cloud.storage.records.limits import JSON_RECORD_MAX_BYTES

logger = logging.getLogger(__name__)

T = TypeVar("T")


class OversizedObject(ChecksumMismatch):
    """An object larger than its kind's limit (:mod:`composer_cloud.storage.records.limits`), refused unread."""


class Store:
    """A key/value view of ``uri`` (``file:///tmp/x``, ``s3://bucket/prefix``, ...).

    Keys are ``/``-separated paths relative to the root; ``..`` and absolute
    keys are rejected. Byte counters (``bytes_read``/``bytes_written``, framed
    bytes) are thread-safe.

    Args:
        uri: the store root.
        storage_options: fsspec options (e.g. ``endpoint_url``); never logged.
        retry: backoff of transient errors (its ``budget_s`` is replaced by ``outage_s``).
        poll: spacing of :meth:`wait_get`'s probes.
        outage_s: how long (seconds) the store may keep failing with
            transient errors before a call gives up; counted from the start
            of the outage, shared by all calls of this store. ``0``: a few
            seconds of retries (``retry.attempts``), for one-shot commands.
        signing_key: with a key, objects are written signed and only
            authentic objects are read (:func:`~composer_cloud.storage.framing.derive_signing_key` of the run key).
            Keys are signed relative to this store's root: open the store at
            the run's root so that writers and readers agree.
    """

    def __init__(
        self,
        uri: str,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy = RetryPolicy(),
        poll: PollPolicy = PollPolicy(),
        outage_s: float = 0.0,
        signing_key: bytes | None = None,
    ) -> None:
        if not (isinstance(outage_s, (int, float)) and math.isfinite(outage_s) and outage_s >= 0):
            raise ValueError(f"Store(outage_s=...) must be a finite number of seconds >= 0, got {outage_s!r}")
        if signing_key is not None and len(signing_key) < MIN_SIGNING_KEY_BYTES:
            raise StoreConfigError(f"Store(signing_key=...) is too short; use at least {MIN_SIGNING_KEY_BYTES} bytes")
        _refuse_credentials(uri, storage_options or {})
        self.retry = dataclasses.replace(retry, budget_s=float(outage_s))
        self.poll = poll
        self.outage_s = float(outage_s)
        self._signing_key = signing_key
        self._storage_options = dict(storage_options or {})
        self.backend: Backend = open_backend(uri.rstrip("/"), storage_options or {})
        self.uri = self.backend.uri
        self.outage = Outage(f"store {self.uri}", budget_s=self.outage_s)
        self._counters = [0, 0]
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never shows storage options or the signing key
        return f"Store({self.uri!r}, outage_s={self.outage_s}, signed={self.signed})"
    # ------------------------------------------------------------ plumbing
    @property
    def signed(self) -> bool:
        """Whether this store writes signed objects and accepts only authentic ones."""
        return self._signing_key is not None

    @property
    def storage_options(self) -> dict[str, Any]:
        """A copy of the fsspec options this store was opened with (they may hold secrets: never log them)."""
        return dict(self._storage_options)

    @property
    def endpoint(self) -> str | None:
        """The S3 endpoint URL in use, if one was configured (``None``: the provider's default)."""
        return getattr(self.backend, "endpoint", None)

    @property
    def bytes_read(self) -> int:
        return self._counters[0]

    @property
    def bytes_written(self) -> int:
        return self._counters[1]

    def _count(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self._counters[0] += read
            self._counters[1] += written

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn`` under this store's retry policy; transient errors that outlast it become :class:`StoreUnavailable`."""
        try:
            return self.retry.call(what, fn, transient=is_transient, outage=self.outage)
        except Exception as exc:
            if not is_transient(exc):
                raise
            since = self.outage.since
            raise StoreUnavailable(self.uri, what, time.monotonic() - since if since else 0.0, exc) from exc

    def path(self, key: str) -> str:
        """Where ``key`` lives in the backend (a filesystem path, or ``bucket/prefix/key``)."""
        return self.backend.path(key)

    def uri_of(self, key: str) -> str:
        return f"{self.uri}/{key}"

    def _frame(self, key: str, payload: bytes | bytearray | memoryview) -> bytes:
        return frame(payload, key=key, signing_key=self._signing_key)

    # ------------------------------------------------------------ writes
    def put(self, key: str, payload: bytes | bytearray | memoryview, *, durable: bool = True) -> int:
        """Atomically write ``payload`` at ``key`` (overwriting). Returns bytes written.

        ``durable=False`` skips the local ``fsync``: for transient round payloads, where rename already
        gives atomicity and a torn object left by a power loss fails its checksum (the round is retried).
        """
        return self._overwrite(key, self._frame(key, payload), durable=durable)

    def _overwrite(self, key: str, data: bytes, *, durable: bool) -> int:
        self.backend.path(key)  # validates the key before anything is retried
        self._retry(f"put {key}", lambda: self.backend.put(key, data, durable=durable))
        self._count(written=len(data))
        return len(data)

    def create(self, key: str, payload: bytes | bytearray | memoryview, *, settle: bool = True) -> bool:
        """Write-once: store ``payload`` at ``key`` only if ``key`` does not exist.

        Returns True if this call created the object, False if it already
        existed (someone else won). Exactly one of any set of racing callers
        gets True.

        A create whose response was lost (a transient error after the request may have reached the
        store) is retried; if the retry finds the key, the stored bytes decide: ours or another's.
        Over HTTP the client library may resend a PUT whose connection broke without telling us
        (``Backend.resends``), so there every refused create is settled by the stored bytes: a
        create whose bytes are already stored is this writer's. Records carry their writer's clock
        time (most also its rank), so two writers' records differ; identical bytes are the same
        object (content-addressed code, a replica racing itself for its own slice).

        ``settle=False``: the caller decides from the record it reads next (a quorum, an outcome), not from
        who created it, so a refused create is not settled by a read (one GET less per refused create).
        """
        data = self._frame(key, payload)
        self.backend.path(key)
        maybe_ours = False

        def attempt() -> bool:
            nonlocal maybe_ours
            try:
                if self.backend.create(key, data):
                    return True
            except Exception as exc:  # noqa: BLE001 - classified, then re-raised for the retry policy
                maybe_ours = maybe_ours or is_transient(exc)
                raise
            if not settle or not (maybe_ours or self.backend.resends):
                return False
            try:
                return bytes(self.backend.read(key)) == data
            except ObjectNotFound:  # deleted in between: the create can be tried again
                raise ConnectionResetError(f"{key} vanished after a create was refused") from None

        created = self._retry(f"create {key}", attempt)
        if created:
            self._count(written=len(data))
        return created

    def put_plain(self, key: str, payload: bytes | bytearray | memoryview) -> int:
        """Atomically write ``payload`` at ``key`` *unframed* (no header, no signature). Returns bytes written.

        Only for objects meant for other tools (plain JSONL metrics that pandas reads as they are).
        Such an object is not verified by :meth:`get`: its writer also puts a framed (and, with a run
        key, signed) digest next to it, which readers check (:mod:`composer_cloud.runs.metrics`).
        """
        return self._overwrite(key, bytes(payload), durable=False)

    def get_plain(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The raw bytes at ``key`` (an object written by :meth:`put_plain`); the caller verifies them.

        ``max_bytes``: read at most that many bytes plus one (a ranged read); a longer object raises
        :class:`ChecksumMismatch` naming the key and the limit without being read whole.
        """
        self.backend.path(key)
        if max_bytes is None:
            data = self._retry(f"get {key}", lambda: self.backend.read(key))
        else:
            data = self._retry(f"get {key}", lambda: self.backend.read(key, limit=max_bytes + 1))
        self._count(read=len(data))
        if max_bytes is not None and len(data) > max_bytes:
            raise OversizedObject(key, f"larger than the {max_bytes}-byte limit for this kind of record; "
                                        "not read (a real record is far smaller)")
        return bytes(data)

    def put_json(self, key: str, obj: Any) -> int:
        return self.put(key, _dumps(obj))

    def create_json(self, key: str, obj: Any, *, settle: bool = True) -> bool:
        return self.create(key, _dumps(obj), settle=settle)

    # ------------------------------------------------------------ reads
    def get(self, key: str, *, max_bytes: int | None = None) -> memoryview:
        """Read and verify ``key``. Raises :class:`ObjectNotFound` or :class:`ChecksumMismatch`.

        A backend whose reads can be damaged in transit (S3) reads an object that fails verification once more.
        ``max_bytes`` bounds the payload: a larger object is refused before it is read whole.
        """
        limit = None if max_bytes is None else max_bytes + SIGNED_HEADER_BYTES
        for tries_left in range(self.backend.rereads, -1, -1):
            try:
                data = self.get_plain(key, max_bytes=limit)
                return unframe(key, data, signing_key=self._signing_key)
            except OversizedObject:
                raise  # its size is not damage in transit: never read again
            except ChecksumMismatch as exc:
                if not tries_left:
                    raise
                logger.debug("%s; reading it again", exc)
        raise AssertionError("unreachable")

    def get_json(self, key: str, *, max_bytes: int = JSON_RECORD_MAX_BYTES) -> Any:
        """Read, verify and parse the JSON record at ``key``, refusing one over ``max_bytes`` unread
        (its kind's limit: :mod:`composer_cloud.storage.records.limits`)."""
        try:
            return json.loads(bytes(self.get(key, max_bytes=max_bytes)))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ChecksumMismatch(key, f"not JSON: {exc}") from None

    def try_get(self, key: str) -> memoryview | None:
        try:
            return self.get(key)
        except ObjectNotFound:
            return None

    def try_get_json(self, key: str, *, max_bytes: int = JSON_RECORD_MAX_BYTES) -> Any | None:
        try:
            return self.get_json(key, max_bytes=max_bytes)
        except ObjectNotFound:
            return None

    def exists(self, key: str) -> bool:
        self.backend.path(key)
        return self._retry(f"exists {key}", lambda: self.backend.exists(key))

    def modified(self, key: str) -> float | None:
        """When ``key`` was last written (epoch seconds), or None when the backend does not say."""
        self.backend.path(key)
        return self._retry(f"info {key}", lambda: self.backend.modified(key))

    def wait_get(self, key: str, *, deadline: float, what: str | None = None,
                 between: Callable[[int], None] | None = None) -> memoryview:
        """Poll for ``key`` until ``deadline`` (a ``time.monotonic()`` value); raises :class:`StoreTimeout`.

        ``between(n)`` runs after the ``n``-th miss and may raise to end the wait early.
        """
        return poll_until(lambda: self.try_get(key), deadline=deadline, policy=self.poll, between=between,
                          on_timeout=lambda waited: StoreTimeout(what or key, waited))

    # ------------------------------------------------------------ listing and deletion
    def list(self, prefix: str = "") -> list[str]:
        """Keys (recursively) under ``prefix``, relative to the store root, sorted. Objects only."""
        if prefix:
            self.backend.path(prefix)
        return sorted(self._retry(f"list {prefix}", lambda: self.backend.find(prefix)))

    def list_dirs(self, prefix: str = "") -> list[str]:
        """Immediate child names under ``prefix`` (directories and objects).

        A name is a hint, not a promise: on some stores (SeaweedFS) a
        directory whose objects were all deleted is still listed for a while.
        Callers read the objects they need (e.g. a manifest) and skip names
        without them.
        """
        if prefix:
            self.backend.path(prefix)
        return sorted(self._retry(f"ls {prefix}", lambda: self.backend.children(prefix)))

    def delete(self, key: str, *, recursive: bool = False) -> None:
        """Delete ``key`` (or everything under it with ``recursive``). Missing keys are fine."""
        self.backend.path(key)
        self._retry(f"delete {key}", lambda: self.backend.delete(key, recursive=recursive))

    def remove_empty_prefix(self, prefix: str) -> None:
        """Remove what is left of an emptied ``prefix`` where the backend keeps directories (local disks)."""
        self.backend.remove_empty_prefix(prefix)

    def check_access(self) -> None:
        """Fail fast with :class:`StoreConfigError`, naming the store, if it cannot be used.

        Costs one LIST of the bucket on S3. Retries transient errors within this
        store's ``outage_s`` (use ``0`` here so an unreachable endpoint fails
        in seconds).
        """
        where = f" at {self.endpoint}" if self.endpoint else ""
        try:
            self._retry("check access", self.backend.check_access)
        except StoreConfigError:
            raise
        except StoreUnavailable as exc:
            cause = exc.__cause__
            raise StoreConfigError(
                f"cannot reach store {self.uri}{where} ({type(cause).__name__}: {cause}); check the endpoint "
                "(AWS_ENDPOINT_URL) and the network") from None
        except Exception as exc:  # noqa: BLE001 - surfaced with context
            raise StoreConfigError(f"cannot use store {self.uri}{where}: {type(exc).__name__}: {exc}") from None


# --------------------------------------------------------------------------- helpers
def _refuse_credentials(uri: str, options: dict[str, Any]) -> None:
    """Credentials in the store URI or an endpoint URL are refused by name (never echoed; the message says where
    they go instead): a URI ends up in logs, errors, handles and job commands."""
    where = "the store URI" if url_has_credentials(uri) else None
    for name in ("endpoint_url",):
        value = options.get(name) or (options.get("client_kwargs") or {}).get(name)
        if where is None and isinstance(value, str) and url_has_credentials(value):
            where = f"storage option {name!r}"
    endpoint = env.s3_endpoint()
    if where is None and endpoint and url_has_credentials(endpoint):
        where = f"${'/$'.join(env.AWS_ENDPOINTS)}"
    if where is not None:
        raise StoreConfigError(f"store {redact(uri)}: {where} carries credentials (user:password@ or a secret query parameter in a URL); put "
                               "them in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (passed to jobs as executor "
                               "secrets), never in a URL")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


def iter_chunks(n: int, parts: int) -> Iterable[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous ``[start, end)`` ranges (sizes differ by <= 1)."""
    for i in range(parts):
        yield (i * n) // parts, ((i + 1) * n) // parts
