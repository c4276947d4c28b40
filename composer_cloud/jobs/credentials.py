"""What an executor's launch needs on this machine: its SDK and its credentials, checked without a backend call.

Each executor class declares its own (:attr:`~composer_cloud.jobs.base.ServerlessExecutor.sdk`,
:meth:`~composer_cloud.jobs.base.ServerlessExecutor.check_credentials`), like SkyPilot's
``Cloud.check_credentials``; ``composer-cloud doctor`` and ``launch --dry-run`` ask every executor of a run
(``runs/doctor.py``). A :class:`Check` never carries a secret's value, only where it was found.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """One credential or SDK check: ``ok``, what was found, and the fix when it failed."""

    name: str
    ok: bool
    detail: str


def install_hint(*extras: str) -> str:
    """``pip install "composer-cloud[modal,s3]"``: the one spelling every message uses."""
    return f'pip install "composer-cloud[{",".join(extras)}]"'


def sdk_installed(module: str) -> bool:
    """Whether ``module`` can be imported here (found, not imported)."""
    return importlib.util.find_spec(module) is not None


__all__ = ["Check", "install_hint", "sdk_installed"]
