"""Turn a run's global parameters into a Hugging Face model directory."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from composer_cloud import checkpoint as ckpt
from composer_cloud.rendezvous.store import Store
from composer_cloud.spec import RunSpec

logger = logging.getLogger(__name__)


def export_model(store: Store, spec: RunSpec, out: Path, *, round: int | None = None) -> int:
    """Write ``save_pretrained`` safetensors + config + tokenizer of the global params; returns the round.

    ``round`` defaults to the latest valid checkpoint. Raises ``LookupError``
    naming the run if there is none.
    """
    from composer_cloud.model import TinyModelConfig, load_model
    from composer_cloud.replica import split_fragments

    if round is None:
        found = ckpt.latest_checkpoint(store)
        if found is None:
            raise LookupError(f"run {store.uri} has no valid checkpoint to export yet")
        round = found.round
    elif not store.exists(f"checkpoints/{round:08d}/global.json"):
        raise LookupError(f"run {store.uri} has no global state for round {round} "
                          f"(available: {ckpt.checkpoint_rounds(store)})")
    tiny = TinyModelConfig(**{k: getattr(spec.model, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")})
    model, tokenizer = load_model(spec.model.name, seed=spec.seed, tiny=tiny)
    fragments = split_fragments(model, spec.sync.fragments)
    glob = ckpt.load_global(store, round)
    with torch.no_grad():
        for i, frag in enumerate(fragments):
            params = glob[f"StreamingDiLoCoFragment_{i}"]["original_parameters"]
            for name, p in frag.named_parameters():
                p.copy_(params[name])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    logger.info("exported round %d to %s", round, out)
    return round
