"""Following a run from the terminal until it ends (``launch`` and ``resume`` attached); Ctrl-C detaches."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.live import Live

from composer_cloud import cli_views, runs
from composer_cloud.runs import Run, RunState, RunStatus

def follow(run: Run, *, console: Console | None) -> RunStatus:
    """Poll ``run`` (every second) until it is no longer running; return its final status.

    With ``console``, a live status table on it. Ctrl-C raises ``KeyboardInterrupt`` at the next poll
    (:func:`ctrl_c_between_polls`); the caller says the run goes on and how to follow it.
    """
    with ctrl_c_between_polls() as check:
        if console is None:
            return runs.wait(run, on_update=lambda st: check())
        status = runs.get_status(run)
        with Live(cli_views.status_table(status), console=console, refresh_per_second=2, transient=False) as live:
            def update(st: RunStatus) -> None:
                check()
                live.update(cli_views.status_table(st))

            final = runs.wait(run, on_update=update)
        if not console.is_terminal:  # to a file or a pipe, Live leaves its last line unterminated
            console.line()
        return final


@contextmanager
def ctrl_c_between_polls() -> Iterator[Callable[[], None]]:
    """Ctrl-C sets a flag; the returned check raises ``KeyboardInterrupt`` at the next status poll (about 1 s).

    A KeyboardInterrupt raised wherever the main thread happens to be can land inside rich's ``Live`` while
    its console lock is held; ``Live.stop()`` then waits forever on its refresh thread, and the terminal
    neither detaches nor says so. Between two polls nothing is held. A second Ctrl-C raises at once. (Off the
    main thread, where no handler can be set, the check does nothing and Ctrl-C behaves as Python's default.)
    """
    pressed = threading.Event()

    def check() -> None:
        if pressed.is_set():
            raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield check
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if pressed.is_set():  # a second Ctrl-C: at once, wherever the main thread is
            raise KeyboardInterrupt
        pressed.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)


def follow_to_end(run: Run, *, console: Console, err_console: Console, as_json: bool) -> int:
    """``wait`` and ``status --wait``: follow ``run`` to its end; the exit code is its outcome (0 completed,
    1 failed or cancelled, 130 Ctrl-C: the run goes on). ``as_json``: the final status as JSON on stdout."""
    import json
    import sys

    try:
        st = follow(run, console=None if as_json else console)
    except KeyboardInterrupt:
        err_console.print(f"stopped watching: the run continues; cancel with: composer-cloud cancel {run.uri}",
                          highlight=False)
        return 130
    if as_json:
        sys.stdout.write(json.dumps(cli_views.status_json(st), indent=2) + "\n")
    return 0 if st.state == RunState.COMPLETED else 1
