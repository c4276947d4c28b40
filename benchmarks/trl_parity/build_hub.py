"""An offline Hugging Face hub cache with tiny random models standing in for ``trl-internal-testing/*``.

``python build_hub.py DIR`` writes ``DIR/models--trl-internal-testing--<name>/...`` (the hub cache layout, so
``from_pretrained("trl-internal-testing/<name>")`` works with ``HF_HUB_CACHE=DIR HF_HUB_OFFLINE=1``). Tokenizers
are byte-level BPEs trained in memory; chat templates are the ones TRL ships (``trl/chat_templates``). Nothing is
downloaded. Models TRL's tests name that are not built here (vision-language, remote code, Glm4Moe,
NemotronH) fail or skip alike under stock TRL and the subclass.
"""
import sys
from pathlib import Path

import torch
import trl
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast

HUB = Path(sys.argv[1])
COMMIT = "0" * 40
TEMPLATES = Path(trl.__file__).parent / "chat_templates"
ZEN = """Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense. Readability counts.
Special cases aren't special enough to break the rules. Although practicality beats purity.
Errors should never pass silently. Unless explicitly silenced. In the face of ambiguity, refuse the temptation to guess.
There should be one-- and preferably only one --obvious way to do it. Although that way may not be obvious at first.
Now is better than never. Although never is often better than *right* now. If the implementation is hard to explain,
it's a bad idea. If the implementation is easy to explain, it may be a good idea. Namespaces are one honking great idea.
def multiply(a, b): return a * b  {"name": "multiply_tool", "arguments": {"a": 3, "b": 4}} 0123456789 user assistant system tool
""" * 4

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
                 "<tool_response>", "</tool_response>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]
GPTOSS_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                   "<|constrain|>", "<|return|>", "<|call|>"]
PLAIN_SPECIALS = ["<s>", "</s>", "<unk>", "<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
                  "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
                  "<|SYSTEM_TOKEN|>", "[INST]", "[/INST]"]


def tokenizer(specials, template, **tokens):
    """A byte-level BPE on the text above with ``specials``, and TRL's chat ``template``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([ZEN], trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)
    if template:
        fast.chat_template = (TEMPLATES / template).read_text()
    return fast


def save(name, model, tok):
    """Write ``model`` and ``tok`` as the ``main`` snapshot of ``trl-internal-testing/<name>``."""
    repo = HUB / f"models--trl-internal-testing--{name}"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    model.save_pretrained(snap)
    tok.save_pretrained(snap)
    print("built", name, sum(p.numel() for p in model.parameters()))


SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)


def build(name, model_type, tok, head="causal", **extra):
    """A two-layer, 16-wide ``model_type`` model (causal LM or one-label sequence classifier) over ``tok``."""
    kw = dict(SMALL, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
              bos_token_id=tok.bos_token_id, **extra)
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    if head == "causal":
        model = AutoModelForCausalLM.from_config(cfg)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
    else:
        cfg.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(cfg)
    save(name, model, tok)


qwen = tokenizer(QWEN_SPECIALS, "qwen2_5.jinja", eos_token="<|im_end|>", pad_token="<|endoftext|>")
qwen3 = tokenizer(QWEN_SPECIALS, "qwen3.jinja", eos_token="<|im_end|>", pad_token="<|endoftext|>")
llama = tokenizer(LLAMA_SPECIALS, "llama3_2.jinja", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                  pad_token="<|finetune_right_pad_id|>")
gptoss = tokenizer(GPTOSS_SPECIALS, "gptoss.jinja", eos_token="<|return|>", pad_token="<|endoftext|>")
plain = tokenizer(PLAIN_SPECIALS, "qwen2_5.jinja", bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")

build("tiny-Qwen2ForCausalLM-2.5", "qwen2", qwen)
build("tiny-Qwen2ForSequenceClassification-2.5", "qwen2", qwen, head="seqcls")
build("tiny-Qwen3ForCausalLM", "qwen3", qwen3, head_dim=4)
build("tiny-Qwen3ForSequenceClassification", "qwen3", qwen3, head="seqcls", head_dim=4)
build("tiny-Qwen3MoeForCausalLM", "qwen3_moe", qwen3, head_dim=4, num_experts=4, num_experts_per_tok=2,
      moe_intermediate_size=16, output_router_logits=False, router_aux_loss_coef=0.001)
build("tiny-LlamaForCausalLM-3.2", "llama", llama)
build("tiny-LlamaForSequenceClassification-3.2", "llama", llama, head="seqcls")
build("tiny-MistralForCausalLM-0.2", "mistral", plain)
build("tiny-GptOssForCausalLM", "gpt_oss", gptoss, head_dim=4, num_local_experts=4, num_experts_per_tok=2,
      layer_types=["sliding_attention", "full_attention"], sliding_window=128, router_aux_loss_coef=0.9)
build("tiny-Gemma2ForCausalLM", "gemma2", plain, head_dim=4)
build("tiny-Cohere2ForCausalLM", "cohere2", plain, layer_types=["sliding_attention", "full_attention"], sliding_window=128)
