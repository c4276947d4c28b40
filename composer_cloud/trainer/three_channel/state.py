"""What makes a three-channel step reproducible: its prompt stream, its RNG streams, and their pickle-free state.

Everything here is saved as ``(tensors, JSON metadata)``: tensors travel as
safetensors, the rest as JSON, nothing is pickled (design invariant 6). The
key layout is the checkpoint format of ``ThreeChannelTrainer.STATE_VERSION``
1; changing a key means a new version.
"""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch


# --------------------------------------------------------------------------- prompt stream
class PromptStream:
    """This rank's shard of the training rows, walked in a fresh seeded order each epoch.

    Rank ``r`` of ``W`` owns rows ``r, r + W, ...``; its state is ``(epoch, position)``.
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]], *, seed: int, rank: int, world_size: int) -> None:
        self.rows = [dict(r) for r in list(rows)[rank::world_size]]
        if not self.rows:
            raise ValueError(f"rank {rank} of {world_size} has no training rows ({len(rows)} rows in all)")
        self.seed = seed * 1_000_003 + rank
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while len(out) < n:
            order = self._order(self.epoch)
            i = order[self.position]
            out.append(dict(self.rows[i]))
            self.position += 1
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "n_rows": len(self.rows)}

    def load(self, state: Mapping[str, int]) -> None:
        if int(state["n_rows"]) != len(self.rows):
            raise ValueError(f"data state is for {state['n_rows']} rows but this shard has {len(self.rows)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# --------------------------------------------------------------------------- RNG
class RNGState:
    """The RNG streams one trainer owns: torch CPU (and CUDA), python ``random``, numpy.

    :meth:`scope` swaps them into the global generators for the duration of a
    step and swaps the caller's back afterwards, so that TRL's sampling and
    shuffling (which use the globals) are reproducible and checkpointable
    without disturbing anyone else's streams.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if device.index is not None:
            self.cuda_index = device.index
        else:
            self.cuda_index = torch.cuda.current_device() if self.cuda else 0
        with torch.random.fork_rng(devices=[self.cuda_index] if self.cuda else []):
            torch.manual_seed(seed)
            self.torch_cpu = torch.get_rng_state()
            self.torch_cuda = torch.cuda.get_rng_state(self.cuda_index) if self.cuda else None
        self.python = random.Random(seed).getstate()
        self.numpy = np.random.RandomState(seed % 2**32).get_state()

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        saved_cuda = torch.cuda.get_rng_state(self.cuda_index) if self.cuda else None
        torch.set_rng_state(self.torch_cpu)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        if self.cuda:
            torch.cuda.set_rng_state(self.torch_cuda, self.cuda_index)
        try:
            yield
        finally:
            self.torch_cpu = torch.get_rng_state()
            self.python = random.getstate()
            self.numpy = np.random.get_state()
            if self.cuda:
                self.torch_cuda = torch.cuda.get_rng_state(self.cuda_index)
                torch.cuda.set_rng_state(saved_cuda, self.cuda_index)
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        kind, keys, pos, has_gauss, gauss = self.numpy
        tensors = {
            "torch_cpu": self.torch_cpu.clone(),
            "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        }
        if self.torch_cuda is not None:
            tensors["torch_cuda"] = self.torch_cuda.clone()
        version, internal, gauss_next = self.python
        meta = {
            "python": [version, list(internal), gauss_next],
            "numpy": [kind, int(pos), int(has_gauss), float(gauss)],
        }
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        self.torch_cpu = tensors["torch_cpu"].to(torch.uint8).cpu().clone()
        if self.cuda:
            if "torch_cuda" not in tensors:
                raise ValueError("checkpoint has no CUDA RNG state but this trainer runs on CUDA")
            self.torch_cuda = tensors["torch_cuda"].to(torch.uint8).cpu().clone()
        version, internal, gauss_next = meta["python"]
        self.python = (int(version), tuple(int(x) for x in internal), gauss_next)
        kind, pos, has_gauss, gauss = meta["numpy"]
        keys = tensors["numpy_keys"].numpy().astype(np.uint32)
        self.numpy = (kind, keys, int(pos), int(has_gauss), float(gauss))


@contextlib.contextmanager
def forked_global_rngs(device: torch.device) -> Iterator[None]:
    """Run a block without changing the caller's torch / python / numpy RNG streams."""
    py, nps = random.getstate(), np.random.get_state()
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(nps)


# --------------------------------------------------------------------------- state_dict helpers
def with_prefix(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{prefix + key: tensor}``: one component's tensors inside the trainer's flat dict."""
    return {f"{prefix}{k}": v for k, v in tensors.items()}


def under_prefix(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors whose key starts with ``prefix``, with the prefix removed (inverse of :func:`with_prefix`)."""
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def pack_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer state as tensors ``optim.<param id>.<name>`` and JSON (param groups, scalar state)."""
    opt = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in opt["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim.{pid}.{k}"] = v.detach().clone().contiguous()
            else:
                scalars.setdefault(str(pid), {})[k] = v
    meta = {"param_groups": opt["param_groups"], "scalars": scalars, "ids": [str(p) for p in opt["state"]]}
    return tensors, meta


def unpack_optimizer(
    optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> None:
    """Load what :func:`pack_optimizer` returned (``betas`` come back from JSON as lists: made tuples again)."""
    state: dict[int, dict[str, Any]] = {}
    for pid in meta["ids"]:
        st: dict[str, Any] = dict(meta["scalars"].get(pid, {}))
        st.update(under_prefix(f"optim.{pid}.", tensors))
        state[int(pid)] = st
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in group.items()} for group in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def pack_generation_buffer(
    buffered: Sequence[Mapping[str, Any]] | None,
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]] | None]:
    """TRL's buffered generation batch as tensors ``buffer.<i>.<key>`` and JSON for the non-tensor entries.

    Raises ``TypeError`` (from ``json.dumps``) on an entry a JSON checkpoint cannot hold, rather than dropping it.
    """
    if buffered is None:
        return {}, None
    tensors: dict[str, torch.Tensor] = {}
    meta: list[dict[str, Any]] = []
    for i, chunk in enumerate(buffered):
        entry: dict[str, Any] = {}
        for k, v in chunk.items():
            if isinstance(v, torch.Tensor):
                tensors[f"buffer.{i}.{k}"] = v.detach().cpu().clone().contiguous()
                entry[k] = "tensor"
            else:
                json.dumps(v)  # fails loudly on anything a JSON checkpoint cannot hold
                entry[k] = {"value": v}
        meta.append(entry)
    return tensors, meta


def unpack_generation_buffer(
    tensors: Mapping[str, torch.Tensor], meta: Sequence[Mapping[str, Any]] | None, device: torch.device
) -> list[dict[str, Any]] | None:
    """Inverse of :func:`pack_generation_buffer`, tensors moved to ``device``."""
    if meta is None:
        return None
    return [
        {k: (tensors[f"buffer.{i}.{k}"].to(device) if spec == "tensor" else spec["value"]) for k, spec in entry.items()}
        for i, entry in enumerate(meta)
    ]


__all__ = [
    "PromptStream",
    "RNGState",
    "forked_global_rngs",
    "pack_generation_buffer",
    "pack_optimizer",
    "under_prefix",
    "unpack_generation_buffer",
    "unpack_optimizer",
    "with_prefix",
]
