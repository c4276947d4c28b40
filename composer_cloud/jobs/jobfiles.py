"""A local job's folder: its files opened without following links, inside their root, and its records signed.

For a ``file://`` store the local executor keeps each replica's job files in the run's folder
(``<run dir>/jobs/<rank>/``), which anyone who can write the store can also write. So nothing there is
trusted the way a private file would be:

* **No links.** The folder is reached from its root (the store folder, or the launcher's working directory
  for remote stores; resolved once, since the user's own links above it are theirs) one component at a time
  with ``O_NOFOLLOW | O_DIRECTORY``, and every file in it is opened relative to that folder's descriptor with
  ``O_NOFOLLOW``. A symbolic link planted at a record's path, or at the folder or one of its parents, makes
  the open fail (:class:`UnsafeJobFolder`): the supervisor never writes, and ``status`` never reads, a file
  outside the folder.
* **Signed records.** ``supervisor.json``, ``exit.json`` and ``cancel`` are framed like store objects
  (:mod:`composer_cloud.storage.framing`): in a signed run with an HMAC under a key derived from the run's
  signing key (:func:`records_key`), with the record's path in the folder (``jobs/<rank>/<name>``) as its key
  name. A record that does not verify is absent (a warning says so): a forged exit record cannot report a live
  run as ended, nor a cancel file written without the key stop one. An unsigned run's records carry a crc32
  only, like its store objects (docs/security.md, known limits).

The supervisor receives the records key in its environment (``COMPOSER_CLOUD_JOB_RECORDS_KEY``), like the run
key the replicas receive; it is never written to a file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from pathlib import Path
from typing import IO, Any

from composer_cloud.errors import ChecksumMismatch, ExecutorError
from composer_cloud.storage.framing import frame, hkdf_sha256, unframe

logger = logging.getLogger(__name__)

#: The records of a job folder (the log and the token are not records: the log is the replica's output, the
#: token is a bearer secret compared with the handle's).
RECORDS = ("supervisor.json", "exit.json", "cancel")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafeJobFolder(ExecutorError):
    """A job folder, or a file in it, is a symbolic link (or not a folder / regular file): refused."""


def records_key(signing_key: bytes | None) -> bytes | None:
    """The key of a job folder's records, derived from the run's signing key (None for an unsigned run)."""
    if signing_key is None:
        return None
    return hkdf_sha256(signing_key, salt=b"", info=b"composer-cloud/local-job-records/v1")


class JobFolder:
    """Job folder ``root / parts`` (``parts``: relative components below ``root``), opened without links.

    Args:
        root: where the walk starts; resolved once (links above it are the user's own).
        parts: the folder's components below ``root``; none may be a link.
        rank: the replica's rank (record key names are ``jobs/<rank>/<name>``).
        key: :func:`records_key` of the run (None: unsigned records).
        create: create missing components (0700); else a missing folder raises ``FileNotFoundError``.
    """

    def __init__(self, root: Path, parts: tuple[str, ...], *, rank: int, key: bytes | None,
                 create: bool = False) -> None:
        if create:  # the root is the user's (the store folder, the working directory): made like any folder
            os.makedirs(root, exist_ok=True)
        self.path = Path(os.path.realpath(root)).joinpath(*parts)
        self.rank = rank
        self._key = key
        fd = os.open(os.path.realpath(root), _DIR_FLAGS)
        try:
            for part in parts:
                fd = _open_child_dir(fd, part, create=create, where=self.path)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    @classmethod
    def at(cls, path: Path, *, rank: int, key: bytes | None) -> "JobFolder":
        """The folder at absolute ``path``, every component walked without links (the supervisor's view:
        the launcher passes it the folder's link-free path)."""
        return cls(Path("/"), Path(path).parts[1:], rank=rank, key=key)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "JobFolder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ files
    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of ``name`` in this folder, never through a link; raises :class:`UnsafeJobFolder`."""
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"not a file name: {name!r}")
        try:
            return os.open(name, flags | _FILE_FLAGS, mode, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeJobFolder(f"{self.path / name} is a symbolic link; refusing to follow it (planted in "
                                      "the store folder?)") from None
            raise

    def read_bytes(self, name: str) -> bytes | None:
        """The content of ``name``, or None when it is missing (a link raises :class:`UnsafeJobFolder`)."""
        try:
            fd = self.open(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def open_text(self, name: str) -> IO[str] | None:
        """``name`` opened for reading as text (replacing undecodable bytes), or None when it is missing."""
        try:
            fd = self.open(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        return os.fdopen(fd, "r", errors="replace")

    def open_append(self, name: str) -> IO[bytes]:
        """``name`` opened for appending (created 0600), unbuffered: the supervisor's replica log."""
        return os.fdopen(self.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab", buffering=0)

    def create_exclusive(self, name: str, data: bytes) -> None:
        """Create ``name`` (0600) holding ``data``; fails if anything, a link included, is there."""
        with os.fdopen(self.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
            f.write(data)

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write ``name`` through a fresh temporary file and a rename inside this folder (a link at ``name`` is
        replaced, never followed)."""
        tmp = f".{name}.{os.getpid()}.tmp"
        self.unlink(tmp)
        self.create_exclusive(tmp, data)
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def size(self, name: str) -> int:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_size
        except FileNotFoundError:
            return 0

    # ------------------------------------------------------------ records
    def _key_name(self, name: str) -> str:
        return f"jobs/{self.rank}/{name}"

    def write_record(self, name: str, record: dict[str, Any]) -> None:
        """Write record ``name`` framed (signed with the records key in a signed run)."""
        payload = json.dumps(record, sort_keys=True).encode()
        self.write_atomic(name, frame(payload, key=self._key_name(name), signing_key=self._key))

    def read_record(self, name: str) -> dict[str, Any] | None:
        """Record ``name``, verified; None when it is missing, a link, or fails verification (warned about)."""
        try:
            raw = self.read_bytes(name)
        except UnsafeJobFolder as exc:
            logger.warning("ignoring %s", exc)
            return None
        if raw is None:
            return None
        try:
            obj = json.loads(bytes(unframe(self._key_name(name), raw, signing_key=self._key)))
        except (ChecksumMismatch, UnicodeDecodeError, ValueError) as exc:
            logger.warning("ignoring %s: not a valid job record (%s)", self.path / name, exc)
            return None
        if not isinstance(obj, dict):
            logger.warning("ignoring %s: not a job record", self.path / name)
            return None
        return obj


def _open_child_dir(fd: int, part: str, *, create: bool, where: Path) -> int:
    """The descriptor of folder ``part`` under ``fd`` (closing ``fd`` once it is opened; on an error the caller
    still owns ``fd``), never through a link."""
    if part in ("", ".", "..") or "/" in part:
        raise UnsafeJobFolder(f"{where}: {part!r} is not a folder name")
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=fd)
        child = os.open(part, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeJobFolder(f"{where}: {part!r} is a symbolic link or not a folder; refusing to follow it "
                                  "(planted in the store folder?)") from None
        raise
    os.close(fd)
    return child


__all__ = ["RECORDS", "JobFolder", "UnsafeJobFolder", "records_key"]
