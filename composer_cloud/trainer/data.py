"""Loading a user's dataset (``[trainer] dataset``), shared by the three-channel and causal-LM trainers.

A hub id, a local file (by extension through the ``json`` / ``csv`` / ``parquet``
builders of :func:`datasets.load_dataset`) or a folder written by
``Dataset.save_to_disk``. :func:`dataset_columns` reads only the column names
(what the launcher checks before anything is written). Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from composer_cloud.errors import ConfigError

#: Local file extensions and the ``datasets`` builder that reads them.
BUILDERS: dict[str, str] = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class DatasetError(ConfigError, ValueError):
    """A dataset cannot be loaded or lacks a column; the message names the setting and what exists."""


def is_local_dataset(name: str, base_dir: str | os.PathLike[str] | None = None) -> bool:
    """True when ``name`` names a local file or folder (an explicit path, or one that exists)."""
    if name.startswith(("/", "./", "../", "~", "file://")):
        return True
    if "://" in name:
        return False
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    return (base / name).exists()


def _local_path(name: str) -> Path:
    return Path(os.path.expanduser(name.removeprefix("file://")))


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((p / "state.json").exists() or (p / "dataset_dict.json").exists()
                                 for p in (path, *[c for c in path.iterdir() if c.is_dir()]))


def _builder_args(name: str, config: str | None, data_files: Any) -> tuple[str, dict[str, Any]]:
    """``(path, kwargs)`` for ``load_dataset``; a local file picks its builder by extension."""
    if is_local_dataset(name):
        path = _local_path(name)
        if path.is_file():
            builder = BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DatasetError(f"trainer.dataset {name!r}: unknown file type {path.suffix!r}; use one of "
                                   f"{sorted(BUILDERS)} or a folder written by Dataset.save_to_disk")
            return builder, {"data_files": str(path)}
        if not path.exists():
            raise DatasetError(f"trainer.dataset {name!r}: no such file or folder ({path.resolve()})")
        return str(path), {"data_files": data_files} if data_files else {}
    kwargs: dict[str, Any] = {"data_files": data_files} if data_files else {}
    if config:
        kwargs["name"] = config
    return name, kwargs


def _load_saved(name: str, split: str) -> Any:
    """``split`` of a ``save_to_disk`` folder (a Dataset, or one split of a DatasetDict)."""
    import datasets

    ds = datasets.load_from_disk(str(_local_path(name)))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DatasetError(f"trainer.dataset {name!r} has splits {sorted(ds)}, not {split!r}")
        ds = ds[split]
    return ds


def load_rows(name: str, split: str, *, config: str | None = None, data_files: Any = None) -> list[dict[str, Any]]:
    """All rows of ``split`` as plain dicts (``datasets.load_dataset`` / ``load_from_disk``)."""
    import datasets

    try:
        if is_local_dataset(name) and _is_saved_dataset(_local_path(name)):
            ds = _load_saved(name, split)
        else:
            path, kwargs = _builder_args(name, config, data_files)
            ds = datasets.load_dataset(path, split=split, **kwargs)
    except DatasetError:
        raise
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise DatasetError(f"trainer.dataset {name!r} (split {split!r}): {exc}") from None
    return [dict(r) for r in ds]


@contextlib.contextmanager
def _streaming_without_torch() -> Iterator[None]:
    """``datasets`` makes each streamed dataset a ``torch.utils.data.IterableDataset`` where torch is installed,
    importing torch (~1.5 CPU-s, most of a launch check's time); reading column names needs none of it. The flag
    is ``datasets``' own (``datasets.config.TORCH_AVAILABLE``), process-wide while this lasts; a streamed dataset
    made afterwards gets its torch parent class as usual."""
    from datasets import config

    before = config.TORCH_AVAILABLE
    config.TORCH_AVAILABLE = False
    try:
        yield
    finally:
        config.TORCH_AVAILABLE = before


def dataset_columns(name: str, split: str, *, config: str | None = None, data_files: Any = None) -> list[str]:
    """The column names of ``split``, reading as little as possible (a saved dataset's schema, or one
    streamed row). Raises :class:`DatasetError` for a local dataset that cannot be read; for a hub
    id that cannot be reached, whatever ``datasets`` raises (the caller decides if that is fatal)."""
    import datasets

    if is_local_dataset(name) and _is_saved_dataset(_local_path(name)):
        return list(_load_saved(name, split).column_names)
    path, kwargs = _builder_args(name, config, data_files)
    try:
        with _streaming_without_torch():
            stream = datasets.load_dataset(path, split=split, streaming=True, **kwargs)
            if stream.column_names:
                return list(stream.column_names)
            first = next(iter(stream), None)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        if is_local_dataset(name):
            raise DatasetError(f"trainer.dataset {name!r} (split {split!r}): {exc}") from None
        raise
    if first is None:
        raise DatasetError(f"trainer.dataset {name!r}: split {split!r} has no rows")
    return list(first)


__all__ = ["BUILDERS", "DatasetError", "dataset_columns", "is_local_dataset", "load_rows"]
