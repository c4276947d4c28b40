"""A run spec's validation errors for people: every error at once, each naming its field, an unknown key
blamed on what gave it (``--set`` or the file) with the closest known key.

``spec.spec_from_dict`` turns pydantic's ``ValidationError`` into one
:class:`~composer_cloud.errors.SpecError` here (nothing here knows the spec's fields but through ``root``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from composer_cloud.errors import SpecError


def _fields_at(root: Any, loc: tuple[Any, ...]) -> list[str]:
    """The field names of the spec table at ``loc`` (``("sync",)`` -> SyncSpec's), for "did you mean"."""
    model: Any = root
    for part in loc:
        field = getattr(model, "model_fields", {}).get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(getattr(model, "model_fields", {}))


def _one_error(err: Any, source: str, given: frozenset[str], root: Any) -> SpecError:
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, SpecError):  # a cross-field check that names its field itself
        return cause
    field = ".".join(str(p) for p in err["loc"]) or "<spec>"
    msg = str(err["msg"]).removeprefix("Value error, ")  # pydantic's prefix says nothing to a user
    if err["type"] == "extra_forbidden":
        import difflib

        # Blame what gave the key: a --set / override, or the file (or defaults, which never have one).
        where = "--set" if field in given or any(field.startswith(g + ".") for g in given) else source
        msg = f"unknown key (given by {where})"
        close = difflib.get_close_matches(str(err["loc"][-1]), _fields_at(root, tuple(err["loc"][:-1])), n=1)
        if close:
            msg += f"; did you mean {'.'.join([*map(str, err['loc'][:-1]), close[0]])}?"
    elif "input" in err and err["type"] not in ("missing", "value_error") and err["loc"][:1] != ("store_options",):
        # Custom validators already say what is wrong; never echo store options (a rejected credential).
        msg = f"{msg} (got {err['input']!r})"
    return SpecError(field, msg)


def error_from_validation(exc: ValidationError, source: str, given: frozenset[str] = frozenset(), *,
                          root: Any) -> SpecError:
    """One :class:`SpecError` naming the first field, its message listing every error of the spec (a user
    fixes them all at once). ``given``: dotted keys set by ``--set``/overrides (so an unknown one is blamed
    on them, not on the file); ``root``: the spec's model class (its tables give the "did you mean")."""
    errors = [_one_error(err, source, given, root) for err in exc.errors()]
    first = errors[0]
    if len(errors) == 1:
        return first
    rest = "; ".join(str(e) for e in errors[1:])
    message = str(first).removeprefix(f"{first.field}: ") if first.field else str(first)
    return SpecError(first.field, f"{message} (and {len(errors) - 1} more: {rest})")


__all__ = ["error_from_validation"]
