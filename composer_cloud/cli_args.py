"""The command line's own value syntax: ``--set KEY=VALUE`` and ``--store-option KEY=VALUE`` pairs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def storage_options(pairs: list[str] | None) -> dict[str, Any] | None:
    """``--store-option KEY=VALUE`` pairs as fsspec options (None when none); ``ValueError`` for a bad pair."""
    if not pairs:
        return None
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--store-option {pair!r}: use KEY=VALUE")
        options[key] = value
    return options


def parse_value(raw: str) -> Any:
    """A --set value: JSON, else a TOML value (1e-4, true, [1, 2], 'x'), else the string itself."""
    import tomllib

    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        pass
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def set_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs as dotted overrides, values typed (:func:`parse_value`); ``ValueError``."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"--set {pair!r}: use KEY=VALUE, e.g. --set sync.codec=bf16")
        out[key] = parse_value(value.strip())
    return out


def writable_dir(out: Path) -> None:
    """``--out`` must be a directory this process can create and write in: say so before any work."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is an existing file; give a directory (new or empty)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".composer-cloud-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({exc.strerror or exc}); choose a directory you can write "
                         "to") from None


__all__ = ["parse_value", "set_overrides", "storage_options", "writable_dir"]
