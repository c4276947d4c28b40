"""Runs as a library: open, launch, resume, cancel, inspect and wait, from Python or a notebook.

``composer-cloud`` (the CLI) is a thin layer over these functions.
"""

from composer_cloud.runs.lifecycle import (
    CancelResult,
    LaunchCheck,
    LaunchError,
    LaunchInterrupted,
    ResumeResult,
    RemoveResult,
    RunExists,
    build_spec,
    cancel,
    check_launch,
    get_status,
    launch,
    plan,
    remove,
    resume,
    wait,
)
from composer_cloud.runs.listing import RunListing, list_runs
from composer_cloud.runs.states import RunState
from composer_cloud.runs.status import ReplicaInfo, RunStatus, read_metrics
from composer_cloud.runs.summary import RunSummary, summarize
from composer_cloud.storage.run import Run, RunNotFound, load_handles, normalize_run_uri, open_run

__all__ = [
    "CancelResult",
    "LaunchCheck",
    "LaunchError",
    "LaunchInterrupted",
    "ReplicaInfo",
    "ResumeResult",
    "Run",
    "RemoveResult",
    "RunExists",
    "RunListing",
    "RunNotFound",
    "RunState",
    "RunStatus",
    "RunSummary",
    "build_spec",
    "cancel",
    "check_launch",
    "get_status",
    "launch",
    "remove",
    "list_runs",
    "load_handles",
    "normalize_run_uri",
    "open_run",
    "plan",
    "read_metrics",
    "resume",
    "summarize",
    "wait",
]
