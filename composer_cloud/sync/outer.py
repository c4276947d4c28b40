"""The outer optimizer of both sync modes: Nesterov SGD on the averaged pseudo-gradient.

Lock-step builds one per DiLoCo fragment and torchft's ``DiLoCo`` steps it once
per round; decoupled steps one per merge (:mod:`composer_cloud.sync.decoupled.outer`).
The hyper-parameters come from the spec only (``[outer_optimizer]``, whose
defaults depend on the sync mode): this config has none of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from composer_cloud.spec import RunSpec


@dataclass(frozen=True)
class OuterOptimizerConfig:
    """``lr`` scales the pseudo-gradient step; ``momentum`` is SGD momentum (Nesterov when ``nesterov``)."""

    lr: float
    momentum: float
    nesterov: bool

    @classmethod
    def from_spec(cls, spec: RunSpec) -> "OuterOptimizerConfig":
        outer = spec.outer_optimizer
        assert outer.lr is not None and outer.momentum is not None  # the spec fills them per sync mode
        return cls(lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)

    def hyperparameters(self) -> dict[str, Any]:
        """Every hyper-parameter of the step, as ``torch.optim.SGD`` names them (the stored ones never count)."""
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov, "dampening": 0.0,
                "weight_decay": 0.0, "maximize": False}


def outer_sgd(params: Iterable[torch.nn.Parameter], config: OuterOptimizerConfig) -> torch.optim.SGD:
    """The outer optimizer over ``params``."""
    import torch

    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov)


__all__ = ["OuterOptimizerConfig", "outer_sgd"]
