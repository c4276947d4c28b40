"""``wait``: follow a run until it is no longer running, and return its final status (exit codes settled)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from composer_cloud.errors import StoreError
from composer_cloud.retry import PollPolicy, poll_until
from composer_cloud.runs.states import RunState
from composer_cloud.runs.status import RunStatus, StatusTracker
from composer_cloud.storage.run import Run, open_run

logger = logging.getLogger(__name__)


#: Seconds ``wait`` keeps polling a finished run for the exit codes of failed replicas: a replica's failed
#: heartbeat is written before its job exits, and the executor records the exit code after it.
EXIT_CODE_SETTLE_S = 10.0


def wait(run: Run | str, *, timeout_s: float | None = None, interval_s: float = 1.0,
         on_update: Callable[[RunStatus], None] | None = None,
         storage_options: Mapping[str, Any] | None = None) -> RunStatus:
    """Poll the run every ``interval_s`` until it is no longer running; return its final status.

    ``on_update`` sees every status (for progress displays). Raises
    ``TimeoutError`` after ``timeout_s`` (None: no limit). A run whose failed replicas have no exit code yet
    is polled up to :data:`EXIT_CODE_SETTLE_S` more, so the final status carries the real exit codes.
    """
    run = run if isinstance(run, Run) else open_run(run, storage_options=storage_options)
    last: list[RunStatus] = []
    tracker = StatusTracker(run)
    settle: list[float] = []

    def finished() -> RunStatus | None:
        try:
            st = tracker.poll()
        except StoreError as exc:
            # The store may be down for a while (replicas ride outages out too): report and keep watching.
            if not last:
                raise
            st = dataclasses.replace(last[-1], store_error=f"{type(exc).__name__}: {exc}")
            if last[-1].store_error is None:
                logger.warning("cannot read run %s from its store (%s); still watching", run.uri, exc)
        last[:] = [st]
        if on_update is not None:
            on_update(st)
        if st.state == RunState.RUNNING or st.store_error:
            return None
        if any(i.state == "failed" and i.exit_code is None for i in st.replicas):
            settle[:] = settle or [time.monotonic() + EXIT_CODE_SETTLE_S]
            if time.monotonic() < settle[0]:
                return None
        return st

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    return poll_until(finished, deadline=deadline, policy=PollPolicy(initial_s=interval_s, max_s=interval_s),
                      on_timeout=lambda waited: TimeoutError(f"run {run.uri} still running after {waited:.0f}s"))


__all__ = ["EXIT_CODE_SETTLE_S", "wait"]
