"""What launch checks about the model and the dataset a spec names, before anything is written.

``runs/lifecycle.check_before_launch`` calls these (and ``--dry-run`` through it):
a local model folder must be a saved model; a hub model the Hub denies is a
warning (the launcher may be offline); a dataset's columns must cover the column
mapping, the reward, or (causal-lm) a text or a prompt and an answer. Each raises
:class:`~composer_cloud.errors.SpecError` naming the field.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from composer_cloud.errors import SpecError

logger = logging.getLogger(__name__)


def check_model_dir(path: Path) -> None:
    """A local ``model.name`` must be a saved model folder: a ``config.json`` with a ``model_type``."""
    import json

    config = path / "config.json"
    if not path.is_dir():
        raise SpecError("model.name", f"{path} is a file; name a folder written by save_pretrained (or a hub id)")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except FileNotFoundError:
        raise SpecError("model.name", f"{path} has no config.json; name a folder written by "
                        "model.save_pretrained(...) and tokenizer.save_pretrained(...)") from None
    except (ValueError, OSError, AttributeError) as exc:
        raise SpecError("model.name", f"{config} is not a readable model config: {exc}") from None
    if not model_type:
        raise SpecError("model.name", f"{config} has no model_type, so transformers cannot load it")


def check_hub_model(name: str, base_dir: Path) -> None:
    """A ``model.name`` that is no local folder should be a hub model; say so early when the Hub disagrees.

    Only a warning: the launcher may be offline or lack the token the replicas get as a secret.
    """
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(name, timeout=10)
    except Exception as exc:  # noqa: BLE001
        logger.warning("model.name %r is neither a folder under %s nor a model the Hub confirms (%s: %s); the "
                       "replicas will try to download it", name, base_dir, type(exc).__name__, str(exc)[:200])
        return
    if info.config is not None and not info.config.get("model_type"):
        logger.warning("model.name %r: its config.json on the Hub has no model_type", name)


#: ``datasets`` builder names that read ``data_files`` (not hub repositories).
_BUILDER_NAMES = {"json", "csv", "parquet", "text", "arrow"}


def _causal_lm_columns(columns: Mapping[str, str], available: list[str]) -> list[str]:
    """The causal-LM trainer needs a text column, or a prompt and an answer column (empty: fine)."""
    has = {c for c in ("text", "prompt", "answer") if columns.get(c, c) in available}
    if "text" in has or {"prompt", "answer"} <= has:
        return []
    return [f"the causal-lm trainer needs a 'text' column, or 'prompt' and 'answer' (its columns: "
            f"{', '.join(available)}); map them with trainer.columns.text = \"<column>\" (or .prompt and .answer)"]


def check_dataset(settings: Mapping[str, Any], local: Mapping[str, Path], trainer: str = "three-channel"
                   ) -> list[str] | None:
    """The dataset's columns cover the mapping and the reward (local datasets: read here; hub ids: a
    warning when they cannot be reached from here). Returns the columns read (None: not read)."""
    from composer_cloud.trainer.three_channel.dataset_task import REWARD_NEEDS, DatasetError, dataset_columns, missing_columns

    name = str(local.get("trainer.dataset", settings["dataset"]))
    files = settings.get("data_files")
    local_files = [str(v) for k, v in sorted(local.items()) if k.startswith("trainer.data_files.")]
    if local_files:
        files = local_files
    split = settings.get("dataset_split", "train")
    splits = [split] + ([settings["eval_split"]] if settings.get("eval_split") else [])
    columns = dict(settings.get("columns") or {})
    reward = settings.get("reward") or "exact_match"
    needed = [REWARD_NEEDS[reward]] if reward in REWARD_NEEDS else []
    if "trainer.dataset" not in local and settings["dataset"] not in _BUILDER_NAMES:
        # A hub dataset: one quick request first, so an unreachable Hub costs a warning, not datasets' retries.
        try:
            from huggingface_hub import HfApi

            HfApi().dataset_info(settings["dataset"], timeout=10)
        except Exception as exc:  # noqa: BLE001 - offline, private, or missing: the replicas will say which
            logger.warning("trainer.dataset %r: columns not checked before launch (the Hub said %s: %s)",
                           settings["dataset"], type(exc).__name__, str(exc)[:200])
            return None
    available: list[str] | None = None
    for sp in splits:
        try:
            available = dataset_columns(name, sp, config=settings.get("dataset_config"), data_files=files)
        except DatasetError as exc:
            raise SpecError("trainer.dataset", str(exc).removeprefix("trainer.dataset ")) from None
        except Exception as exc:  # noqa: BLE001 - a hub dataset we cannot reach from here: the replicas may
            if "trainer.dataset" in local:
                raise SpecError("trainer.dataset", f"{name!r} cannot be read: {exc}") from None
            logger.warning("trainer.dataset %r: columns not checked before launch (%s: %s)", name,
                           type(exc).__name__, exc)
            return None
        problems = (_causal_lm_columns(columns, available) if trainer == "causal-lm"
                    else missing_columns(columns, available, needed=needed))
        if problems:
            field = "trainer.columns" if any(p.startswith("trainer.columns") for p in problems) else "trainer.dataset"
            raise SpecError(field, f"split {sp!r} of {settings['dataset']!r}: " + "; ".join(problems))
    return available


__all__ = ["check_dataset", "check_hub_model", "check_model_dir"]
