"""``composer-cloud ls``: the runs under a store, newest first, each in the state ``status`` gives it.

One derivation: every listed state is :func:`composer_cloud.runs.status.run_status` of
that run, the very function ``status`` calls (executors polled), so ``ls`` and
``status`` cannot disagree. Runs are ordered by when they were created, newest
first, whatever their ids.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from composer_cloud.errors import ConfigError, StoreConfigError, StoreError
from composer_cloud.runs.states import RunState
from composer_cloud.runs.status import run_status
from composer_cloud.storage import layout
from composer_cloud.storage.run import normalize_run_uri, open_run
from composer_cloud.storage.store import Store, join_uri

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunListing:
    """One run found under a store: id, URI, state and committed rounds."""

    run_id: str
    uri: str
    state: RunState
    rounds_committed: int
    rounds: int
    #: epoch seconds the run was created (its launch; a resume does not change it); None when unknown
    launched_at: float | None = None
    #: the spec's ``sync.mode`` (decoupled: ``rounds_committed`` counts merges, not rounds)
    sync_mode: str = "lockstep"


def _created(root: Store, name: str) -> float | None:
    """When run ``name`` was created: its launch-time model files (never rewritten), else its spec (which a
    resume that changes the executor or replica count rewrites)."""
    times = []
    for key in (f"{name}/{layout.model_file_key('config.json')}", f"{name}/{layout.SPEC}"):
        try:
            t = root.modified(key)
        except (StoreError, OSError):
            t = None
        if t is not None:
            times.append(t)
    return min(times) if times else None


def list_runs(store: str, *, storage_options: Mapping[str, Any] | None = None,
              poll_executors: bool = True) -> list[RunListing]:
    """Runs directly under ``store`` (directories with a ``spec.json``), newest first by creation time.

    Each state is what ``status`` says (``poll_executors=False`` trades that for speed: a run whose
    jobs died without a word then still reads "running"). An entry that cannot be read is listed as
    ``unreadable`` rather than failing the listing; a store that cannot be listed at all (a bucket that
    does not exist, no credentials) raises :class:`StoreConfigError` saying so.
    """
    uri = normalize_run_uri(store)
    root = Store(uri, storage_options=dict(storage_options or {}))
    try:
        names = root.list_dirs()
        if not names and not uri.startswith("file://"):
            root.check_access()  # an empty listing of a bucket that does not exist is no answer
    except StoreConfigError as exc:
        raise StoreConfigError(f"cannot list runs under {uri}: {exc}") from None
    except (StoreError, OSError) as exc:
        raise StoreConfigError(f"cannot list runs under {uri}: {type(exc).__name__}: {exc}. Check the bucket "
                               f"name and credentials (`composer-cloud doctor {uri}`)") from None
    out: list[RunListing] = []
    for name in names:
        if not root.exists(f"{name}/{layout.SPEC}"):
            continue
        run_uri = join_uri(root.uri, name)
        try:
            run = open_run(run_uri, storage_options=storage_options)
            st = run_status(run, poll_executors=poll_executors)
            out.append(RunListing(run.run_id, run.uri, st.state, st.rounds_committed, st.rounds,
                                  _created(root, name), sync_mode=run.spec.sync.mode))
        except (StoreError, ConfigError) as exc:
            logger.warning("cannot read run %s: %s", run_uri, exc)
            out.append(RunListing(name, run_uri, RunState.UNREADABLE, 0, 0, _created(root, name)))
    return sorted(out, key=lambda r: (r.launched_at or 0.0, r.run_id), reverse=True)


__all__ = ["RunListing", "list_runs"]
