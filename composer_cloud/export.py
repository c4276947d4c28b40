"""Turn a run's global parameters into a Hugging Face model directory."""

from __future__ import annotations

import logging
from pathlib import Path

from composer_cloud import checkpoint as ckpt
from composer_cloud.runs.run import Run

logger = logging.getLogger(__name__)


def export_model(run: Run, out: Path, *, round: int | None = None) -> int:
    """Write ``save_pretrained`` safetensors + config + tokenizer of the global params; returns the round.

    A LoRA run's model is written merged (a plain transformers model, no PEFT needed to load it).

    ``round`` defaults to the latest valid checkpoint. Raises ``LookupError``
    naming the run if there is none, or if ``round`` has no global state.
    """
    from composer_cloud.diloco import load_global_parameters, split_fragments
    from composer_cloud.model import load_spec_model

    store, spec = run.store, run.spec
    model, tokenizer = load_spec_model(spec.model, seed=spec.seed)
    fragments = split_fragments(model, spec.sync.fragments)
    if round is not None:
        if not ckpt.has_global_state(store, round):
            raise LookupError(f"run {store.uri} has no global state for round {round} "
                              f"(available: {ckpt.global_state_rounds(store)})")
        load_global_parameters(fragments, ckpt.load_global(store, round))
    else:
        # Newest checkpoint with a manifest whose global state reads back intact: one verified read each.
        before = None
        while True:
            found = ckpt.latest_checkpoint(store, before=before, verify=False)
            if found is None:
                raise LookupError(f"run {store.uri} has no valid checkpoint to export yet")
            try:
                load_global_parameters(fragments, ckpt.load_global(store, found.round))
                round = found.round
                break
            except ckpt.CorruptCheckpoint as exc:
                logger.warning("checkpoint %d cannot be exported (%s); trying the previous one", found.round, exc)
                before = found.round
    from composer_cloud.lora import export_merged

    export_merged(model, tokenizer, out)  # under [model.lora]: the adapters folded into the base
    logger.info("exported round %d to %s", round, out)
    return round
