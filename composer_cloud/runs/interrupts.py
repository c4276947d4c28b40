"""Ctrl-C while a launch writes its run or starts its jobs: what was left, and when the interrupt may land.

``runs/lifecycle.launch`` raises :class:`LaunchInterrupted` (a ``KeyboardInterrupt``) saying whether the run
was written and whether any job started; :func:`sigint_after` makes starting an executor's jobs and recording
their handles one step for Ctrl-C.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class LaunchInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) while :func:`launch` was writing the run or starting its jobs.

    ``written``: the run's spec is in the store (``status`` says "not started" until a job starts;
    ``resume`` starts it, ``rm`` deletes it); ``started``: at least one replica job was started (the
    run goes on; ``cancel`` stops it). Neither: nothing of the run was left in the store.
    """

    def __init__(self, run_uri: str, *, written: bool, started: bool) -> None:
        super().__init__(run_uri)
        self.run_uri = run_uri
        self.written = written
        self.started = started

    def advice(self) -> str:
        """What the person who pressed Ctrl-C should know, one line."""
        uri = self.run_uri
        if self.started:
            return (f"interrupted: replicas of run {uri} were started and go on; cancel with: composer-cloud cancel "
                    f"{uri}; follow with: composer-cloud status {uri}")
        if self.written:
            return (f"interrupted before any replica started: run {uri} is written but not started; start it with: "
                    f"composer-cloud resume {uri}; delete it with: composer-cloud rm {uri}")
        return "interrupted: nothing was launched and nothing of the run was left in the store"


@contextmanager
def sigint_after() -> Iterator[None]:
    """Ctrl-C (SIGINT) inside the block is raised as ``KeyboardInterrupt`` when the block ends, not in it.

    Starting an executor's jobs and recording their handles is one step for Ctrl-C: a job is never left
    running without its handle in the store (status would call the run "not started", and `resume` would
    start a second job beside it). Off the main thread (no signal handler can be set) it does nothing.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


__all__ = ["LaunchInterrupted", "sigint_after"]
