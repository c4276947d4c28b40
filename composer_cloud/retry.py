"""The one retry policy and the one polling loop of composer-cloud.

* :func:`is_transient` says which I/O errors are worth retrying (the default
  classifier of :meth:`RetryPolicy.call`).
* :class:`RetryPolicy` retries a call that failed with a *transient* error
  (the caller says which errors are transient) with exponential backoff and
  full jitter. Non-transient errors propagate at once. With ``budget_s > 0``
  it keeps retrying past ``attempts`` until the outage has lasted
  ``budget_s`` seconds: that is how a replica rides out a store outage.
* :class:`Outage` is the shared memory of such an outage: when it started
  and how many errors it cost, so that N threads hitting one dead endpoint
  log once when it starts and once when it ends, and all of them give up at
  the same moment (``start + budget_s``), not ``budget_s`` after each call.
* :func:`poll_until` repeats a cheap probe until it yields a value or a
  deadline passes, with capped exponential backoff between probes;
  :func:`wait_until` is the same for a yes/no condition. The waits of the
  store and the sync layer go through them, so such a wait always has a
  deadline (``deadline=None`` only where a human is watching and can press
  Ctrl-C).

Times are seconds; deadlines are ``time.monotonic()`` values.
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     errno.ECONNABORTED, errno.EPIPE, getattr(errno, "EREMOTEIO", errno.EIO), errno.EIO}
# Exception classes (matched by name anywhere in the MRO, so that neither botocore nor aiohttp must be
# importable here) that mean "the request did not complete": connection refused/reset/closed, timeouts,
# an unparsable (e.g. truncated) response.
_TRANSIENT_NAMES = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                    "HTTPClientError", "ResponseParserError", "ClientConnectionError", "ClientConnectorError",
                    "ServerDisconnectedError", "ClientOSError", "ClientPayloadError", "ServerTimeoutError",
                    "IncompleteRead"}
# S3 error codes that a later identical request can succeed on.
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeoutException",
                    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests",
                    "ConditionalRequestConflict", "OperationAborted", "BandwidthLimitExceeded"}


def http_error_of(exc: BaseException) -> tuple[int | None, str | None] | None:
    """``(HTTP status, S3 error code)`` of a botocore ``ClientError`` in ``exc`` or its causes, else ``None``.

    s3fs translates ``ClientError`` into ``OSError``/``FileExistsError`` and
    keeps the original as ``__cause__``; the status code is what the server
    really said, the errno is only s3fs's guess.
    """
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 5:
        response = getattr(cur, "response", None)
        if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            code = (response.get("Error") or {}).get("Code")
            return (int(status) if status is not None else None), (str(code) if code is not None else None)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
        seen += 1
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether an I/O error (filesystem, HTTP, S3 through s3fs/botocore) is worth retrying.

    * An answer from an S3 server decides by its status: 5xx, 408, 429 and
      the throttling/conflict codes are transient; every other 4xx is not
      (retrying cannot change "denied", "missing", "exists").
    * Missing, existing, forbidden (as Python exceptions): never.
    * Connection and timeout errors, unparsable responses, and the errnos
      that mean "try again": yes.

    Errors of our own (e.g. ``StoreError``) are not ``OSError`` and are never
    retried.
    """
    http = http_error_of(exc)
    if http is not None:
        status, code = http
        return (code in _TRANSIENT_CODES or status in (408, 429)
                or (status is not None and status >= 500 and code not in {"NotImplemented"}))
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__)


class Outage:
    """Thread-safe record of one ongoing run of transient failures of a resource (e.g. a store).

    :meth:`failed` is called on every transient error and returns when the
    outage started; :meth:`recovered` on every success. The first failure
    after a success logs one warning, the first success after failures logs
    one more with the duration and the error count; individual retries log
    at debug level only.
    """

    def __init__(self, name: str, *, budget_s: float = 0.0) -> None:
        self.name = name
        self.budget_s = budget_s
        self._lock = threading.Lock()
        self._since: float | None = None
        self._errors = 0

    @property
    def since(self) -> float | None:
        """``time.monotonic()`` at the first error of the ongoing outage, or ``None``."""
        return self._since

    def failed(self, what: str, exc: BaseException) -> float:
        """Note a transient error of ``what``; return the outage's start (monotonic seconds)."""
        with self._lock:
            self._errors += 1
            if self._since is None:
                self._since = time.monotonic()
                budget = f"retrying for up to {self.budget_s:.0f}s" if self.budget_s > 0 else "retrying briefly"
                logger.warning("%s: transient error on %s (%s: %s); %s", self.name, what, type(exc).__name__,
                               exc, budget)
            return self._since

    def recovered(self) -> None:
        """Note a success; ends (and logs the end of) an ongoing outage."""
        if self._since is None:  # fast path, no lock: the common case
            return
        with self._lock:
            if self._since is None:
                return
            logger.warning("%s: reachable again after %.1fs (%d transient errors)", self.name,
                           time.monotonic() - self._since, self._errors)
            self._since = None
            self._errors = 0


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: before retry ``k`` sleep ~U(0, min(cap_s, base_s * 2**k)).

    Attributes:
        attempts: calls at least made, the first included (``1`` = no retry).
        base_s: backoff scale of the first retry.
        cap_s: largest single sleep.
        budget_s: outage budget. ``0``: give up after ``attempts`` calls
            (a few seconds: one-shot commands). ``> 0``: also keep retrying
            until ``budget_s`` seconds have passed since the outage began
            (the call's first error, or the shared :class:`Outage`'s start);
            the last sleep is clipped so the call ends near that deadline.
    """

    attempts: int = 6
    base_s: float = 0.1
    cap_s: float = 5.0
    budget_s: float = 0.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if not (self.budget_s >= 0 and self.budget_s != float("inf")):
            raise ValueError(f"RetryPolicy.budget_s must be a finite number >= 0, got {self.budget_s}")

    def call(self, what: str, fn: Callable[[], T], *,
             transient: Callable[[BaseException], bool] = is_transient, outage: Outage | None = None) -> T:
        """Call ``fn``; retry while it raises an error ``transient`` accepts (see the class doc for how long).

        ``outage`` (optional) is shared by the calls to one resource: it
        carries the outage's start and does the once-per-outage logging.
        """
        first_error: float | None = None
        attempt = 0
        while True:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - classified by ``transient``
                if not transient(exc):
                    raise
                now = time.monotonic()
                since = outage.failed(what, exc) if outage is not None else now
                if first_error is None:
                    first_error = now
                start = min(since, first_error)
                attempt += 1
                left = start + self.budget_s - now
                if attempt >= self.attempts and left <= 0:
                    raise
                delay = random.uniform(0, min(self.cap_s, self.base_s * 2 ** min(attempt - 1, 30)))
                if attempt >= self.attempts:
                    delay = min(delay, left)
                if outage is None:
                    logger.warning("transient error on %s (%s: %s); retry %d in %.2fs", what,
                                   type(exc).__name__, exc, attempt, delay)
                else:
                    logger.debug("transient error on %s (%s: %s); retry %d in %.2fs", what,
                                 type(exc).__name__, exc, attempt, delay)
                time.sleep(delay)
                continue
            if outage is not None:
                outage.recovered()
            return result


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


class _Deadline(Exception):
    pass


def wait_until(condition: Callable[[], bool], *, deadline: float, policy: PollPolicy = PollPolicy(),
               between: Callable[[int], None] | None = None) -> bool:
    """Poll ``condition`` until it holds (True) or ``deadline`` (a ``time.monotonic()`` value) passes (False).

    ``between`` as for :func:`poll_until` (it may raise to stop the wait early).
    """
    try:
        return poll_until(lambda: True if condition() else None, deadline=deadline, policy=policy, between=between,
                          on_timeout=lambda waited: _Deadline())
    except _Deadline:
        return False
