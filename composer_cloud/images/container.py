"""What runs inside a replica's container around the replica process.

This is the container side of the executors: the Modal function's body
(:func:`run_replica_body`) and the shape of a replica failure
(:class:`ReplicaFailed`, :func:`failure_message`). It imports only the
standard library and ``composer_cloud.errors`` (itself standard library only), so the launch side (``composer_cloud.jobs``) may import it
while nothing here imports the launch side: imports go ``jobs -> images`` only.

Invariant: a replica that exits non-zero raises :class:`ReplicaFailed`, which
carries the exit code and the last output lines and pickles by value, so it
crosses Modal's result channel intact and the launcher can show why.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from composer_cloud.errors import ExecutorError

logger = logging.getLogger(__name__)

#: How many trailing log lines a failed replica's status message carries.
FAILURE_TAIL_LINES = 20
#: Seconds a replica gets to exit after SIGTERM before its process group is killed.
TERMINATE_GRACE_S = 30.0


def failure_message(head: str, tail: Iterable[str]) -> str:
    """``head`` plus the last log lines, indented, for a FAILED replica status."""
    lines = [ln.rstrip("\n") for ln in tail if ln.strip()]
    if not lines:
        return head
    return head + "\nlast log lines:\n" + "\n".join(f"  | {ln}" for ln in lines)


class ReplicaFailed(ExecutorError):
    """A replica process exited non-zero. Picklable, so it crosses Modal intact."""

    def __init__(self, exit_code: int, tail: Sequence[str] = ()) -> None:
        self.exit_code = int(exit_code)
        self.tail = list(tail)
        super().__init__(self.exit_code, self.tail)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ReplicaFailed, (self.exit_code, self.tail))

    def __str__(self) -> str:
        return failure_message(f"replica exited with code {self.exit_code}", self.tail)


def run_replica_body(argv: Sequence[str], env: Mapping[str, str], *, tail_lines: int = FAILURE_TAIL_LINES,
                     out: Any = None) -> dict[str, Any]:
    """Run ``argv`` with ``os.environ | env`` to completion, echoing its output line by line.

    This is the body of the Modal function (stdout becomes the call's logs) and
    runs unchanged on a laptop. Returns ``{"exit_code": 0}``; raises
    :class:`ReplicaFailed` with the exit code and last ``tail_lines`` lines
    otherwise. If the function is interrupted (Modal cancels the input by
    raising into it), the replica's whole process group is terminated first.
    """
    out = out or sys.stdout
    argv = list(argv)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable  # the container's interpreter, whatever PATH says
    tail: deque[str] = deque(maxlen=tail_lines)
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            out.write(line + "\n")
            out.flush()
            tail.append(line)
        rc = proc.wait()
    finally:
        # Interrupted (cancellation raised into us) before the replica ended: take its children down too.
        if proc.poll() is None:
            terminate_group(proc)
    if rc != 0:
        raise ReplicaFailed(rc, list(tail))
    return {"exit_code": 0}


def terminate_group(proc: subprocess.Popen, grace_s: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace_s`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("replica process group %d ignored SIGTERM for %.0f s; killing it", proc.pid, grace_s)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    except ProcessLookupError:
        pass
