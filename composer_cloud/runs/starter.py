"""``composer-cloud init``: a starter run spec with every setting at its default, commented.

The text is generated from :class:`~composer_cloud.spec.RunSpec` and the default trainer's settings class, so
it cannot drift from the defaults: loading it gives the default spec (``tests/test_cli.py`` checks that).
Settings without a default value (unset), the outer optimizer (its defaults depend on ``sync.mode``), the
trainer's keys and what ``launch`` sets itself are written as comments.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from composer_cloud.spec import RunSpec

#: Settings never written: set by launch (code.ref, code.files), generated (run_id).
_LEFT_OUT = {"run_id", "code.ref", "code.files"}
#: Tables written as comments: their defaults depend on other settings.
_COMMENTED = {"outer_optimizer": "defaults depend on sync.mode (lock-step: lr 0.7, momentum 0.9; decoupled: 1.0, 0.3)"}


def _toml(value: Any) -> str:
    """A TOML literal of a JSON-able default (strings, numbers, booleans, lists, inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def _table(lines: list[str], name: str, data: dict[str, Any], *, comment: bool = False) -> None:
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict) or not v or k == "store_options"}
    tables = {k: v for k, v in data.items() if k not in scalars}
    if name:
        lines += ["", f"{'# ' if comment else ''}[{name}]"]
        if name in _COMMENTED:
            lines.append(f"# {_COMMENTED[name]}")
    for key, value in scalars.items():
        dotted = f"{name}.{key}" if name else key
        if dotted in _LEFT_OUT:
            continue
        if value is None:
            lines.append(f"# {key} =               # unset by default")
        else:
            lines.append(f"{'# ' if comment else ''}{key} = {_toml(value)}")
    for key, value in tables.items():
        _table(lines, f"{name}.{key}" if name else key, value, comment=comment or key in _COMMENTED)


def starter_spec() -> str:
    """The starter spec's TOML text (every key optional; each line is its default)."""
    from composer_cloud.trainer.settings import settings_class

    spec = RunSpec().to_json_dict()
    trainer = spec.pop("trainer")
    lines = ["# A composer-cloud run spec with every setting at its default (composer-cloud init).",
             "# Every key is optional: delete what you do not change. Launch it with",
             "#   composer-cloud launch --config <this file> --dry-run",
             "# run_id is generated at launch (or give --run-id)."]
    _table(lines, "", spec)
    lines += ["", "[trainer]", f"name = {_toml(trainer['name'])}",
              "# the trainer's own keys with their defaults (docs/trainer.md, docs/datasets.md):"]
    for f in dataclasses.fields(settings_class(trainer["name"])):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        value = trainer.get(f.name, default)
        lines.append(f"# {f.name} = {_toml(value)}" if value is not None else f"# {f.name} =               # unset")
    return "\n".join(lines) + "\n"


__all__ = ["starter_spec"]
