"""Store conformance probe: does a store give the guarantees the object-store all-reduce relies on?

A store's write-once and consistency properties are
probed before a run starts, and a store that lacks them is refused by name.
:func:`probe_store` exercises the real store under a scratch prefix
(``<uri>/.composer-cloud-probe/<uuid>/``) that it deletes afterwards, and
reports each property; it never raises for a failing property, only
:class:`~composer_cloud.storage.store.StoreConfigError` when the store
cannot be reached at all.

Required properties (a run is unsafe without them):

* ``conditional_create``: two creates of one key: the first wins, the second
  is refused, the object keeps the first payload (``If-None-Match: *``).
* ``concurrent_create``: :data:`RACERS` threads create one key at once:
  exactly one wins and the object holds the winner's payload.
* ``read_after_write``: a new object is readable at once, byte for byte.
* ``list_after_write``: new objects are listed at once.
* ``overwrite_visibility``: a read after an overwrite returns the new payload.
* ``delete``: a deleted object is gone for reads, listings and ``exists``.
* ``no_partial_reads``: while a :data:`LARGE_OBJECT_BYTES` object is being
  written (a new key, then an overwrite), every read of it returns nothing or
  one whole version, never a part (a store that serves objects while they are
  written would hand a reader a half-written pseudo-gradient or checkpoint).

Informational (reported, never refused):

* ``empty_prefix_cleanup``: a prefix whose objects were all deleted is no
  longer listed (SeaweedFS keeps it for a while; callers tolerate it).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composer_cloud import env
from composer_cloud.errors import ObjectNotFound, StoreConfigError
from composer_cloud.storage.layout import (
    PROBE_PREFIX,  # where the probe writes, under the store root; removed afterwards
)
from composer_cloud.storage.store import Store, join_uri

__all__ = ["PROBE_PREFIX", "ConformanceReport", "PropertyCheck", "StoreConfigError", "StoreNotConforming",
           "format_report", "probe_store", "require_conformance"]

logger = logging.getLogger(__name__)

#: Concurrent creators of one key in ``concurrent_create``.
RACERS = 8
#: Size of the object written while it is read in ``no_partial_reads`` (a multi-MiB pseudo-gradient slot).
LARGE_OBJECT_BYTES = 8 << 20

#: Reports of stores that conformed, per process: a launcher probes each store once (``require_conformance``).
_CONFORMING: dict[tuple[str, str], "ConformanceReport"] = {}
_CONFORMING_LOCK = threading.Lock()


@dataclass(frozen=True)
class PropertyCheck:
    """One property of a store: ``ok`` or not, with a ``detail`` saying what was seen.

    ``required=False`` marks an informational property that never fails a report.
    """

    name: str
    ok: bool
    detail: str
    required: bool = True


@dataclass(frozen=True)
class ConformanceReport:
    """The outcome of :func:`probe_store` on ``store`` (the URI probed)."""

    store: str
    checks: list[PropertyCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every required property holds."""
        return all(c.ok for c in self.checks if c.required)

    def failures(self) -> list[PropertyCheck]:
        """The required properties that do not hold."""
        return [c for c in self.checks if c.required and not c.ok]


def probe_store(uri: str, *, storage_options: dict[str, Any] | None = None) -> ConformanceReport:
    """Probe ``uri`` for the properties listed in the module doc; return a :class:`ConformanceReport`.

    Writes only under ``<uri>/.composer-cloud-probe/<uuid>/`` and deletes it
    afterwards (a failed cleanup is logged, not raised). Retries transient
    errors briefly (``outage_s=0``): a probe answers in seconds.

    Raises:
        StoreConfigError: the URI is invalid, or the store (bucket) cannot be
            reached or used with these credentials.
    """
    root = Store(uri, storage_options=storage_options, outage_s=0)
    root.check_access()
    scratch = Store(join_uri(root.uri, PROBE_PREFIX, uuid.uuid4().hex), storage_options=storage_options,
                    outage_s=0)
    checks: list[PropertyCheck] = []
    try:
        for name, check, required in _CHECKS:
            checks.append(_run(name, check, scratch, required))
    finally:
        try:
            _cleanup(root, scratch)
        except Exception as exc:  # noqa: BLE001 - the report matters more than the scratch objects
            logger.warning("could not delete the probe's scratch objects under %s: %s: %s", scratch.uri,
                           type(exc).__name__, exc)
    report = ConformanceReport(store=root.uri, checks=checks)
    if not report.ok:
        logger.warning("store %s fails: %s", root.uri, ", ".join(c.name for c in report.failures()))
    return report


class StoreNotConforming(StoreConfigError):
    """The store lacks a property the all-reduce needs; ``report`` says which (the message names them)."""

    def __init__(self, report: ConformanceReport) -> None:
        self.report = report
        names = ", ".join(c.name for c in report.failures())
        super().__init__(f"store {report.store} does not provide {names}; it cannot hold a run "
                         f"(see docs/store.md)\n{format_report(report)}")


def require_conformance(uri: str, *, storage_options: dict[str, Any] | None = None) -> ConformanceReport:
    """:func:`probe_store`, raising :class:`StoreNotConforming` (a :class:`StoreConfigError`) if a property fails.

    Every command that writes to a run (``launch``, ``resume``, ``cancel``) calls it before its first
    write, so a run copied onto a store without these properties is refused, not resumed. A store that
    conformed is not probed again by this process (a launcher's lifetime); one that failed is probed
    again each time (it may have been fixed).
    """
    key = (uri.rstrip("/"), _options_key(storage_options))  # the endpoint too: AWS_ENDPOINT_URL may change
    with _CONFORMING_LOCK:
        cached = _CONFORMING.get(key)
    if cached is not None:
        return cached
    report = probe_store(uri, storage_options=storage_options)
    if not report.ok:
        raise StoreNotConforming(report)
    with _CONFORMING_LOCK:
        _CONFORMING[key] = report
    return report


def _options_key(storage_options: dict[str, Any] | None) -> str:
    """A cache key for storage options (a digest: the options may hold secrets)."""
    import hashlib
    import json

    blob = json.dumps([storage_options or {}, env.s3_endpoint()], sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()


def format_report(report: ConformanceReport) -> str:
    """A human-readable table of ``report`` (one line per property), for the CLI."""
    width = max((len(c.name) for c in report.checks), default=0)
    lines = [f"store {report.store}: " + ("conforms" if report.ok else
                                            f"DOES NOT CONFORM ({len(report.failures())} required "
                                            "propert" + ("y" if len(report.failures()) == 1 else "ies")
                                            + " failed)")]
    for c in report.checks:
        status = "ok  " if c.ok else ("FAIL" if c.required else "note")
        lines.append(f"  {status}  {c.name:<{width}}  {c.detail}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- checks
def _run(name: str, check: Callable[[Store], tuple[bool, str]], store: Store, required: bool) -> PropertyCheck:
    try:
        ok, detail = check(store)
    except Exception as exc:  # noqa: BLE001 - a property that errors does not hold
        ok, detail = False, f"raised {type(exc).__name__}: {exc}"
    return PropertyCheck(name, ok, detail, required)


def _cleanup(root: Store, scratch: Store) -> None:
    root.delete(scratch.uri[len(root.uri) + 1:], recursive=True)
    root.remove_empty_prefix(PROBE_PREFIX)  # unless another probe is still using it


def _conditional_create(st: Store) -> tuple[bool, str]:
    first = st.create("create/once", b"first")
    second = st.create("create/once", b"second")
    stored = bytes(st.get("create/once"))
    if not first:
        return False, "the first create of a new key was refused"
    if second:
        return False, ("a second create of an existing key succeeded: the store ignores If-None-Match: * "
                       "(two replicas could both win a write-once record)")
    if stored != b"first":
        return False, f"the refused create changed the object (now {stored!r})"
    return True, "second create of an existing key refused, object unchanged"


def _concurrent_create(st: Store) -> tuple[bool, str]:
    barrier = threading.Barrier(RACERS)
    won: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def race(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            if st.create("create/race", f"racer-{i}".encode()):
                with lock:
                    won.append(i)
        except Exception as exc:  # noqa: BLE001 - reported below
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=race, args=(i,), daemon=True) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        return False, f"{len(errors)} of {RACERS} racing creates raised: {errors[0]}"
    if len(won) != 1:
        return False, f"{len(won)} of {RACERS} racing creates of one key won (exactly 1 must)"
    stored = bytes(st.get("create/race"))
    if stored != f"racer-{won[0]}".encode():
        return False, f"the winner was racer {won[0]} but the object holds {stored[:32]!r}"
    return True, f"1 of {RACERS} racing creates won, the object is the winner's"


def _read_after_write(st: Store) -> tuple[bool, str]:
    payload = uuid.uuid4().bytes * 64
    st.put("raw/obj", payload)
    try:
        got = bytes(st.get("raw/obj"))
    except ObjectNotFound:
        return False, "a new object was not found right after its PUT"
    if got != payload:
        return False, "a new object read back different bytes"
    return True, "a new object reads back at once"


def _list_after_write(st: Store) -> tuple[bool, str]:
    keys = [f"law/{i}" for i in range(3)]
    for k in keys:
        st.put(k, b"x")
    listed = st.list("law")
    missing = [k for k in keys if k not in listed]
    if missing:
        return False, f"new objects missing from an immediate listing: {missing}"
    return True, f"{len(keys)} new objects listed at once"


def _overwrite_visibility(st: Store) -> tuple[bool, str]:
    st.put("ow/obj", b"v1")
    st.get("ow/obj")  # a cached old version is what this catches
    st.put("ow/obj", b"v2")
    got = bytes(st.get("ow/obj"))
    if got != b"v2":
        return False, f"a read right after an overwrite returned the old payload {got!r}"
    return True, "a read after an overwrite sees the new payload"


def _delete(st: Store) -> tuple[bool, str]:
    st.put("del/obj", b"x")
    st.put("del/keep", b"y")
    st.delete("del/obj")
    if st.try_get("del/obj") is not None:
        return False, "a deleted object can still be read"
    if "del/obj" in st.list("del"):
        return False, "a deleted object is still listed"
    if st.exists("del/obj"):
        return False, "a deleted object still exists"
    if st.list("del") != ["del/keep"]:
        return False, f"deleting one object changed its neighbours: {st.list('del')}"
    return True, "a deleted object is gone for reads, listings and exists"


def _no_partial_reads(st: Store) -> tuple[bool, str]:
    """Read a large object over and over while it is created, then overwritten: only whole versions."""
    versions = [bytes([v]) * LARGE_OBJECT_BYTES for v in (0xA5, 0x5A)]  # plain: the raw bytes are compared
    partial: list[str] = []
    reading, stop = threading.Event(), threading.Event()

    def read_while_written() -> None:
        while not stop.is_set():
            reading.set()
            try:
                data = st.get_plain("big/obj")
            except ObjectNotFound:
                continue
            if data not in versions:
                partial.append(f"{len(data)} of {LARGE_OBJECT_BYTES} bytes" if len(data) != LARGE_OBJECT_BYTES
                               else "a mix of two versions")
                return

    reader = threading.Thread(target=read_while_written, daemon=True)
    reader.start()
    reading.wait(timeout=30)
    try:
        for data in versions:
            st.put_plain("big/obj", data)
    finally:
        stop.set()
        reader.join(timeout=120)
    mib = LARGE_OBJECT_BYTES >> 20
    if partial:
        return False, (f"a read during a {mib} MiB write returned a partial object ({partial[0]}): readers "
                       "could use half-written payloads")
    if st.get_plain("big/obj") != versions[1]:
        return False, f"a {mib} MiB object did not read back whole after its write"
    return True, f"reads during a {mib} MiB write saw only whole objects"


def _empty_prefix_cleanup(st: Store) -> tuple[bool, str]:
    st.put("gone/sub/obj", b"x")
    st.put("stay/obj", b"y")
    st.delete("gone", recursive=True)
    listed = st.list_dirs("")
    if "gone" in listed:
        return False, ("a prefix whose objects were all deleted is still listed as a directory (harmless: "
                       "readers skip names without their objects)")
    return True, "an emptied prefix is no longer listed"


_CHECKS: list[tuple[str, Callable[[Store], tuple[bool, str]], bool]] = [
    ("conditional_create", _conditional_create, True),
    ("concurrent_create", _concurrent_create, True),
    ("read_after_write", _read_after_write, True),
    ("list_after_write", _list_after_write, True),
    ("overwrite_visibility", _overwrite_visibility, True),
    ("delete", _delete, True),
    ("no_partial_reads", _no_partial_reads, True),
    ("empty_prefix_cleanup", _empty_prefix_cleanup, False),
]
