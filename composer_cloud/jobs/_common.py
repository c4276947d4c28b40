"""Helpers shared by the cloud executors (Modal, Hugging Face Jobs)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from composer_cloud import env as cc_env
from composer_cloud.images.container import FAILURE_TAIL_LINES, failure_message
from composer_cloud.spec import RunSpec

#: Non-secret JSON of ``spec.store_options`` for code that must open the store
#: before it can read the spec (the HF bootstrap; the replica may use it too).
STORE_OPTIONS_ENV = cc_env.STORE_OPTIONS

_EXIT_CODE = re.compile(r"exit(?:ed)?(?: with)? (?:status |code)[:= ]*(-?\d+)", re.IGNORECASE)


def run_id_of(run_uri: str) -> str:
    """``s3://bucket/prefix/run-1`` -> ``run-1`` (the run directory's name)."""
    tail = run_uri.rstrip("/").rsplit("/", 1)[-1]
    return tail.split("://", 1)[-1]


def scheme_of(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else "file"


def job_env(spec: RunSpec) -> dict[str, str]:
    """Environment variables every cloud replica job gets. Never holds a secret.

    ``spec.store_options`` cannot hold credentials (the spec validator rejects
    credential-like keys), so it may travel as plain environment.
    """
    env = {"PYTHONUNBUFFERED": "1"}
    if spec.store_options:
        env[STORE_OPTIONS_ENV] = json.dumps(spec.store_options, sort_keys=True)
    if spec.code.ref:  # the digest travels with the job, not only through the (untrusted) store
        env[cc_env.CODE_REF] = json.dumps(spec.code.ref, sort_keys=True)
    if spec.code.files:  # likewise the digests of the uploaded local files (in their keys)
        env[cc_env.FILES] = json.dumps(spec.code.files, sort_keys=True)
    return env


def parse_exit_code(message: str | None) -> int | None:
    """Find an exit code in a backend's failure message (``"... exit code: 3"``)."""
    if not message:
        return None
    m = _EXIT_CODE.search(message)
    return int(m.group(1)) if m else None




@dataclass(frozen=True)
class CostEstimate:
    """Dollars for ``jobs`` jobs of one executor (see :class:`~composer_cloud.jobs.base.LaunchPlan`).

    Attributes:
        hourly_usd: all jobs running for one hour.
        estimated_usd: all jobs running until their timeout, once.
        max_usd: all jobs running until their timeout on every attempt.
        basis: where the price came from (and when), or why there is none.
    """

    hourly_usd: float | None
    estimated_usd: float | None
    max_usd: float | None
    basis: str

    @classmethod
    def of(cls, *, jobs: int, price_per_job_hour_usd: float | None, timeout_s: float, attempts: int,
           basis: str) -> "CostEstimate":
        if price_per_job_hour_usd is None:
            return cls(None, None, None, basis)
        hourly = jobs * price_per_job_hour_usd
        once = hourly * timeout_s / 3600
        return cls(hourly, once, once * max(1, attempts), basis)

    def plan_fields(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~composer_cloud.jobs.base.LaunchPlan`."""
        return {"hourly_cost_usd": self.hourly_usd, "estimated_cost_usd": self.estimated_usd,
                "max_cost_usd": self.max_usd, "cost_basis": self.basis}


__all__ = ["FAILURE_TAIL_LINES", "STORE_OPTIONS_ENV", "CostEstimate", "failure_message", "job_env", "parse_exit_code",
           "run_id_of", "scheme_of"]
