"""Nested state dicts <-> safetensors bytes, without pickle.

torch state dicts (optimizer state, torchft fragment state) are trees of
dicts, lists, tensors and scalars, with integer dict keys in places. This
module stores the tensors as safetensors entries and the tree's shape as JSON
in the safetensors metadata, so ``decode_state(encode_state(x))`` rebuilds
``x`` exactly (tensor bytes, dtypes, key types) and nothing is unpickled.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

_TENSOR = "__tensor__"
_ITEMS = "__items__"
_TUPLE = "__tuple__"


def flatten(tree: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``tree`` into ``(tensors by path, JSON skeleton)``."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node.detach().to("cpu").contiguous()
            return {_TENSOR: path}
        if isinstance(node, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in node):
                return {k: walk(v, f"{path}/{k}") for k, v in node.items()}
            return {_ITEMS: [[k, walk(v, f"{path}/{k}")] for k, v in node.items()]}
        if isinstance(node, tuple):
            return {_TUPLE: [walk(v, f"{path}/{i}") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"cannot store {type(node).__name__} at {path or '/'} (tensors, scalars, lists, dicts only)")

    skeleton = walk(tree, prefix)
    return tensors, skeleton


def unflatten(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if _TENSOR in node:
                return tensors[node[_TENSOR]]
            if _ITEMS in node:
                return {k: walk(v) for k, v in node[_ITEMS]}
            if _TUPLE in node:
                return tuple(walk(v) for v in node[_TUPLE])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(skeleton)


#: The one ``__metadata__`` key our safetensors blobs use (its value: JSON with sorted keys).
METADATA_KEY = "composer_cloud"


def save_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes that depend only on the tensors and ``metadata``, in every process.

    safetensors keeps ``__metadata__`` in a hash map whose order changes from
    one call to the next, so two writers of the same state would write
    different bytes. One metadata key holding sorted JSON makes the bytes a
    function of the content: a slice or reduced slot written by a taker-over is
    byte-identical to the owner's.
    """
    return st_save(tensors, metadata={METADATA_KEY: json.dumps(metadata, sort_keys=True, separators=(",", ":"))})


def encode_state(tree: Any, *, metadata: dict[str, str] | None = None) -> bytes:
    """Serialise a state tree to safetensors bytes (skeleton in the metadata)."""
    tensors, skeleton = flatten(tree)
    meta = dict(metadata or {})
    meta["skeleton"] = json.dumps(skeleton)
    return save_tensors(tensors, meta)


def decode_state(data: bytes | memoryview) -> Any:
    """Inverse of :func:`encode_state`."""
    raw = bytes(data)
    tensors = st_load(raw)
    meta = read_metadata(raw)
    return unflatten(tensors, json.loads(meta["skeleton"]))


def read_metadata(raw: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob, without loading tensors."""
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    meta = dict(header.get("__metadata__", {}))
    packed = meta.pop(METADATA_KEY, None)
    if packed is not None:
        meta.update(json.loads(packed))
    return meta
