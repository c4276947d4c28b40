"""An object store over fsspec with the guarantees the all-reduce needs.

Invariants (see ``DESIGN.md``):

* **Atomic objects.** :meth:`Store.put` never exposes a partial object. On a
  local filesystem it writes a temporary file in the same directory and
  renames it over the key; on S3 a single PUT is atomic.
* **Verified objects.** Every object is framed as ``MAGIC | crc32 | length |
  payload`` (16-byte little-endian header). :meth:`Store.get` checks all three
  and raises :class:`ChecksumMismatch` naming the key; a damaged payload is
  never returned.
* **Write-once records.** :meth:`Store.create` succeeds for exactly one of any
  number of racing writers: ``os.link`` of a fully written temporary file onto
  the key on local filesystems (fails if the key exists), ``If-None-Match: *``
  on S3 (via s3fs ``mode="create"``).
* **Deadlines, not hangs.** :meth:`Store.wait_get` polls with capped
  exponential backoff until a deadline and raises :class:`StoreTimeout`.
* **No pickle.** The store moves bytes; callers encode tensors with
  safetensors and metadata with JSON.

Transient backend errors (connection resets, timeouts, HTTP 5xx, S3
``SlowDown``) are retried with exponential backoff and full jitter.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import uuid
import zlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import fsspec

from composer_cloud.retry import PollPolicy, RetryPolicy, is_transient, poll_until

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAGIC = b"CCO1"
_HEADER = struct.Struct("<4sIQ")  # magic, crc32(payload), len(payload)
HEADER_BYTES = _HEADER.size


# --------------------------------------------------------------------------- errors
class StoreError(RuntimeError):
    """Base class of every error raised by the store and the all-reduce."""


class ObjectNotFound(StoreError, KeyError):
    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"object not found: {key}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class ChecksumMismatch(StoreError):
    """A stored object failed verification (bad magic, length or crc32)."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        super().__init__(f"object {key} is corrupt ({reason}); it was not used")


class StoreTimeout(StoreError):
    """A wait on the store passed its deadline."""

    def __init__(self, key: str, waited_s: float) -> None:
        self.key = key
        self.waited_s = waited_s
        super().__init__(f"timed out after {waited_s:.1f}s waiting for {key}")


class StoreConfigError(StoreError):
    """The store URI or its credentials cannot work; the message says how to fix it."""


# --------------------------------------------------------------------------- framing
def frame(payload: bytes | bytearray | memoryview) -> bytes:
    """Prefix ``payload`` with the verification header."""
    view = memoryview(payload)
    return _HEADER.pack(MAGIC, zlib.crc32(view), view.nbytes) + bytes(view)


def unframe(key: str, data: bytes) -> memoryview:
    """Verify and strip the header; raises :class:`ChecksumMismatch`."""
    if len(data) < HEADER_BYTES:
        raise ChecksumMismatch(key, f"truncated: {len(data)} bytes")
    magic, crc, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ChecksumMismatch(key, "not a composer-cloud object")
    payload = memoryview(data)[HEADER_BYTES:]
    if payload.nbytes != length:
        raise ChecksumMismatch(key, f"length {payload.nbytes} != recorded {length}")
    if zlib.crc32(payload) != crc:
        raise ChecksumMismatch(key, "crc32 mismatch")
    return payload


# --------------------------------------------------------------------------- store
class Store:
    """A key/value view of ``uri`` (``file:///tmp/x``, ``s3://bucket/prefix``, ...).

    Keys are ``/``-separated paths relative to the root; ``..`` and absolute
    keys are rejected. Byte counters (``bytes_read``/``bytes_written``, payload
    bytes only) are thread-safe and shared with :meth:`child` stores.
    """

    def __init__(
        self,
        uri: str,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy = RetryPolicy(),
        poll: PollPolicy = PollPolicy(),
        _fs: Any = None,
        _counters: list[int] | None = None,
        _lock: threading.Lock | None = None,
    ) -> None:
        self.uri = uri.rstrip("/")
        self.retry = retry
        self.poll = poll
        if _fs is None:
            _fs, root = open_filesystem(self.uri, storage_options or {})
        else:
            root = _fs._strip_protocol(self.uri)
        self.fs = _fs
        self.root = root.rstrip("/")
        self.local = "file" in _protocols(self.fs)
        if self.local:
            self.uri = f"file://{self.root}"  # absolute, so other processes resolve it alike
        self._counters = _counters if _counters is not None else [0, 0]
        self._lock = _lock or threading.Lock()

    # ------------------------------------------------------------ plumbing
    def child(self, prefix: str) -> "Store":
        """A store rooted at ``<root>/<prefix>`` sharing this store's filesystem and counters."""
        _check_key(prefix)
        return Store(f"{self.uri}/{prefix}", retry=self.retry, poll=self.poll, _fs=self.fs,
                     _counters=self._counters, _lock=self._lock)

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
        return self.retry.call(what, fn, transient=is_transient)

    def path(self, key: str) -> str:
        _check_key(key)
        return f"{self.root}/{key}"

    def uri_of(self, key: str) -> str:
        return f"{self.uri}/{key}"

    # ------------------------------------------------------------ writes
    def put(self, key: str, payload: bytes | bytearray | memoryview, *, durable: bool = True) -> int:
        """Atomically write ``payload`` at ``key`` (overwriting). Returns bytes written.

        ``durable=False`` skips the local ``fsync``: for transient round
        payloads, where rename already gives atomicity and a torn object left
        by a power loss fails its checksum (the round is then retried).
        """
        data = frame(payload)
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
        gets True.
        """
        data = frame(payload)
        path = self.path(key)

        def attempt() -> bool:
            try:
                if self.local:
                    self._local_put(path, data, exclusive=True)
                else:
                    self.fs.pipe_file(path, data, mode="create")
                return True
            except FileExistsError:
                return False

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

    def put_json(self, key: str, obj: Any) -> int:
        return self.put(key, _dumps(obj))

    def create_json(self, key: str, obj: Any) -> bool:
        return self.create(key, _dumps(obj))

    # ------------------------------------------------------------ reads
    def get(self, key: str) -> memoryview:
        """Read and verify ``key``. Raises :class:`ObjectNotFound` or :class:`ChecksumMismatch`."""
        path = self.path(key)

        def read() -> bytes:
            try:
                return self.fs.cat_file(path)
            except FileNotFoundError:
                raise ObjectNotFound(key) from None

        data = self._retry(f"get {key}", read)
        self._count(read=len(data))
        return unframe(key, data)

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

    def wait_get(self, key: str, *, deadline: float, what: str | None = None,
                 between: Callable[[int], None] | None = None) -> memoryview:
        """Poll for ``key`` until ``deadline`` (a ``time.monotonic()`` value); raises :class:`StoreTimeout`.

        ``between(n)`` runs after the ``n``-th miss and may raise to end the wait early.
        """
        return poll_until(lambda: self.try_get(key), deadline=deadline, policy=self.poll, between=between,
                          on_timeout=lambda waited: StoreTimeout(what or key, waited))

    # ------------------------------------------------------------ listing and deletion
    def list(self, prefix: str = "") -> list[str]:
        """Keys (recursively) under ``prefix``, relative to the store root, sorted."""
        base = self.path(prefix) if prefix else self.root

        def ls() -> list[str]:
            try:
                return self.fs.find(base)
            except FileNotFoundError:
                return []

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
        """Immediate child names under ``prefix`` (directories and objects)."""
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
        """Fail fast, with a message naming the bucket/path, if the store cannot be used."""
        try:
            if self.local:
                os.makedirs(self.root, exist_ok=True)
                return
            bucket = self.root.split("/", 1)[0]
            try:
                if not self.fs.exists(bucket):
                    raise StoreConfigError(
                        f"bucket {bucket!r} of store {self.uri} does not exist (or is not visible with "
                        "these credentials); create it first or check AWS_ENDPOINT_URL")
                self.fs.ls(self.root if self.fs.exists(self.root) else bucket, detail=False)
            except PermissionError as exc:
                raise StoreConfigError(
                    f"access to bucket {bucket!r} of store {self.uri} was denied ({exc}); check the "
                    "credentials in the standard AWS_* environment variables or profile") from None
        except StoreConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced with context
            raise StoreConfigError(f"cannot reach store {self.uri}: {type(exc).__name__}: {exc}") from None


# --------------------------------------------------------------------------- helpers
def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _check_key(key: str) -> None:
    if not key or key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: keys are relative paths without '..' or empty parts")


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


SUPPORTED_PROTOCOLS = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "memory")


def open_filesystem(uri: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """Resolve ``uri`` to an fsspec filesystem and a root path.

    ``s3://`` honours the standard AWS credential chain and
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (for MinIO, R2, SeaweedFS),
    unless ``endpoint_url`` is given in ``storage_options``.
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
            options.setdefault("client_kwargs", {})["endpoint_url"] = endpoint
        options.setdefault("cache_regions", False)
        options.setdefault("use_listings_cache", False)
        options.setdefault("skip_instance_cache", True)
    if scheme == "file":
        path = uri.split("://", 1)[1]
        path = os.path.abspath(path)
        fs = fsspec.filesystem("file", **options)
        return fs, path
    try:
        fs, root = fsspec.core.url_to_fs(uri, **options)
    except ImportError as exc:
        raise StoreConfigError(f"store {uri!r}: the fsspec backend for {scheme!r} is not installed ({exc})") from None
    return fs, root


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


def iter_chunks(n: int, parts: int) -> Iterable[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous ``[start, end)`` ranges (sizes differ by <= 1)."""
    for i in range(parts):
        yield (i * n) // parts, ((i + 1) * n) // parts
