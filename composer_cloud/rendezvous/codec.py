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
from safetensors.torch import save as st_save

CodecName = Literal["fp32", "bf16", "int8"]
CODECS: tuple[str, ...] = ("fp32", "bf16", "int8")
INT8_CHUNK = 512


def encoded_nbytes(codec: str, numel: int) -> int:
    """Approximate payload size (without the safetensors header) of ``numel`` elements."""
    if codec == "fp32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    if codec == "int8":
        return numel + 4 * -(-numel // INT8_CHUNK)
    raise ValueError(f"unknown codec {codec!r}")


def encode(codec: str, x: torch.Tensor) -> bytes:
    """Encode a 1-D float tensor (any float dtype; promoted to fp32 first)."""
    if x.dim() != 1:
        raise ValueError("codec input must be 1-D")
    x = x.detach().to("cpu", torch.float32).contiguous()
    meta = {"codec": codec, "numel": str(x.numel())}
    if codec == "fp32":
        return st_save({"data": x}, metadata=meta)
    if codec == "bf16":
        return st_save({"data": x.to(torch.bfloat16)}, metadata=meta)
    if codec == "int8":
        q, scale = _int8_quantize(x)
        return st_save({"q": q, "scale": scale}, metadata=meta | {"chunk": str(INT8_CHUNK)})
    raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")


def decode(codec: str, data: bytes | memoryview, *, key: str = "<payload>") -> torch.Tensor:
    """Decode to a 1-D float32 tensor. ``key`` names the object in errors."""
    tensors = st_load(bytes(data))
    if codec == "fp32":
        return tensors["data"]
    if codec == "bf16":
        return tensors["data"].to(torch.float32)
    if codec == "int8":
        return _int8_dequantize(tensors["q"], tensors["scale"])
    raise ValueError(f"{key}: unknown codec {codec!r}")


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
