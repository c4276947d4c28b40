"""An object store over fsspec with the guarantees the all-reduce needs.

Invariants (see ``DESIGN.md`` and ``docs/store.md``):

* **Atomic objects.** :meth:`Store.put` never exposes a partial object. On a
  local filesystem it writes a temporary file in the same directory and
  renames it over the key; on S3 a single PUT is atomic.
* **Verified objects.** Every object is framed as ``MAGIC | crc32 | length |
  payload`` (16-byte little-endian header). :meth:`Store.get` checks all three
  and raises :class:`ChecksumMismatch` naming the key; a damaged payload is
  never returned.
* **Authentic objects** (with a signing key). The frame also carries an
  HMAC-SHA256 over the key and the payload; unsigned or mis-signed objects
  raise :class:`SignatureMismatch`, so a bucket writer without the run key
  cannot inject or move an object.
* **Write-once records.** :meth:`Store.create` succeeds for exactly one of any
  number of racing writers: ``os.link`` of a fully written temporary file onto
  the key on local filesystems (fails if the key exists), ``If-None-Match: *``
  on S3 (via s3fs ``mode="create"``). A 412 answer means "exists" whatever its
  body says (SeaweedFS omits the ``<Condition>`` element s3fs looks for).
* **Deadlines, not hangs.** :meth:`Store.wait_get` polls with capped
  exponential backoff until a deadline and raises :class:`StoreTimeout`.
* **No pickle.** The store moves bytes; callers encode tensors with
  safetensors and metadata with JSON.

Transient backend errors (connection refused/reset, timeouts, HTTP 5xx, S3
``SlowDown``) are retried by :class:`~composer_cloud.retry.RetryPolicy` only:
s3fs and botocore are configured not to retry (:func:`open_filesystem`).
``Store(outage_s=...)`` sets how long a store may be unreachable before a call
fails with :class:`StoreUnavailable`: ``0`` (default) gives up after a few seconds of retries (one-shot
commands), replicas pass ``spec.sync.store_outage_s`` to ride out an outage.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import json
import logging
import math
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import fsspec

from composer_cloud import env
from composer_cloud.errors import (
    ChecksumMismatch,
    ObjectNotFound,
    SignatureMismatch,
    StoreConfigError,
    StoreTimeout,
    StoreUnavailable,
)
from composer_cloud.retry import Outage, PollPolicy, RetryPolicy, http_error_of, is_transient, poll_until

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAGIC = b"CCO1"
_HEADER = struct.Struct("<4sIQ")  # magic, crc32(payload), len(payload)
HEADER_BYTES = _HEADER.size
SIGNED_MAGIC = b"CCS1"
_SIGNED_HEADER = struct.Struct("<4sIQ32s")  # magic, crc32(payload), len(payload), hmac-sha256
SIGNED_HEADER_BYTES = _SIGNED_HEADER.size
_MAC_DOMAIN = b"composer-cloud/object/v1\0"
#: Shortest accepted run key, in bytes (a shorter secret is guessable offline from one signed object).
MIN_SIGNING_KEY_BYTES = 16

#: botocore socket timeouts for S3 (seconds): connecting, and waiting for the next bytes of a response.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------- framing
def _mac(signing_key: bytes, key: str, payload: memoryview) -> bytes:
    h = hmac.new(signing_key, _MAC_DOMAIN, hashlib.sha256)
    h.update(key.encode())
    h.update(b"\0")
    h.update(payload)
    return h.digest()


def frame(payload: bytes | bytearray | memoryview, *, key: str | None = None,
          signing_key: bytes | None = None) -> bytes:
    """Prefix ``payload`` with the verification header (signed over ``key`` + payload with ``signing_key``)."""
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B") if view.c_contiguous else memoryview(bytes(view))
    if signing_key is None:
        return _HEADER.pack(MAGIC, zlib.crc32(view), view.nbytes) + bytes(view)
    if key is None:
        raise ValueError("frame(signing_key=...) needs the object's key: the signature covers it")
    return _SIGNED_HEADER.pack(SIGNED_MAGIC, zlib.crc32(view), view.nbytes, _mac(signing_key, key, view)) + bytes(view)


def unframe(key: str, data: bytes, *, signing_key: bytes | None = None) -> memoryview:
    """Verify and strip the header; raises :class:`ChecksumMismatch` (:class:`SignatureMismatch`).

    Without ``signing_key`` signed and unsigned frames are accepted (their
    crc32 is checked, the signature is not). With it, only a frame whose
    HMAC over ``key`` and the payload verifies is accepted.
    """
    if len(data) < HEADER_BYTES:
        raise ChecksumMismatch(key, f"truncated: {len(data)} bytes")
    magic = bytes(data[:4])
    if magic == SIGNED_MAGIC:
        if len(data) < SIGNED_HEADER_BYTES:
            raise ChecksumMismatch(key, f"truncated: {len(data)} bytes")
        _, crc, length, mac = _SIGNED_HEADER.unpack_from(data)
        payload = memoryview(data)[SIGNED_HEADER_BYTES:]
    elif magic == MAGIC:
        if signing_key is not None:
            raise SignatureMismatch(key, "unsigned, but this run requires signed objects")
        _, crc, length = _HEADER.unpack_from(data)
        mac = None
        payload = memoryview(data)[HEADER_BYTES:]
    else:
        raise ChecksumMismatch(key, "not a composer-cloud object")
    if payload.nbytes != length:
        raise ChecksumMismatch(key, f"length {payload.nbytes} != recorded {length}")
    if zlib.crc32(payload) != crc:
        raise ChecksumMismatch(key, "crc32 mismatch")
    if signing_key is not None and not hmac.compare_digest(mac, _mac(signing_key, key, payload)):
        raise SignatureMismatch(key, "HMAC mismatch: written without this run's key, or under another key name")
    return payload


def signing_key_from_env(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The run key from ``COMPOSER_CLOUD_RUN_KEY`` (UTF-8 bytes), or ``None`` when unset or empty.

    Raises :class:`StoreConfigError` (naming the variable, never echoing the
    value) if it is shorter than :data:`MIN_SIGNING_KEY_BYTES`.
    """
    value = environ.get(env.RUN_KEY, "")
    if not value:
        return None
    key = value.encode()
    if len(key) < MIN_SIGNING_KEY_BYTES:
        raise StoreConfigError(f"{env.RUN_KEY} is too short ({len(key)} bytes); use at least "
                               f"{MIN_SIGNING_KEY_BYTES} random bytes, e.g. `python -c 'import secrets; "
                               "print(secrets.token_hex(32))'`")
    return key


def derive_signing_key(run_key: bytes, run_id: str) -> bytes:
    """The per-run signing key: HMAC-SHA256(run_key, run_id), so a key reused across runs cannot replay objects."""
    return hmac.new(run_key, b"composer-cloud/run/v1\0" + run_id.encode(), hashlib.sha256).digest()


# --------------------------------------------------------------------------- store
def _is_precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is an HTTP 412 answer. s3fs gives ``FileExistsError`` only if the body names the
    ``If-None-Match`` condition (AWS, moto); SeaweedFS and body-less 412s get ``OSError(EINVAL)``."""
    http = http_error_of(exc)
    return http is not None and (http[0] == 412 or http[1] in ("PreconditionFailed", "412"))


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
            authentic objects are read (see :func:`signing_key_from_env`).
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
        self.uri = uri.rstrip("/")
        self.retry = dataclasses.replace(retry, budget_s=float(outage_s))
        self.poll = poll
        self.outage_s = float(outage_s)
        self._signing_key = signing_key
        self.fs, root = open_filesystem(self.uri, storage_options or {})
        self.root = root.rstrip("/")
        self.local = "file" in _protocols(self.fs)
        if self.local:
            self.uri = f"file://{self.root}"  # absolute, so other processes resolve it alike
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
    def endpoint(self) -> str | None:
        """The S3 endpoint URL in use, if one was configured (``None``: the provider's default)."""
        return (getattr(self.fs, "client_kwargs", None) or {}).get("endpoint_url")

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
        _check_key(key)
        return f"{self.root}/{key}"

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
        path = self.path(key)
        if self.local:
            self._retry(f"put {key}", lambda: self._local_put(path, data, exclusive=False, durable=durable))
        else:
            self._retry(f"put {key}", lambda: self.fs.pipe_file(path, data))
        self._count(written=len(data))
        return len(data)

    def create(self, key: str, payload: bytes | bytearray | memoryview) -> bool:
        """Write-once: store ``payload`` at ``key`` only if ``key`` does not exist.

        Returns True if this call created the object, False if it already
        existed (someone else won). Exactly one of any set of racing callers
        gets True. An HTTP 412 means "exists" whatever its body says.

        A create whose response was lost (a transient error after the request may have reached the
        store) is retried; if the retry finds the key, the stored bytes decide: ours or another's.
        """
        data = self._frame(key, payload)
        path = self.path(key)
        maybe_ours = False

        def attempt() -> bool:
            nonlocal maybe_ours
            try:
                if self.local:
                    self._local_put(path, data, exclusive=True)
                else:
                    self.fs.pipe_file(path, data, mode="create")
                return True
            except FileExistsError:
                pass
            except Exception as exc:  # botocore's timeouts are not OSError; a 412 may be an OSError(EINVAL)
                if not _is_precondition_failed(exc):
                    maybe_ours = maybe_ours or is_transient(exc)
                    raise
            if not maybe_ours:
                return False
            try:
                return bytes(self.fs.cat_file(path)) == data
            except FileNotFoundError:  # deleted in between: the create can be tried again
                raise ConnectionResetError(f"{key} vanished after a create was refused") from None

        created = self._retry(f"create {key}", attempt)
        if created:
            self._count(written=len(data))
        return created

    def _local_put(self, path: str, data: bytes, *, exclusive: bool, durable: bool = True) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if durable or exclusive:
                    f.flush()
                    os.fsync(f.fileno())
            if exclusive:
                # link() fails with EEXIST if the key exists: an atomic test-and-set.
                os.link(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def put_plain(self, key: str, payload: bytes | bytearray | memoryview) -> int:
        """Atomically write ``payload`` at ``key`` *unframed* (no header, no signature). Returns bytes written.

        Only for objects meant for other tools (plain JSONL metrics that pandas reads as they are).
        Such an object is not verified by :meth:`get`: its writer also puts a framed (and, with a run
        key, signed) digest next to it, which readers check (:mod:`composer_cloud.runs.metrics`).
        """
        return self._overwrite(key, bytes(payload), durable=False)

    def get_plain(self, key: str) -> bytes:
        """The raw bytes at ``key`` (an object written by :meth:`put_plain`); the caller verifies them."""
        data = self._retry(f"get {key}", lambda: self._cat(key))
        self._count(read=len(data))
        return bytes(data)

    def _cat(self, key: str) -> bytes:
        """One read of ``key``'s bytes as stored; ObjectNotFound, or ChecksumMismatch for a damaged response."""
        try:
            return self.fs.cat_file(self.path(key))
        except FileNotFoundError:
            raise ObjectNotFound(key) from None
        except Exception as exc:
            # botocore verifies the response's x-amz-checksum-* header when the store sends one.
            if type(exc).__name__ == "FlexibleChecksumError":
                raise ChecksumMismatch(key, f"response checksum mismatch: {exc}") from None
            raise

    def put_json(self, key: str, obj: Any) -> int:
        return self.put(key, _dumps(obj))

    def create_json(self, key: str, obj: Any) -> bool:
        return self.create(key, _dumps(obj))

    # ------------------------------------------------------------ reads
    def get(self, key: str) -> memoryview:
        """Read and verify ``key``. Raises :class:`ObjectNotFound` or :class:`ChecksumMismatch`.

        On S3 an object that fails verification is read once more (damaged in transit: one extra GET).
        """
        for tries_left in (1, 0) if not self.local else (0,):
            try:
                data = self.get_plain(key)
                return unframe(key, data, signing_key=self._signing_key)
            except ChecksumMismatch as exc:
                if not tries_left:
                    raise
                logger.debug("%s; reading it again", exc)
        raise AssertionError("unreachable")

    def get_json(self, key: str) -> Any:
        try:
            return json.loads(bytes(self.get(key)))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ChecksumMismatch(key, f"not JSON: {exc}") from None

    def try_get(self, key: str) -> memoryview | None:
        try:
            return self.get(key)
        except ObjectNotFound:
            return None

    def try_get_json(self, key: str) -> Any | None:
        try:
            return self.get_json(key)
        except ObjectNotFound:
            return None

    def exists(self, key: str) -> bool:
        path = self.path(key)
        return self._retry(f"exists {key}", lambda: self.fs.exists(path))

    def modified(self, key: str) -> float | None:
        """When ``key`` was last written (epoch seconds), or None when the filesystem does not say."""
        path = self.path(key)
        info = self._retry(f"info {key}", lambda: self.fs.info(path))
        for name in ("mtime", "LastModified", "last_modified", "created"):
            value = info.get(name)
            if isinstance(value, datetime.datetime):
                return value.timestamp()
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return None

    def wait_get(self, key: str, *, deadline: float, what: str | None = None,
                 between: Callable[[int], None] | None = None) -> memoryview:
        """Poll for ``key`` until ``deadline`` (a ``time.monotonic()`` value); raises :class:`StoreTimeout`.

        ``between(n)`` runs after the ``n``-th miss and may raise to end the wait early.
        """
        return poll_until(lambda: self.try_get(key), deadline=deadline, policy=self.poll, between=between,
                          on_timeout=lambda waited: StoreTimeout(what or key, waited))

    # ------------------------------------------------------------ listing and deletion
    def list(self, prefix: str = "") -> list[str]:
        """Keys (recursively) under ``prefix``, relative to the store root, sorted. Objects only.

        Directory entries are dropped: SeaweedFS keeps a directory for a
        prefix whose objects were all deleted, and s3fs reports it when the
        prefix has no objects.
        """
        base = self.path(prefix) if prefix else self.root

        def ls() -> list[str]:
            try:
                found = self.fs.find(base, detail=True)
            except FileNotFoundError:
                return []
            return [p for p, info in found.items() if info.get("type") != "directory"]

        found = self._retry(f"list {prefix}", ls)
        out = []
        for p in found:
            p = self.fs._strip_protocol(p) if "://" in p else p
            rel = p[len(self.root) + 1:] if p.startswith(self.root + "/") else p
            if os.path.basename(rel).startswith(".tmp-"):
                continue
            out.append(rel)
        return sorted(out)

    def list_dirs(self, prefix: str = "") -> list[str]:
        """Immediate child names under ``prefix`` (directories and objects).

        A name is a hint, not a promise: on some stores (SeaweedFS) a
        directory whose objects were all deleted is still listed for a while.
        Callers read the objects they need (e.g. a manifest) and skip names
        without them.
        """
        base = self.path(prefix) if prefix else self.root

        def ls() -> list[str]:
            try:
                return self.fs.ls(base, detail=False)
            except FileNotFoundError:
                return []

        names = [os.path.basename(p.rstrip("/")) for p in self._retry(f"ls {prefix}", ls)]
        return sorted(n for n in names if n and not n.startswith(".tmp-"))

    def delete(self, key: str, *, recursive: bool = False) -> None:
        """Delete ``key`` (or everything under it with ``recursive``). Missing keys are fine."""
        path = self.path(key)

        def rm() -> None:
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass

        self._retry(f"delete {key}", rm)

    def check_access(self) -> None:
        """Fail fast with :class:`StoreConfigError`, naming the store, if it cannot be used.

        Costs one LIST of the bucket. Retries transient errors within this
        store's ``outage_s`` (use ``0`` here so an unreachable endpoint fails
        in seconds).
        """
        if self.local:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise StoreConfigError(f"cannot create store directory {self.root} ({exc.strerror})") from None
            return
        bucket = self.root.split("/", 1)[0]
        where = f" at {self.endpoint}" if self.endpoint else ""
        try:
            self._retry(f"list bucket {bucket}", lambda: self.fs.ls(bucket, detail=False, refresh=True))
        except FileNotFoundError:
            raise StoreConfigError(
                f"bucket {bucket!r} of store {self.uri} does not exist{where} (or is not visible with these "
                "credentials); create it first or check AWS_ENDPOINT_URL") from None
        except PermissionError as exc:
            raise StoreConfigError(
                f"access to bucket {bucket!r} of store {self.uri}{where} was denied ({exc}); check the "
                "credentials in the standard AWS_* environment variables or profile") from None
        except StoreUnavailable as exc:
            cause = exc.__cause__
            raise StoreConfigError(
                f"cannot reach store {self.uri}{where} ({type(cause).__name__}: {cause}); check the endpoint "
                "(AWS_ENDPOINT_URL) and the network") from None
        except Exception as exc:  # noqa: BLE001 - surfaced with context
            raise StoreConfigError(f"cannot use store {self.uri}{where}: {type(exc).__name__}: {exc}") from None


# --------------------------------------------------------------------------- helpers
def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _check_key(key: str) -> None:
    if not key or key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: keys are relative paths without '..' or empty parts")


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def open_filesystem(uri: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """Resolve ``uri`` to an fsspec filesystem and a root path.

    ``s3://`` honours the standard AWS credential chain and
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (for MinIO, R2, SeaweedFS),
    unless ``endpoint_url`` is given in ``storage_options``.

    One retry layer: s3fs (its ``retries`` attribute set to 1) and botocore (``standard`` mode,
    ``total_max_attempts=1``) make one attempt per call, with socket timeouts of
    :data:`CONNECT_TIMEOUT_S` / :data:`READ_TIMEOUT_S`; :class:`Store`'s
    :class:`~composer_cloud.retry.RetryPolicy` does all retrying. Options
    given in ``storage_options`` win.
    """
    if "://" not in uri:
        raise StoreConfigError(
            f"store {uri!r} has no scheme; use file:///abs/path, file://./relative, or s3://bucket/prefix")
    scheme = uri.split("://", 1)[0]
    if scheme not in fsspec.available_protocols():
        raise StoreConfigError(
            f"store {uri!r}: unknown scheme {scheme!r}; supported here: file://, s3:// and other fsspec protocols")
    options = dict(storage_options)
    if scheme in ("s3", "s3a"):
        endpoint = options.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": endpoint}
        config = dict(options.get("config_kwargs", {}))
        config.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
        config.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
        config.setdefault("read_timeout", READ_TIMEOUT_S)
        options["config_kwargs"] = config
        options.setdefault("cache_regions", False)
        options.setdefault("use_listings_cache", False)
        options.setdefault("skip_instance_cache", True)
    if scheme == "file":
        path = uri.split("://", 1)[1]
        path = os.path.abspath(path)
        fs = fsspec.filesystem("file", **options)
        return fs, path
    # s3fs takes its retry count as a class attribute, not a constructor option.
    s3fs_retries = options.pop("retries", 1) if scheme in ("s3", "s3a") else None
    try:
        fs, root = fsspec.core.url_to_fs(uri, **options)
    except ImportError as exc:
        raise StoreConfigError(f"store {uri!r}: the fsspec backend for {scheme!r} is not installed ({exc})") from None
    except TypeError as exc:
        raise StoreConfigError(f"store {uri!r}: invalid storage option ({exc}); check store_options") from None
    if s3fs_retries is not None:
        fs.retries = int(s3fs_retries)  # an instance of our own (skip_instance_cache)
    return fs, root


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


def iter_chunks(n: int, parts: int) -> Iterable[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous ``[start, end)`` ranges (sizes differ by <= 1)."""
    for i in range(parts):
        yield (i * n) // parts, ((i + 1) * n) // parts
