"""The record of one policy version (``policy/<v>.json``): what a rollout worker needs to rebuild it, and check it.

A version is an **anchor** (the whole policy as bf16 safetensors) or a **patch** against version ``v - 1`` (the
flat positions whose bf16 bit patterns changed, and their new values: :mod:`composer_cloud.rollouts.patch_codec`).
The record is written once, after its blob, so a record that exists names a blob that exists. It carries no
clock time and no writer: every replica holding the same global model writes byte-identical records (several may
publish the same version; the first create wins and the others' identical bytes change nothing).

``digest`` is the sha256 of the *rebuilt* bf16 state (:func:`composer_cloud.rollouts.patch_codec.state_digest`:
tensors in sorted name order, each as dtype, shape and raw bytes), so a reader that applied a whole chain checks
the end result, not only each link. ``blob_sha256`` checks the blob's bytes before they are decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer_cloud.errors import BadObject
from composer_cloud.storage.records.fields import as_object, check_position, int_field, sha256_field

#: The record's format; a reader refuses any other.
POLICY_FORMAT = 1
ANCHOR = "anchor"
PATCH = "patch"


@dataclass(frozen=True)
class PolicyRecord:
    """``policy/<v>.json``.

    Attributes:
        version: the policy version: the global model trainers start round ``version`` from (0: the initial model).
        kind: ``"anchor"`` or ``"patch"``.
        base: the version a patch applies to (always ``version - 1``); ``None`` for an anchor.
        lora: the state is a LoRA model's adapters alone (the frozen base is rebuilt from the spec).
        tensors: tensors in the rebuilt state.
        numel: elements in the rebuilt state.
        changed: elements whose bf16 bits differ from the base's (an anchor: ``numel``).
        state_bytes: bytes of the rebuilt state (bf16: ``2 * numel``), what a full publish would move.
        blob_bytes: bytes of the blob (safetensors, unframed), what this version moves.
        blob_sha256: sha256 of the blob's bytes.
        digest: sha256 of the rebuilt bf16 state (canonical form, see the module docstring).
    """

    version: int
    kind: str
    base: int | None
    lora: bool
    tensors: int
    numel: int
    changed: int
    state_bytes: int
    blob_bytes: int
    blob_sha256: str
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"format": POLICY_FORMAT, "version": self.version, "kind": self.kind, "base": self.base,
                "lora": self.lora, "tensors": self.tensors, "numel": self.numel, "changed": self.changed,
                "state_bytes": self.state_bytes, "blob_bytes": self.blob_bytes, "blob_sha256": self.blob_sha256,
                "digest": self.digest}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, version: int) -> "PolicyRecord":
        """Parse and check against the key's own ``version``; :class:`BadObject` naming the key and the field."""
        obj = as_object(obj, key)
        if obj.get("format") != POLICY_FORMAT:
            raise BadObject(key, f"field 'format' is {obj.get('format')!r:.20}, this reader knows {POLICY_FORMAT} "
                                 "(a policy published by another composer-cloud version: upgrade the worker)")
        check_position(obj, key=key, version=version)
        kind = obj.get("kind")
        if kind not in (ANCHOR, PATCH):
            raise BadObject(key, f"field 'kind' must be {ANCHOR!r} or {PATCH!r}, got {kind!r:.40}")
        base = obj.get("base")
        if kind == ANCHOR and base is not None:
            raise BadObject(key, f"an anchor has no base, got 'base' = {base!r:.20}")
        if kind == PATCH and (version < 1 or base != version - 1):
            raise BadObject(key, f"a patch of version {version} applies to version {version - 1}, "
                                 f"got 'base' = {base!r:.20}")
        lora = obj.get("lora")
        if not isinstance(lora, bool):
            raise BadObject(key, f"field 'lora' must be true or false, got {lora!r:.20}")
        numel = int_field(obj, "numel", key)
        changed = int_field(obj, "changed", key)
        if changed > numel or (kind == ANCHOR and changed != numel):
            raise BadObject(key, f"field 'changed' ({changed}) does not fit 'numel' ({numel}) of a {kind}")
        state_bytes = int_field(obj, "state_bytes", key)
        if state_bytes != 2 * numel:
            raise BadObject(key, f"field 'state_bytes' ({state_bytes}) must be 2 * numel ({2 * numel}): bf16")
        return cls(version=version, kind=kind, base=base, lora=lora, tensors=int_field(obj, "tensors", key),
                   numel=numel, changed=changed, state_bytes=state_bytes,
                   blob_bytes=int_field(obj, "blob_bytes", key), blob_sha256=sha256_field(obj, "blob_sha256", key),
                   digest=sha256_field(obj, "digest", key))


__all__ = ["ANCHOR", "PATCH", "POLICY_FORMAT", "PolicyRecord"]
