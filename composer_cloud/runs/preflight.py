"""What launch checks about the model and the dataset a spec names, before anything is written.

``runs/lifecycle.check_before_launch`` calls these (and ``--dry-run`` through it):
a local model folder must be a saved model; a hub model the Hub denies is a
warning (the launcher may be offline); a dataset's columns must cover the column
mapping, the reward, or (causal-lm) a text or a prompt and an answer. Each raises
:class:`~composer_cloud.errors.SpecError` naming the field.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from composer_cloud.errors import SpecError
from composer_cloud.jobs import assign_ranks
from composer_cloud.trainer.plugin import TrainerPlugin

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


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """``datasets`` logs a broken file's error itself (twice, with a 0-based row): leave the telling to us."""
    quiet = logging.getLogger("datasets")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        quiet.setLevel(level)


def check_local_data_file(path: Path, setting: str) -> None:
    """A local data file a spec names is not empty, and a JSON-lines file is JSON on every line.

    Raises :class:`SpecError` naming ``setting``, the file and the first bad line (counted from 1, as
    editors count). Folders (saved datasets) and other formats are left to their readers.
    """
    import json

    if not path.is_file():
        return
    if path.stat().st_size == 0:
        raise SpecError(setting, f"{str(path)!r} is empty (0 bytes); it needs one row per line")
    if path.suffix not in (".jsonl", ".ndjson") and not (path.suffix == ".json" and setting == "trainer.pairs"):
        return
    rows = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError as exc:
                raise SpecError(setting, f"{str(path)!r} line {number} is not JSON ({exc}): "
                                f"{line.strip()[:80]!r}") from None
            rows += 1
    if rows == 0:
        raise SpecError(setting, f"{str(path)!r} has no rows (only blank lines)")


def check_dataset(settings: Mapping[str, Any], local: Mapping[str, Path], trainer: TrainerPlugin
                   ) -> list[str] | None:
    """The dataset's columns are what ``trainer`` needs (:meth:`TrainerPlugin.dataset_problems`: the mapping, a
    reward's column; local datasets: read here; hub ids: a warning when they cannot be reached from here).
    Returns the columns read (None: not read)."""
    from composer_cloud.trainer.data import DatasetError, dataset_columns

    name = str(local.get("trainer.dataset", settings["dataset"]))
    files = settings.get("data_files")
    local_files = [str(v) for k, v in sorted(local.items()) if k.startswith("trainer.data_files.")]
    if local_files:
        files = local_files
    split = settings.get("dataset_split", "train")
    splits = [split] + ([settings["eval_split"]] if settings.get("eval_split") else [])
    if "trainer.dataset" not in local and settings["dataset"] not in _BUILDER_NAMES:
        # A hub dataset: one quick request first, so an unreachable Hub costs a warning, not datasets' retries.
        try:
            from huggingface_hub import HfApi

            HfApi().dataset_info(settings["dataset"], timeout=10)
        except Exception as exc:  # noqa: BLE001 - offline, private, or missing: the replicas will say which
            logger.warning("trainer.dataset %r: columns not checked before launch (the Hub said %s: %s)",
                           settings["dataset"], type(exc).__name__, str(exc)[:200])
            return None
    if "trainer.dataset" in local:
        for path in [Path(f) for f in (local_files or [])] or [local["trainer.dataset"]]:
            check_local_data_file(path, "trainer.dataset")
    available: list[str] | None = None
    for sp in splits:
        try:
            with _quiet_datasets():  # its own log lines repeat the error we raise, with a 0-based "row"
                available = dataset_columns(name, sp, config=settings.get("dataset_config"), data_files=files)
        except DatasetError as exc:
            raise SpecError("trainer.dataset", str(exc).removeprefix("trainer.dataset ")) from None
        except Exception as exc:  # noqa: BLE001 - a hub dataset we cannot reach from here: the replicas may
            if "trainer.dataset" in local:
                raise SpecError("trainer.dataset", f"{name!r} cannot be read: {type(exc).__name__}: "
                                f"{exc or 'no reason given'}") from None
            logger.warning("trainer.dataset %r: columns not checked before launch (%s: %s)", name,
                           type(exc).__name__, exc)
            return None
        problems = trainer.dataset_problems(available)
        if problems:
            field = "trainer.columns" if any(p.startswith("trainer.columns") for p in problems) else "trainer.dataset"
            raise SpecError(field, f"split {sp!r} of {settings['dataset']!r}: " + "; ".join(problems))
    return available


def launch_warnings(spec: Any, *, given: Mapping[str, Any] | None = None) -> list[str]:
    """Settings that launch accepts but that likely do not do what was meant (printed, never refused): a GPU
    type or flavor ``given`` (the settings the user set) for an executor no replica runs on, more local
    replica processes than this machine's cores."""
    executors = dict(assign_ranks(spec.executor, spec.replicas))
    given = given or {}
    out = []
    for setting, flag, executor in (("modal.gpu", "--gpu", "modal"), ("hf_jobs.flavor", "--flavor", "hf-jobs")):
        if given.get(setting) is not None and executor not in executors:
            out.append(f"{flag} {given[setting]} ({setting}) applies to {executor} replicas, but none runs there "
                       f"(executor {spec.executor!r}); local replicas use this machine's GPUs "
                       "(device = \"auto\" | \"cuda\")")
    local = len(executors.get("local", [])) * spec.gpus_per_replica
    cores = os.cpu_count() or 1
    if local > cores:
        out.append(f"{local} local replica processes on {cores} CPU core{'s' if cores != 1 else ''}: they will "
                   "share the cores and every round waits for the slowest; fewer replicas (--replicas) or a "
                   "cloud executor train faster")
    return out


@contextmanager
def leaves_no_new_folders(store_uri: str) -> Iterator[None]:
    """The store probe of a new ``file://`` store creates its folder: remove the folders it created (deepest
    first, only empty ones) when the block ends, so a check (``--dry-run``, ``doctor``) leaves no trace and a
    misspelt path is not made real."""
    local_root = Path(store_uri[len("file://"):]) if store_uri.startswith("file://") else None
    created = [p for p in ([local_root, *local_root.parents] if local_root else []) if not p.exists()]
    try:
        yield
    finally:
        for folder in created:
            try:
                folder.rmdir()
            except OSError:
                break


# ---------------------------------------------------------------- the replica's own start-up checks
#: What a replica refuses while it builds its model and trainer (``replica/runtime.Replica._build``), each
#: with what the launcher does about it. ``tests/test_first_hour.py`` reads this table against the
#: replica's code and proves each "launch" entry is refused by ``--dry-run``.
REPLICA_REFUSALS: dict[str, str] = {
    "model.attention: flash_attention_2 needs a CUDA GPU": "launch: local replicas on this machine's device, "
                                                           "cloud replicas without a GPU",
    "model.attention: flash_attention_2 computes in half precision": "launch: a spec check, every executor",
    "model.attention: flash_attention_2 needs the flash-attn package": "launch for local replicas; cannot for "
                                                                       "cloud replicas (their image decides)",
    "model.precision: has no bfloat16 support": "launch for local replicas (this machine's GPU); cannot for cloud "
                                                "replicas (the GPU model is known only in the job)",
    "model.precision: use": "launch: the spec's type allows only fp32 and bf16",
    "model.lora.target_modules: matches no module of this model": "launch for the demo model (a list of its "
                                                                  "linear layers' names is accepted as it is) and "
                                                                  "local model folders (built on the meta device); "
                                                                  "cannot for a hub model (the launcher may be "
                                                                  "offline)",
    "model.lora.dropout: the three-channel trainer runs without dropout": "launch: the trainer's check_model",
    "trainer.rollout: needs": "launch for local replicas (the trainer's check_launch); cloud replicas: in the job",
    "trainer.rollout: should be": "launch: the spec's type allows only the listed modes",
}


def replica_device(spec: Any, executor: str, gpus_per_replica: int) -> str:
    """The device type the replicas of ``executor`` will compute on, as ``Replica._build`` picks it.

    ``device = "auto"``: CUDA when the replica has a GPU (local: this machine's; cloud: its plan's GPUs).
    """
    if spec.device != "auto":
        return str(spec.device)
    if executor == "local":
        from composer_cloud.forking import gpu_device_nodes

        if not gpu_device_nodes():
            return "cpu"  # no GPU device file: torch would find none (importing it costs ~2 CPU-s)
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if gpus_per_replica > 0 else "cpu"


def _meta_model(spec: Any, local_model: Path | None) -> Any | None:
    """The spec's model with no weights (meta device), for checks on its module names; None: not known here.

    The demo model is built from its config; a local model folder from its ``config.json``; a hub model is
    not fetched (the launcher may be offline) and its replicas check it.
    """
    import torch

    if spec.model.name == "tiny":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from composer_cloud.model import TinyModelConfig

        m = spec.model  # the module names do not depend on the vocabulary's size
        config = Qwen2Config(vocab_size=TinyModelConfig().vocab_size, hidden_size=m.hidden_size,
                             num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                             num_key_value_heads=m.num_key_value_heads, intermediate_size=m.intermediate_size,
                             tie_word_embeddings=True)
        with torch.device("meta"):
            return Qwen2ForCausalLM(config)
    if local_model is not None:
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(local_model)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
        except Exception as exc:  # noqa: BLE001 - the replica loads it and says what is wrong
            logger.warning("model.name %s: LoRA target modules not checked before launch (%s: %s)", local_model,
                           type(exc).__name__, exc)
    return None


def _tiny_linear_targets(spec: Any) -> bool:
    """The built-in model's LoRA targets are a list of its linear layers' names: every name matches, so there is
    nothing for a meta-device model to find (building one imports transformers and peft, ~7 CPU-s)."""
    from composer_cloud.model import TINY_LINEAR_MODULES

    targets = spec.model.lora.target_modules
    return spec.model.name == "tiny" and not isinstance(targets, str) and bool(targets) and \
        set(targets) <= TINY_LINEAR_MODULES


def check_replica_build(spec: Any, devices: Mapping[str, str], local_model: Path | None) -> None:
    """The checks a replica runs while it builds its model and trainer, run here where they can be.

    ``devices``: executor name -> the device type its replicas compute on (:func:`replica_device`).
    Calls the replica's own functions (``model.resolve_attention``, ``model.check_precision``,
    ``lora.apply_lora`` on a meta-device model, the trainer's ``check_model``), so the launcher refuses
    with the replica's words. Raises :class:`SpecError` naming the field. :data:`REPLICA_REFUSALS` lists
    what cannot be checked here and why.
    """
    from composer_cloud.trainer.settings import settings_class

    def refuse(exc: ValueError, where: str) -> SpecError:
        field, _, rest = str(exc).partition(": ")
        return SpecError(field, f"{rest} ({where})")

    check_model = getattr(settings_class(spec.trainer.name), "check_model", None)
    if check_model is not None:
        try:
            check_model(spec.model)
        except ValueError as exc:
            raise refuse(exc, f"trainer {spec.trainer.name!r}") from None
    for executor, device in devices.items():
        if executor != "local" and device != "cpu":
            continue  # a cloud GPU: its image and GPU model are known only in the job
        from composer_cloud.model import check_precision, resolve_attention

        where = f"the {executor} executor's replicas compute on {device}"
        try:
            check_precision(spec.model.precision, device)
            resolve_attention(spec.model.attention, device=device, precision=spec.model.precision)
        except ValueError as exc:
            raise refuse(exc, where) from None
    lora = spec.model.lora
    if lora is not None and lora.target_modules != "all-linear" and not _tiny_linear_targets(spec):
        model = _meta_model(spec, local_model)
        if model is not None:
            import warnings

            from composer_cloud.lora import apply_lora

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                               target_modules=lora.target_modules, seed=spec.seed)
                except ValueError as exc:
                    raise refuse(exc, f"model {spec.model.name!r}") from None


__all__ = ["REPLICA_REFUSALS", "check_dataset", "check_local_data_file", "launch_warnings", "leaves_no_new_folders", "check_hub_model", "check_model_dir", "check_replica_build",
           "replica_device"]
