#!/usr/bin/env python
"""Rollout speed: ``rollout = "hf"`` (``model.generate`` on the trainer's model) vs ``"hf-fast"`` (bf16 copy).

    python benchmarks/rollout_speed.py --shape qwen2.5-0.5b --device cuda --completions 32 --tokens 256 --out speed.json
    python benchmarks/rollout_speed.py --shape tiny --device cpu --completions 8 --tokens 32 --out speed.json

Times one generation batch of ``--completions`` completions of exactly ``--tokens`` new tokens each (EOS is
blocked, so both modes generate the same number of tokens; a random model rarely stops anyway) from random
prompts of ``--prompt-tokens`` tokens, on a model of ``--shape`` (``benchmarks/gpu.py``'s shapes, random
weights, nothing downloaded; or ``demo``, the README's built-in model). Each mode as the trainer runs it:

* ``hf``: ``model.generate`` on the fp32 master model under bf16 autocast, TRL's generation config
  (``disable_compile=True``, dynamic cache);
* ``hf-fast``: :class:`~composer_cloud.trainer.three_channel.fast_rollout.FastSampler` over a bf16
  :class:`~composer_cloud.trainer.three_channel.fast_rollout.InferenceCopy` (static cache; the decode step
  compiled with CUDA graphs on CUDA, eager on CPU), plus the copy's refresh from the policy, which a
  training step pays once per generation.

``--warmup`` untimed calls first (compilation and CUDA-graph capture land there: ``first_call_s``), then the
median of ``--repeats`` timed calls. The JSON (``--out``) holds one row per mode (``seconds``,
``tokens_per_s``, ``first_call_s``; ``refresh_s`` for hf-fast) and ``speedup`` = hf-fast's tokens/s over hf's.
:func:`measure` is the same as a function (``benchmarks/gpu_check.sh`` calls the CLI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu import SHAPES, build_model  # noqa: E402  (the GPU benchmark's shapes: one definition)

from composer_cloud.model import build_tokenizer, load_spec_model  # noqa: E402
from composer_cloud.spec import spec_from_dict  # noqa: E402
from composer_cloud.trainer.three_channel.fast_rollout import FastSampler, InferenceCopy  # noqa: E402


#: The README's demo model (``[model]`` defaults: the built-in ~3.4 M-parameter model, fp32).
DEMO = "demo"
LORA = {"r": 16, "alpha": 32.0, "target_modules": "all-linear"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure(shape: str, device: str, *, completions: int = 32, tokens: int = 256, prompt_tokens: int = 64,
            lora: bool = False, repeats: int = 3, warmup: int = 1, seed: int = 0) -> dict[str, Any]:
    """Both modes' rows and the speedup (see the module docstring); seconds are wall-clock per generation batch."""
    dev = torch.device(device)
    tok = build_tokenizer()
    if shape == DEMO:
        model = load_spec_model(spec_from_dict({"model": {"lora": LORA} if lora else {}}).model, seed=seed,
                                device=dev)[0]
        vocab = model.config.vocab_size
    else:
        model = build_model(shape, lora=lora, device=dev, seed=seed)
        vocab = SHAPES[shape]["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, min(vocab, tok.vocab_size) - 10, (completions, prompt_tokens), generator=gen)
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0,
                  top_p=1.0, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                  eos_token_id=[tok.eos_token_id])
    rows: list[dict[str, Any]] = []

    from transformers import GenerationConfig

    hf_config = GenerationConfig(**kwargs, disable_compile=True)
    input_ids = prompts.to(dev)
    mask = torch.ones_like(input_ids)

    def hf_call() -> None:
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=hf_config)
        assert out.shape[1] == prompt_tokens + tokens

    copy_s = 0.0

    def build_copy() -> None:
        nonlocal sampler
        sampler = FastSampler(InferenceCopy(model), kwargs)

    sampler: FastSampler | None = None
    copy_s = _timed(build_copy, dev)
    assert sampler is not None
    prompt_list = prompts.tolist()

    def fast_call() -> None:
        out, _ = sampler.generate(prompt_list, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
        assert all(len(c) == tokens for c in out)

    for name, call in (("hf", hf_call), ("hf-fast", fast_call)):
        torch.manual_seed(seed)
        first = [_timed(call, dev) for _ in range(max(warmup, 0))]
        times = [_timed(call, dev) for _ in range(max(repeats, 1))]
        seconds = statistics.median(times)
        row = {"rollout": name, "shape": shape, "device": dev.type, "lora": lora, "completions": completions,
               "tokens": completions * tokens, "prompt_tokens": prompt_tokens, "seconds": seconds,
               "tokens_per_s": completions * tokens / seconds, "first_call_s": first[0] if first else None,
               "times": times}
        if name == "hf-fast":
            row["refresh_s"] = statistics.median(_timed(sampler.copy.refresh, dev) for _ in range(3))
            row["build_s"] = copy_s
            row["compiled"] = sampler.compiled
            row["cache_allocations"] = sampler.cache_allocations
        if dev.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        rows.append(row)
    hf_row, fast_row = rows
    import transformers

    return {
        "rows": rows,
        "speedup": fast_row["tokens_per_s"] / hf_row["tokens_per_s"],
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"{'rollout':8} {'shape':14} {'device':6} {'tokens':>7} {'seconds':>8} {'tokens/s':>10} {'first call s':>12}")
    for r in report["rows"]:
        first = "-" if r["first_call_s"] is None else f"{r['first_call_s']:.2f}"
        print(f"{r['rollout']:8} {r['shape']:14} {r['device']:6} {r['tokens']:>7} {r['seconds']:>8.3f} "
              f"{r['tokens_per_s']:>10.0f} {first:>12}")
    print(f"speedup hf-fast / hf: {report['speedup']:.2f}x ({report['device_name']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=[DEMO, *SHAPES],
                   help="a benchmarks/gpu.py shape (random weights) or 'demo' (the README's model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--completions", type=int, default=32, help="completions per generation batch")
    p.add_argument("--tokens", type=int, default=256, help="new tokens per completion")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--lora", action="store_true", help="LoRA r16 all-linear (the copy holds the merged weights)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    report = measure(args.shape, args.device, completions=args.completions, tokens=args.tokens,
                     prompt_tokens=args.prompt_tokens, lora=args.lora, repeats=args.repeats, warmup=args.warmup)
    print_table(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
