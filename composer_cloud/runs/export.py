"""Turn a run's global parameters into a Hugging Face model directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from composer_cloud.errors import CorruptCheckpoint
from composer_cloud.runs import sync_state
from composer_cloud.storage.run import Run
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore

logger = logging.getLogger(__name__)


def export_model(run: Run, out: Path, *, round: int | None = None, adapter: bool = False) -> int:
    """Write ``save_pretrained`` safetensors + config + tokenizer of the global params; returns the round.

    A LoRA run's model is written merged (a plain transformers model, no PEFT needed to load it); with
    ``adapter``, its adapter alone in PEFT's format instead (any other run is refused: ``LookupError``).

    ``round`` defaults to the latest valid checkpoint. Raises ``LookupError``
    naming the run if there is none, or if ``round`` has no global state.
    """
    from composer_cloud.model import load_spec_model
    from composer_cloud.sync.lockstep.diloco import load_global_parameters, split_fragments

    store, spec = run.store, run.spec
    if adapter:
        _check_adapter_export(run)
    states, attempt_of = GlobalStateStore(store), sync_state.attempt_of(store, spec)
    model, tokenizer = load_spec_model(spec.model, seed=spec.seed)
    fragments = split_fragments(model, spec.sync.fragments)
    if round is not None:
        attempt = attempt_of(round)
        if attempt is None or not states.durable(round, attempt):
            raise LookupError(f"run {store.uri} has no global state for round {round} "
                              f"(available: {states.durable_rounds(attempt_of)})")
        load_global_parameters(fragments, states.load(round, attempt))
    else:
        # Newest checkpoint with a manifest whose global state reads back intact: one verified read each.
        before = None
        while True:
            found = sync_state.latest_checkpoint(store, spec, before=before, verify=False)
            if found is None:
                raise LookupError(f"run {store.uri} has no valid checkpoint to export yet")
            try:
                load_global_parameters(fragments, states.load(found.round, found.manifest.attempt))
                round = found.round
                break
            except CorruptCheckpoint as exc:
                logger.warning("checkpoint %d cannot be exported (%s); trying the previous one", found.round, exc)
                before = found.round
    if adapter:
        _write_adapter(model, tokenizer, out)
    else:
        from composer_cloud.lora import export_merged

        export_merged(model, tokenizer, out)  # under [model.lora]: the adapters folded into the base
    logger.info("exported round %d to %s", round, out)
    return round


def _check_adapter_export(run: Run) -> None:
    """``export --adapter`` needs a LoRA run: refuse any other before anything is read or written."""
    if getattr(run.spec.model, "lora", None) is None:
        raise LookupError(f"run {run.store.uri} has no [model.lora]: --adapter writes a LoRA run's adapter; "
                          "export it without --adapter")


def _write_adapter(model: Any, tokenizer: Any, out: Path) -> None:
    """The adapter alone in PEFT's format, with the tokenizer (``PeftModel.from_pretrained(base, out)``).

    The base it applies to is the run's ``model.name`` (for ``"tiny"``, the model built from the run's spec).
    """
    from composer_cloud.lora import export_adapter

    export_adapter(model, out)
    tokenizer.save_pretrained(out)
