#!/usr/bin/env python
"""The inner loop on a GPU: composer-cloud's three-channel trainer against plain ``trl.GRPOTrainer``.

    python benchmarks/gpu.py                          # Qwen2.5-0.5B and 1.5B shapes, on the GPU
    python benchmarks/gpu.py --shapes qwen2.5-0.5b --steps 5 --json out.json
    python benchmarks/gpu.py --tiny                   # a tiny shape on CPU, end to end (gpu_check.sh --cpu runs a smaller one)

Models are built from Qwen2.5 configs with random weights (nothing is downloaded); the tokenizer is the
built-in BPE one (ids beyond it decode to nothing, which only the reward sees). GRPO settings:
``--generations`` (8) completions per prompt, ``--completion`` (256) new tokens, ``--batch`` completions per
step, bf16 autocast, channel 1 only for the anchor comparison (the loss TRL computes), reward a hash of the
completion text (cheap, non-constant). A random model never emits EOS, so every completion runs to the cap:
the worst case of a step's cost.

Rows (one per shape x {full, lora} x rollout x {composer-cloud, trl}; rollouts: ``hf``, the fast mode
``hf-fast`` where the trainer has it (composer-cloud only: plain TRL has no such mode) and ``vllm``); per
inner step, medians over ``--steps`` after ``--warmup``. The JSON is rewritten after every row (``complete``
turns true at the end), so a run stopped by a timeout keeps the rows it measured:

* ``rollout_s``: ``_generate_and_score_completions`` (sampling, reward, the old/ref log-prob forwards),
  timed by a benchmark-side wrapper on both trainers; ``train_s``: the rest of the step (loss, backward,
  clip, optimizer step);
* ``peak_mem_gib``: ``torch.cuda.max_memory_allocated`` over the steps (GPU only);
* ``tokens_per_s``: completion tokens per second of the whole step; ``rollout_tokens_per_s`` and
  ``rollout_mfu`` (``2 N`` per generated token over ``rollout_s``): the rollout alone;
* ``mfu``: model FLOPs / (step time x peak FLOPs of the GPU): ``2 N`` per generated or scored token
  forward, ``6 N`` per trained token (``4 N`` under LoRA: frozen weights get no weight gradient);
  ``N`` = parameters other than the input embedding; attention's quadratic term left out (GPU only);
* ``vs_trl``: composer-cloud's step time / TRL's on the same shape, mode and rollout, or TRL's ``hf`` for a
  mode TRL lacks (``vs_trl_anchor`` says which; goal <= 1.05 for ``hf``);
* ``sync_s`` / ``sync_share_h50``: one DiLoCo round of the synced parameter set through a local
  ``file://`` store (torchft's DiLoCo over the object-store all-reduce, one replica, fp32), and its share
  of a round of ``H = 50`` inner steps: ``sync_s / (50 * step_s + sync_s)`` (goal <= 2%). Measured after
  every GPU row, LoRA's first, ``--sync-rounds`` (1) after a warm-up round, all within ``--sync-budget-s``
  (60 s): a full round of a 0.5B model moves ~2 GB of float32 through the disk;
* ``store_mib_per_round`` / ``store_vs_full``: that round's store traffic (the store's byte counters: the
  payload, the reduced slot, the global state and the records), and its ratio to the full fine-tune's.

vLLM rows run only where ``vllm`` imports and a GPU is present (TRL's colocated engine).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
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

from composer_cloud.lora import apply_lora, sync_footprint, synced_parameters  # noqa: E402
from composer_cloud.model import PRECISION_ATTR, build_tokenizer  # noqa: E402

# Qwen2.5 shapes (their config.json; random weights). "tiny" is for --tiny on CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True),
    "tiny": dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True),
}
#: Dense bf16 peak FLOP/s by GPU name fragment (NVIDIA's datasheets, SXM parts).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}
H = 50
#: Rollout modes faster than plain ``model.generate`` that need no extra package (run where the trainer knows them).
FAST_ROLLOUTS = ("hf-fast",)
#: Rollout modes plain ``trl.GRPOTrainer`` has (the anchor rows); the others are compared with TRL's ``hf``.
TRL_ROLLOUTS = ("hf", "vllm")


def build_model(shape: str, *, lora: bool, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A ``shape`` model with random weights (the same for a given seed and device), as the benchmark runs it.

    On a CUDA or meta device the weights are initialised there (a 0.5B model's initialisation on the CPU
    takes seconds per build, and the benchmark builds one per row); on a CPU as before (CPU results do not
    change). The CUDA RNG is reseeded by the build.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, attn_implementation="sdpa")
    where = device if device.type in ("cuda", "meta") else torch.device("cpu")
    with torch.random.fork_rng(devices=[]), where:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    # As load_spec_model does: a LoRA base is frozen, so bf16 storage loses nothing.
    model = model.to(device, torch.bfloat16 if lora else torch.float32)
    if lora:
        model = apply_lora(model, r=16, alpha=32, dropout=0.0, target_modules="all-linear", seed=seed)
    setattr(model, PRECISION_ATTR, "bf16")
    return model


def _reward(prompts: Any = None, completions: Any = None, **_: Any) -> list[float]:
    return [hashlib.sha256(str(c).encode()).digest()[0] / 255 for c in completions]


class _RewardTask:
    """The smallest task for ThreeChannelTrainer: numbered prompts, the hash reward."""

    name = "bench"

    def __init__(self, n: int = 512) -> None:
        self.rows = [{"prompt": f"def task_{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n"} for i in range(n)]

    def examples(self, split: str) -> list[dict[str, Any]]:
        return [dict(r) for r in self.rows]

    def reward(self, completions: Any, rows: Any) -> list[float]:
        return _reward(completions=completions)

    def default_hints(self) -> None:
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _rollout_timer(trainer: Any, device: torch.device, spent: list[float]):
    """Time ``_generate_and_score_completions`` on this trainer instance (the library is not modified)."""
    original = trainer._generate_and_score_completions

    def timed(inputs: Any) -> Any:
        _sync(device)
        t0 = time.perf_counter()
        out = original(inputs)
        _sync(device)
        spent.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed
    try:
        yield
    finally:
        trainer._generate_and_score_completions = original


def grpo_settings(args: argparse.Namespace, rollout: str) -> dict[str, Any]:
    return dict(batch_size=args.batch, num_generations=args.generations, max_completion_length=args.completion,
                mask_truncated_completions=False, sdpo_weight=0.0, dpo_weight=0.0, rollout=rollout,
                eval_examples=0)


def run_composer(model: torch.nn.Module, args: argparse.Namespace, rollout: str, device: torch.device) -> dict:
    from composer_cloud.trainer.three_channel import ThreeChannelSettings, ThreeChannelTrainer

    tok = build_tokenizer()
    tr = ThreeChannelTrainer(
        model=model, tokenizer=tok, task=_RewardTask(), settings=ThreeChannelSettings(**grpo_settings(args, rollout)),
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6),
        device=device, precision="bf16",
    )
    rollout_s: list[float] = []
    steps: list[float] = []
    with _rollout_timer(tr.grpo, device, rollout_s):
        for i in range(args.warmup + args.steps):
            if i == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            tr.step()
            _sync(device)
            steps.append(time.perf_counter() - t0)
    return _row(steps[args.warmup:], rollout_s[args.warmup:], device)


def run_trl(model: torch.nn.Module, args: argparse.Namespace, rollout: str, device: torch.device) -> dict:
    """Plain ``trl.GRPOTrainer.train()`` on the same model, settings and prompts (a callback times each step)."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from composer_cloud.trainer.three_channel import ThreeChannelSettings

    s = ThreeChannelSettings(**grpo_settings(args, rollout))
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), **s.grpo_kwargs(), learning_rate=1e-6, bf16=True,
        use_cpu=device.type == "cpu", max_steps=args.warmup + args.steps, lr_scheduler_type="constant",
        report_to="none", save_strategy="no", logging_steps=10**6, disable_dropout=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    steps: list[float] = []
    rollout_s: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            _sync(device)
            steps.append(time.perf_counter() - self.t0)

    if rollout == "vllm":
        from composer_cloud.trainer.three_channel.rollout import ensure_engine_model_dir

        ensure_engine_model_dir(model, build_tokenizer())
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=config, processing_class=build_tokenizer(),
                          train_dataset=Dataset.from_list(_RewardTask().rows), callbacks=[StepTimer()])
    trainer.remove_callback(PrinterCallback)  # the table is the output
    with _rollout_timer(trainer, device, rollout_s):
        trainer.train()
    return _row(steps[args.warmup:], rollout_s[args.warmup:], device)


def _row(steps: list[float], rollout_s: list[float], device: torch.device) -> dict:
    step = statistics.median(steps)
    roll = statistics.median(rollout_s) if rollout_s else 0.0
    return {"step_s": step, "rollout_s": roll, "train_s": max(0.0, step - roll),
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "step_s_samples": steps}


def measure_sync(model: torch.nn.Module, rounds: int = 1, budget_s: float = 60.0) -> dict[str, Any]:
    """One DiLoCo round of ``synced_parameters(model)`` through a fresh ``file://`` store, time-boxed.

    Returns ``sync_s`` (median wall seconds of the measured rounds), ``sync_bytes`` (mean store bytes per
    round, read + written, the store's counters), ``sync_rounds`` (rounds measured) and ``sync_warm``
    (whether a warm-up round was left out of ``sync_s``). Runs a warm-up round and then up to ``rounds``
    more, but starts no round once ``budget_s`` seconds have passed: a full fine-tune's round of a 0.5B model
    moves ~2 GB of float32 through the local disk, which must not eat a short GPU slot. When the warm-up
    round alone used the budget, it is the measurement (``sync_warm = False``).

    The one place this benchmark touches the sync layer: torchft's DiLoCo (via ``build_diloco``) over the
    object-store all-reduce, one replica, fp32 codec, ``sync_every = 1`` so every optimizer step is a round.
    """
    from composer_cloud.spec import spec_from_dict
    from composer_cloud.storage.store import Store
    from composer_cloud.sync.lockstep.diloco import LockstepConfig, ParameterGroup, build_diloco

    group = ParameterGroup(list(synced_parameters(model).items()))
    inner = torch.optim.SGD(group.parameters(), lr=0.0)
    config = LockstepConfig.from_spec(spec_from_dict({"replicas": 1, "min_replicas": 1, "inner_steps": 1}))
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as root:
        store = Store(f"file://{root}")
        loop = build_diloco(store=store, rank=0, model=group, inner_optimizer=inner, config=config)
        times: list[float] = []
        try:
            with loop:
                while len(times) < rounds + 1 and (not times or time.perf_counter() - t_start < budget_s):
                    t0 = time.perf_counter()
                    inner.step()
                    times.append(time.perf_counter() - t0)
        finally:
            loop.close()  # the last round's global state is uploaded: every round's bytes are counted
    measured = times[1:] or times
    return {"sync_s": statistics.median(measured), "sync_bytes": (store.bytes_read + store.bytes_written) / len(times),
            "sync_rounds": len(measured), "sync_warm": len(times) > 1}


def generation_params(model: torch.nn.Module) -> int:
    """``N`` of ``2 N`` FLOPs per generated token: parameters other than the input embedding, plus the
    LM head's when it is tied to the embedding (it still computes). LoRA adapters are counted (they compute)."""
    embed = model.get_input_embeddings().weight.numel()
    n = sum(p.numel() for p in model.parameters()) - embed
    return n + (embed if getattr(model.config, "tie_word_embeddings", False) else 0)


def model_flops(model: torch.nn.Module, args: argparse.Namespace, prompt_tokens: int, lora: bool) -> float:
    embed = model.get_input_embeddings().weight.numel()
    n = sync_footprint(model).total_params - (sync_footprint(model).synced_params if lora else 0) - embed
    n += embed if getattr(model.config, "tie_word_embeddings", False) else 0  # the LM head computes with it
    tokens = args.batch * (prompt_tokens + args.completion)
    # generation + old-logp forward (2N each, per token), training (6N full, 4N LoRA)
    return (2 + 2 + (4 if lora else 6)) * n * tokens


def available_rollouts(device: torch.device) -> list[str]:
    """Rollout modes this machine can run: ``hf``; the fast mode where the trainer knows it; vLLM where it
    imports and a GPU is present."""
    from typing import get_args

    from composer_cloud.trainer.three_channel.settings import Rollout

    known = set(get_args(Rollout))
    out = ["hf"] + [m for m in FAST_ROLLOUTS if m in known]
    if "vllm" in known and device.type == "cuda" and importlib.util.find_spec("vllm"):
        out.append("vllm")
    return out


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU from its name (:data:`PEAK_BF16`), ``None`` when unknown or a CPU."""
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` atomically (temp file + rename): a reader, or a kill, never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


def _relate(rows: list[dict[str, Any]]) -> None:
    """Fill each row's ``vs_trl`` (step time / plain TRL's on the same shape, mode and rollout; a mode TRL has
    not, like the fast one, against TRL's ``hf`` row) and ``store_vs_full``, from the rows measured so far."""
    for row in rows:
        key = ("shape", "mode")
        anchor = (next((r for r in rows if r["impl"] == "trl" and r["rollout"] == row["rollout"]
                        and all(r[k] == row[k] for k in key)), None)
                  or next((r for r in rows if r["impl"] == "trl" and r["rollout"] == "hf"
                           and all(r[k] == row[k] for k in key)), None))
        row["vs_trl"] = row["step_s"] / anchor["step_s"] if anchor else None
        row["vs_trl_anchor"] = f"trl/{anchor['rollout']}" if anchor else None
        full = next((r for r in rows if r["mode"] == "full" and r["shape"] == row["shape"]
                     and r.get("store_mib_per_round") is not None), None)
        mine = row.get("store_mib_per_round")
        row["store_vs_full"] = mine / full["store_mib_per_round"] if full and mine is not None else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny shape on CPU, few steps (a smoke run)")
    p.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"], choices=list(SHAPES))
    p.add_argument("--batch", type=int, default=32, help="completions per inner step")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--completion", type=int, default=256, help="max new tokens")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    p.add_argument("--rollouts", nargs="+", default=None,
                   help="rollout modes (default: every one this machine runs: hf, the fast mode, vllm)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--sync-rounds", type=int, default=1, help="sync rounds measured after a warm-up round")
    p.add_argument("--sync-budget-s", type=float, default=60.0,
                   help="seconds all sync measurements may take together (LoRA's first; 0: none)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "out" / "gpu.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.shapes, args.batch, args.completion, args.steps, args.warmup = ["tiny"], 8, 16, 2, 1
        args.device = "cpu"
    want = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if want == "auto" else want)
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    rollouts = available_rollouts(device)
    if args.rollouts:
        missing = [r for r in args.rollouts if r not in rollouts]
        if missing:
            print(f"rollouts {missing} cannot run here (available: {rollouts}); left out", file=sys.stderr)
        rollouts = [r for r in args.rollouts if r in rollouts]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_flops(gpu)
    prompt_tokens = max(len(build_tokenizer()(r["prompt"])["input_ids"]) for r in _RewardTask().rows)

    rows: list[dict[str, Any]] = []
    report = {"device": gpu, "torch": torch.__version__, "batch": args.batch, "generations": args.generations,
              "completion_tokens": args.completion, "steps": args.steps, "warmup": args.warmup, "H": H,
              "peak_flops": peak, "rollouts": rollouts, "complete": False, "rows": rows}
    write_report(args.json, report)  # rewritten after every row: a timeout keeps what was measured
    footprints: dict[tuple[str, str], Any] = {}
    for shape in args.shapes:
        for mode in args.modes:
            lora = mode == "lora"
            probe = build_model(shape, lora=lora, device=torch.device("meta") if shape != "tiny" else device)
            fp = footprints[shape, mode] = sync_footprint(probe)
            flops = model_flops(probe, args, prompt_tokens, lora)
            n_gen = generation_params(probe)
            del probe
            for rollout in rollouts:
                impls = [("composer-cloud", run_composer)] + ([("trl", run_trl)] if rollout in TRL_ROLLOUTS else [])
                for impl, run in impls:
                    model = build_model(shape, lora=lora, device=device)
                    row = run(model, args, rollout, device)
                    del model
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    gen_tokens = args.batch * args.completion
                    row.update(shape=shape, mode=mode, rollout=rollout, impl=impl,
                               tokens_per_s=gen_tokens / row["step_s"],
                               mfu=flops / (row["step_s"] * peak) if peak else None,
                               rollout_tokens_per_s=gen_tokens / row["rollout_s"] if row["rollout_s"] else None,
                               rollout_mfu=(2 * n_gen * gen_tokens / (row["rollout_s"] * peak)
                                            if peak and row["rollout_s"] else None),
                               synced_mib=fp.synced_bytes / 2**20, full_mib=fp.full_bytes / 2**20,
                               synced_ratio=fp.ratio, sync_s=None, store_mib_per_round=None, sync_share_h50=None)
                    rows.append(row)
                    _relate(rows)
                    write_report(args.json, report)
                    print(f"{shape} {mode} {rollout} {impl}: step {row['step_s']:.2f}s", flush=True)
    # The sync rounds last (they need no GPU), LoRA's first (small), within one time box.
    t_sync = time.perf_counter()
    for shape in args.shapes:
        for mode in sorted(args.modes, key=lambda m: m != "lora"):
            left = args.sync_budget_s - (time.perf_counter() - t_sync)
            if left <= 0:
                print(f"{shape} {mode}: sync not measured (--sync-budget-s {args.sync_budget_s:g} spent)", flush=True)
                continue
            sync = measure_sync(build_model(shape, lora=mode == "lora", device=torch.device("cpu")),
                                rounds=args.sync_rounds, budget_s=left)
            for row in rows:
                if row["shape"] == shape and row["mode"] == mode:
                    row.update(sync_s=sync["sync_s"], store_mib_per_round=sync["sync_bytes"] / 2**20,
                               sync_rounds=sync["sync_rounds"], sync_warm=sync["sync_warm"],
                               sync_share_h50=sync["sync_s"] / (H * row["step_s"] + sync["sync_s"]))
            _relate(rows)
            write_report(args.json, report)
            print(f"{shape} {mode}: sync {sync['sync_s']:.2f}s ({sync['sync_rounds']} round(s))", flush=True)
    report["complete"] = True
    write_report(args.json, report)
    print_table(report)
    print(f"wrote {args.json}")
    return 0


def print_table(report: dict[str, Any]) -> None:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    head = ("shape", "mode", "rollout", "impl", "step s", "rollout s", "train s", "peak GiB", "tok/s", "MFU",
            "vs TRL", "synced MiB", "store MiB/round", "vs full", "sync s", "sync@H50")
    print(f"{report['device']}: {report['batch']} completions ({report['generations']} per prompt) x "
          f"{report['completion_tokens']} tokens, median of {report['steps']} steps")
    print(" | ".join(head))
    for r in report["rows"]:
        print(" | ".join([r["shape"], r["mode"], r["rollout"], r["impl"], f(r["step_s"], ".3f"),
                          f(r["rollout_s"], ".3f"), f(r["train_s"], ".3f"), f(r["peak_mem_gib"], ".1f"),
                          f(r["tokens_per_s"], ".0f"), f(r["mfu"], ".1%"), f(r["vs_trl"], ".3f"),
                          f(r["synced_mib"], ".1f"), f(r["store_mib_per_round"], ".2f"), f(r["store_vs_full"], ".2%"),
                          f(r["sync_s"], ".3f"), f(r["sync_share_h50"], ".2%")]))


if __name__ == "__main__":
    raise SystemExit(main())
