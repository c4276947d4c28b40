"""Models and tokenizers for replicas.

``"tiny"`` builds a few-million-parameter Qwen2 model from a transformers
config and a byte-level BPE tokenizer trained in memory on the built-in
corpus, so a run needs no download and no network. Any other model reference
is a Hugging Face model id or a local directory, loaded with transformers.

:func:`load_spec_model` applies the ``[model]`` table's compute settings:
the attention kernel (:func:`resolve_attention`), gradient checkpointing,
LoRA (:mod:`composer_cloud.lora`) and the compute precision, which it records
on the model for the trainer (:func:`compute_precision`). Parameters are
float32 in every case (a LoRA model's frozen base may be bfloat16).
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from composer_cloud.compat_transformers import enable_activation_checkpointing

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# TRL (each generation) and PEFT (each adapter) read `model.is_gradient_checkpointing`, which transformers
# deprecates: a FutureWarning in every replica log and export that is theirs to fix and tells a user nothing.
warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)

TINY = "tiny"
#: Attribute of a loaded model that records its ``[model] precision`` (read with :func:`compute_precision`).
PRECISION_ATTR = "composer_cloud_precision"


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


#: The linear layers of the built-in model (Qwen2's decoder: attention and MLP projections; ``lm_head`` is tied to
#: the embeddings), by the short names ``[model.lora] target_modules`` lists. The launcher accepts a list of these
#: without building the model (transformers and peft: ~7 CPU-s); ``tests/test_precision_lora.py`` holds the set to
#: the linear layers of the model :func:`build_tiny_model` builds with the installed transformers.
TINY_LINEAR_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


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


def tiny_config(tokenizer: Any, *, config: TinyModelConfig | None = None, attention: str = "sdpa") -> Any:
    """The ``Qwen2Config`` of the ``tiny`` model for ``tokenizer`` (no weights: cheap to build)."""
    from transformers import Qwen2Config

    cfg = config or TinyModelConfig()
    return Qwen2Config(
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
        attn_implementation=attention,
    )


def tiny_generation_config(hf_config: Any, tokenizer: Any) -> Any:
    """The generation config a ``tiny`` model built from ``hf_config`` carries (see :func:`build_tiny_model`)."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(hf_config)
    generation.pad_token_id = tokenizer.pad_token_id
    return generation


def build_tiny_model(
    tokenizer: Any, *, seed: int, config: TinyModelConfig | None = None, attention: str = "sdpa"
) -> torch.nn.Module:
    """A freshly initialised Qwen2 causal LM; identical on every replica for a given seed."""
    import torch
    from transformers import Qwen2ForCausalLM

    hf_config = tiny_config(tokenizer, config=config, attention=attention)
    # Initialisation draws from torch's global RNG: fork it so that building a
    # model does not perturb the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(hf_config)
    model.generation_config = tiny_generation_config(hf_config, tokenizer)  # one definition: export writes it too
    return model


def load_model(
    ref: str,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    tiny: TinyModelConfig | None = None,
    attention: str = "sdpa",
    dtype: torch.dtype | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Return ``(model, tokenizer)`` for ``ref``: ``"tiny"``, a hub id or a local path.

    Models are loaded in float32 unless ``dtype`` says otherwise: DiLoCo keeps
    an fp32 copy of the global parameters and the outer step is applied in the
    parameters' dtype (only a LoRA model's frozen base is ever loaded in bf16).
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if ref == TINY:
        tokenizer = build_tokenizer((tiny or TinyModelConfig()).vocab_size)
        model = build_tiny_model(tokenizer, seed=seed, config=tiny, attention=attention).to(dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("loading model %s with transformers", ref)
        tokenizer = AutoTokenizer.from_pretrained(ref)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, attn_implementation=attention)
    return model.to(device), tokenizer


def flash_attention_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(choice: str, *, device: torch.device | str, precision: str) -> str:
    """The transformers ``attn_implementation`` for ``[model] attention`` on ``device``.

    ``auto``: ``flash_attention_2`` on a CUDA device with bf16 when ``flash_attn``
    is installed, else ``sdpa`` (PyTorch's fused attention). Raises ``ValueError``
    naming ``model.attention`` for flash-attention where it cannot run.
    """
    on_cuda = _device_type(device) == "cuda"
    if choice == "auto":
        return "flash_attention_2" if on_cuda and precision == "bf16" and flash_attention_installed() else "sdpa"
    if choice == "flash_attention_2":
        if not on_cuda:
            raise ValueError(f"model.attention: flash_attention_2 needs a CUDA GPU; this replica runs on {device}")
        if precision != "bf16":
            raise ValueError('model.attention: flash_attention_2 computes in half precision; set model.precision = "bf16"')
        if not flash_attention_installed():
            raise ValueError("model.attention: flash_attention_2 needs the flash-attn package "
                             "(pip install flash-attn --no-build-isolation), or use \"sdpa\"")
    return choice


def _device_type(device: torch.device | str) -> str:
    """``"cuda"`` for ``"cuda:1"`` or ``torch.device("cuda", 1)`` (a name needs no torch import: the launcher's
    checks run without it)."""
    return device.split(":", 1)[0] if isinstance(device, str) else device.type


def check_precision(precision: str, device: torch.device | str) -> None:
    """Raise ``ValueError`` naming ``model.precision`` when ``device`` cannot compute in it."""
    if precision != "bf16" or _device_type(device) != "cuda":
        return
    import torch

    device = torch.device(device)
    if not torch.cuda.is_bf16_supported():
        raise ValueError(f'model.precision: {torch.cuda.get_device_name(device)} has no bfloat16 support '
                         '(GPUs before Ampere); use "fp32"')


def compute_precision(model: torch.nn.Module) -> str:
    """The ``[model] precision`` a model was loaded for (``"fp32"`` when not loaded by :func:`load_spec_model`)."""
    return str(getattr(model, PRECISION_ATTR, "fp32"))


def load_spec_model(model_spec: Any, *, seed: int, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` for a spec's ``[model]`` table (its shape fields apply to ``"tiny"`` only).

    Applies the attention kernel, gradient checkpointing (non-reentrant), LoRA
    (``[model.lora]``: a PEFT model whose adapters alone are trainable) and
    records the compute precision on the model (:func:`compute_precision`).
    """
    import torch

    precision = getattr(model_spec, "precision", "fp32")
    lora = getattr(model_spec, "lora", None)
    check_precision(precision, device)
    attention = resolve_attention(getattr(model_spec, "attention", "auto"), device=device, precision=precision)
    tiny = TinyModelConfig(**{k: getattr(model_spec, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")})
    # A LoRA base never changes: under bf16 it is stored in bf16 (half the memory); PEFT keeps the adapters fp32.
    dtype = torch.bfloat16 if lora is not None and precision == "bf16" else torch.float32
    model, tokenizer = load_model(model_spec.name, seed=seed, device=device, tiny=tiny, attention=attention,
                                  dtype=dtype)
    if getattr(model_spec, "gradient_checkpointing", False):
        enable_activation_checkpointing(model, {"use_reentrant": False})
    if lora is not None:
        from composer_cloud.lora import apply_lora

        model = apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                           target_modules=lora.target_modules, seed=seed)
    setattr(model, PRECISION_ATTR, precision)
    return model, tokenizer


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
