"""Lossless bf16 patches of a policy: the positions whose bf16 bit patterns changed, and their new values.

PULSE (arXiv 2602.03839): at RL learning rates most bf16 weights keep their bit pattern from one step to the
next (an update far below half a bf16 ulp rounds back to the same value), so a patch of the changed elements is a
small fraction of the full bf16 state. The codec is exact: applying ``encode_patch(old, new)`` to ``old`` gives
``new`` bit for bit, including ``-0.0`` and NaN payloads (bit patterns are compared as int16, never as floats).

Per tensor (flattened, row-major), the changed positions are stored in whichever of three encodings is smallest
(ties: the first in this order), a deterministic choice, so every writer of the same pair writes the same bytes:

* ``dense``: every element (no positions); for a tensor that changed almost everywhere;
* ``bitmap``: one bit per element, ``numpy.packbits(bitorder="little")``, padding bits zero;
* ``gaps``: LEB128 varints (7 bits per byte, low group first, high bit = more) of the gaps between consecutive
  changed positions minus one (the first: the position itself); at 1 % density a gap averages ~100, one byte.

A blob is safetensors (:func:`composer_cloud.storage.tensors.save_tensors`): an anchor holds the state's tensors by
name; a patch holds ``val/<name>`` (the new bf16 values, 1-D) and, unless dense, ``pos/<name>`` (uint8), with
``{name: [encoding, values stored]}`` in its metadata (dense: every element, changed or not). Unchanged tensors are absent from a patch. Nothing is pickled.

:func:`state_digest` is the canonical sha256 of a bf16 state: for each tensor in sorted name order, the JSON line
``["<name>", "bfloat16", [shape...], nbytes]`` and then the raw little-endian bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from composer_cloud.errors import BadObject
from composer_cloud.storage.tensors import read_metadata, save_tensors

logger = logging.getLogger(__name__)

#: The blob format this codec writes and reads.
PATCH_FORMAT = "1"
DENSE, BITMAP, GAPS = "dense", "bitmap", "gaps"
ENCODINGS = (DENSE, BITMAP, GAPS)
#: Longest varint this codec writes (9 bytes: 63 bits, more than any tensor's element count).
_MAX_VARINT_BYTES = 9


class PatchError(BadObject, ValueError):
    """A policy blob is not what this codec writes (names, dtypes, sizes, positions out of range).

    Raised with the blob's key; a blob read from the store is untrusted, so this is an expected failure.
    """

    def __init__(self, key: str, problem: str) -> None:
        self.problem = problem
        super().__init__(key, problem, message=f"policy blob {key}: {problem}; it was not used")


# --------------------------------------------------------------------------- the canonical state
def bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor's bit patterns as int16, flat (compare these, never the floats: NaN != NaN, -0.0 == 0.0)."""
    return t.reshape(-1).view(torch.int16)


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 of a bf16 state in canonical form (sorted names; dtype, shape, byte count, raw bytes)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        if t.dtype != torch.bfloat16:
            raise ValueError(f"state_digest: tensor {name!r} is {t.dtype}, the policy is bf16")
        raw = bits(t.contiguous()).numpy().tobytes()
        h.update(json.dumps([name, "bfloat16", list(t.shape), len(raw)]).encode() + b"\n")
        h.update(raw)
    return h.hexdigest()


def state_numel(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in state.values())


# --------------------------------------------------------------------------- positions
def varint_encode(values: np.ndarray) -> np.ndarray:
    """LEB128 varints of non-negative integers (int64), concatenated, as uint8."""
    v = values.astype(np.uint64)
    nbytes = np.ones(len(v), dtype=np.int64)
    for k in range(1, _MAX_VARINT_BYTES):
        nbytes += v >= np.uint64(1 << (7 * k))
    starts = np.cumsum(nbytes) - nbytes
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    for k in range(int(nbytes.max(initial=0))):
        m = nbytes > k
        group = ((v[m] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        out[starts[m] + k] = group | np.where(nbytes[m] > k + 1, 0x80, 0).astype(np.uint8)
    return out


def varint_decode(data: np.ndarray, count: int, *, key: str, name: str) -> np.ndarray:
    """Inverse of :func:`varint_encode`: exactly ``count`` varints filling ``data``, else :class:`PatchError`."""
    if count == 0 or len(data) == 0:
        if count or len(data):
            raise PatchError(key, f"pos/{name}: {len(data)} bytes for {count} positions")
        return np.zeros(0, dtype=np.int64)
    last = (data & 0x80) == 0
    ends = np.flatnonzero(last)
    if not last[-1] or len(ends) != count:
        raise PatchError(key, f"pos/{name}: holds {len(ends)} whole varints{'' if last[-1] else ' and a torn one'}, "
                              f"the record says {count}")
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1] + 1])
    lengths = ends - starts + 1
    if int(lengths.max()) > _MAX_VARINT_BYTES:
        raise PatchError(key, f"pos/{name}: a varint longer than {_MAX_VARINT_BYTES} bytes")
    shift = (np.arange(len(data), dtype=np.int64) - np.repeat(starts, lengths)) * 7
    return np.add.reduceat((data & 0x7F).astype(np.int64) << shift, starts)


def encode_positions(positions: np.ndarray, numel: int) -> tuple[str, np.ndarray | None]:
    """``(encoding, bytes)`` of sorted unique ``positions`` in ``[0, numel)``: the smallest of the three
    encodings (``dense`` has no bytes). Sizes counted: position bytes plus 2 bytes per stored value."""
    n = len(positions)
    gaps = varint_encode(np.diff(positions, prepend=-1) - 1)
    sizes = {DENSE: 2 * numel, BITMAP: (numel + 7) // 8 + 2 * n, GAPS: len(gaps) + 2 * n}
    best = min(ENCODINGS, key=lambda e: (sizes[e], ENCODINGS.index(e)))
    if best == DENSE:
        return DENSE, None
    if best == BITMAP:
        mask = np.zeros(numel, dtype=np.bool_)
        mask[positions] = True
        return BITMAP, np.packbits(mask, bitorder="little")
    return GAPS, gaps


def decode_positions(encoding: str, data: np.ndarray | None, count: int, numel: int, *, key: str,
                     name: str) -> np.ndarray | None:
    """Positions (int64, strictly increasing, in ``[0, numel)``) of ``count`` changes; ``None`` for dense."""
    if encoding == DENSE:
        if data is not None or count != numel:
            raise PatchError(key, f"{name}: a dense change holds every element ({numel}), got {count} and positions")
        return None
    if data is None:
        raise PatchError(key, f"pos/{name}: missing for a {encoding} change")
    if encoding == BITMAP:
        if len(data) != (numel + 7) // 8:
            raise PatchError(key, f"pos/{name}: a bitmap of {numel} elements is {(numel + 7) // 8} bytes, "
                                  f"got {len(data)}")
        mask = np.unpackbits(data, bitorder="little")
        if mask[numel:].any():
            raise PatchError(key, f"pos/{name}: bits set past the tensor's {numel} elements")
        positions = np.flatnonzero(mask[:numel])
        if len(positions) != count:
            raise PatchError(key, f"pos/{name}: the bitmap sets {len(positions)} positions, the patch says {count}")
        return positions.astype(np.int64)
    if encoding == GAPS:
        if count > numel:
            raise PatchError(key, f"pos/{name}: {count} changes in a tensor of {numel} elements")
        gaps = varint_decode(data, count, key=key, name=name)
        if count and (int(gaps.max()) >= numel):
            raise PatchError(key, f"pos/{name}: a gap of {int(gaps.max())} in a tensor of {numel} elements")
        positions = np.cumsum(gaps + 1) - 1
        if count and int(positions[-1]) >= numel:
            raise PatchError(key, f"pos/{name}: position {int(positions[-1])} past the tensor's {numel} elements")
        return positions
    raise PatchError(key, f"{name}: unknown position encoding {encoding!r:.20} (known: {', '.join(ENCODINGS)})")


# --------------------------------------------------------------------------- blobs
def _load(blob: bytes, key: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        return st_load(blob), read_metadata(blob)
    except (SafetensorError, ValueError, KeyError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PatchError(key, f"not a safetensors blob this codec wrote ({type(exc).__name__}: {exc})") from None


def encode_anchor(state: Mapping[str, torch.Tensor], *, version: int) -> bytes:
    """The whole bf16 state as safetensors bytes (a function of the state and ``version`` alone)."""
    return save_tensors({n: state[n].contiguous() for n in sorted(state)},
                        {"format": PATCH_FORMAT, "kind": "anchor", "version": str(version)})


def decode_anchor(blob: bytes, *, key: str, version: int) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_anchor`; :class:`PatchError` for a blob it would not write."""
    tensors, meta = _load(blob, key)
    if meta.get("format") != PATCH_FORMAT or meta.get("kind") != "anchor" or meta.get("version") != str(version):
        raise PatchError(key, f"metadata {dict(sorted(meta.items()))!r:.120} is not an anchor of version {version}")
    bad = sorted(n for n, t in tensors.items() if t.dtype != torch.bfloat16)
    if bad:
        raise PatchError(key, f"tensors {bad[:4]} are not bf16")
    return tensors


def encode_patch(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
                 version: int) -> tuple[bytes, int]:
    """``(blob, changed elements)`` of the patch taking ``base`` (version ``version - 1``) to ``new``.

    Both states must hold the same names and shapes (bf16); ``ValueError`` otherwise (publish an anchor).
    """
    if set(base) != set(new):
        raise ValueError(f"a patch keeps the tensor names; these differ: {sorted(set(base) ^ set(new))[:4]}")
    tensors: dict[str, torch.Tensor] = {}
    changes: dict[str, list[object]] = {}
    changed = 0
    for name in sorted(new):
        old_t, new_t = base[name], new[name]
        if old_t.shape != new_t.shape or old_t.dtype != torch.bfloat16 or new_t.dtype != torch.bfloat16:
            raise ValueError(f"a patch keeps shapes and bf16: {name} is {old_t.dtype}{tuple(old_t.shape)} -> "
                             f"{new_t.dtype}{tuple(new_t.shape)}")
        new_bits = bits(new_t.contiguous())
        positions = torch.nonzero(bits(old_t.contiguous()) != new_bits).reshape(-1)
        n = len(positions)
        if n == 0:
            continue
        encoding, data = encode_positions(positions.numpy(), new_t.numel())
        values = new_bits if encoding == DENSE else new_bits[positions]
        tensors[f"val/{name}"] = values.view(torch.bfloat16).clone()
        if data is not None:
            tensors[f"pos/{name}"] = torch.from_numpy(data)
        changes[name] = [encoding, len(values)]  # values stored: a dense change stores unchanged ones too
        changed += n
    blob = save_tensors(tensors, {"format": PATCH_FORMAT, "kind": "patch", "version": str(version),
                                  "changes": json.dumps(changes, sort_keys=True, separators=(",", ":"))})
    return blob, changed


def apply_patch(base: Mapping[str, torch.Tensor], blob: bytes, *, key: str,
                version: int) -> tuple[dict[str, torch.Tensor], int]:
    """``(state of version, values stored)``: ``base`` (version ``version - 1``) with the patch applied.

    ``base`` is not modified: changed tensors are new, unchanged ones are ``base``'s own objects.
    :class:`PatchError` for a blob this codec would not write against this base.
    """
    tensors, meta = _load(blob, key)
    if meta.get("format") != PATCH_FORMAT or meta.get("kind") != "patch" or meta.get("version") != str(version):
        raise PatchError(key, f"metadata {dict(sorted(meta.items()))!r:.120} is not a patch of version {version}")
    try:
        changes = json.loads(meta.get("changes", ""))
    except json.JSONDecodeError:
        raise PatchError(key, "its 'changes' metadata is not JSON") from None
    if not isinstance(changes, dict):
        raise PatchError(key, "its 'changes' metadata is not an object")
    expected = {f"val/{n}" for n in changes} | {f"pos/{n}" for n, c in changes.items()
                                                 if isinstance(c, list) and c[:1] != [DENSE]}
    if set(tensors) != expected:
        raise PatchError(key, f"tensors {sorted(set(tensors) ^ expected)[:4]} do not match its 'changes'")
    out = dict(base)
    stored = 0
    for name, change in sorted(changes.items()):
        if name not in base:
            raise PatchError(key, f"changes {name!r:.80}, which the base version {version - 1} does not hold")
        if (not isinstance(change, list) or len(change) != 2 or change[0] not in ENCODINGS
                or not isinstance(change[1], int) or isinstance(change[1], bool) or change[1] < 1):
            raise PatchError(key, f"{name}: change {change!r:.60} is not [encoding, count >= 1]")
        encoding, count = change
        old_t = base[name]
        values = tensors[f"val/{name}"]
        if values.dtype != torch.bfloat16 or tuple(values.shape) != (count,):
            raise PatchError(key, f"val/{name}: {values.dtype}{tuple(values.shape)}, expected bf16 ({count},)")
        pos_t = tensors.get(f"pos/{name}")
        if pos_t is not None and (pos_t.dtype != torch.uint8 or pos_t.dim() != 1):
            raise PatchError(key, f"pos/{name}: {pos_t.dtype}{tuple(pos_t.shape)}, expected uint8 1-D")
        positions = decode_positions(encoding, None if pos_t is None else pos_t.numpy(), count, old_t.numel(),
                                     key=key, name=name)
        if positions is None:
            out[name] = values.reshape(old_t.shape).clone()
        else:
            flat = old_t.reshape(-1).clone()
            flat[torch.from_numpy(positions)] = values
            out[name] = flat.reshape(old_t.shape)
        stored += count
    return out, stored


__all__ = ["BITMAP", "DENSE", "ENCODINGS", "GAPS", "PATCH_FORMAT", "PatchError", "apply_patch", "bits",
           "decode_anchor", "decode_positions", "encode_anchor", "encode_patch", "encode_positions", "state_digest",
           "state_numel", "varint_decode", "varint_encode"]
