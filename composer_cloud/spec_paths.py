"""Spec settings that may name a local file or folder, and replacing their values.

``launch`` ships such files to cloud replicas and records verified copies; each replica then runs the spec
with the paths of its local copies (:mod:`composer_cloud.replica.usercode`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from composer_cloud.spec import RunSpec, spec_from_dict

#: Settings whose value may name a local file or folder (``trainer.data_files`` entries: ``trainer.data_files.<i>``);
#: ``launch`` ships them to cloud replicas, which use verified local copies.
_PATH_SETTING = re.compile(r"model\.name|trainer\.(pairs|dataset)|trainer\.data_files\.\d{1,4}")


def is_path_setting(name: str) -> bool:
    """Whether ``name`` (``trainer.data_files.<i>`` for one entry) is a setting that may name a local path."""
    return _PATH_SETTING.fullmatch(name) is not None


def with_paths(spec: RunSpec, values: dict[str, str], *, source: str) -> RunSpec:
    """``spec`` with each path setting of ``values`` replaced (``trainer.data_files.<i>`` replaces one entry)."""
    return spec_from_dict(apply_spec_paths(spec.to_json_dict(), values), source=source)


def apply_spec_paths(spec_dict: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a spec's JSON with each dotted setting of ``values`` replaced (``trainer.data_files.<i>``
    replaces one entry of the list)."""
    out = copy.deepcopy(spec_dict)
    for setting, value in values.items():
        parts = setting.split(".")
        if parts[0] == "model":
            out["model"][parts[1]] = value
        elif len(parts) == 3:  # trainer.data_files.<i>
            files = out["trainer"][parts[1]]
            if isinstance(files, str):
                out["trainer"][parts[1]] = value
            else:
                files[int(parts[2])] = value
        else:
            out["trainer"][parts[1]] = value
    return out


__all__ = ["apply_spec_paths", "is_path_setting", "with_paths"]
