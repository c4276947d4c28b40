"""The policy chain: the replicas publish the global model to rollout workers through the store, as bf16.

After each outer step the replica publishes **version** ``v``: the global model that trainers start round ``v``
from (version 0: the initial model). A version is stored as

* an **anchor** (every :data:`DEFAULT_ANCHOR_EVERY`-th version, and whenever the previous version is not in the
  store): the whole bf16 policy, ``policy/<v>.anchor.safetensors``;
* otherwise a lossless bf16 **patch** against version ``v - 1`` (:mod:`composer_cloud.rollouts.patch_codec`):
  at RL learning rates only a few percent of bf16 weights change per outer step, so a patch is a few percent
  of the full bf16 state (``docs/rollouts.md``, "Policy traffic: anchor and patches");

then its write-once record ``policy/<v>.json`` (:class:`~composer_cloud.storage.records.policy.PolicyRecord`),
which names the kind, the base version, the byte sizes and the sha256 of the rebuilt bf16 state. Under LoRA only
the adapter's (trainable) tensors are published: the frozen base is rebuilt from the spec by every worker.

Invariants:

* **Bitwise.** :meth:`PolicyReader.load` returns exactly the bf16 cast of the published model, or raises
  :class:`PolicyChainError` (digest mismatch, a missing link, a damaged, forged or unsigned object in a signed
  run: every object is read through the :class:`~composer_cloud.storage.store.Store`, which verifies frames and
  signatures). The digest is checked on every version :meth:`~PolicyReader.load` returns.
* **Idempotent.** Blobs and records are written once and are functions of the model and the version alone (no
  clock, no writer): every replica holding the global model may publish it; the first create wins, the others'
  identical bytes change nothing. A record is created after its blob, so a record names a blob that exists.
* **Linked.** A patch is written only when the record of ``v - 1`` exists and its digest equals the base the
  patch was computed against; otherwise the version is an anchor.

Keys: :mod:`composer_cloud.storage.layout` (``policy/``). Traffic measured by ``benchmarks/policy_patches.py``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from composer_cloud.errors import BadObject, ObjectNotFound
from composer_cloud.lora import is_lora_model, synced_parameters
from composer_cloud.rollouts.patch_codec import (
    apply_patch,
    decode_anchor,
    encode_anchor,
    encode_patch,
    state_digest,
    state_numel,
)
from composer_cloud.storage import layout
from composer_cloud.storage.records.policy import ANCHOR, PATCH, PolicyRecord
from composer_cloud.storage.store import OversizedObject, Store
from composer_cloud.sync.trust import create_over_forged

logger = logging.getLogger(__name__)

#: Every this many versions the chain restarts from an anchor (version 0 is one): a worker that starts late
#: reads one anchor and at most ``DEFAULT_ANCHOR_EVERY - 1`` patches.
DEFAULT_ANCHOR_EVERY = 16


class PolicyChainError(BadObject):
    """A policy version cannot be rebuilt exactly: a link of its chain is missing, damaged, forged or unsigned
    (in a signed run), or the rebuilt state's digest differs from its record's. ``key`` names the object."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason, message=f"policy chain: {key}: {reason}")


@dataclass(frozen=True)
class PolicyPublished:
    """What :func:`publish_policy` left in the store for ``record.version``.

    ``created``: this call created the record (False: another replica, or an earlier process, did first;
    ``matches`` says whether its digest is this model's).
    """

    record: PolicyRecord
    created: bool
    matches: bool = True

    @property
    def version(self) -> int:
        return self.record.version

    @property
    def kind(self) -> str:
        return self.record.kind

    @property
    def ratio(self) -> float:
        """Blob bytes over the full bf16 state's bytes (an anchor: ~1.0)."""
        return self.record.blob_bytes / max(self.record.state_bytes, 1)


def should_publish(spec: Any) -> bool:
    """Whether the replicas of ``spec`` publish the policy chain: only when rollout workers are configured
    (``[rollouts] workers > 0``; a spec without the section publishes nothing)."""
    rollouts = getattr(spec, "rollouts", None)
    workers = getattr(rollouts, "workers", 0) if rollouts is not None else 0
    return isinstance(workers, int) and workers > 0


def policy_state(model: torch.nn.Module, *, lora: bool = False) -> dict[str, torch.Tensor]:
    """The published policy of ``model``: ``{parameter name: bf16 CPU copy}`` (a copy even when the parameter is
    already bf16 on the CPU, so later training never changes it).

    ``lora=False``: every parameter (``named_parameters``: a tied embedding once). ``lora=True``: the adapter's
    trainable tensors (:func:`composer_cloud.lora.synced_parameters`); ``ValueError`` for a model without one.
    """
    if lora and not is_lora_model(model):
        raise ValueError("publish_policy(lora=True): the model has no LoRA adapter; set [model.lora] or lora=False")
    params = synced_parameters(model) if lora else dict(model.named_parameters())
    with torch.no_grad():
        return {n: p.detach().to(device="cpu", dtype=torch.bfloat16, copy=True).contiguous()
                for n, p in sorted(params.items())}


def apply_policy(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a rebuilt bf16 ``state`` into ``model``'s parameters (cast to each parameter's dtype and device).

    The state must name exactly the model's published parameters: all of them, or under LoRA the adapter's
    (:func:`composer_cloud.lora.synced_parameters`). ``ValueError`` naming the first difference otherwise.
    """
    params = synced_parameters(model)
    if set(state) != set(params):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(f"apply_policy: the policy does not fit the model: missing {missing[:3]}, unknown "
                         f"{extra[:3]} (a LoRA worker needs a LoRA policy and the same [model] settings)")
    with torch.no_grad():
        for name, p in params.items():
            t = state[name]
            if t.shape != p.shape:
                raise ValueError(f"apply_policy: {name} is {tuple(t.shape)} in the policy, {tuple(p.shape)} in "
                                 "the model (the worker's [model] must be the trainers')")
            p.copy_(t.to(device=p.device, dtype=p.dtype))


# --------------------------------------------------------------------------- reading
def _read_record(store: Store, version: int) -> PolicyRecord:
    key = layout.policy_record_key(version)
    try:
        return PolicyRecord.from_json(store.get_json(key), key=key, version=version)
    except ObjectNotFound:
        raise PolicyChainError(key, f"version {version} was never published or was pruned (a missing link: "
                                    "the publisher re-anchors at its next version)") from None
    except BadObject as exc:
        raise PolicyChainError(key, f"the record is not usable ({exc.reason})") from exc


def _read_blob(store: Store, record: PolicyRecord) -> bytes:
    key = layout.policy_blob_key(record.version, record.kind)
    try:
        blob = bytes(store.get(key, max_bytes=record.blob_bytes))
    except ObjectNotFound:
        raise PolicyChainError(key, f"the {record.kind} its record names is missing") from None
    except BadObject as exc:
        raise PolicyChainError(key, f"the {record.kind} is not usable ({exc.reason})") from exc
    if len(blob) != record.blob_bytes or hashlib.sha256(blob).hexdigest() != record.blob_sha256:
        raise PolicyChainError(key, f"its bytes are not the ones its record names ({len(blob)} bytes, record "
                                    f"says {record.blob_bytes}; sha256 differs)")
    return blob


class PolicyReader:
    """A rollout worker's view of the chain: the newest version, and any version rebuilt bitwise.

    Keeps the last rebuilt version, so that reading versions in order applies one patch each. The returned
    tensors are shared with that cache: do not modify them in place (:func:`apply_policy` copies them).
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None
        #: bytes of blobs read by this reader (what the chain cost a worker).
        self.bytes_read = 0

    def latest_version(self) -> int | None:
        """The newest version whose record is authentic and well-formed, or None before version 0 exists."""
        versions = sorted({p[0] for k in self.store.list(layout.POLICY)
                           if (p := layout.parse_policy_key(k)) is not None and p[1] == "record"}, reverse=True)
        for v in versions:
            try:
                _read_record(self.store, v)
                return v
            except PolicyChainError as exc:
                logger.warning("skipping policy version %d: %s", v, exc)
        return None

    def record(self, version: int) -> PolicyRecord:
        """The verified record of ``version``; :class:`PolicyChainError` if it is missing or not usable."""
        return _read_record(self.store, version)

    def load(self, version: int) -> dict[str, torch.Tensor]:
        """The bf16 state of ``version`` (by parameter name), rebuilt from the nearest anchor (or the cached
        version) forward through its patches and checked against the record's digest."""
        if self._cached is not None and self._cached[0] == version:
            return dict(self._cached[1])
        chain: list[PolicyRecord] = []
        start: dict[str, torch.Tensor] | None = None
        v = version
        while True:
            rec = _read_record(self.store, v)
            chain.append(rec)
            if rec.kind == ANCHOR:
                break
            assert rec.base is not None  # the record's parser guarantees it
            v = rec.base
            if self._cached is not None and self._cached[0] == v:
                start = self._cached[1]
                break
        state = start
        for rec in reversed(chain):
            blob = _read_blob(self.store, rec)
            self.bytes_read += len(blob)
            key = layout.policy_blob_key(rec.version, rec.kind)
            if rec.kind == ANCHOR:
                state = decode_anchor(blob, key=key, version=rec.version)
            else:
                assert state is not None
                state, _ = apply_patch(state, blob, key=key, version=rec.version)
        assert state is not None
        top = chain[0]
        digest = state_digest(state)
        if digest != top.digest:
            raise PolicyChainError(layout.policy_record_key(version), f"the state rebuilt through versions "
                                   f"{[r.version for r in reversed(chain)]} has digest {digest[:12]}..., the record "
                                   f"says {top.digest[:12]}... (a damaged or forged link); it was not used")
        self._cached = (version, state)
        logger.debug("policy version %d rebuilt from %d object(s)", version, len(chain))
        return dict(state)


# --------------------------------------------------------------------------- publishing
class PolicyPublisher:
    """Publishes successive versions from one process, remembering the last one (the next patch's base).

    A fresh publisher (a restarted replica) whose previous version is in the store rebuilds it once with a
    :class:`PolicyReader`; one that cannot writes an anchor.
    """

    def __init__(self, store: Store, *, lora: bool = False, anchor_every: int = DEFAULT_ANCHOR_EVERY) -> None:
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1 (1: every version is an anchor), got {anchor_every}")
        self.store = store
        self.lora = lora
        self.anchor_every = anchor_every
        self._last: tuple[int, dict[str, torch.Tensor], str] | None = None  # version, state, digest

    def publish(self, version: int, model: torch.nn.Module) -> PolicyPublished:
        """Publish ``model`` (cast to bf16: :func:`policy_state`) as ``version``."""
        return self.publish_state(version, policy_state(model, lora=self.lora))

    def publish_state(self, version: int, state: dict[str, torch.Tensor]) -> PolicyPublished:
        """Publish a bf16 ``state`` (from :func:`policy_state`; not modified afterwards by the caller) as
        ``version``: blob first, then the write-once record."""
        if version < 0:
            raise ValueError(f"policy versions start at 0, got {version}")
        digest = state_digest(state)
        key = layout.policy_record_key(version)
        existing = self._existing(version)
        if existing is not None:
            return self._settled(existing, state, digest, created=False)
        base = self._base(version)
        if base is None:
            kind, blob, changed = ANCHOR, encode_anchor(state, version=version), state_numel(state)
        else:
            kind = PATCH
            try:
                blob, changed = encode_patch(base, state, version=version)
            except ValueError as exc:  # the model's tensors changed names or shapes: start a new chain
                logger.warning("policy version %d: %s; publishing an anchor", version, exc)
                kind, blob, changed = ANCHOR, encode_anchor(state, version=version), state_numel(state)
        record = PolicyRecord(
            version=version, kind=kind, base=version - 1 if kind == PATCH else None, lora=self.lora,
            tensors=len(state), numel=state_numel(state), changed=changed, state_bytes=2 * state_numel(state),
            blob_bytes=len(blob), blob_sha256=hashlib.sha256(blob).hexdigest(), digest=digest)
        blob_key = layout.policy_blob_key(version, kind)
        if not self._create_blob(blob_key, blob):
            existing = self._existing(version)
            if existing is None:
                raise PolicyChainError(blob_key, "another object is stored there and no record names it; "
                                                 "publishing the next version re-anchors")
            return self._settled(existing, state, digest, created=False)
        created = create_over_forged(self.store, key, record.to_json(),
                                     lambda obj: PolicyRecord.from_json(obj, key=key, version=version))
        if not created:
            existing = self._existing(version)
            if existing is None:
                raise PolicyChainError(key, "lost the create to an object that is not a usable record")
            if existing.kind != kind:  # our blob is named by no record: remove it
                self.store.delete(blob_key)
            return self._settled(existing, state, digest, created=False)
        logger.info("policy version %d published: %s, %d of %d elements changed, %d bytes (%.2f%% of bf16)",
                    version, kind, changed, record.numel, record.blob_bytes,
                    100 * record.blob_bytes / max(record.state_bytes, 1))
        self._last = (version, state, digest)
        return PolicyPublished(record, created=True)

    def _existing(self, version: int) -> PolicyRecord | None:
        """The usable record of ``version``, or None (absent; in a signed run a forged one counts as absent)."""
        try:
            return _read_record(self.store, version)
        except PolicyChainError as exc:
            if isinstance(exc.__cause__, BadObject):
                logger.warning("%s", exc)
            return None

    def _settled(self, existing: PolicyRecord, state: dict[str, torch.Tensor], digest: str, *,
                 created: bool) -> PolicyPublished:
        matches = existing.digest == digest
        if not matches:
            logger.warning("policy version %d was already published with another state (digest %s..., ours "
                           "%s...): workers read the stored one; a resume that is not bitwise publishes a "
                           "different model under the same version", existing.version, existing.digest[:12],
                           digest[:12])
        self._last = (existing.version, state, digest)
        return PolicyPublished(existing, created=created, matches=matches)

    def _base(self, version: int) -> dict[str, torch.Tensor] | None:
        """The state of ``version - 1`` to patch against, or None (publish an anchor)."""
        if version == 0 or version % self.anchor_every == 0:
            return None
        try:
            previous = _read_record(self.store, version - 1)
        except PolicyChainError as exc:
            logger.info("policy version %d is an anchor: %s", version, exc.reason)
            return None
        if self._last is not None and self._last[0] == version - 1 and self._last[2] == previous.digest:
            return self._last[1]
        try:
            return PolicyReader(self.store).load(version - 1)
        except PolicyChainError as exc:
            logger.warning("policy version %d is an anchor: version %d cannot be rebuilt (%s)", version,
                           version - 1, exc)
            return None

    def _create_blob(self, key: str, blob: bytes) -> bool:
        """Write-once; True when the stored blob is ours (created now, or identical bytes already there)."""
        if self.store.create(key, blob):
            return True
        try:
            stored = bytes(self.store.get(key, max_bytes=len(blob)))
        except ObjectNotFound:
            return self.store.create(key, blob)
        except OversizedObject:
            return False  # not ours, and too large to be a forgery worth reading
        except BadObject:
            if not self.store.signed:
                return False
            logger.warning("replacing %s, which no job of this run wrote", key)
            self.store.delete(key)
            return self.store.create(key, blob)
        return stored == blob


def prune_policy(store: Store, *, keep_from: int) -> list[int]:
    """Delete the versions no reader of ``keep_from`` or later needs: everything before the newest anchor at or
    below ``keep_from`` (records first, so no remaining record names a deleted blob). Returns the deleted versions.

    A worker that still reads a deleted version gets :class:`PolicyChainError` naming it; choose ``keep_from``
    from the staleness the trainers accept (the oldest version a worker may still sample from).
    """
    found: dict[int, set[str]] = {}
    for key in store.list(layout.POLICY):
        if (parsed := layout.parse_policy_key(key)) is not None:
            found.setdefault(parsed[0], set()).add(parsed[1])
    anchors = [v for v in sorted(found) if v <= keep_from and ANCHOR in found[v] and "record" in found[v]
               and _is_anchor(store, v)]
    if not anchors:
        return []
    doomed = [v for v in sorted(found) if v < anchors[-1]]
    for v in doomed:
        if "record" in found[v]:
            store.delete(layout.policy_record_key(v))
    for v in doomed:
        for kind in (ANCHOR, PATCH):
            if kind in found[v]:
                store.delete(layout.policy_blob_key(v, kind))
    if doomed:
        logger.info("pruned policy versions %d..%d (the anchor of version %d stays)", doomed[0], doomed[-1],
                    anchors[-1])
    return doomed


def _is_anchor(store: Store, version: int) -> bool:
    try:
        return _read_record(store, version).kind == ANCHOR
    except PolicyChainError:
        return False


def publish_policy(store: Store, *, version: int, model: torch.nn.Module, lora: bool = False,
                   anchor_every: int = DEFAULT_ANCHOR_EVERY) -> PolicyPublished:
    """Publish ``model`` as policy ``version`` (see the module docstring); idempotent across replicas.

    Stateless: the base of a patch is read back from the store. A replica that publishes every version keeps a
    :class:`PolicyPublisher`, which remembers the last version instead.
    """
    return PolicyPublisher(store, lora=lora, anchor_every=anchor_every).publish(version, model)


__all__ = ["DEFAULT_ANCHOR_EVERY", "PolicyChainError", "PolicyPublished", "PolicyPublisher", "PolicyReader",
           "apply_policy", "policy_state", "prune_policy", "publish_policy", "should_publish"]
