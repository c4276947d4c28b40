"""The one mapping of ``spec.max_restarts`` onto each executor's relaunch mechanism.

``max_restarts`` is how many times a replica job that exits non-zero (or
whose container dies) is started again; the relaunched replica rejoins the run
by loading the latest durable checkpoint and healing. Each backend has its own
mechanism, and this table is the only place that maps the setting onto them:

=========  ==========================================  ==============================================
executor   who relaunches                              relaunches of one replica
=========  ==========================================  ==============================================
local      the supervisor process (``jobs/local.py``)  ``max_restarts``
hf-jobs    the Jobs server (``run_job(attempts=...)``)  ``max_restarts`` (sent as ``attempts = n + 1``)
modal      Modal's retry policy (``modal.Retries``)    ``min(10, max(modal.retries, max_restarts))``
=========  ==========================================  ==============================================

Modal has a setting of its own (``[modal] retries``) and a cap of 10 retries;
the larger of the two settings wins so that ``max_restarts`` means at least
what it says on every executor, up to what Modal allows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from composer_cloud.spec import RunSpec

#: The most retries ``modal.Retries`` accepts.
MODAL_MAX_RETRIES = 10


def relaunches(spec: "RunSpec", executor: str) -> int:
    """How many times ``executor`` relaunches a failed replica job of ``spec`` (see the module table)."""
    if executor in ("local", "hf-jobs"):
        return spec.max_restarts
    if executor == "modal":
        return min(MODAL_MAX_RETRIES, max(spec.modal.retries, spec.max_restarts))
    raise ValueError(f"executor: unknown executor {executor!r} (no restart mapping)")


def attempts(spec: "RunSpec", executor: str) -> int:
    """Starts of one replica job at most, the first included: ``relaunches + 1`` (for cost bounds)."""
    return relaunches(spec, executor) + 1


__all__ = ["MODAL_MAX_RETRIES", "attempts", "relaunches"]
