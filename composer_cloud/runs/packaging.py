"""Launcher side of the user code and local files that travel with a run, through the run's store.

A run names user code by ``"module:attr"`` settings (a task factory, a hint
source, a reward) and may list extra paths (``[code] include``). On the local
executor those happen to be importable because the replica inherits the
launcher's directory; on Modal or Hugging Face Jobs nothing but the installed
packages exists. ``launch`` therefore packages the user's code
(:func:`collect_code` -> :func:`upload_code`) and the local files the spec
names (:func:`spec_local_paths` -> :func:`pack_path` -> :func:`put_verified`);
each replica installs them (:mod:`composer_cloud.replica.usercode`), so its
working directory no longer matters.

Invariants:

* **Only the user's code travels.** A reference is resolved to its top-level
  package or module file. Builtin, frozen, stdlib and site-packages modules and
  ``composer_cloud`` itself are installed in every image and are never
  packaged. Absolute imports in packaged files that resolve to other user
  modules (a sibling ``helpers.py``) are followed and packaged too; dynamic
  imports are not (list them in ``include``).
* **Content-addressed and deterministic.** A bundle is a zip with sorted
  entries, fixed timestamps and permissions and no ``__pycache__``, ``*.pyc``
  or hidden files (``.git``, ``.env``, ...), so the same code gives the same
  sha256 and the same key (:func:`composer_cloud.storage.layout.code_key`,
  :func:`~composer_cloud.storage.layout.file_key`). Objects are created
  write-once; an existing object whose bytes do not hash to its name is
  replaced, never reused.
"""

from __future__ import annotations

import ast
import filecmp
import difflib
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import site
import sys
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_cloud.archive import MAX_ENTRIES, write_zip
from composer_cloud.errors import BadReference, ChecksumMismatch, ConfigError
from composer_cloud.registry import is_reference
from composer_cloud.storage import layout
from composer_cloud.storage.records import CodeRef
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)

#: Largest code bundle (sum of uncompressed file sizes) :func:`collect_code` builds by default.
MAX_CODE_BYTES = 50 * 2**20
#: Largest single path (a file, or a directory's files together) :func:`pack_path` packs by default.
#: Objects travel through memory; larger models belong on the Hugging Face Hub, named by repo id.
MAX_FILE_BYTES = 2**30

_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


# --------------------------------------------------------------------------- errors
class UserCodeError(ConfigError, ValueError):
    """User code or files cannot be packaged; the message names the setting or path and what to do."""


class CodeNotFound(BadReference, UserCodeError):
    """A ``"module:attr"`` reference names a module that is neither installed nor found locally."""


class BundleTooLarge(UserCodeError):
    """The code or a file to upload exceeds its size limit."""


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class CodeBundle:
    """A deterministic zip of user code, ready for :func:`upload_code`.

    Attributes:
        data: the zip's bytes (its root goes on ``sys.path`` in the replica).
        sha256: hex digest of ``data``.
        modules: top-level modules packaged (sorted).
        files: every entry of the zip (sorted).
        installed: top-level modules of references left to the image (stdlib,
            site-packages, ``composer_cloud``), for dry-run reports.
    """

    data: bytes = field(repr=False)
    sha256: str
    modules: tuple[str, ...]
    files: tuple[str, ...]
    installed: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def empty(self) -> bool:
        """True when there is nothing to ship (every reference is installed, nothing included)."""
        return not self.files


# --------------------------------------------------------------------------- launcher side
def collect_code(
    references: Sequence[str] | Mapping[str, str | None],
    *,
    include: Sequence[str | os.PathLike[str]] = (),
    base_dir: str | os.PathLike[str] | None = None,
    max_bytes: int = MAX_CODE_BYTES,
) -> CodeBundle:
    """Package the user code behind ``references`` plus the ``include`` paths.

    Args:
        references: ``"module:attr"`` strings, or a mapping from setting name
            (``"trainer.task"``) to reference, so errors name the setting.
            Values that are not references (registered names such as
            ``"python-functions"``, ``None``, ``""``) are skipped.
        include: files or directories, relative to ``base_dir`` (or absolute
            inside it); each lands in the bundle at its path relative to
            ``base_dir``, so the bundle root mirrors ``base_dir``.
        base_dir: where the user's code lives (default: the current
            directory). Searched before ``sys.path``, as if it were first on
            ``sys.path``.
        max_bytes: limit on the sum of the packaged files' sizes.

    Modules are located without importing them (no user code runs here).
    Each referenced top-level package goes to ``<name>/...`` and each module
    file to ``<name>.py`` at the bundle root.

    Raises:
        CodeNotFound: a reference's module is not found (names the setting).
        UserCodeError: an ``include`` path is missing or outside ``base_dir``.
        BundleTooLarge: the bundle would exceed ``max_bytes`` or :data:`MAX_ENTRIES`.
    """
    base = Path(os.path.abspath(base_dir if base_dir is not None else os.getcwd()))
    search = [str(base), *sys.path]
    entries = _Entries(max_bytes=max_bytes, what="the code bundle")
    packaged: set[str] = set()
    installed: set[str] = set()
    seen: set[str] = set()
    # (setting, reference or None, top-level module, named explicitly)
    queue: list[tuple[str, str | None, str, bool]] = [
        (setting, ref, ref.partition(":")[0].split(".")[0], True) for setting, ref in _named(references)]
    while queue:
        setting, ref, top, explicit = queue.pop(0)
        if top in seen:
            continue
        seen.add(top)
        spec = _find_top_level(top, search)
        if spec is None:
            if explicit:
                raise CodeNotFound(
                    f"{setting}: module {top!r} of {ref!r} was found neither in {base} nor on sys.path, so it "
                    f"cannot be packaged for the replicas; run from the folder that contains {top}/ or {top}.py, "
                    f"add that folder to PYTHONPATH, or fix the module name")
            continue  # an optional or conditional import the user's code handles itself
        try:
            roots = [] if isinstance(spec, str) else _user_roots(spec)
        except UserCodeError:
            if explicit:
                raise
            continue  # an import of something installed oddly (an egg) is the image's business
        if top == "composer_cloud" or not roots:
            if explicit:  # imports of installed packages are the image's business, not this report's
                installed.add(top)
            continue
        if not explicit and spec.origin is None:
            continue  # only named references may pull in a namespace package (a bare folder)
        if explicit and ref is not None:
            _check_attribute(setting, ref, roots)
        logger.debug("packaging %s from %s", top, ", ".join(map(str, roots)))
        packaged.add(top)
        for i, root in enumerate(roots):
            if root.is_dir():
                for rel, path in _walk(root):
                    entries.add(f"{top}/{rel}", path, first_wins=i > 0)  # namespace portions: first wins, as in import
            else:
                entries.add(root.name, root)
        for name in _imported_top_levels(entries.python_files_of(top, roots)):
            queue.append((setting, None, name, False))
    for item in include:
        _add_include(entries, base, item)
    data = write_zip(entries.sources, compress=True)
    bundle = CodeBundle(data=data, sha256=hashlib.sha256(data).hexdigest(), modules=tuple(sorted(packaged)),
                        files=tuple(sorted(entries.sources)), installed=tuple(sorted(installed)))
    logger.info("code bundle %s: %d files, %d bytes; packaged %s; installed in the image: %s", bundle.sha256[:12],
                len(bundle.files), bundle.size, list(bundle.modules) or "-", list(bundle.installed) or "-")
    return bundle


def upload_code(store: Store, bundle: CodeBundle) -> CodeRef:
    """Write ``bundle`` write-once at ``code/<sha256>.zip`` in ``store`` (the run's store).

    Idempotent: an intact object with the same digest is left as it is.
    """
    if hashlib.sha256(bundle.data).hexdigest() != bundle.sha256:
        raise ValueError("bundle.sha256 does not match bundle.data; build bundles with collect_code")
    key = layout.code_key(bundle.sha256)
    put_verified(store, key, bundle.data, bundle.sha256)
    return CodeRef(key=key, sha256=bundle.sha256, bytes=bundle.size, modules=bundle.modules)


def pack_path(path: str | os.PathLike[str], *, max_bytes: int = MAX_FILE_BYTES,
              given: str | None = None) -> tuple[str, bytes, str]:
    """``(store key, bytes, sha256)`` of a local file or directory, ready for :func:`put_verified`.

    Reads and zips in memory; writes nothing. Raises :class:`UserCodeError`
    (missing path) or :class:`BundleTooLarge` (over ``max_bytes``).
    """
    path = Path(os.path.normpath(os.path.abspath(path)))
    name = path.name or path.resolve().name
    if not path.exists():
        raise UserCodeError(f"{given or os.fspath(path)!r}: no such file or directory (looked at {path})")
    if path.is_dir():
        entries = _Entries(max_bytes=max_bytes, what=f"directory {path}")
        for rel, file in _walk(path):
            entries.add(rel, file)
        data = write_zip(entries.sources, compress=False)  # weights do not compress; STORED is fast
        sha = hashlib.sha256(data).hexdigest()
        return layout.file_key(sha, name, directory=True), data, sha
    size = path.stat().st_size
    if size > max_bytes:
        raise BundleTooLarge(
            f"{path} is {size} bytes, over the {max_bytes}-byte limit for uploads through the store; "
            "publish it (e.g. to the Hugging Face Hub) and name it by id instead")
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    return layout.file_key(sha, name, directory=False), data, sha


def path_size(path: str | os.PathLike[str]) -> int:
    """Bytes :func:`pack_path` would read: a file's size, or the sum over a folder's packaged files."""
    p = Path(path)
    return sum(f.stat().st_size for _, f in _walk(p)) if p.is_dir() else p.stat().st_size


def _top_level_names(path: Path) -> set[str] | None:
    """Names a Python file binds at top level (defs, classes, assignments, imports); None when it cannot be
    known without running it (a syntax error, a star import, a module ``__getattr__``)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:
        return None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            return None  # conditional definitions: only an import would tell
    return None if "__getattr__" in names else names


def _check_attribute(setting: str, ref: str, roots: Sequence[Path]) -> None:
    """A ``"module:attr"`` reference whose module file is found must bind ``attr`` at top level (a typo in the
    function name is refused here, not by every replica). Unknowable cases pass."""
    module, _, attr = ref.partition(":")
    if not attr or not roots:
        return
    parts = module.split(".")[1:]
    root = roots[0]
    candidates = [root] if not parts and root.is_file() else [
        root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")]
    path = next((c for c in candidates if c.is_file()), None)
    names = _top_level_names(path) if path is not None else None
    if names is not None and attr.split(".")[0] not in names:
        close = difflib.get_close_matches(attr, sorted(names), n=1)
        raise CodeNotFound(f"{setting}: {ref!r}: {path} defines no {attr.split('.')[0]!r}"
                           + (f"; did you mean {module}:{close[0]}?" if close else ""))


# --------------------------------------------------------------------------- local paths named by a spec
#: Values of those settings that are never paths.
_NOT_PATHS = {"model.name": {"tiny"}, "trainer.pairs": {"auto", "builtin", "none"}}
#: ``datasets`` builders whose ``data_files`` are local files (with any other dataset they live in its repo).
_FILE_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}


@dataclass(frozen=True)
class SpecPath:
    """A local file or folder named by a spec setting.

    Attributes:
        setting: the dotted setting (``trainer.data_files`` entries: ``trainer.data_files.<i>``).
        given: the value as written.
        path: the absolute path it names (relative values are relative to the spec's folder).
    """

    setting: str
    given: str
    path: Path


def _explicit_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~", "file://"))


#: File suffixes a dataset or model id on the Hub never has: such a value names a local file.
_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".arrow", ".txt", ".safetensors", ".bin")


def _looks_like_path(setting: str, value: str) -> bool:
    """A value that cannot be a hub id (``org/name``): a file suffix, a trailing or second ``/``, a backslash."""
    if setting not in ("model.name", "trainer.dataset"):
        return False
    return value.lower().endswith(_FILE_SUFFIXES) or value.endswith("/") or value.count("/") > 1 or "\\" in value


def _as_local(value: str, base: Path) -> Path:
    return Path(os.path.normpath(base / os.path.expanduser(value.removeprefix("file://"))))


def spec_local_paths(model_name: str, settings: Mapping[str, Any], *,
                     base_dir: str | os.PathLike[str] | None = None) -> list[SpecPath]:
    """The local files and folders a run's spec names (``model.name``, ``trainer.pairs``,
    ``trainer.dataset``, ``trainer.data_files``), resolved against ``base_dir``.

    A value is a path when it is written as one (``/``, ``./``, ``../``, ``~``,
    ``file://``) or names something that exists under ``base_dir``; anything
    else (a hub id, an ``s3://`` URI, a built-in name) is left alone. A value
    written as a path that does not exist is a :class:`UserCodeError` naming
    the setting.
    """
    base = Path(os.path.abspath(base_dir if base_dir is not None else os.getcwd()))
    candidates: list[tuple[str, Any]] = [("model.name", model_name)]
    candidates += [(f"trainer.{k}", settings.get(k)) for k in ("pairs", "dataset")]
    files = settings.get("data_files")
    if settings.get("dataset") in _FILE_BUILDERS and files is not None:
        items = [files] if isinstance(files, str) else list(files) if isinstance(files, list) else None
        if items is None:
            raise UserCodeError("trainer.data_files: with a local builder give a path or a list of paths "
                                "(a split -> files table is not shipped; use one dataset file per split instead)")
        candidates += [(f"trainer.data_files.{i}", v) for i, v in enumerate(items)]
    out: list[SpecPath] = []
    for setting, value in candidates:
        if not isinstance(value, str) or value in _NOT_PATHS.get(setting, ()):
            continue
        if "://" in value and not value.startswith("file://"):
            continue  # s3://, hf://, ...: read by the replica itself
        path = _as_local(value, base)
        if not path.exists():
            if _explicit_path(value) or _looks_like_path(setting, value) or setting in ("trainer.pairs",) \
                    or setting.startswith("trainer.data_files"):
                raise UserCodeError(f"{setting} = {value!r}: no such file or folder (looked at {path})")
            continue  # a hub id
        if any(ch in value for ch in "*?["):
            raise UserCodeError(f"{setting} = {value!r}: glob patterns are not shipped; name the files")
        out.append(SpecPath(setting, value, path))
    return out


# --------------------------------------------------------------------------- module lookup
def _named(references: Sequence[str] | Mapping[str, str | None]) -> list[tuple[str, str]]:
    if isinstance(references, str):
        raise TypeError("references must be a sequence (or mapping) of 'module:attr' strings, not one string")
    pairs = list(references.items()) if isinstance(references, Mapping) else [("reference", r) for r in references]
    return [(setting, ref) for setting, ref in pairs if isinstance(ref, str) and is_reference(ref)]


def _find_top_level(name: str, search: list[str]) -> importlib.machinery.ModuleSpec | str | None:
    """The spec of top-level module ``name`` as an import with ``search`` as ``sys.path`` would find it.

    Does not import anything. ``"builtin"`` for builtin and frozen modules.
    """
    if name in sys.builtin_module_names or importlib.machinery.FrozenImporter.find_spec(name) is not None:
        return "builtin"
    # PathFinder applies import's own rules (a regular package anywhere beats namespace portions).
    spec = importlib.machinery.PathFinder.find_spec(name, search)
    if spec is None:
        try:  # other meta-path finders (editable installs) and already-imported modules
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
    return spec


@functools.lru_cache(maxsize=1)
def _installed_roots() -> tuple[Path, ...]:
    """Directories whose modules every image has: the stdlib, site-packages, and composer_cloud."""
    kinds = ("stdlib", "platstdlib", "purelib", "platlib")
    base_vars = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}  # the interpreter under a venv
    roots = [paths[k] for paths in (sysconfig.get_paths(), sysconfig.get_paths(vars=base_vars)) for k in kinds]
    roots += getattr(site, "getsitepackages", lambda: [])()
    roots.append(site.getusersitepackages())
    roots.append(os.path.dirname(os.path.abspath(__file__)))  # composer_cloud itself
    return tuple(Path(os.path.realpath(r)) for r in roots if r)


def _is_installed(path: Path) -> bool:
    real = Path(os.path.realpath(path))
    if {"site-packages", "dist-packages"} & set(real.parts):
        return True
    return any(real == root or real.is_relative_to(root) for root in _installed_roots())


def _user_roots(spec: importlib.machinery.ModuleSpec) -> list[Path]:
    """The user's files behind a top-level ``spec``: a package directory (or namespace portions) or a file."""
    if spec.submodule_search_locations is not None:
        roots = [Path(p) for p in spec.submodule_search_locations]
    elif spec.origin and spec.has_location:
        roots = [Path(spec.origin)]
    else:
        return []
    roots = [r for r in roots if not _is_installed(r)]
    for r in roots:
        if not (r.is_dir() or r.is_file()):
            raise UserCodeError(f"module {spec.name!r} is loaded from {r}, which is not a plain file or folder "
                                "(a zip or egg?); unpack it or install it in the image")
    return roots


def _imported_top_levels(files: Sequence[Path]) -> list[str]:
    """Top-level names of absolute imports in ``files`` (relative imports stay inside their package)."""
    names: set[str] = set()
    for path in files:
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError) as exc:
            logger.warning("not scanning %s for imports: %s", path, exc)
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return sorted(names)


# --------------------------------------------------------------------------- packaging
class _Entries:
    """Archive name -> source file, with conflict and size checks as entries are added."""

    def __init__(self, *, max_bytes: int, what: str) -> None:
        self.sources: dict[str, Path] = {}
        self.sizes: dict[str, int] = {}
        self.total = 0
        self.max_bytes = max_bytes
        self.what = what

    def add(self, arcname: str, path: Path, *, first_wins: bool = False) -> None:
        old = self.sources.get(arcname)
        if old is not None:
            if first_wins or os.path.realpath(old) == os.path.realpath(path) or filecmp.cmp(old, path, shallow=False):
                return
            raise UserCodeError(f"{old} and {path} would both be packaged as {arcname!r} with different contents; "
                                "rename one or drop it from [code] include")
        self.sources[arcname] = path
        self.sizes[arcname] = path.stat().st_size
        self.total += self.sizes[arcname]
        total = self.total
        if total > self.max_bytes or len(self.sources) > MAX_ENTRIES:
            largest = sorted(self.sizes.items(), key=lambda kv: -kv[1])[:5]
            raise BundleTooLarge(
                f"{self.what} exceeds its limit ({len(self.sources)} files / {MAX_ENTRIES}, {total} bytes / "
                f"{self.max_bytes}); largest: " + ", ".join(f"{n} ({s} bytes)" for n, s in largest)
                + ". Move data out of the code folders and upload it as files, or publish it and name it by id")

    def python_files_of(self, top: str, roots: Sequence[Path]) -> list[Path]:
        if len(roots) == 1 and roots[0].is_file():
            return [roots[0]] if roots[0].suffix == ".py" else []
        return [p for a, p in self.sources.items() if a.startswith(f"{top}/") and a.endswith(".py")]


def _walk(root: Path) -> Iterator[tuple[str, Path]]:
    """Files under ``root`` as (posix path relative to root, path), sorted; skips hidden names and bytecode.

    Symlinked files are read through; symlinked directories are followed once (cycles are cut).
    """
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        rel_dir = Path(dirpath).relative_to(root)
        for f in sorted(filenames):
            if f.startswith(".") or f.endswith(_SKIP_SUFFIXES):
                continue
            path = Path(dirpath) / f
            if path.is_file():  # skips dangling links, sockets, fifos
                yield (rel_dir / f).as_posix(), path


def _add_include(entries: _Entries, base: Path, item: str | os.PathLike[str]) -> None:
    path = Path(os.path.normpath(base / item))
    rel = os.path.relpath(path, base)
    if rel == ".." or rel.startswith(".." + os.sep):
        raise UserCodeError(f"[code] include: {os.fspath(item)!r} is outside {base}; include paths are placed at "
                            "their path relative to that folder, so move it inside or launch from a parent folder")
    if not path.exists():
        raise UserCodeError(f"[code] include: {os.fspath(item)!r} does not exist (looked at {path})")
    prefix = "" if rel == "." else Path(rel).as_posix() + "/"
    if path.is_dir():
        for sub, file in _walk(path):
            entries.add(prefix + sub, file)
    else:
        entries.add(Path(rel).as_posix(), path)


# --------------------------------------------------------------------------- store I/O
def put_verified(store: Store, key: str, data: bytes, sha256: str) -> None:
    """Create ``key`` write-once; if it exists, keep it only if its bytes hash to ``sha256``."""
    if store.create(key, data):
        logger.info("uploaded %s (%d bytes)", store.uri_of(key), len(data))
        return
    try:
        existing = store.get(key)
        if hashlib.sha256(existing).hexdigest() == sha256:
            logger.debug("%s already in the store", key)
            return
        reason = "its sha256 does not match its name"
    except ChecksumMismatch as exc:
        reason = str(exc)
    # A content-addressed key with other content is damaged or forged: no reader may use it, so replace it.
    logger.warning("replacing %s: %s", key, reason)
    store.put(key, data)
