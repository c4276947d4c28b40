"""Field checks shared by the records' parsers: each raises :class:`~composer_cloud.errors.BadObject` naming
the key and the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from composer_cloud.errors import BadObject

SHA256 = re.compile(r"[0-9a-f]{64}")

def is_int(value: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_object(obj: Any, key: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BadObject(key, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def int_field(obj: Mapping[str, Any], name: str, key: str, *, lo: int = 0) -> int:
    v = obj.get(name)
    if not is_int(v) or v < lo:
        raise BadObject(key, f"field {name!r} must be an integer >= {lo}, got {v!r:.40}")
    return v


def float_field(obj: Mapping[str, Any], name: str, key: str) -> float:
    v = obj.get(name)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise BadObject(key, f"field {name!r} must be a finite number, got {v!r:.40}")
    return float(v)


def sha256_field(obj: Mapping[str, Any], name: str, key: str) -> str:
    v = obj.get(name)
    if not isinstance(v, str) or not SHA256.fullmatch(v):
        raise BadObject(key, f"field {name!r} must be a sha256 hex digest")
    return v


def rank_list(value: Any, *, key: str, name: str, replicas: int | None, sorted_unique: bool = True) -> list[int]:
    """A list of ranks: ints in ``[0, replicas)`` (``replicas=None``: just ``>= 0``)."""
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise BadObject(key, f"field {name!r} must be a list of integer ranks, got {value!r:.80}")
    bad = [v for v in value if v < 0 or (replicas is not None and v >= replicas)]
    if bad:
        raise BadObject(key, f"field {name!r} has ranks {bad[:8]} outside [0, {replicas})")
    if sorted_unique and any(b <= a for a, b in zip(value, value[1:])):
        raise BadObject(key, f"field {name!r} must be sorted and unique, got {value[:16]}")
    return list(value)


def check_position(obj: Mapping[str, Any], *, key: str, **want: int) -> None:
    """The record names the position it is stored at (``round=``, ``attempt=``...): one copied elsewhere is refused."""
    for name, expected in want.items():
        if obj.get(name) != expected:
            raise BadObject(key, f"field {name!r} is {obj.get(name)!r:.40}, expected {expected} (a record copied "
                                 "from another round or attempt, or none at all)")
