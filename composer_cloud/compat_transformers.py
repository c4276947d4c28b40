"""Transformers' activation-checkpointing API on both sides of its rename (transformers 5.23).

transformers 5.23 renamed gradient checkpointing to *activation* checkpointing:
``PreTrainedModel.activation_checkpointing_enable`` / ``is_activation_checkpointing`` and the
``TrainingArguments`` fields ``activation_checkpointing`` / ``activation_checkpointing_kwargs``.
The old names (``gradient_checkpointing_enable``, ``is_gradient_checkpointing``,
``gradient_checkpointing[_kwargs]``) stay as deprecated aliases that emit a ``FutureWarning``
on every use; releases before 5.23 only have the old names (passing the new field to
``GRPOConfig`` there is a ``TypeError``). This module is the one place that picks the
name, by feature detection (not by version number), so the rest of composer_cloud calls:

* :func:`enable_activation_checkpointing` and :func:`is_activation_checkpointing` on a model,
* :func:`activation_checkpointing_args` for the ``TrainingArguments`` / ``GRPOConfig`` keywords.

TRL and PEFT still read the deprecated aliases internally (TRL around every no-grad forward,
PEFT when it wraps a model): :func:`silence_deprecated_checkpointing_aliases` filters exactly those
``FutureWarning`` messages (nothing else), and importing this module installs that filter.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Any

logger = logging.getLogger(__name__)

#: The ``FutureWarning`` messages of transformers >= 5.23's deprecated checkpointing aliases
#: (regular expressions matched at the start of the message, as :func:`warnings.filterwarnings` does).
DEPRECATED_ALIAS_MESSAGES: tuple[str, ...] = (
    r"`is_gradient_checkpointing` is deprecated",
    r"`gradient_checkpointing_enable` is deprecated",
    r"`gradient_checkpointing_disable` is deprecated",
    r"`gradient_checkpointing(_kwargs)?` is deprecated",
)


def silence_deprecated_checkpointing_aliases() -> None:
    """Ignore the ``FutureWarning`` s of transformers' deprecated checkpointing aliases (idempotent).

    Only those messages are filtered: every other warning, including other ``FutureWarning`` s of
    transformers, is shown as before. composer_cloud itself uses the new names where they exist;
    the aliases are read by TRL and PEFT, which a user cannot change.
    """
    for message in DEPRECATED_ALIAS_MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


@functools.cache
def training_args_use_activation_names() -> bool:
    """Whether ``transformers.TrainingArguments`` has the ``activation_checkpointing`` field (>= 5.23)."""
    from transformers import TrainingArguments

    return any(f.name == "activation_checkpointing" for f in dataclasses.fields(TrainingArguments))


def activation_checkpointing_args(enabled: bool, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords that turn activation checkpointing on or off.

    Always both the flag and its kwargs, under the names the installed transformers knows
    (``activation_checkpointing*`` from 5.23, ``gradient_checkpointing*`` before), so TRL's
    own default (``GRPOConfig.gradient_checkpointing = True``) never applies unseen.

    Args:
        enabled: checkpoint activations in the trainer's forward passes.
        kwargs: passed to ``torch.utils.checkpoint`` (e.g. ``{"use_reentrant": False}``).
    """
    prefix = "activation" if training_args_use_activation_names() else "gradient"
    return {f"{prefix}_checkpointing": bool(enabled), f"{prefix}_checkpointing_kwargs": dict(kwargs or {})}


def _has_activation_api(model: Any) -> bool:
    # A method, not the property: hasattr() on `is_gradient_checkpointing` would run it (and warn).
    return callable(getattr(model, "activation_checkpointing_enable", None))


def enable_activation_checkpointing(model: Any, kwargs: dict[str, Any] | None = None) -> None:
    """Turn on activation checkpointing of a transformers model (or a PEFT model around one)."""
    if _has_activation_api(model):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_activation_checkpointing(model: Any) -> bool:
    """Whether ``model`` checkpoints activations; ``False`` for a model without the API (not a transformers model)."""
    if _has_activation_api(model):
        return bool(getattr(model, "is_activation_checkpointing", False))
    return bool(getattr(model, "is_gradient_checkpointing", False))


silence_deprecated_checkpointing_aliases()

__all__ = [
    "activation_checkpointing_args",
    "enable_activation_checkpointing",
    "is_activation_checkpointing",
    "silence_deprecated_checkpointing_aliases",
    "training_args_use_activation_names",
]
