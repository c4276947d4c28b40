"""Write-once decisions that a forged object cannot block, in a signed run.

Records that decide something are created once (``If-None-Match: *`` / exclusive create). Someone who can
write the bucket but holds no run key can still put *something* at a record's key first; in a signed run
that object fails verification, so it was not written by a job of the run and can be replaced. Readers
never trust such an object either (they read, verify and parse before deciding anything).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from composer_cloud.errors import BadObject, ObjectNotFound
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)

_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(tag: str, message: str, *args: Any) -> None:
    """Log ``message`` at WARNING the first time ``tag`` is seen in this process (polls repeat)."""
    with _warned_lock:
        if tag in _warned:
            return
        _warned.add(tag)
    logger.warning(message, *args)


def _read(store: Store, key: str) -> Any | None:
    try:
        return store.get_json(key)
    except ObjectNotFound:
        return None


def create_over_forged(store: Store, key: str, obj: Any, parse: Callable[[Any], object]) -> bool:
    """Write-once create of ``key`` that a forged object cannot block: returns whether this call created it.

    In a signed run an object at ``key`` that fails verification or ``parse`` (unsigned, garbage, another
    run's) was not written by a job of the run, so it is deleted and the create retried once; a valid object
    there means another writer won the race (False). Unsigned runs cannot tell, and keep write-once as is.
    """
    if store.create_json(key, obj):
        return True
    if not store.signed:
        return False
    try:
        existing = _read(store, key)
        if existing is None:
            return store.create_json(key, obj)
        parse(existing)
        return False
    except BadObject as exc:
        logger.warning("replacing %s, which no job of this run wrote (%s)", key, exc.reason)
    store.delete(key)
    return store.create_json(key, obj)



__all__ = ["create_over_forged", "warn_once"]
