"""How a decoupled contribution's pseudo-gradient becomes bytes and back: fp32 tensors, or sparse.

``sync.codec = "sparse"`` makes every contribution one SparseLoCo payload (:mod:`composer_cloud.sync.sparse`)
of the model's parameters flattened in sorted-name order; every other codec keeps the dense float32
safetensors blob (decoupled merges sum few contributions, so they stay exact). The writer's error-feedback
accumulator advances only once its contribution is published (:meth:`ContributionEncoder.commit`), and is
part of the replica's checkpointed inner state (``state_dict`` / ``load_state_dict``, bitwise).

Decoding is strict either way: a payload is untrusted and any mismatch with the run's settings or the
model's names and shapes raises :class:`~composer_cloud.errors.BadObject` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
import torch

from composer_cloud.errors import BadObject
from composer_cloud.sync import sparse
from composer_cloud.sync.checks import check_tree

Shapes = Mapping[str, tuple[int, ...]]
_ACC = "model"  # the one accumulator of a decoupled replica: the whole model, flattened


def _flatten(delta: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([delta[n].detach().to("cpu", torch.float32).reshape(-1) for n in sorted(delta)])


class ContributionEncoder:
    """One replica's contribution encoder; holds the sparse codec's error feedback (None settings: dense)."""

    def __init__(self, settings: sparse.SparseSettings | None) -> None:
        self.settings = settings
        self._acc: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None

    def encode(self, delta: Mapping[str, torch.Tensor], meta: dict[str, str]) -> bytes:
        """The contribution's bytes. For sparse, the new accumulator waits for :meth:`commit`."""
        from composer_cloud.storage.tensors import save_tensors

        if self.settings is None:
            return save_tensors({k: v.detach().to("cpu", dtype=torch.float32).contiguous() for k, v in delta.items()},
                                meta)
        enc = sparse.encode(_flatten(delta), self._acc, self.settings)
        self._pending = enc.accumulator
        return enc.payload

    def commit(self) -> None:
        """The contribution was published: what it sent no longer stays in the accumulator."""
        if self._pending is not None:
            self._acc, self._pending = self._pending, None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self._acc is None else {_ACC: self._acc.clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` output; raises ``ValueError`` for a state this run cannot use."""
        if not state:
            self._acc = None
            return
        if self.settings is None or set(state) != {_ACC}:
            raise ValueError(f"codec state {sorted(state)} does not belong to this run's codec")
        ef = sparse.ErrorFeedback(self.settings)
        ef.load_state_dict(dict(state))
        self._acc = ef.state_dict()[_ACC]


def decode_contribution(raw: bytes, *, key: str, shapes: Shapes,
                        settings: sparse.SparseSettings | None) -> dict[str, torch.Tensor]:
    """The pseudo-gradient in a contribution blob: the model's names and shapes, float32, finite."""
    if settings is not None:
        numel = sum(_numel(s) for s in shapes.values())
        try:
            flat = sparse.decode(raw, key=key, numel=numel, settings=settings).to_dense()
        except sparse.SparsePayloadError as exc:
            raise BadObject(key, exc.problem) from None
        tensors, offset = {}, 0
        for name in sorted(shapes):
            n = _numel(shapes[name])
            tensors[name] = flat[offset:offset + n].view(shapes[name])
            offset += n
        return tensors
    from safetensors.torch import load as st_load

    try:
        tensors = st_load(raw)
    except Exception as exc:  # noqa: BLE001 - any decode failure is a bad object
        raise BadObject(key, f"not safetensors ({type(exc).__name__})") from None
    check_tree(tensors, shapes, key)
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise BadObject(key, f"tensor {name!r} is {t.dtype}, expected float32")
    return tensors


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["ContributionEncoder", "decode_contribution"]
