#!/usr/bin/env python
"""Policy traffic: bytes of a lossless bf16 patch against the full bf16 model, per inner and per outer step.

    python benchmarks/policy_patches.py --out policy_patches.json
    python benchmarks/policy_patches.py --models demo --lrs 1e-6 --inner-steps 4 --rounds 1

For each model (``demo``: the README's built-in ~3.4 M-parameter model; ``mid``: a ~42 M-parameter Qwen2 shape
built from a config, random weights, nothing downloaded; ``demo-lora``: the demo model's LoRA r16 adapter) and
each inner learning rate, it runs ``--rounds`` DiLoCo rounds of one replica the way the lock-step replica does:
``--inner-steps`` AdamW steps (betas 0.9/0.95, weight decay 0.01, a causal-LM loss on the built-in corpus), then
the outer Nesterov SGD step (lr 0.7, momentum 0.9: the lock-step defaults, :mod:`composer_cloud.sync.outer`) on
the pseudo-gradient ``global - local``. It measures

* **per inner step**: the patch (:func:`composer_cloud.rollouts.patch_codec.encode_patch`, the bytes
  ``publish_policy`` writes) from the model before the step to the model after it;
* **per outer step**: the patch from global version ``v`` to ``v + 1``, published through a real store
  (:class:`~composer_cloud.rollouts.policy.PolicyPublisher`) and rebuilt by a
  :class:`~composer_cloud.rollouts.policy.PolicyReader`, checked bitwise against the bf16 cast;

each as a fraction of the full bf16 state (the anchor). ``changed`` is the fraction of bf16 elements whose bit
pattern changed; ``int32 positions`` is what the same patch would cost with 4-byte positions instead of the
codec's per-tensor choice (gap varints, bitmap or dense). CPU only; the bytes do not depend on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from composer_cloud.corpus import train_corpus  # noqa: E402
from composer_cloud.lora import synced_parameters  # noqa: E402
from composer_cloud.model import build_tokenizer, load_spec_model  # noqa: E402
from composer_cloud.rollouts.patch_codec import encode_anchor, encode_patch  # noqa: E402
from composer_cloud.rollouts.policy import PolicyPublisher, PolicyReader, policy_state  # noqa: E402
from composer_cloud.spec import spec_from_dict  # noqa: E402
from composer_cloud.storage.store import Store  # noqa: E402
from composer_cloud.sync.outer import OuterOptimizerConfig, outer_sgd  # noqa: E402

#: The ~42 M-parameter shape (a Qwen2 of hidden 512, 8 layers, a 32k tied vocabulary): minutes are too slow on
#: two shared CPU cores at a few hundred million parameters, this one runs its rows in well under a minute.
MID = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
           intermediate_size=1408, tie_word_embeddings=True)
MODELS = ("demo", "demo-lora", "mid")
OUTER = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True)


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, bool]:
    """``(model, lora)``: fp32 parameters, as a replica trains them on a CPU."""
    if name == "mid":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return Qwen2ForCausalLM(Qwen2Config(**MID, attn_implementation="sdpa")), False
    lora = name == "demo-lora"
    spec = spec_from_dict({"model": {"lora": {"r": 16, "alpha": 32.0, "target_modules": "all-linear"}} if lora else {}})
    return load_spec_model(spec.model, seed=seed)[0], lora


def batches(batch: int, seq: int, seed: int) -> Any:
    """Endless causal-LM batches of the built-in corpus (the demo's tokenizer), in a fixed order."""
    tok = build_tokenizer()
    ids = [i for text in train_corpus(400) for i in tok(text)["input_ids"]]
    flat = torch.tensor(ids)
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(flat) - seq, (batch,), generator=gen)
        yield torch.stack([flat[s:s + seq] for s in starts.tolist()])


def _row_of(blob: bytes, changed: int, full: int, numel: int) -> dict[str, Any]:
    return {"bytes": len(blob), "ratio": len(blob) / full, "changed": changed / numel,
            "int32_ratio": (6 * changed) / full}


def measure(name: str, lr: float, *, inner_steps: int, rounds: int, batch: int, seq: int,
            seed: int = 0) -> dict[str, Any]:
    """One row: ``rounds`` DiLoCo rounds at inner learning rate ``lr`` (see the module docstring)."""
    model, lora = build(name, seed)
    params = synced_parameters(model)
    numel = sum(p.numel() for p in params.values())
    full_model = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(params.values(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    global_params = {n: p.detach().clone() for n, p in params.items()}
    outer = outer_sgd(global_params.values(), OUTER)
    data = batches(batch, seq, seed)
    t0 = time.perf_counter()
    inner_rows: list[dict[str, Any]] = []
    outer_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"file://{tmp}/run")
        publisher, reader = PolicyPublisher(store, lora=lora), PolicyReader(store)
        first = publisher.publish(0, model)
        anchor_bytes = first.record.blob_bytes
        full = first.record.state_bytes
        for version in range(1, rounds + 1):
            for _ in range(inner_steps):
                before = policy_state(model, lora=lora)
                tokens = next(data)
                model(input_ids=tokens, labels=tokens).loss.backward()
                inner.step()
                inner.zero_grad(set_to_none=True)
                after = policy_state(model, lora=lora)
                blob, changed = encode_patch(before, after, version=1)
                inner_rows.append(_row_of(blob, changed, full, numel))
            with torch.no_grad():  # DiLoCo: pseudo-gradient = global - local, outer SGD on the global copy
                for n, p in params.items():
                    global_params[n].grad = global_params[n] - p.detach()
                outer.step()
                outer.zero_grad(set_to_none=True)
                for n, p in params.items():
                    p.copy_(global_params[n])
            out = publisher.publish(version, model)
            rebuilt = reader.load(version)
            direct = policy_state(model, lora=lora)
            assert all(torch.equal(rebuilt[n].view(torch.int16), direct[n].view(torch.int16)) for n in direct), \
                f"version {version} did not rebuild bitwise"
            outer_rows.append({"bytes": out.record.blob_bytes, "ratio": out.ratio,
                               "changed": out.record.changed / numel,
                               "int32_ratio": 6 * out.record.changed / full})
    assert anchor_bytes == len(encode_anchor(policy_state(build(name, seed)[0], lora=lora), version=0))

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    return {"model": name, "lora": lora, "params": full_model, "published_params": numel, "lr": lr,
            "inner_steps": inner_steps, "rounds": rounds, "batch": batch, "seq": seq,
            "full_bf16_bytes": full, "full_model_bf16_bytes": 2 * full_model, "anchor_bytes": anchor_bytes,
            "inner": {"ratio": mean(inner_rows, "ratio"), "changed": mean(inner_rows, "changed"),
                      "int32_ratio": mean(inner_rows, "int32_ratio"), "bytes": mean(inner_rows, "bytes"),
                      "max_ratio": max(r["ratio"] for r in inner_rows)},
            "outer": {"ratio": mean(outer_rows, "ratio"), "changed": mean(outer_rows, "changed"),
                      "int32_ratio": mean(outer_rows, "int32_ratio"), "bytes": mean(outer_rows, "bytes"),
                      "per_round": outer_rows},
            "seconds": time.perf_counter() - t0}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':10} {'params':>7} {'lr':>6} {'full bf16':>10} | {'inner: changed':>14} {'patch':>7} | "
          f"{'outer: changed':>14} {'patch':>7} {'patch bytes':>11} {'int32 pos':>9}")
    for r in rows:
        size = (f"{r['published_params'] / 1e6:.2f}M" if not r["lora"]
                else f"{r['published_params'] / 1e3:.0f}k")
        print(f"{r['model']:10} {size:>7} {r['lr']:>6.0e} {r['full_bf16_bytes'] / 2**20:>8.2f}Mi | "
              f"{r['inner']['changed']:>14.2%} {r['inner']['ratio']:>7.2%} | "
              f"{r['outer']['changed']:>14.2%} {r['outer']['ratio']:>7.2%} "
              f"{r['outer']['bytes'] / 2**10:>9.1f}Ki {r['outer']['int32_ratio']:>9.2%}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-6, 1e-5], help="inner AdamW learning rates")
    p.add_argument("--inner-steps", type=int, default=8, help="H: inner steps per round")
    p.add_argument("--rounds", type=int, default=2, help="outer steps (published versions after version 0)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = [measure(m, lr, inner_steps=args.inner_steps, rounds=args.rounds, batch=args.batch, seq=args.seq)
            for m in args.models for lr in args.lrs]
    print_table(rows)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "torch": torch.__version__, "device": "cpu"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
