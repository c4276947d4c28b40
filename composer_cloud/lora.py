"""LoRA through PEFT: wrap a model, name what DiLoCo syncs, export merged or as an adapter.

Under ``[model.lora]`` a replica trains low-rank adapters on a frozen base
(:func:`apply_lora`). The pieces the sync layer and ``export`` use:

* :func:`synced_parameters`: the parameters DiLoCo averages and checkpoints,
  by name. Under LoRA only the adapters (the base never changes, so its
  pseudo-gradient is zero and syncing it would only cost bytes); otherwise
  every parameter.
* :func:`export_merged`: the adapters folded into the base
  (``merge_and_unload``), saved as a plain Hugging Face model that
  ``transformers`` loads without PEFT.
* :func:`export_adapter`: the adapter alone in PEFT's format
  (``adapter_config.json`` + ``adapter_model.safetensors``).

Invariants: :func:`apply_lora` draws the adapters' initial values from its own
seeded generator (every replica builds identical adapters for one seed, and the
caller's RNG streams are untouched); LoRA's ``B`` matrices start at zero, so the
wrapped model computes exactly what the base does until the first step.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)


def is_lora_model(model: torch.nn.Module) -> bool:
    """True for a PEFT-wrapped model (what :func:`apply_lora` returns).

    Never imports ``peft`` itself: a model can only be a PEFT model once ``peft`` was imported.
    """
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def apply_lora(
    model: torch.nn.Module,
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: str | Sequence[str],
    seed: int,
) -> torch.nn.Module:
    """Wrap ``model`` in LoRA adapters (PEFT); only the adapters require gradients afterwards.

    Raises ``ValueError`` naming ``model.lora.target_modules`` (and the model's linear
    layers) when the target modules match nothing.
    """
    from peft import LoraConfig, get_peft_model
    from peft.utils.error import NoMatchingPeftModuleError

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")
    # The adapters' A matrices are drawn from torch's global RNG: fork and seed it so that every replica
    # gets the same adapters and the caller's stream is not perturbed.
    devices = [model.device.index or 0] if getattr(model, "device", torch.device("cpu")).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            wrapped = get_peft_model(model, config)
    except NoMatchingPeftModuleError:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"model.lora.target_modules: {target_modules!r} matches no module of this model; its "
                         f"linear layers are {linear} (or use \"all-linear\")") from None
    return wrapped


def synced_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``{name: parameter}`` that DiLoCo syncs and checkpoints, in model order.

    Under LoRA: the trainable (adapter) parameters only. Otherwise: every
    parameter. The names are ``model.named_parameters()``'s, identical on every
    replica built from the same spec.
    """
    if is_lora_model(model):
        return {name: p for name, p in model.named_parameters() if p.requires_grad}
    return dict(model.named_parameters())


@dataclass(frozen=True)
class SyncFootprint:
    """Bytes of the synced parameter set against the whole model (float32 on the wire unless a codec says otherwise).

    Attributes:
        synced_params: elements DiLoCo syncs (:func:`synced_parameters`).
        total_params: elements of the whole model (base included).
        synced_bytes: ``synced_params`` in their own dtypes (bytes).
        full_bytes: every parameter of the model, float32 (what a full fine-tune syncs).
    """

    synced_params: int
    total_params: int
    synced_bytes: int
    full_bytes: int

    @property
    def ratio(self) -> float:
        """``synced_bytes / full_bytes``."""
        return self.synced_bytes / self.full_bytes


def sync_footprint(model: torch.nn.Module) -> SyncFootprint:
    """Measure :class:`SyncFootprint` for ``model`` (works on meta-device models: nothing is read)."""
    synced = synced_parameters(model)
    # The base of a LoRA model holds its own weights once (the adapters are extra tensors).
    total = sum(p.numel() for p in model.parameters())
    base = sum(p.numel() for name, p in model.named_parameters() if name not in synced) if is_lora_model(model) else total
    return SyncFootprint(
        synced_params=sum(p.numel() for p in synced.values()),
        total_params=total,
        synced_bytes=sum(p.numel() * p.element_size() for p in synced.values()),
        full_bytes=4 * base,
    )


def merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model with the adapters folded into its weights (``merge_and_unload``; in place).

    A model without adapters is returned as it is. The LoRA model must not be
    used afterwards: its base layers now carry the merged weights.
    """
    if not is_lora_model(model):
        return model
    return model.merge_and_unload()


def export_merged(model: torch.nn.Module, tokenizer: Any, out: str | Path) -> Path:
    """Save the merged model (:func:`merged_model`, consumes ``model``) and the tokenizer to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plain = merged_model(model)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def export_adapter(model: torch.nn.Module, out: str | Path) -> Path:
    """Save the adapter alone in PEFT's format (``PeftModel.from_pretrained(base, out)`` loads it)."""
    if not is_lora_model(model):
        raise ValueError("export_adapter: the model has no LoRA adapter; set [model.lora] in the run spec")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


__all__ = [
    "SyncFootprint",
    "apply_lora",
    "export_adapter",
    "export_merged",
    "is_lora_model",
    "merged_model",
    "sync_footprint",
    "synced_parameters",
]
