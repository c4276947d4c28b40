"""The one retry policy and the one polling loop of composer-cloud.

* :class:`RetryPolicy` retries a call that failed with a *transient* error
  (the caller says which errors are transient) with exponential backoff and
  full jitter. Non-transient errors propagate at once.
* :func:`poll_until` repeats a cheap probe until it yields a value or a
  deadline passes, with capped exponential backoff between probes. Every wait
  in the package (records in the store, a job's state) goes through it, so a
  wait always has a deadline (``deadline=None`` only where a human is
  watching and can press Ctrl-C).

Times are seconds; deadlines are ``time.monotonic()`` values.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     getattr(errno, "EREMOTEIO", errno.EIO), errno.EIO}
_TRANSIENT_NAMES = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                    "ClientConnectorError", "ServerDisconnectedError", "ClientOSError"}


def is_transient(exc: BaseException) -> bool:
    """Whether an I/O error (filesystem, HTTP, S3 through s3fs/botocore) is worth retrying.

    Missing, existing, forbidden: never (retrying cannot change the answer).
    Connection and timeout errors, and the errnos s3fs maps throttling and
    5xx answers to: yes. Errors of our own (e.g. ``StoreError``) are not
    ``OSError`` and are never retried.
    """
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return type(exc).__name__ in _TRANSIENT_NAMES


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: before retry ``k`` sleep ~U(0, min(cap_s, base_s * 2**k)).

    Attributes:
        attempts: total calls, the first included (``1`` = no retry).
        base_s: backoff scale of the first retry.
        cap_s: largest single sleep.
    """

    attempts: int = 6
    base_s: float = 0.1
    cap_s: float = 5.0

    def call(self, what: str, fn: Callable[[], T], *,
             transient: Callable[[BaseException], bool] = is_transient) -> T:
        """Call ``fn``; retry while it raises an error ``transient`` accepts, up to ``attempts`` calls."""
        for attempt in range(self.attempts):
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified by ``transient``
                if not transient(exc) or attempt == self.attempts - 1:
                    raise
                delay = random.uniform(0, min(self.cap_s, self.base_s * 2**attempt))
                logger.warning("transient error on %s (%s: %s); retry %d/%d in %.2fs",
                               what, type(exc).__name__, exc, attempt + 1, self.attempts - 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class PollPolicy:
    """How :func:`poll_until` spaces its probes: ``initial_s``, times ``factor`` each time, at most ``max_s``."""

    initial_s: float = 0.01
    max_s: float = 0.5
    factor: float = 1.5


def poll_until(
    probe: Callable[[], T | None],
    *,
    deadline: float | None,
    on_timeout: Callable[[float], BaseException],
    policy: PollPolicy = PollPolicy(),
    between: Callable[[int], None] | None = None,
) -> T:
    """Call ``probe`` until it returns something other than ``None``; return that.

    Args:
        probe: a cheap check; ``None`` means "not yet".
        deadline: ``time.monotonic()`` value after which :func:`on_timeout`'s
            exception is raised (``None``: no deadline).
        on_timeout: builds the exception to raise from the seconds waited.
        policy: spacing of the probes.
        between: called with the number of failed probes so far after each
            failed probe; it may raise to stop the wait early (e.g. the round
            was aborted by a peer).
    """
    start = time.monotonic()
    delay = policy.initial_s
    failed = 0
    while True:
        found = probe()
        if found is not None:
            return found
        failed += 1
        if between is not None:
            between(failed)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise on_timeout(now - start)
        sleep = delay if deadline is None else min(delay, max(0.0, deadline - now))
        time.sleep(sleep)
        delay = min(policy.max_s, delay * policy.factor)
