"""The three-channel trainer: TRL's ``GRPOTrainer`` with the loss of :mod:`composer_cloud.trainer.three_channel.loss`.

One module per concern:

* :mod:`.settings`: :class:`ThreeChannelSettings`, the ``[trainer]`` table
  (and :class:`ThreeChannelConfig`, the loss's part of it); no torch, no TRL;
* :mod:`.compat`: the TRL compatibility guard (:func:`check_trl_compatibility`,
  run when the module is imported, before anything uses TRL's private hooks);
* :mod:`.grpo`: :class:`ThreeChannelGRPOTrainer`, the ``GRPOTrainer`` subclass;
* :mod:`.state`: :class:`PromptStream`, the RNG streams and the pickle-free
  ``(tensors, JSON)`` state helpers;
* :mod:`.sourced`: completions from rollout workers (:class:`~.sourced.CompletionSource`, the key, the
  staleness and fallback policy);
* :mod:`.adapter`: :class:`ThreeChannelTrainer`, the runtime's ``InnerTrainer``,
  and :func:`build_three_channel_trainer`, its factory.

Names are imported lazily (as in ``huggingface_hub``): importing
:mod:`.settings` (the launcher's settings check) loads neither torch nor TRL;
the first access to a TRL-backed name imports :mod:`.compat` and so runs the
TRL guard.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "ThreeChannelConfig": "settings",
    "ThreeChannelSettings": "settings",
    "TRL_SUPPORTED": "compat",
    "TRLCompatibilityError": "compat",
    "check_trl_compatibility": "compat",
    "ThreeChannelGRPOTrainer": "grpo",
    "PromptStream": "state",
    "RNGState": "state",
    "ThreeChannelTrainer": "adapter",
    "build_three_channel_trainer": "adapter",
}

if TYPE_CHECKING:
    from composer_cloud.trainer.three_channel.adapter import ThreeChannelTrainer, build_three_channel_trainer
    from composer_cloud.trainer.three_channel.compat import (
        TRL_SUPPORTED,
        TRLCompatibilityError,
        check_trl_compatibility,
    )
    from composer_cloud.trainer.three_channel.grpo import ThreeChannelGRPOTrainer
    from composer_cloud.trainer.three_channel.settings import ThreeChannelConfig, ThreeChannelSettings
    from composer_cloud.trainer.three_channel.state import PromptStream, RNGState


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "PromptStream",
    "RNGState",
    "TRLCompatibilityError",
    "TRL_SUPPORTED",
    "ThreeChannelConfig",
    "ThreeChannelGRPOTrainer",
    "ThreeChannelSettings",
    "ThreeChannelTrainer",
    "build_three_channel_trainer",
    "check_trl_compatibility",
]
assert sorted(__all__) == sorted(_EXPORTS)
