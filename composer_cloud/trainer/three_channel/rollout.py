"""vLLM rollouts (``[trainer] rollout = "vllm"``): availability checks and the engine's model directory.

The engine itself is TRL's (``GRPOConfig(use_vllm=True, vllm_mode="colocate")``:
``trl.generation.vllm_generation.VLLMGeneration``, one engine inside each
replica's process, on its GPU). This module holds what TRL leaves to us:

* :func:`check_vllm_rollout`: refuse, naming ``trainer.rollout``, where vLLM
  cannot run (no CUDA device, vLLM not installed: the message says how to
  install it). :func:`check_rollout_before_launch` is the launcher's version
  for replicas that run on the launching machine.
* :func:`ensure_engine_model_dir`: vLLM builds its engine from
  ``model.name_or_path``; a model built from a config (the demo model, the GPU
  benchmark's shapes) has none, so its config, tokenizer and weights are
  written to a directory first. Which weights the engine starts from does not
  matter: TRL pushes the policy's weights before the first generation. A
  temporary directory it makes lives as long as the model (removed when the
  model is collected or the process exits; a kill -9 leaves it in the temp dir).

The runtime imports this module only when ``rollout = "vllm"``, and the module
imports nothing of vLLM itself (TRL does, when it builds the engine).

Weight refresh: TRL pushes the policy's weights into the engine before a
generation whenever ``state.global_step`` moved since the last push (so after
every inner optimizer step). Parameters replaced outside the optimizer (a
DiLoCo outer step, a heal, a decoupled adopt, a restored checkpoint) reach the
engine through ``ThreeChannelTrainer.on_params_replaced()``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import weakref
from typing import Any

logger = logging.getLogger(__name__)

#: How to get the optional vLLM dependency (TRL's pinned vLLM range).
VLLM_INSTALL = "pip install 'composer-cloud[vllm]'"


def vllm_installed() -> bool:
    """Whether ``vllm`` can be imported here (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def check_vllm_rollout(device_type: str) -> None:
    """Raise ``ValueError`` naming ``trainer.rollout`` when a replica on ``device_type`` cannot generate with vLLM.

    Every missing piece is named at once (the install command, the GPU), so one fix is never followed by another refusal.
    """
    missing = []
    if not vllm_installed():
        missing.append(f"vLLM, which is not installed: {VLLM_INSTALL}")
    if device_type != "cuda":
        missing.append(f"a CUDA GPU; this replica runs on {device_type}")
    if missing:
        raise ValueError(f'trainer.rollout: "vllm" needs {" and ".join(missing)}. Or use rollout = "hf".')


def runs_replicas_here(executor: str) -> bool:
    """Whether ``executor`` (``"local"``, ``"local:1,modal:2"``...) puts any replica on the launching machine."""
    from composer_cloud.spec import parse_executor

    try:
        return any(share.backend == "local" for share in parse_executor(executor))
    except ValueError:  # malformed: launch's rank assignment refuses it, naming the setting
        return False


def check_rollout_before_launch(spec: Any, *, cuda_available: bool | None = None) -> None:
    """The launch-time check of ``trainer.rollout`` for replicas that run on this machine (the ``local`` executor).

    ``launch`` runs it with its other checks (``runs.lifecycle.check_before_launch``). Cloud executors'
    replicas are checked where they run. ``cuda_available`` defaults to asking torch (only imported when
    ``rollout = "vllm"``).
    """
    if (spec.trainer.model_extra or {}).get("rollout") != "vllm" or not runs_replicas_here(spec.executor):
        return
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    device = "cuda" if spec.device == "cuda" or (spec.device == "auto" and cuda_available) else "cpu"
    check_vllm_rollout(device)


def ensure_engine_model_dir(model: Any, tokenizer: Any, *, directory: str | None = None) -> str:
    """Return a ``name_or_path`` vLLM can build its engine from, writing one if ``model`` has none.

    A hub id or an existing local directory is returned as it is. Otherwise the
    (base) model's config and weights and the tokenizer are saved to
    ``directory`` (default: a new temporary directory) and the model's
    ``name_or_path`` points there. A temporary directory is removed with the
    model (garbage collection or interpreter exit): a full copy of the weights
    per replica start would otherwise pile up in the temp dir.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    current = str(getattr(base, "name_or_path", "") or "")
    if current and (not os.path.exists(current) or os.path.isfile(os.path.join(current, "config.json"))):
        return current
    if directory:
        target = directory
    else:
        target = tempfile.mkdtemp(prefix="composer-cloud-vllm-")
        weakref.finalize(base, shutil.rmtree, target, ignore_errors=True)
    # Under LoRA the base's layers are wrapped: save them under their plain names, without the adapters.
    state = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
    base.save_pretrained(target, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(target)
    base.name_or_path = target
    base.config._name_or_path = target
    logger.info("vLLM engine model directory: %s", target)
    return target


__all__ = [
    "VLLM_INSTALL",
    "check_rollout_before_launch",
    "check_vllm_rollout",
    "ensure_engine_model_dir",
    "runs_replicas_here",
    "vllm_installed",
]
