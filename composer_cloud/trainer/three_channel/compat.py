"""The TRL compatibility guard: the private ``GRPOTrainer`` hooks the three-channel trainer relies on.

:class:`~.grpo.ThreeChannelGRPOTrainer` overrides or calls private
``GRPOTrainer`` methods. Importing this module (which ``grpo`` does first)
runs :func:`check_trl_compatibility` on the installed TRL, so a TRL release
that changed those hooks fails at import with a message naming the supported
range (:data:`TRL_SUPPORTED`, the same pin as ``pyproject.toml``) instead of
failing, or worse training wrongly, in the middle of a run.
"""

from __future__ import annotations

import importlib
import inspect
import logging

import trl
from packaging.version import Version
from trl import GRPOTrainer

from composer_cloud.errors import ConfigError

logger = logging.getLogger(__name__)

TRL_SUPPORTED = ">=1.16,<1.17"  # keep in sync with pyproject.toml
_TRL_MIN, _TRL_MAX = Version("1.16"), Version("1.17")

# Private GRPOTrainer methods the subclass overrides or calls, with the leading
# parameters it relies on. Extra trailing parameters are fine if they have
# defaults (our calls stay valid); anything else is a break.
EXPECTED_HOOKS: dict[str, tuple[str, ...]] = {
    "_generate_and_score_completions": ("self", "inputs"),
    "_compute_loss": ("self", "model", "inputs"),
    "_prepare_inputs": ("self", "generation_batch"),
    "_tokenize_prompts": ("self", "prompts"),
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ),
    "training_step": ("self", "model", "inputs", "num_items_in_batch"),
    "_generate_single_turn": ("self", "prompt_ids", "images", "multimodal_fields", "num_generations"),
}
# Instance attributes of GRPOTrainer read or written by the subclass and the adapter (checked after __init__).
EXPECTED_ATTRS: tuple[str, ...] = (
    "_step",
    "_buffered_inputs",
    "_metrics",
    "eos_token_ids",
    "temperature",
    "num_iterations",
    "aux_loss_enabled",
    "router_aux_loss_coef",
    "use_vllm",  # raised for TRL's importance-sampling correction of sampler log-probs (grpo._sampler_correction)
    "reward_funcs",
    "max_completion_length",
)
# Module-level names of trl.trainer.grpo_trainer the subclass replaces while TRL's __init__ runs.
EXPECTED_MODULE_NAMES: tuple[str, ...] = ("create_model_from_path",)


class TRLCompatibilityError(ConfigError, ImportError):
    """The installed TRL's ``GRPOTrainer`` no longer matches what the three-channel trainer overrides."""


def check_trl_compatibility(cls: type = GRPOTrainer, version: str | None = None) -> None:
    """Raise :class:`TRLCompatibilityError` when ``cls`` lacks a hook or a hook's signature changed.

    A version outside :data:`TRL_SUPPORTED` whose hooks still match only logs a warning.
    """
    version = version or trl.__version__
    problems: list[str] = []
    for name, expected in EXPECTED_HOOKS.items():
        fn = getattr(cls, name, None)
        if fn is None or not callable(fn):
            problems.append(f"GRPOTrainer.{name} is missing")
            continue
        params = list(inspect.signature(fn).parameters.values())
        names = tuple(p.name for p in params[: len(expected)])
        extra_required = [
            p.name
            for p in params[len(expected) :]
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if names != expected or extra_required:
            got = "(" + ", ".join(p.name for p in params) + ")"
            problems.append(f"GRPOTrainer.{name}{got}, expected ({', '.join(expected)}, ...)")
    module = importlib.import_module(cls.__module__) if cls is GRPOTrainer else None
    for name in EXPECTED_MODULE_NAMES if module is not None else ():
        if not callable(getattr(module, name, None)):
            problems.append(f"{cls.__module__}.{name} is missing")
    if problems:
        raise TRLCompatibilityError(
            f"composer_cloud's three-channel trainer supports trl{TRL_SUPPORTED}, but the installed trl "
            f"{version} changed the private GRPOTrainer hooks it overrides: " + "; ".join(problems) + ". "
            f"Install a supported version (pip install 'trl{TRL_SUPPORTED}')."
        )
    v = Version(version)
    if not (_TRL_MIN <= v < _TRL_MAX):
        logger.warning("trl %s is outside the tested range trl%s; its hooks still match", version, TRL_SUPPORTED)


def check_trainer_attributes(trainer: GRPOTrainer) -> None:
    """Raise :class:`TRLCompatibilityError` when a built ``GRPOTrainer`` lacks an attribute we use."""
    missing = [a for a in EXPECTED_ATTRS if not hasattr(trainer, a)]
    if missing:
        raise TRLCompatibilityError(
            f"trl {trl.__version__}: GRPOTrainer instances no longer have {missing}; supported: trl{TRL_SUPPORTED}"
        )


check_trl_compatibility()


__all__ = ["TRL_SUPPORTED", "TRLCompatibilityError", "check_trainer_attributes", "check_trl_compatibility"]
