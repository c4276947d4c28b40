"""Where a store's bytes live: one backend per kind, each keeping its own quirks.

:class:`~composer_cloud.storage.store.Store` frames, verifies, retries and
counts; a backend only moves bytes, in keys relative to its root, and says
what the store's answers mean:

* :class:`LocalBackend` (``file://``): atomic puts through a temporary file in
  the same directory and ``os.replace``; write-once creates through
  ``os.link`` of a fully written (fsynced) temporary file, which fails if the
  key exists.
* :class:`FsspecBackend` (``s3://`` and every other fsspec protocol): one PUT
  is atomic; creates send ``If-None-Match: *`` (s3fs ``mode="create"``). An
  HTTP 412 means "exists" whatever its body says (SeaweedFS omits the
  ``<Condition>`` element s3fs looks for), and a response whose
  ``x-amz-checksum-*`` botocore rejects (moto, proxies) is a damaged read,
  which the store reads once more. s3fs and botocore make one attempt per
  call (the store's :class:`~composer_cloud.retry.RetryPolicy` does all
  retrying), with socket timeouts of :data:`CONNECT_TIMEOUT_S` /
  :data:`READ_TIMEOUT_S`.

Errors: missing keys raise :class:`~composer_cloud.errors.ObjectNotFound`,
transient failures propagate as the backend raised them (the store's
classifier decides), bad configuration raises
:class:`~composer_cloud.errors.StoreConfigError` with what to fix.
"""

from __future__ import annotations

import datetime
import os
import uuid
from typing import Any, Protocol

import fsspec

from composer_cloud import env
from composer_cloud.errors import ChecksumMismatch, LinkOutsideStore, ObjectNotFound, StoreConfigError
from composer_cloud.retry import http_error_of

#: botocore socket timeouts for S3 (seconds): connecting, and waiting for the next bytes of a response.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
#: Name prefix of temporary objects (local writes); never listed as keys.
TMP_PREFIX = ".tmp-"


class Backend(Protocol):
    """The byte mover under a :class:`~composer_cloud.storage.store.Store`. Keys are relative to ``root``."""

    #: The store's URI as other processes must spell it (``file://`` URIs absolute).
    uri: str
    #: Extra reads of an object whose bytes failed verification (damaged in transit, not at rest).
    rereads: int
    #: Whether the client may resend a request whose response was lost, without telling the caller
    #: (a create then reads as refused by its own first write): the store settles refusals by bytes.
    resends: bool

    def path(self, key: str) -> str: ...
    def put(self, key: str, data: bytes, *, durable: bool) -> None: ...
    def create(self, key: str, data: bytes) -> bool: ...
    def read(self, key: str, limit: int | None = None) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def modified(self, key: str) -> float | None: ...
    def find(self, prefix: str) -> list[str]: ...
    def children(self, prefix: str) -> list[str]: ...
    def delete(self, key: str, *, recursive: bool) -> None: ...
    def remove_empty_prefix(self, prefix: str) -> None: ...
    def check_access(self) -> None: ...


def check_key(key: str) -> None:
    if not key or key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: keys are relative paths without '..' or empty parts")


class _FsspecListing:
    """Reads, listings and deletion through an fsspec filesystem, shared by both backends."""

    fs: Any
    root: str

    def path(self, key: str) -> str:
        check_key(key)
        return f"{self.root}/{key}"

    def _base(self, prefix: str) -> str:
        return self.path(prefix) if prefix else self.root

    def read(self, key: str, limit: int | None = None) -> bytes:
        """The object's bytes; with ``limit``, at most ``limit`` bytes are read (a longer object is cut)."""
        try:
            return self.fs.cat_file(self.path(key), **({} if limit is None else {"start": 0, "end": limit}))
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    def modified(self, key: str) -> float | None:
        info = self.fs.info(self.path(key))
        for name in ("mtime", "LastModified", "last_modified", "created"):
            value = info.get(name)
            if isinstance(value, datetime.datetime):
                return value.timestamp()
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return None

    def find(self, prefix: str) -> list[str]:
        """Keys of the objects under ``prefix`` (recursively; directory entries dropped: SeaweedFS keeps a
        directory for a prefix whose objects were all deleted, and s3fs reports it when the prefix is empty)."""
        try:
            found = self.fs.find(self._base(prefix), detail=True)
        except FileNotFoundError:
            return []
        out = []
        for p, info in found.items():
            if info.get("type") == "directory":
                continue
            p = self.fs._strip_protocol(p) if "://" in p else p
            rel = p[len(self.root) + 1:] if p.startswith(self.root + "/") else p
            if not os.path.basename(rel).startswith(TMP_PREFIX):
                out.append(rel)
        return out

    def children(self, prefix: str) -> list[str]:
        try:
            names = [os.path.basename(p.rstrip("/")) for p in self.fs.ls(self._base(prefix), detail=False)]
        except FileNotFoundError:
            return []
        return [n for n in names if n and not n.startswith(TMP_PREFIX)]

    def delete(self, key: str, *, recursive: bool) -> None:
        try:
            self.fs.rm(self.path(key), recursive=recursive)
        except FileNotFoundError:
            pass


class LocalBackend(_FsspecListing):
    """A directory on a filesystem with atomic ``rename`` and ``link`` (local disks, most NFSv4 setups)."""

    rereads = 0
    resends = False  # os.link answers in-process: no response can be lost

    def __init__(self, uri: str, storage_options: dict[str, Any]) -> None:
        self.root = os.path.abspath(uri.split("://", 1)[1]).rstrip("/") or "/"
        self.fs = fsspec.filesystem("file", **storage_options)
        self.uri = f"file://{self.root}"  # absolute, so other processes resolve it alike
        # The store's own location may lie behind the user's symbolic links (/tmp -> /private/tmp): only links
        # *inside* the store, which anyone who can write it can plant, must not lead out of it.
        self._real_root = os.path.realpath(self.root)

    def path(self, key: str) -> str:
        """The key's path, once it is known not to lead out of the store through a symbolic link (a link
        planted in the store folder would make a reader read, a writer write or ``delete`` remove a file
        anywhere this user can): raises :class:`~composer_cloud.errors.LinkOutsideStore`."""
        path = super().path(key)
        real = os.path.realpath(path)
        if real != self._real_root and not real.startswith(self._real_root.rstrip("/") + "/"):
            raise LinkOutsideStore(key)
        return path

    def put(self, key: str, data: bytes, *, durable: bool) -> None:
        self._write(self.path(key), data, exclusive=False, durable=durable)

    def create(self, key: str, data: bytes) -> bool:
        try:
            self._write(self.path(key), data, exclusive=True)
        except FileExistsError:
            return False
        return True

    def _write(self, path: str, data: bytes, *, exclusive: bool, durable: bool = True) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if durable or exclusive:
                    f.flush()
                    os.fsync(f.fileno())
            if exclusive:
                os.link(tmp, path)  # fails with EEXIST if the key exists: an atomic test-and-set
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def remove_empty_prefix(self, prefix: str) -> None:
        try:
            os.rmdir(self.path(prefix))
        except OSError:
            pass  # not empty (someone else uses it) or already gone

    def check_access(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise StoreConfigError(f"cannot create store directory {self.root} ({exc.strerror})") from None


def is_precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is an HTTP 412 answer. s3fs gives ``FileExistsError`` only if the body names the
    ``If-None-Match`` condition (AWS, moto); SeaweedFS and body-less 412s get ``OSError(EINVAL)``."""
    http = http_error_of(exc)
    return http is not None and (http[0] == 412 or http[1] in ("PreconditionFailed", "412"))


class FsspecBackend(_FsspecListing):
    """Any other fsspec filesystem; S3-compatible stores get the options and quirks they need."""

    rereads = 1  # a response damaged in transit: one more GET
    resends = True  # aiohttp resends a PUT whose kept-alive connection was reset before the answer

    def __init__(self, uri: str, storage_options: dict[str, Any]) -> None:
        self.uri = uri
        self.fs, root = _open_fsspec(uri, storage_options)
        self.root = root.rstrip("/")
        # s3fs's cat_file sends a HEAD before every GET when max_concurrency > 1 (to plan ranged parallel
        # reads), and on a missing key its HEAD 404 falls back to a LIST: a billed LIST per poll miss.
        # One stream per read makes a read one GET and a miss one GET 404 (docs/scale.md, measured).
        self._read_options = {"max_concurrency": 1} if _takes_max_concurrency(self.fs) else {}

    @property
    def endpoint(self) -> str | None:
        """The S3 endpoint URL in use, if one was configured (``None``: the provider's default)."""
        return (getattr(self.fs, "client_kwargs", None) or {}).get("endpoint_url")

    def put(self, key: str, data: bytes, *, durable: bool) -> None:
        self.fs.pipe_file(self.path(key), data)

    def create(self, key: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(self.path(key), data, mode="create")
        except FileExistsError:
            return False
        except Exception as exc:  # botocore's timeouts are not OSError; a 412 may be an OSError(EINVAL)
            if is_precondition_failed(exc):
                return False
            raise
        return True

    def exists(self, key: str) -> bool:
        """One HEAD on S3 (s3fs's ``exists`` follows a HEAD 404 with a LIST, billed as a PUT); callers ask
        about records and markers, never about directories."""
        if not self._read_options:
            return super().exists(key)
        bucket, path, _ = self.fs.split_path(self.path(key))
        try:
            self.fs.call_s3("head_object", Bucket=bucket, Key=path)
        except FileNotFoundError:
            return False
        return True

    def read(self, key: str, limit: int | None = None) -> bytes:
        """The object's bytes; with ``limit``, at most ``limit`` bytes are read (one ranged GET)."""
        try:
            return self.fs.cat_file(self.path(key), **self._read_options,
                                    **({} if limit is None else {"start": 0, "end": limit}))
        except FileNotFoundError:
            raise ObjectNotFound(key) from None
        except Exception as exc:
            # botocore verifies the response's x-amz-checksum-* header when the store sends one.
            if type(exc).__name__ == "FlexibleChecksumError":
                raise ChecksumMismatch(key, f"response checksum mismatch: {exc}") from None
            raise

    def remove_empty_prefix(self, prefix: str) -> None:
        return None  # object stores have no directories to remove

    def check_access(self) -> None:
        """One LIST of the bucket; transient errors propagate (the store retries them)."""
        bucket = self.root.split("/", 1)[0]
        where = f" at {self.endpoint}" if self.endpoint else ""
        try:
            self.fs.ls(bucket, detail=False, refresh=True)
        except FileNotFoundError:
            raise StoreConfigError(
                f"bucket {bucket!r} of store {self.uri} does not exist{where} (or is not visible with these "
                "credentials); create it first or check AWS_ENDPOINT_URL") from None
        except PermissionError as exc:
            raise StoreConfigError(
                f"access to bucket {bucket!r} of store {self.uri}{where} was denied ({exc}); check the "
                "credentials in the standard AWS_* environment variables or profile") from None


def _takes_max_concurrency(fs: Any) -> bool:
    """Whether ``fs.cat_file`` takes ``max_concurrency`` (s3fs); other filesystems get no extra option."""
    import inspect

    try:
        return "max_concurrency" in inspect.signature(fs._cat_file).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def _open_fsspec(uri: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """An fsspec filesystem and root path for ``uri``; S3 options set for one attempt per call.

    ``s3://`` honours the standard AWS credential chain and ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL`` (MinIO, R2, SeaweedFS), unless ``endpoint_url`` is given in the options,
    which win over every default set here.
    """
    scheme = uri.split("://", 1)[0]
    options = dict(storage_options)
    s3 = scheme in ("s3", "s3a")
    if s3:
        endpoint = options.pop("endpoint_url", None) or env.s3_endpoint()
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
    # s3fs takes its retry count as a class attribute, not a constructor option.
    s3fs_retries = options.pop("retries", 1) if s3 else None
    try:
        fs, root = fsspec.core.url_to_fs(uri, **options)
    except ImportError as exc:
        raise StoreConfigError(f"store {uri!r}: the fsspec backend for {scheme!r} is not installed ({exc})") from None
    except TypeError as exc:
        raise StoreConfigError(f"store {uri!r}: invalid storage option ({exc}); check store_options") from None
    if s3fs_retries is not None:
        fs.retries = int(s3fs_retries)  # an instance of our own (skip_instance_cache)
    return fs, root


def open_backend(uri: str, storage_options: dict[str, Any]) -> LocalBackend | FsspecBackend:
    """The backend for ``uri`` (``file:///abs``, ``file://./rel``, ``s3://bucket/prefix``, ...)."""
    if "://" not in uri:
        raise StoreConfigError(
            f"store {uri!r} has no scheme; use file:///abs/path, file://./relative, or s3://bucket/prefix")
    scheme = uri.split("://", 1)[0]
    if scheme not in fsspec.available_protocols():
        raise StoreConfigError(
            f"store {uri!r}: unknown scheme {scheme!r}; supported here: file://, s3:// and other fsspec protocols")
    if scheme == "file":
        return LocalBackend(uri, storage_options)
    return FsspecBackend(uri, storage_options)


__all__ = ["Backend", "CONNECT_TIMEOUT_S", "FsspecBackend", "LocalBackend", "READ_TIMEOUT_S", "check_key",
           "is_precondition_failed", "open_backend"]
