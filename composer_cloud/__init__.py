"""composer-cloud: DiLoCo post-training across independent serverless jobs.

Replicas never talk to each other: they synchronise DiLoCo pseudo-gradients
through an object store (``file://``, ``s3://`` or any fsspec filesystem).

The library API (imported lazily, so ``import composer_cloud`` stays cheap)::

    import composer_cloud as cc
    run = cc.launch(overrides={"replicas": 2, "rounds": 2})
    print(cc.wait(run).state)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = {"Run", "RunStatus", "open_run", "launch", "resume", "cancel", "get_status", "wait", "plan", "build_spec",
        "check_launch", "list_runs", "read_metrics", "summarize"}


def __getattr__(name: str) -> Any:
    if name in _API or name == "runs":  # ``cc.runs.read_metrics`` as well as ``cc.read_metrics``
        import importlib

        runs = importlib.import_module("composer_cloud.runs")  # not `from composer_cloud import runs`: it asks here
        return runs if name == "runs" else getattr(runs, name)
    raise AttributeError(f"module 'composer_cloud' has no attribute {name!r}")


__all__ = sorted(_API)
