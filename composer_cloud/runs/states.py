"""A run's state: the one vocabulary of ``status``, ``ls``, ``wait`` and the library API.

Derived by :meth:`composer_cloud.runs.status.StatusTracker.poll` from the store and the executors, in this
order (the first that holds):

================  ==========================================================================================
state             when
================  ==========================================================================================
``cancelled``     ``control/cancel.json`` exists (``cancel`` asked for it)
``completed``     the final round's global state is durable, and every replica job ended (or none is known)
``failed``        every replica job ended, and the final round's state is not durable
``not started``   the run was written, but no replica job was recorded and none ever sent a heartbeat
``running``       anything else
``unreadable``    ``ls`` only: the run's records could not be read
================  ==========================================================================================

A :class:`RunState` is a ``str`` (``enum.StrEnum``): JSON output, comparisons with the strings above and the
CLI's tables are what they were when the state was a plain string.
"""

from __future__ import annotations

import enum


class RunState(enum.StrEnum):
    """The state of one run (see the module's table)."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    NOT_STARTED = "not started"
    UNREADABLE = "unreadable"

    @property
    def is_terminal(self) -> bool:
        """Whether nothing will change it without a command (``resume``, ``rm``): every state but running."""
        return self is not RunState.RUNNING


__all__ = ["RunState"]
