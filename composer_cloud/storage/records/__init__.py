"""Every JSON record of a run, typed once: one dataclass per record, with its ``to_json``/``from_json`` pair.

A writer builds the dataclass and stores ``to_json()``; a reader calls
``from_json(obj, key=...)`` on what it read. The bucket is not trusted
(``docs/store.md``), so ``from_json`` checks the schema (types, ranges, and the
record's own position where it carries one) and raises
:class:`~composer_cloud.errors.BadObject` naming the key and the field; what
a rejection costs is the caller's decision. Rules that relate several records
(an outcome must agree with its quorum, a merge's weights with its
contributions) belong to the protocols, not here. Keys: :mod:`composer_cloud.storage.layout`.

Records read by status displays (:class:`Heartbeat`) are parsed leniently
instead: a malformed field reads as unknown, never as an error.

The records live in one file per family (:mod:`.rounds`, :mod:`.checkpoints`,
:mod:`.decoupled`, :mod:`.run`, :mod:`.samples`, :mod:`.policy`; field checks in :mod:`.fields`); import them from here.
"""

from __future__ import annotations

from composer_cloud.storage.records.checkpoints import BlobEntry, Manifest, ReplicaMarker, SliceMarker
from composer_cloud.storage.records.decoupled import Contribution, FinalRecord, MergeRecord, Rejected
from composer_cloud.storage.records.policy import PolicyRecord
from composer_cloud.storage.records.rounds import Join, Outcome, Quorum, SlotDigest, Void
from composer_cloud.storage.records.samples import RoundSamples, Sample
from composer_cloud.storage.records.run import (
    CancelRecord,
    CodeRef,
    Heartbeat,
    HeartbeatState,
    JobHandle,
    MetricsDigest,
    ResumeRecord,
)

__all__ = ["BlobEntry", "CancelRecord", "CodeRef", "Contribution", "FinalRecord", "Heartbeat", "HeartbeatState",
           "JobHandle", "Join", "Manifest", "MergeRecord", "MetricsDigest", "Outcome", "PolicyRecord", "Quorum", "Rejected",
           "ReplicaMarker", "ResumeRecord", "RoundSamples", "Sample", "SliceMarker", "SlotDigest", "Void"]
