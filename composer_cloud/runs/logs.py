"""Replica logs of a run, all replicas at once: merged by time, tailed, filtered, followed.

Every executor's ``logs(handle, follow=...)`` yields a job's lines from the
start (a local file, HF Jobs' SSE stream, Modal's log service); this module
adds, the same way for all of them:

* ``tail``: the last N lines of each replica;
* ``since``: lines at or after a time (replica lines start with a UTC ISO
  timestamp; a line without one, e.g. a traceback, takes the time of the line
  before it);
* merging: without ``follow`` the replicas' lines are merged by time; with
  ``follow`` one thread per replica reads its stream and lines are printed
  as they arrive (history first, merged by time);
* no terminal control: a job's output is not trusted (a log file in a store
  folder can be written by anyone who can write the store), so escape
  sequences (CSI, OSC, ...) and other control characters are removed from
  every line before it is shown (:func:`printable`): a log line cannot move
  the cursor, rewrite the screen or the window title, or set the clipboard.
"""

from __future__ import annotations

import datetime as _dt
import heapq
import queue
import re
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from composer_cloud.jobs import JobHandle, get_executor, trusted_handles
from composer_cloud.storage.run import Run, load_handles

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d)(?:[.,](\d{1,6}))?(Z)?")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
# ECMA-48: CSI (ESC [ or 0x9b ... final byte), OSC/DCS/SOS/PM/APC strings (to BEL or ST), two-byte ESC sequences.
_ESCAPES = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
                      r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                      r"|\x1b[ -/]*[0-~]?")
# Every other C0/C1 control but tab (a carriage return would let a line overwrite what came before it).
_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def printable(line: str) -> str:
    """``line`` without terminal escape sequences and control characters (tabs kept)."""
    return _CONTROLS.sub("", _ESCAPES.sub("", line))


@dataclass(frozen=True)
class LogLine:
    rank: int
    line: str
    #: UTC seconds since the epoch, from the line's timestamp (or the one before it); None if none yet
    time: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def line_time(line: str) -> float | None:
    """The UTC time a replica log line starts with (``2026-01-02T03:04:05.678Z``), else None."""
    m = _STAMP.match(line)
    if not m:
        return None
    frac = (m.group(3) or "0").ljust(6, "0")
    try:
        t = _dt.datetime.fromisoformat(f"{m.group(1)}T{m.group(2)}.{frac}")
    except ValueError:
        return None
    return t.replace(tzinfo=_dt.timezone.utc).timestamp()


def parse_since(value: str, *, now: float | None = None) -> float:
    """``--since``: a duration back from now (``90s``, ``10m``, ``2h``, ``1d``) or an ISO time (UTC unless given)."""
    v = value.strip()
    m = _DURATION.match(v)
    if m:
        scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        base = _dt.datetime.now(_dt.timezone.utc).timestamp() if now is None else now
        return base - float(m.group(1)) * scale
    try:
        t = _dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {value!r}: use a duration (30s, 10m, 2h, 1d) or an ISO time "
                         "(2026-01-02T03:04:05)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return t.timestamp()


#: A replica's logging line: ``<UTC stamp> r<rank> <LEVEL> <logger>: <message>`` (replica/__main__.py).
_RECORD = re.compile(r"^\S+ r\d+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): ")
_RANK_TOKEN = re.compile(r"^(\S+) r\d+ ")


def is_ours(line: str, previous: bool) -> bool:
    """Whether ``logs`` shows ``line`` without ``--verbose``: composer-cloud's own records, any library's
    warnings and errors, and lines without a record header (tracebacks, prints) after a shown one.
    ``previous``: whether the line before was shown."""
    m = _RECORD.match(line)
    if m is None:
        return previous
    return m.group(2).startswith("composer_cloud") or m.group(1) in ("WARNING", "ERROR", "CRITICAL")


def without_rank(line: str) -> str:
    """The line without the replica's own ``r<rank>`` token (``logs`` prefixes every line with ``[r<rank>]``)."""
    return _RANK_TOKEN.sub(r"\1 ", line, count=1) if _RECORD.match(line) else line


def _stamped(rank: int, lines: Iterator[str], last: list[float | None], verbose: bool = True) -> Iterator[LogLine]:
    shown = True
    for raw in lines:
        line = printable(raw)
        t = line_time(line)
        if t is not None:
            last[0] = t
        if not verbose:
            shown = is_ours(line, shown)
            if not shown:
                continue
        yield LogLine(rank, line, last[0])


def _history(ex: Any, h: JobHandle, *, tail: int | None, since: float | None,
             verbose: bool = True) -> tuple[list[LogLine], int]:
    """The job's lines so far (filtered), and how many lines it had in all."""
    last: list[float | None] = [None]
    kept: deque[LogLine] | list[LogLine] = deque(maxlen=tail) if tail is not None else []
    n = 0
    for ll in _stamped(h.rank, ex.logs(h, follow=False), last, verbose):
        n += 1
        if since is None or (ll.time is not None and ll.time >= since):
            kept.append(ll)
    return list(kept), n


def _merge(per_replica: Sequence[list[LogLine]]) -> list[LogLine]:
    """Each replica's lines are in time order; merge them (lines before any timestamp first, by rank)."""
    return list(heapq.merge(*per_replica, key=lambda ll: (-1.0 if ll.time is None else ll.time)))


def replica_logs(run: Run, *, ranks: Sequence[int] | None = None, follow: bool = False, tail: int | None = None,
                 since: float | None = None, errors: list[str] | None = None, verbose: bool = True
                 ) -> Iterator[LogLine]:
    """The run's replica log lines (``ranks``: only those), merged; with ``follow`` until every job ended.

    ``verbose=False`` keeps only :func:`is_ours` lines (composer-cloud's records, warnings and errors,
    tracebacks), before ``tail`` counts.

    A replica whose logs cannot be fetched is skipped; its error is appended
    to ``errors`` (when given) so the caller can report it.
    """
    if tail is not None and tail < 0:
        raise ValueError("--tail must be >= 0")
    handles = [h for h in trusted_handles(load_handles(run.store), run.spec) if ranks is None or h.rank in ranks]
    executors: dict[str, Any] = {}
    errs = errors if errors is not None else []

    def ex_of(h: JobHandle) -> Any:
        return executors.get(h.executor) or executors.setdefault(h.executor, get_executor(h.executor, run.spec, run_key=run.run_key))

    # History: every replica in parallel (remote log fetches are slow), then merged by time.
    histories: dict[int, tuple[list[LogLine], int]] = {}

    def fetch(h: JobHandle) -> None:
        try:
            histories[h.rank] = _history(ex_of(h), h, tail=tail, since=since, verbose=verbose)
        except Exception as exc:  # noqa: BLE001 - one replica's logs must not hide the others'
            errs.append(f"replica {h.rank}: {exc}")
            histories[h.rank] = ([], -1)

    threads = [threading.Thread(target=fetch, args=(h,), daemon=True) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield from _merge([histories[h.rank][0] for h in handles])
    if not follow:
        return

    # Live: one reader per replica; each skips the lines it already printed (streams restart at the top).
    out: queue.Queue[LogLine | None] = queue.Queue()

    def follow_one(h: JobHandle) -> None:
        seen = histories[h.rank][1]
        last: list[float | None] = [None]
        try:
            if seen >= 0:
                for i, ll in enumerate(_stamped(h.rank, ex_of(h).logs(h, follow=True), last, verbose)):
                    if i >= seen:
                        out.put(ll)
        except Exception as exc:  # noqa: BLE001
            errs.append(f"replica {h.rank}: {exc}")
        finally:
            out.put(None)

    live = [threading.Thread(target=follow_one, args=(h,), daemon=True) for h in handles]
    for t in live:
        t.start()
    running = len(live)
    while running:
        item = out.get()
        if item is None:
            running -= 1
        else:
            yield item


__all__ = ["LogLine", "is_ours", "line_time", "parse_since", "replica_logs", "without_rank"]
