"""Sparse, error-feedback pseudo-gradients (SparseLoCo's compressor) as a pure, strict codec.

SparseLoCo (Sarfi et al., arXiv 2508.15706) sends, per replica and per sync, the chunk-wise top-k of an
error-feedback accumulator with a few bits per value; what is not sent stays in the accumulator::

    e  <- decay * e + delta              # delta = global - local (the pseudo-gradient), fp32
    s  <- Q(TopK_chunk(e))               # k largest |e| of every chunk, n-bit values
    e  <- e - decode(s)                  # the residual (selection AND quantisation error) is fed back
    mean over replicas of decode(s)      # the outer step: theta <- theta - lr * mean (no outer momentum)

Wire format of one contribution (:func:`encode`): safetensors (no pickle) with one metadata entry of sorted
JSON ``{"codec": "sparse", "version", "numel", "chunk", "topk", "value_bits"}`` and three tensors:

* ``index_high``, ``index_low`` (uint8): for every chunk, its ``k`` positions, ascending, as Rice-coded gaps
  with parameter ``r = floor(log2(chunk / k))``: each gap's ``gap >> r`` in unary (one-bits and a
  terminating zero, padded with one-bits) and its low ``r`` bits packed MSB first (zero padding bits). About
  ``r + 2`` bits per position, against ``ceil(log2(chunk))`` written plainly (12 for 4096), and never more
  than ``k + (chunk - k) >> r`` unary bits per chunk.
* ``values`` (uint8): one code per position, ``value_bits`` bits: a sign bit and ``value_bits - 1`` bits of
  level, bit-packed the same way.
* ``levels`` (bfloat16, shape ``(chunks, 2 ** (value_bits - 1))``): every chunk's magnitude codebook,
  fitted to the selected magnitudes by two Lloyd (1-D k-means) iterations. A value decodes to
  ``sign * levels[chunk, level]``.

Chunks are contiguous runs of ``chunk`` elements of the flat tensor; every chunk sends ``k = topk`` positions
except the last, shorter one, which sends ``min(k, its length)``. So the payload's size depends only on
``numel`` and the settings, up to the unary gap bits (bounded: :func:`estimate_bytes`). Bits per value sent:
about ``rice_bits + 2 + value_bits``, plus ``2 * 2**(value_bits-1)`` bytes of levels per chunk.

Invariants:

* **Deterministic.** ``encode`` of the same inputs gives the same bytes (canonical order: positions
  ascending); :func:`mean` and :func:`merge` add in the order given, in float32.
* **Exact feedback.** The returned accumulator is ``decay * e + delta - decode(payload)``, computed with the
  very decoder a reader uses, so nothing sent is counted twice and nothing unsent is lost.
* **Strict decoding.** The bucket is untrusted: :func:`decode` checks the header, every tensor's dtype and
  length, the settings (against the run's when given), finite non-negative levels, positions inside their
  chunk, padding bits as written; any failure raises :class:`SparsePayloadError` naming the
  object's key and the field.
* **State is a tensor tree.** :class:`ErrorFeedback` holds one float32 accumulator per name;
  ``state_dict()`` is a ``dict[str, Tensor]`` that safetensors stores and restores bitwise.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy.ctypeslib  # noqa: F401 - safetensors imports it lazily; racing first imports in threads can fail
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from composer_cloud.errors import BadObject

if TYPE_CHECKING:
    from composer_cloud.spec import RunSpec

logger = logging.getLogger(__name__)

CODEC = "sparse"
FORMAT_VERSION = 1
#: The one ``__metadata__`` key of our safetensors payloads (sorted JSON, so bytes depend on content only).
METADATA_KEY = "composer_cloud"
_LLOYD_ITERATIONS = 2
_MAX_HEADER_BYTES = 1 << 16


class SparseSettings(BaseModel):
    """Settings of the sparse codec (``sync.sparse`` in the run spec). Defaults: SparseLoCo's.

    Attributes:
        density: fraction of each chunk sent, ``topk = max(1, round(density * chunk))`` positions per chunk
            (SparseLoCo: 64 of 4096, 1.56 %).
        value_bits: bits per sent value: a sign bit and ``value_bits - 1`` bits of magnitude level.
        decay: error-feedback decay ``beta`` in ``e <- beta * e + delta`` (0: no memory, plain top-k).
        chunk: elements per chunk; positions are sent in ``ceil(log2(chunk))`` bits.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    density: float = Field(default=1 / 64, gt=0, le=1)
    value_bits: int = Field(default=2, ge=1, le=8)
    decay: float = Field(default=0.95, ge=0, le=1)
    chunk: int = Field(default=4096, ge=2, le=1 << 20)

    @property
    def topk(self) -> int:
        """Positions sent per (full) chunk."""
        return max(1, min(self.chunk, round(self.density * self.chunk)))

    @property
    def index_bits(self) -> int:
        """Bits of a position inside a chunk written plainly (the bound the gap code never exceeds much)."""
        return max(1, (self.chunk - 1).bit_length())

    @property
    def rice_bits(self) -> int:
        """Low bits of each gap between sent positions: ``floor(log2(chunk / topk))`` (Rice parameter)."""
        return max(0, (self.chunk // self.topk).bit_length() - 1)

    @property
    def levels(self) -> int:
        """Magnitude levels per chunk (``2 ** (value_bits - 1)``)."""
        return 1 << (self.value_bits - 1)


class SparsePayloadError(BadObject, ValueError):
    """A sparse payload is malformed, forged, or encoded with other settings.

    ``key`` names the object, ``problem`` what is wrong (with the field); a payload read from the store is
    untrusted, so this is an expected failure: the caller rejects the contribution, never uses it.
    """

    def __init__(self, key: str, problem: str) -> None:
        self.problem = problem
        super().__init__(key, problem, message=f"{key}: {problem}")


@dataclass(frozen=True)
class SparseUpdate:
    """A decoded contribution: ``values`` (float32) at flat ``indices`` (int64, ascending) of ``numel``."""

    numel: int
    indices: torch.Tensor
    values: torch.Tensor

    def to_dense(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        out[self.indices] = self.values
        return out

    def norm(self) -> float:
        return float(torch.linalg.vector_norm(self.values.double()))


@dataclass(frozen=True)
class SparseEncoding:
    """What :func:`encode` returns: the payload, the new accumulator, and what the payload decodes to."""

    payload: bytes
    accumulator: torch.Tensor
    sent: SparseUpdate


# --------------------------------------------------------------------------- layout
def chunk_layout(numel: int, settings: SparseSettings) -> tuple[int, int, int]:
    """``(full chunks, length of the last partial chunk (0: none), positions it sends)``."""
    full, rem = divmod(numel, settings.chunk)
    return full, rem, min(settings.topk, rem)


def nnz_of(numel: int, settings: SparseSettings) -> int:
    """Positions one contribution of ``numel`` elements sends."""
    full, _, k_last = chunk_layout(numel, settings)
    return full * settings.topk + k_last


def max_high_bits(numel: int, settings: SparseSettings) -> int:
    """Upper bound of the unary stream's length in bits: per chunk ``k + (length - k) >> rice_bits``."""
    full, rem, k_last = chunk_layout(numel, settings)
    k, r = settings.topk, settings.rice_bits
    bound = full * (k + ((settings.chunk - k) >> r))
    return bound + (k_last + ((rem - k_last) >> r) if rem else 0)


def estimate_bytes(numel: int, settings: SparseSettings) -> int:
    """Upper bound of one contribution's tensor bytes (the payload adds a header of about 400 bytes).

    Exact for values, levels and the gaps' low bits; the unary high bits depend on the data and are
    bounded by :func:`max_high_bits` (a uniform spread of positions uses about half of that bound's slack).
    """
    full, rem, _ = chunk_layout(numel, settings)
    nnz = nnz_of(numel, settings)
    chunks = full + (1 if rem else 0)
    return (-(-max_high_bits(numel, settings) // 8) + -(-nnz * settings.rice_bits // 8)
            + -(-nnz * settings.value_bits // 8) + 2 * chunks * settings.levels)


# --------------------------------------------------------------------------- bit packing
def _to_bytes(bits: torch.Tensor, pad_bit: int = 0) -> torch.Tensor:
    """A stream of 0/1 values as uint8 bytes, MSB first, padded with ``pad_bit`` to a whole byte."""
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, torch.full((pad,), pad_bit, dtype=torch.uint8)])
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.int64).to(torch.uint8)


def _to_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_to_bytes` (int64 0/1 values, padding included)."""
    shifts = torch.arange(7, -1, -1, dtype=torch.int64)
    return ((packed.to(torch.int64).reshape(-1, 1) >> shifts) & 1).reshape(-1)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers ``< 2**bits`` into a uint8 tensor, MSB first, zero-padded to a byte."""
    shifts = torch.arange(bits - 1, -1, -1, dtype=torch.int64)
    return _to_bytes(((codes.reshape(-1, 1).to(torch.int64) >> shifts) & 1).reshape(-1).to(torch.uint8))


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> tuple[torch.Tensor, bool]:
    """Inverse of :func:`pack_bits`: ``count`` codes (int64), and whether every padding bit was zero."""
    flat = _to_bits(packed)
    used = count * bits
    clean = not bool(flat[used:].any())
    weights = 1 << torch.arange(bits - 1, -1, -1, dtype=torch.int64)
    return (flat[:used].view(count, bits) * weights).sum(dim=1), clean


# --------------------------------------------------------------------------- encode
def _select(acc: torch.Tensor, settings: SparseSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk, the top-k positions by magnitude, ascending: ``(positions in chunk, chunk id)`` per sent value."""
    numel = acc.numel()
    c, k = settings.chunk, settings.topk
    full, rem, k_last = chunk_layout(numel, settings)
    pos_parts, chunk_parts = [], []
    if full:
        mags = acc[:full * c].abs().view(full, c)
        top = torch.topk(mags, k, dim=1, sorted=True).indices
        pos_parts.append(torch.sort(top, dim=1).values.reshape(-1))
        chunk_parts.append(torch.arange(full, dtype=torch.int64).repeat_interleave(k))
    if rem:
        top = torch.topk(acc[full * c:].abs(), k_last, sorted=True).indices
        pos_parts.append(torch.sort(top).values)
        chunk_parts.append(torch.full((k_last,), full, dtype=torch.int64))
    return torch.cat(pos_parts), torch.cat(chunk_parts)


def _fit_levels(mags: torch.Tensor, chunk_of: torch.Tensor, chunks: int, levels: int) -> torch.Tensor:
    """Per chunk, a codebook of ``levels`` magnitudes (ascending) fitted by Lloyd iterations, as bfloat16."""
    if levels == 1:
        sums = torch.zeros(chunks, dtype=torch.float64).index_add_(0, chunk_of, mags.double())
        counts = torch.zeros(chunks, dtype=torch.float64).index_add_(0, chunk_of, torch.ones_like(mags.double()))
        return (sums / counts.clamp(min=1)).to(torch.float32).view(chunks, 1).to(torch.bfloat16)
    # Start from equal-count groups of the sorted magnitudes (the rank of each value inside its chunk).
    order = torch.argsort(mags, stable=True)
    order = order[torch.argsort(chunk_of[order], stable=True)]
    counts = torch.zeros(chunks, dtype=torch.int64).index_add_(0, chunk_of, torch.ones_like(chunk_of))
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(chunk_of)
    rank[order] = torch.arange(mags.numel(), dtype=torch.int64) - starts[chunk_of[order]]
    assign = (rank * levels) // counts[chunk_of].clamp(min=1)
    centers = _bin_means(mags, chunk_of, assign, chunks, levels, fallback=None)
    for _ in range(_LLOYD_ITERATIONS):
        assign = _nearest(mags, centers[chunk_of])
        centers = _bin_means(mags, chunk_of, assign, chunks, levels, fallback=centers)
    return torch.sort(centers, dim=1).values.to(torch.bfloat16)


def _bin_means(mags: torch.Tensor, chunk_of: torch.Tensor, assign: torch.Tensor, chunks: int, levels: int,
               fallback: torch.Tensor | None) -> torch.Tensor:
    flat = chunk_of * levels + assign
    sums = torch.zeros(chunks * levels, dtype=torch.float64).index_add_(0, flat, mags.double())
    counts = torch.zeros(chunks * levels, dtype=torch.float64).index_add_(0, flat, torch.ones_like(sums[flat]))
    means = (sums / counts.clamp(min=1)).view(chunks, levels).to(torch.float32)
    empty = (counts == 0).view(chunks, levels)
    if fallback is not None:
        return torch.where(empty, fallback, means)
    # Empty initial bins (a chunk with fewer values than levels): use the chunk's largest mean so far.
    filled = torch.where(empty, torch.full_like(means, -1.0), means)
    return torch.where(empty, filled.amax(dim=1, keepdim=True).clamp(min=0), means)


def _nearest(mags: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """Index of the closest codebook entry per magnitude (ties: the lower entry)."""
    return torch.argmin((mags[:, None] - codebooks).abs(), dim=1)


def encode(delta: torch.Tensor, accumulator: torch.Tensor | None, settings: SparseSettings) -> SparseEncoding:
    """Fold ``delta`` into the error-feedback accumulator and encode its chunk-wise top-k.

    Args:
        delta: this sync's pseudo-gradient, 1-D (any float dtype; used in float32). Must be finite.
        accumulator: the previous accumulator (1-D float32 of the same length), or ``None`` for zeros.
        settings: the codec's settings.

    Returns:
        :class:`SparseEncoding`: the payload bytes, the new accumulator
        ``decay * accumulator + delta - decode(payload)`` (a new tensor; the inputs are not modified) and
        the decoded payload. Raises ``ValueError`` for a non-finite input or a length mismatch.
    """
    if delta.dim() != 1:
        raise ValueError(f"sparse encode: delta must be 1-D, got shape {tuple(delta.shape)}")
    delta = delta.detach().to("cpu", torch.float32)
    numel = delta.numel()
    if numel == 0:
        raise ValueError("sparse encode: empty delta")
    if accumulator is None:
        acc = delta.clone()
    else:
        if accumulator.shape != delta.shape or accumulator.dtype != torch.float32:
            raise ValueError(f"sparse encode: accumulator {tuple(accumulator.shape)} {accumulator.dtype} does "
                             f"not match delta {tuple(delta.shape)} float32")
        acc = accumulator.detach().to("cpu").mul(settings.decay).add_(delta)
    if not bool(torch.isfinite(acc).all()):
        raise ValueError("sparse encode: the accumulator is not finite (a NaN/inf pseudo-gradient); not sent")
    full, rem, _ = chunk_layout(numel, settings)
    chunks = full + (1 if rem else 0)
    pos, chunk_of = _select(acc, settings)
    flat_idx = chunk_of * settings.chunk + pos
    vals = acc[flat_idx]
    mags = vals.abs()
    levels = _fit_levels(mags, chunk_of, chunks, settings.levels)
    level = _nearest(mags, levels.to(torch.float32)[chunk_of])
    sign = (vals < 0).to(torch.int64)
    codes = (sign << (settings.value_bits - 1)) | level
    high, low = _gap_code(pos, chunk_of, settings.rice_bits)
    tensors = {"index_high": high, "index_low": low, "values": pack_bits(codes, settings.value_bits),
               "levels": levels}
    meta = {"codec": CODEC, "version": FORMAT_VERSION, "numel": numel, "chunk": settings.chunk,
            "topk": settings.topk, "value_bits": settings.value_bits}
    payload = _save(tensors, meta)
    sent = SparseUpdate(numel, flat_idx, _dequantize(codes, chunk_of, levels, settings.value_bits))
    acc[flat_idx] -= sent.values
    return SparseEncoding(payload=payload, accumulator=acc, sent=sent)


def _gap_code(pos: torch.Tensor, chunk_of: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rice code of the gaps between ascending positions of each chunk: ``(unary high parts, r-bit low parts)``.

    Gap ``g`` (positions skipped since the previous sent one, or since the chunk's start) is written as
    ``g >> r`` one-bits and a zero in ``index_high`` (padded with one-bits to a byte), and ``g & (2**r - 1)``
    in ``index_low`` (:func:`pack_bits`).
    """
    first = torch.ones_like(pos, dtype=torch.bool)
    first[1:] = chunk_of[1:] != chunk_of[:-1]
    prev = torch.cat([pos.new_zeros(1), pos[:-1] + 1])
    gaps = torch.where(first, pos, pos - prev)
    high = gaps >> r
    ends = torch.cumsum(high + 1, 0) - 1  # the terminating zero of each gap
    bits = torch.ones(int(ends[-1]) + 1, dtype=torch.uint8)
    bits[ends] = 0
    packed = _to_bytes(bits, pad_bit=1)
    low = pack_bits(gaps & ((1 << r) - 1), r) if r else torch.zeros(0, dtype=torch.uint8)
    return packed, low


def _gap_decode(high: torch.Tensor, low: torch.Tensor, chunk_of: torch.Tensor, r: int,
                key: str) -> torch.Tensor:
    """Inverse of :func:`_gap_code`: positions inside their chunks (validated by the caller)."""
    nnz = chunk_of.numel()
    bits = _to_bits(high)
    ends = torch.nonzero(bits == 0).reshape(-1)
    if ends.numel() != nnz:
        raise SparsePayloadError(key, f"index_high: {ends.numel()} gap terminators, expected {nnz}")
    if bits.numel() - 1 - int(ends[-1]) >= 8:
        raise SparsePayloadError(key, "index_high: more than a byte of padding")
    quotient = torch.diff(ends, prepend=ends.new_full((1,), -1)) - 1
    if r:
        remainder, clean = unpack_bits(low, r, nnz)
        if not clean:
            raise SparsePayloadError(key, "index_low: non-zero padding bits")
    else:
        remainder = torch.zeros(nnz, dtype=torch.int64)
    steps = (quotient << r) + remainder + 1  # distance to the previous position + 1 (first: from -1)
    run = torch.cumsum(steps, 0)
    first = torch.ones(nnz, dtype=torch.bool)
    first[1:] = chunk_of[1:] != chunk_of[:-1]
    starts = torch.cummax(torch.where(first, run - steps, torch.zeros_like(run)), 0).values
    return run - starts - 1


def _dequantize(codes: torch.Tensor, chunk_of: torch.Tensor, levels: torch.Tensor, value_bits: int) -> torch.Tensor:
    """The one decoder of values, used by the encoder (for the residual) and by readers."""
    level_mask = (1 << (value_bits - 1)) - 1
    mag = levels.to(torch.float32)[chunk_of, codes & level_mask]
    return torch.where((codes >> (value_bits - 1)) & 1 == 1, -mag, mag)


# --------------------------------------------------------------------------- decode
def decode(data: bytes | bytearray | memoryview, *, key: str = "<payload>", numel: int | None = None,
           settings: SparseSettings | None = None) -> SparseUpdate:
    """Decode and validate one contribution; raises :class:`SparsePayloadError` naming ``key`` and the field.

    ``numel`` (when given) is the length the caller expects; ``settings`` (when given) are the run's: a
    payload encoded with another chunk size, density or value width is rejected (it could be denser, i.e.
    heavier, than the run allows).
    """
    tensors, meta = _load(data, key, CODEC, {"index_high": torch.uint8, "index_low": torch.uint8,
                                             "values": torch.uint8, "levels": torch.bfloat16})
    n = _meta_int(meta, "numel", key, 1, 1 << 40)
    chunk = _meta_int(meta, "chunk", key, 2, 1 << 20)
    topk = _meta_int(meta, "topk", key, 1, chunk)
    value_bits = _meta_int(meta, "value_bits", key, 1, 8)
    if numel is not None and n != numel:
        raise SparsePayloadError(key, f"numel: {n} elements, expected {numel}")
    got = SparseSettings(density=topk / chunk, value_bits=value_bits, chunk=chunk)
    if got.topk != topk:  # a topk that no density gives back (cannot happen for honest writers)
        raise SparsePayloadError(key, f"topk: {topk} is not representable for chunk {chunk}")
    if settings is not None and (settings.chunk, settings.topk, settings.value_bits) != (chunk, topk, value_bits):
        raise SparsePayloadError(key, f"settings: chunk {chunk}, topk {topk}, value_bits {value_bits} differ from "
                                      f"the run's (chunk {settings.chunk}, topk {settings.topk}, "
                                      f"value_bits {settings.value_bits})")
    full, rem, k_last = chunk_layout(n, got)
    chunks = full + (1 if rem else 0)
    nnz = nnz_of(n, got)
    high = tensors["index_high"]
    if high.dim() != 1 or not 1 <= high.numel() <= -(-max_high_bits(n, got) // 8):
        raise SparsePayloadError(key, f"index_high: {high.numel()} bytes, at most "
                                      f"{-(-max_high_bits(n, got) // 8)} for {nnz} positions")
    _check_len(tensors["index_low"], -(-nnz * got.rice_bits // 8), "index_low", key)
    _check_len(tensors["values"], -(-nnz * value_bits // 8), "values", key)
    levels = tensors["levels"]
    if tuple(levels.shape) != (chunks, got.levels):
        raise SparsePayloadError(key, f"levels: shape {tuple(levels.shape)}, expected ({chunks}, {got.levels})")
    lv = levels.to(torch.float32)
    if not bool(torch.isfinite(lv).all()) or bool((lv < 0).any()):
        raise SparsePayloadError(key, "levels: every level must be finite and >= 0")
    codes, clean_v = unpack_bits(tensors["values"], value_bits, nnz)
    if not clean_v:
        raise SparsePayloadError(key, "values: non-zero padding bits")
    chunk_of = torch.arange(full, dtype=torch.int64).repeat_interleave(topk)
    if rem:
        chunk_of = torch.cat([chunk_of, torch.full((k_last,), full, dtype=torch.int64)])
    # Gaps are >= 0, so positions ascend strictly by construction; only the chunk's end can be overrun.
    pos = _gap_decode(high, tensors["index_low"], chunk_of, got.rice_bits, key)
    length = torch.full((chunks,), chunk, dtype=torch.int64)
    if rem:
        length[-1] = rem
    if bool((pos >= length[chunk_of]).any()):
        bad = int(torch.nonzero(pos >= length[chunk_of])[0])
        raise SparsePayloadError(key, f"index: position {int(pos[bad])} outside chunk {int(chunk_of[bad])} "
                                      f"of {int(length[chunk_of[bad]])} elements")
    flat_idx = chunk_of * chunk + pos
    return SparseUpdate(n, flat_idx, _dequantize(codes, chunk_of, levels, value_bits))


def _check_len(t: torch.Tensor, expected: int, name: str, key: str) -> None:
    if t.dim() != 1 or t.numel() != expected:
        raise SparsePayloadError(key, f"{name}: {t.numel()} bytes (shape {tuple(t.shape)}), expected {expected}")


def _meta_int(meta: dict[str, object], name: str, key: str, lo: int, hi: int) -> int:
    value = meta.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise SparsePayloadError(key, f"{name}: {value!r} is not an integer in [{lo}, {hi}]")
    return value


# --------------------------------------------------------------------------- aggregation
def mean(updates: Sequence[SparseUpdate], *, numel: int | None = None) -> torch.Tensor:
    """Dense float32 mean of ``updates``: summed in the given order, then divided by their count."""
    return total(updates, numel=numel).div_(len(updates))


def total(updates: Sequence[SparseUpdate], *, numel: int | None = None) -> torch.Tensor:
    """Dense float32 sum of ``updates``, added one update after the other in the given order."""
    if not updates:
        raise ValueError("no updates to sum")
    n = updates[0].numel if numel is None else numel
    out = torch.zeros(n, dtype=torch.float32)
    for u in updates:
        if u.numel != n:
            raise ValueError(f"update of {u.numel} elements in a sum of {n}")
        out[u.indices] += u.values  # indices are unique within one update: no write conflicts
    return out


def merge(updates: Sequence[SparseUpdate]) -> SparseUpdate:
    """The exact sparse sum (union of the supports), added in the given order in float32.

    Bitwise equal to ``total(updates)`` restricted to the union (the convergence benchmark's union density).
    """
    if not updates:
        raise ValueError("no updates to merge")
    n = updates[0].numel
    if any(u.numel != n for u in updates):
        raise ValueError("updates of different lengths cannot be merged")
    union = torch.unique(torch.cat([u.indices for u in updates]), sorted=True)
    values = torch.zeros(union.numel(), dtype=torch.float32)
    for u in updates:
        values[torch.searchsorted(union, u.indices)] += u.values
    return SparseUpdate(n, union, values)


# --------------------------------------------------------------------------- safetensors framing
def _save(tensors: dict[str, torch.Tensor], meta: dict[str, object]) -> bytes:
    return st_save(tensors, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True, separators=(",", ":"))})


def _load(data: bytes | bytearray | memoryview, key: str, codec: str,
          expected: dict[str, torch.dtype]) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    raw = bytes(data)
    if len(raw) < 8:
        raise SparsePayloadError(key, f"header: truncated payload of {len(raw)} bytes")
    (header_len,) = struct.unpack_from("<Q", raw)
    if header_len > min(_MAX_HEADER_BYTES, len(raw) - 8):
        raise SparsePayloadError(key, f"header: length {header_len} does not fit the payload")
    try:
        header = json.loads(raw[8:8 + header_len])
        meta = json.loads(header["__metadata__"][METADATA_KEY])
    except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed payload
        raise SparsePayloadError(key, f"header: not a {codec} payload ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or meta.get("codec") != codec:
        raise SparsePayloadError(key, f"codec: {meta.get('codec') if isinstance(meta, dict) else meta!r}, "
                                      f"expected {codec!r}")
    if meta.get("version") != FORMAT_VERSION:
        raise SparsePayloadError(key, f"version: {meta.get('version')!r}, this reader knows {FORMAT_VERSION}")
    try:
        tensors = st_load(raw)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
        raise SparsePayloadError(key, f"tensors: not a safetensors payload ({type(exc).__name__}: {exc})") from None
    got = {name: t.dtype for name, t in tensors.items()}
    if got != expected:
        raise SparsePayloadError(key, f"tensors: {got} do not match {codec!r} ({expected})")
    return tensors, meta


# --------------------------------------------------------------------------- replica state
class ErrorFeedback:
    """A replica's error-feedback accumulators, one float32 tensor per name (e.g. per all-reduce bucket).

    Training state (DESIGN invariant 13): checkpoint :meth:`state_dict` with the replica's other state and
    :meth:`load_state_dict` it on resume; encoding then continues bitwise as if never interrupted.
    """

    def __init__(self, settings: SparseSettings) -> None:
        self.settings = settings
        self._acc: dict[str, torch.Tensor] = {}

    def encode(self, name: str, delta: torch.Tensor) -> SparseEncoding:
        """Encode ``delta`` for bucket ``name`` and keep the new accumulator (only once encoding succeeded)."""
        out = encode(delta, self._acc.get(name), self.settings)
        self._acc[name] = out.accumulator
        return out

    def names(self) -> list[str]:
        return sorted(self._acc)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in sorted(self._acc.items())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the accumulators; each must be a finite 1-D float32 tensor (raises ``ValueError`` naming it)."""
        checked: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.float32:
                raise ValueError(f"error-feedback state {name!r}: expected a 1-D float32 tensor")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"error-feedback state {name!r}: not finite")
            checked[name] = t.detach().to("cpu").clone()
        self._acc = checked

    def reset(self, names: Iterable[str] | None = None) -> None:
        """Forget the accumulators (all, or ``names``): after a heal, the residual of a dropped round is stale."""
        for name in list(self._acc if names is None else names):
            self._acc.pop(name, None)


def settings_of(spec: RunSpec) -> SparseSettings | None:
    """A run's codec settings (``[sync.sparse]``) when ``sync.codec = "sparse"``, else None."""
    exchange_keys = {"exchange", "group_size"}  # [sync.sparse] keys that pick the exchange (grouped.py)
    return SparseSettings(**spec.sync.sparse.model_dump(exclude=exchange_keys)) if spec.sync.codec == CODEC else None


__all__ = ["CODEC", "ErrorFeedback", "SparseEncoding", "SparsePayloadError", "SparseSettings",
           "SparseUpdate", "chunk_layout", "decode", "encode", "estimate_bytes", "mean", "merge", "nnz_of", "settings_of", "total"]
