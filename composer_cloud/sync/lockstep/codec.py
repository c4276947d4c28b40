"""Wire codecs for pseudo-gradient slots.

A codec turns a 1-D float32 tensor into bytes and back. Payloads are
safetensors (no pickle); reduction always happens in float32 on decoded
values. Error bounds are per element, for finite inputs in the normal range:

* ``fp32`` — lossless.
* ``bf16`` — round-to-nearest-even to an 8-bit significand:
  ``|decode(encode(x)) - x| <= 2**-8 * |x|`` (half an ulp, ``2**-9`` relative
  to the next power of two, so ``2**-8`` relative to ``|x|``). 2 bytes/element.
* ``int8`` — symmetric absmax quantisation per chunk of ``INT8_CHUNK``
  elements: ``s = max|x_chunk| / 127``, ``q = round(x / s)``, so
  ``|decode(encode(x)) - x| <= s / 2 = max|x_chunk| / 254``.
  1 byte/element + 4 bytes per chunk.

A slot goes through a codec twice in one all-reduce (each replica's part on
the way to its reducer, then the reduced mean on the way back), so the error
of an all-reduced element is at most the mean of the inputs' bounds plus the
bound of the mean; tests check exactly that.
"""

from __future__ import annotations

from typing import Literal

import numpy.ctypeslib  # noqa: F401 - safetensors imports it lazily; racing first imports in threads can fail
import torch
from safetensors.torch import load as st_load

from composer_cloud.errors import BadObject
from composer_cloud.storage.tensors import save_tensors

CodecName = Literal["fp32", "bf16", "int8"]
CODECS: tuple[str, ...] = ("fp32", "bf16", "int8")
INT8_CHUNK = 512


def encode(codec: str, x: torch.Tensor) -> bytes:
    """Encode a 1-D float tensor (any float dtype; promoted to fp32 first)."""
    if x.dim() != 1:
        raise ValueError("codec input must be 1-D")
    x = x.detach().to("cpu", torch.float32).contiguous()
    meta = {"codec": codec, "numel": str(x.numel())}
    if codec == "fp32":
        return save_tensors({"data": x}, meta)
    if codec == "bf16":
        return save_tensors({"data": x.to(torch.bfloat16)}, meta)
    if codec == "int8":
        q, scale = _int8_quantize(x)
        return save_tensors({"q": q, "scale": scale}, meta | {"chunk": str(INT8_CHUNK)})
    raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")


class PayloadError(BadObject, ValueError):
    """An encoded payload is not what its codec writes (wrong tensors, dtypes or sizes).

    Raised by :func:`decode` with the object's key; a payload read from the
    store is untrusted, so this is an expected failure, not a bug.
    """

    def __init__(self, key: str, problem: str) -> None:
        self.problem = problem
        super().__init__(key, problem, message=f"{key}: {problem}")


def decode(codec: str, data: bytes | memoryview, *, key: str = "<payload>", numel: int | None = None) -> torch.Tensor:
    """Decode to a 1-D float32 tensor of ``numel`` elements (when given).

    ``key`` names the object in errors. Raises :class:`PayloadError` when the
    bytes are not a well-formed payload of ``codec`` (not safetensors, other
    tensor names, dtypes or shapes, a header that names another codec, or a
    length other than ``numel``). Values are not checked: non-finite values
    decode as they are (the all-reduce checks them).
    """
    if codec not in CODECS:
        raise ValueError(f"{key}: unknown codec {codec!r}; choose one of {CODECS}")
    try:
        tensors = st_load(bytes(data))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
        raise PayloadError(key, f"not a safetensors payload ({type(exc).__name__}: {exc})") from None
    expected = {"fp32": {"data": torch.float32}, "bf16": {"data": torch.bfloat16},
                "int8": {"q": torch.int8, "scale": torch.float32}}[codec]
    got = {name: t.dtype for name, t in tensors.items()}
    if got != expected:
        raise PayloadError(key, f"tensors {got} do not match codec {codec!r} ({expected})")
    if any(t.dim() != 1 for t in tensors.values()):
        raise PayloadError(key, "tensors must be 1-D")
    if codec == "int8":
        q, scale = tensors["q"], tensors["scale"]
        if scale.numel() != -(-q.numel() // INT8_CHUNK):
            raise PayloadError(key, f"{scale.numel()} int8 scales for {q.numel()} elements "
                                    f"(chunk {INT8_CHUNK})")
        out = _int8_dequantize(q, scale)
    else:
        out = tensors["data"].to(torch.float32)
    if numel is not None and out.numel() != numel:
        raise PayloadError(key, f"{out.numel()} elements, expected {numel}")
    return out


def norm_rtol(codec: str) -> float:
    """Relative bound on how far a codec moves a vector's L2 norm: ``|‖dec(enc(x))‖ - ‖x‖| <= rtol ‖x‖``.

    From the per-element bounds above: fp32 is exact (float32 rounding of the
    norm itself only); bf16 moves every element by at most ``2**-8 |x_i|``;
    int8 moves a chunk by at most ``sqrt(INT8_CHUNK) * max|x_chunk| / 254 <=
    0.089 ‖x_chunk‖`` (``INT8_CHUNK = 512``), hence the whole vector by at
    most ``0.089 ‖x‖``. Used to cross-check published norms, never to compare values.
    """
    return {"fp32": 1e-5, "bf16": 2**-8 + 1e-5, "int8": (INT8_CHUNK ** 0.5) / 254 + 1e-5}[codec]


def _int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    chunks = -(-n // INT8_CHUNK)
    padded = torch.zeros(chunks * INT8_CHUNK, dtype=torch.float32)
    padded[:n] = x
    view = padded.view(chunks, INT8_CHUNK)
    scale = view.abs().amax(dim=1) / 127.0
    # An all-zero chunk has scale 0: divide by 1 instead (q is 0 either way).
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(view / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[:n].contiguous(), scale


def _int8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n = q.numel()
    chunks = scale.numel()
    padded = torch.zeros(chunks * INT8_CHUNK, dtype=torch.float32)
    padded[:n] = q.to(torch.float32)
    return (padded.view(chunks, INT8_CHUNK) * scale[:, None]).view(-1)[:n].contiguous()
