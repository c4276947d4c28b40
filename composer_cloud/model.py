"""Models and tokenizers for replicas.

``"tiny"`` builds a few-million-parameter Qwen2 model from a transformers
config and a byte-level BPE tokenizer trained in memory on the built-in
corpus, so a run needs no download and no network. Any other model reference
is a Hugging Face model id or a local directory, loaded with transformers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

logger = logging.getLogger(__name__)

TINY = "tiny"


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the built-in model. Defaults give ~3.4 M parameters."""

    vocab_size: int = 1024
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 688
    max_position_embeddings: int = 512


@lru_cache(maxsize=4)
def build_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE tokenizer trained on the built-in corpus (deterministic).

    Special tokens: ``<|pad|>`` (id 0), ``<|endoftext|>`` (eos and bos).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from composer_cloud.corpus import train_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|pad|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_corpus(2000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
    )
    fast.padding_side = "left"
    return fast


def build_tiny_model(tokenizer: Any, *, seed: int, config: TinyModelConfig | None = None) -> torch.nn.Module:
    """A freshly initialised Qwen2 causal LM; identical on every replica for a given seed."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = config or TinyModelConfig()
    hf_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    # Initialisation draws from torch's global RNG: fork it so that building a
    # model does not perturb the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(hf_config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_model(
    ref: str,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    tiny: TinyModelConfig | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Return ``(model, tokenizer)`` for ``ref``: ``"tiny"``, a hub id or a local path.

    Models are loaded in float32: DiLoCo keeps an fp32 copy of the global
    parameters and the outer step is applied in the parameters' dtype.
    """
    if ref == TINY:
        tokenizer = build_tokenizer((tiny or TinyModelConfig()).vocab_size)
        model = build_tiny_model(tokenizer, seed=seed, config=tiny)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("loading model %s with transformers", ref)
        tokenizer = AutoTokenizer.from_pretrained(ref)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    return model.to(device), tokenizer


def load_spec_model(model_spec: Any, *, seed: int, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` for a spec's ``[model]`` table (its shape fields apply to ``"tiny"`` only)."""
    tiny = TinyModelConfig(**{k: getattr(model_spec, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")})
    return load_model(model_spec.name, seed=seed, device=device, tiny=tiny)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
