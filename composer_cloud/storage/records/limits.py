"""How large each kind of record may be in the store, checked before it is read whole (issue 33, item 5).

A bucket writer can put a huge object where a small record is expected; a reader asks the store for at
most the kind's limit (one ranged read, :meth:`~composer_cloud.storage.store.Store.get_json`), and an
object over it fails like any unverifiable object (:class:`~composer_cloud.errors.ChecksumMismatch`
naming the key and the limit): absent as a decision, never read into memory. Limits are payload bytes
(framing excluded) with a wide margin over the largest real record (noted per kind).
"""

from __future__ import annotations

#: Any JSON record without a kind of its own (handles, cancel, heartbeats, digests): real ones are < 8 KiB.
JSON_RECORD_MAX_BYTES = 1 << 20
#: Round records (quorum, outcome, void, slot digest): ~20 bytes per rank; 256 KiB is > 10,000 ranks.
ROUND_RECORD_MAX_BYTES = 256 << 10
#: Checkpoint manifests: ~100 bytes per listed replica and slice; 8 MiB is > 40,000 entries.
MANIFEST_MAX_BYTES = 8 << 20
#: Slice and replica markers (one blob each): < 1 KiB.
MARKER_MAX_BYTES = 64 << 10

__all__ = ["JSON_RECORD_MAX_BYTES", "MANIFEST_MAX_BYTES", "MARKER_MAX_BYTES", "ROUND_RECORD_MAX_BYTES"]
