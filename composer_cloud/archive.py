"""Zip archives for code and files that travel through the store: deterministic to write, safe to extract.

Invariants:

* :func:`write_zip` output depends only on entry names and contents (sorted
  entries, fixed timestamps and permissions), so the same files give the same
  sha256 on every machine with the same zlib.
* :func:`extract_atomic` never writes outside its target: absolute paths,
  ``..``, backslashes, links, special files, duplicate names and archives
  larger than the limits are refused (:class:`UnsafeArchive`) before anything
  is written; the files appear at the target by one rename.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

from composer_cloud.errors import BadObject

logger = logging.getLogger(__name__)

#: Largest total size and entry count an extraction accepts.
MAX_EXTRACT_BYTES = 2 * 2**30
MAX_ENTRIES = 20_000

_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest time zip can represent
_FILE_MODE = 0o644


class UnsafeArchive(BadObject):
    """An archive read from the store holds an entry that must not be extracted."""

    def __init__(self, key: str, entry: str, reason: str) -> None:
        self.entry = entry
        super().__init__(key, reason,
                         message=f"object {key} holds an unsafe entry {entry!r} ({reason}); nothing was extracted")


def write_zip(sources: Mapping[str, Path], *, compress: bool) -> bytes:
    """A zip of ``sources`` whose bytes depend only on the names and contents."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for arcname in sorted(sources):
            info = zipfile.ZipInfo(arcname, date_time=_ZIP_TIME)
            info.create_system = 3  # unix, whatever the host
            info.external_attr = (stat.S_IFREG | _FILE_MODE) << 16
            info.compress_type = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
            zf.writestr(info, sources[arcname].read_bytes())
    return buf.getvalue()


def safe_members(zf: zipfile.ZipFile, key: str) -> list[tuple[zipfile.ZipInfo, tuple[str, ...]]]:
    """Every entry with its path parts, after refusing anything unsafe; raises :class:`UnsafeArchive`."""
    infos = zf.infolist()
    if len(infos) > MAX_ENTRIES:
        raise UnsafeArchive(key, infos[MAX_ENTRIES].filename, f"more than {MAX_ENTRIES} entries")
    out: list[tuple[zipfile.ZipInfo, tuple[str, ...]]] = []
    files: set[tuple[str, ...]] = set()
    total = 0
    for info in infos:
        name = info.filename
        mode = info.external_attr >> 16
        if name.startswith("/") or "\\" in name or "\0" in name or re.match(r"[A-Za-z]:", name):
            raise UnsafeArchive(key, name, "absolute or non-POSIX path")
        parts = tuple(name.rstrip("/").split("/")) if info.is_dir() else tuple(name.split("/"))
        if any(p in ("", ".", "..") for p in parts):
            raise UnsafeArchive(key, name, "empty, '.' or '..' path component")
        if stat.S_ISLNK(mode):
            raise UnsafeArchive(key, name, "symbolic link")
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise UnsafeArchive(key, name, "not a regular file or directory")
        if info.flag_bits & 0x1:
            raise UnsafeArchive(key, name, "encrypted")
        if not info.is_dir():
            if parts in files:
                raise UnsafeArchive(key, name, "duplicate entry")
            files.add(parts)
        total += info.file_size
        if total > MAX_EXTRACT_BYTES:
            raise UnsafeArchive(key, name, f"archive expands beyond {MAX_EXTRACT_BYTES} bytes")
        out.append((info, parts))
    for parts in files:  # a file may not also be a directory of another entry
        for i in range(1, len(parts)):
            if parts[:i] in files:
                raise UnsafeArchive(key, "/".join(parts), f"{'/'.join(parts[:i])} is also a file")
    return out


def extract_atomic(data: bytes, key: str, target: Path) -> None:
    """Check every entry, extract to a temporary sibling of ``target``, then rename it into place."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise UnsafeArchive(key, "", f"not a zip archive: {exc}") from None
    with zf:
        members = safe_members(zf, key)  # all checks before the first byte is written
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            for info, parts in members:
                dest = tmp.joinpath(*parts)
                if info.is_dir():
                    dest.mkdir(parents=True, exist_ok=True)
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                copy_member(zf, info, dest, key)
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
                logger.debug("%s was extracted concurrently; using that copy", target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def copy_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path, key: str) -> None:
    written = 0
    try:
        with zf.open(info) as src, open(dest, "xb") as out:
            while chunk := src.read(1 << 20):
                written += len(chunk)
                if written > info.file_size:  # never trust the declared size to bound the output
                    raise UnsafeArchive(key, info.filename, "expands beyond its declared size")
                out.write(chunk)
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError) as exc:
        raise UnsafeArchive(key, info.filename, f"cannot be extracted: {exc}") from None
    dest.chmod(_FILE_MODE)
