"""``"module:attr"`` references: the one loader, and name registries built on it.

Settings that name user code (a task factory, a hint source, a trainer or
executor implementation) use ``"package.module:attribute"``. Every such
setting is loaded by :func:`load_object`, so every one fails the same way: a
:class:`~composer_cloud.errors.BadReference` (a ``LookupError``) naming the
setting and saying what was wrong. :func:`resolve` takes a registered name or
a reference, for settings that accept both.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from composer_cloud.errors import BadReference

__all__ = ["BadReference", "is_reference", "load_object", "resolve"]


def is_reference(value: str) -> bool:
    """Whether ``value`` looks like ``"module:attr"`` (as opposed to a registered name)."""
    module, sep, attr = value.partition(":")
    return bool(sep and module and attr)


def load_object(reference: str, *, setting: str) -> Any:
    """Import ``module`` and return its ``attr`` for a ``"module:attr"`` reference.

    ``setting`` is the dotted name of the setting the reference came from; it
    is named in every error.
    """
    module, sep, attr = reference.partition(":")
    if not (sep and module and attr):
        raise BadReference(f"{setting}: {reference!r} is not of the form 'package.module:attribute'")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise BadReference(f"{setting}: cannot import module {module!r} ({exc}); is it on sys.path?") from None
    obj: Any = mod
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BadReference(f"{setting}: module {module!r} has no attribute {attr!r}") from None
    return obj


def reference_for(name: str, registry: Mapping[str, str], *, setting: str, kind: str | None = None) -> str:
    """The ``"module:attr"`` reference ``name`` stands for, without importing anything.

    A registered name maps to ``registry[name]``; a reference given directly
    is returned as it is. Anything else is a :class:`BadReference` listing the
    registered names. Settings checks (which must not import user code) call
    this; :func:`resolve` calls it and imports. ``kind`` names what is looked
    up in the error (default: the last part of ``setting``).
    """
    if name in registry:
        return registry[name]
    if is_reference(name):
        return name
    kind = kind or setting.rsplit(".", 1)[-1]
    raise BadReference(f"{setting}: unknown {kind} {name!r}; choose one of {sorted(registry)} "
                       "or give 'package.module:attribute'")


def resolve(name: str, registry: Mapping[str, str], *, setting: str, kind: str | None = None) -> Any:
    """A registered name (``registry[name]`` is a reference) or a reference given directly, imported."""
    return load_object(reference_for(name, registry, setting=setting, kind=kind), setting=setting)
