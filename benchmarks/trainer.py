"""Benchmark of the three-channel trainer on the tiny model and the demo task (CPU).

Two questions, at equal batch (same prompts per step, completions per prompt,
completion length, model, optimizer):

1. **Cost**: step time of all three channels vs channel 1 (GRPO/DAPO) alone.
   Reported as the ratio of median step times, and split into the part both
   configurations share (sampling + sandboxed reward) and the loss part
   (forwards, backward, optimizer step), where channels 2 and 3 add their work.
2. **Learning**: mean reward of the sampled completions on the demo task over
   steps, and greedy held-out reward before and after, for both configurations.

A randomly initialised model scores ~0 on the demo task (no reward variance,
nothing for GRPO to learn from), so both runs start from the same short
next-token warm-up on the built-in corpus (cached in the output directory).
The two trainers are stepped alternately, so machine load hits both alike.

    python benchmarks/trainer.py                      # defaults: ~5-10 min on 2 cores
    python benchmarks/trainer.py --steps 40 --warmup-steps 100 --json out.json --png out.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from composer_cloud.corpus import train_corpus  # noqa: E402
from composer_cloud.model import load_model  # noqa: E402
from composer_cloud.trainer import TrainerContext, build_trainer  # noqa: E402

logger = logging.getLogger("benchmarks.trainer")
OUT = ROOT / "benchmarks" / "out"


def warm_start(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Next-token training on the built-in corpus; cached by its settings."""
    from safetensors.torch import load_file, save_file

    cache = Path(args.out_dir) / f"warm-tiny-s{args.seed}-n{args.warmup_steps}-b{args.warmup_batch}.safetensors"
    if cache.exists() and not args.no_cache:
        logger.info("warm start: loading %s", cache)
        return load_file(str(cache))
    model, tok = load_model("tiny", seed=args.seed)
    texts = train_corpus(4000)
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    start = time.perf_counter()
    for step in range(args.warmup_steps):
        batch = [tok.eos_token + t + tok.eos_token for t in rng.sample(texts, args.warmup_batch)]
        enc = tok(batch, return_tensors="pt", padding=True)
        loss = model(**enc, labels=enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0:
            logger.info("warm start %d/%d loss %.3f (%.0fs)", step, args.warmup_steps, loss.item(), time.perf_counter() - start)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    cache.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(cache))
    return state


def build(args: argparse.Namespace, state: dict[str, torch.Tensor], *, sdpo_weight: float, dpo_weight: float):
    model, tok = load_model("tiny", seed=args.seed)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    settings = {
        "batch_size": args.batch_size,
        "num_generations": args.num_generations,
        "max_completion_length": args.max_completion_length,
        "sdpo_weight": sdpo_weight,
        "dpo_weight": dpo_weight,
        "replay_batch_size": args.replay_batch_size,
        "eval_examples": args.eval_examples,
        "sandbox_workers": args.sandbox_workers,
    }
    ctx = TrainerContext(
        model=model,
        tokenizer=tok,
        rank=0,
        world_size=1,
        seed=args.seed,
        device=torch.device("cpu"),
        settings=settings,
        inner_optimizer={"lr": args.lr, "weight_decay": 0.0, "betas": [0.9, 0.99], "grad_clip": 1.0},
    )
    trainer = build_trainer("three-channel", ctx)
    # Instrument: time spent sampling + scoring (shared by both configurations).
    g = trainer.grpo
    original = g._generate_and_score_completions
    trainer.gen_seconds = 0.0  # type: ignore[attr-defined]

    def timed(inputs):
        t0 = time.perf_counter()
        try:
            return original(inputs)
        finally:
            trainer.gen_seconds += time.perf_counter() - t0  # type: ignore[attr-defined]

    g._generate_and_score_completions = timed
    return trainer


def controlled_timing(args: argparse.Namespace, state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Loss + backward of channel 1 alone vs all three channels on one identical batch.

    The end-to-end comparison lets the two policies drift apart (e.g. in
    completion length, which changes sampling and forward cost too); this
    isolates what channels 2 and 3 add for the same completions: the teacher
    forward, the full-vocabulary logits and the replay forward/backward.
    """
    import dataclasses

    tr = build(args, state, sdpo_weight=args.sdpo_weight, dpo_weight=args.dpo_weight)
    tr.step()  # one real generation batch (and the replay reference log-probs)
    g = tr.grpo
    inputs = dict(g._buffered_inputs[0], replay=g.replay.sample(args.replay_batch_size))
    configs = {"one": dataclasses.replace(g.settings, sdpo_weight=0.0, dpo_weight=0.0), "three": g.settings}
    times: dict[str, list[float]] = {"one": [], "three": []}
    for i in range(args.timing_repeats + 2):
        for name in (["one", "three"] if i % 2 == 0 else ["three", "one"]):
            t0 = time.perf_counter()
            out = g.compute_three_channel_loss(tr.model, inputs, config=configs[name])
            out.total.backward()
            dt = time.perf_counter() - t0
            tr.model.zero_grad(set_to_none=True)
            if i >= 2:  # warm-up repeats
                times[name].append(dt)
    one, three = statistics.median(times["one"]), statistics.median(times["three"])
    return {
        "loss_backward_one_s": one,
        "loss_backward_three_s": three,
        "loss_backward_ratio": three / one,
        "hinted_rows": int(inputs["has_hint"].sum()) if "has_hint" in inputs else 0,
        "rows": int(inputs["completion_ids"].size(0)),
        "replay_pairs": args.replay_batch_size,
        "completion_tokens": int(inputs["completion_mask"].sum()),
    }


def moving_average(xs: list[float], k: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        window = xs[max(0, i - k + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    state = warm_start(args)
    controlled = controlled_timing(args, state)
    logger.info("controlled timing: %s", controlled)
    configs = {"channel 1 only": (0.0, 0.0), "three channels": (args.sdpo_weight, args.dpo_weight)}
    if args.ablations:
        configs.update({"channels 1+2": (args.ablation_sdpo_weight, 0.0), "channels 1+3": (0.0, args.dpo_weight)})
    trainers = {name: build(args, state, sdpo_weight=a, dpo_weight=b) for name, (a, b) in configs.items()}
    results: dict[str, dict[str, Any]] = {
        name: {"sdpo_weight": a, "dpo_weight": b, "metrics": [], "step_s": [], "gen_s": [], "loss_s": []} for name, (a, b) in configs.items()
    }
    for name, tr in trainers.items():
        results[name]["eval_before"] = tr.evaluate()
        results[name]["eval_curve"] = [(0, results[name]["eval_before"]["eval_reward_mean"])]
        logger.info("%s: eval before %s", name, results[name]["eval_before"])
    for step in range(args.steps):
        order = list(trainers) if step % 2 == 0 else list(reversed(trainers))  # alternate who goes first
        for name in order:
            tr = trainers[name]
            tr.gen_seconds = 0.0
            t0 = time.perf_counter()
            m = tr.step()
            dt = time.perf_counter() - t0
            r = results[name]
            r["metrics"].append(m)
            r["step_s"].append(dt)
            r["gen_s"].append(tr.gen_seconds)
            r["loss_s"].append(dt - tr.gen_seconds)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            for name, tr in trainers.items():
                results[name]["eval_curve"].append((step + 1, tr.evaluate()["eval_reward_mean"]))
        if step % 5 == 0 or step == args.steps - 1:
            logger.info(
                "step %d  " + "  |  ".join(f"{n}: reward %.3f step %.2fs" for n in trainers),
                step,
                *[v for n in trainers for v in (results[n]["metrics"][-1]["reward_mean"], results[n]["step_s"][-1])],
            )
    for name, tr in trainers.items():
        results[name]["eval_after"] = tr.evaluate()
        results[name]["eval_curve"].append((args.steps, results[name]["eval_after"]["eval_reward_mean"]))

    skip = min(args.timing_skip, args.steps - 1)
    summary: dict[str, Any] = {}
    for name, r in results.items():
        rewards = [m["reward_mean"] for m in r["metrics"]]
        q = max(1, len(rewards) // 4)
        summary[name] = {
            "median_step_s": statistics.median(r["step_s"][skip:]),
            "median_gen_reward_s": statistics.median(r["gen_s"][skip:]),
            "median_loss_s": statistics.median(r["loss_s"][skip:]),
            "reward_first_quarter": sum(rewards[:q]) / q,
            "reward_last_quarter": sum(rewards[-q:]) / q,
            "eval_before": r["eval_before"]["eval_reward_mean"],
            "eval_after": r["eval_after"]["eval_reward_mean"],
            "eval_best": max(v for _, v in r["eval_curve"]),
            "eval_curve": r["eval_curve"],
        }
    one, three = summary["channel 1 only"], summary["three channels"]
    gen = one["median_gen_reward_s"]
    other = one["median_loss_s"] - controlled["loss_backward_one_s"]  # optimizer step, clipping, bookkeeping
    ratios = {
        "step_time_ratio": three["median_step_s"] / one["median_step_s"],
        "loss_part_ratio": three["median_loss_s"] / one["median_loss_s"],
        "controlled_loss_backward_ratio": controlled["loss_backward_ratio"],
        # channel 1's step with its loss + backward replaced by the three-channel one, same batch
        "controlled_step_time_ratio": (gen + other + controlled["loss_backward_three_s"])
        / (gen + other + controlled["loss_backward_one_s"]),
    }
    return {
        "config": vars(args),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads, "cpus": os.cpu_count()},
        "summary": summary,
        "controlled_timing": controlled,
        "ratios": ratios,
        "criteria": {
            "step_time_ratio_le_1_5": ratios["step_time_ratio"] <= 1.5,
            "controlled_step_time_ratio_le_1_5": ratios["controlled_step_time_ratio"] <= 1.5,
            "three_channel_sampled_reward_rises": three["reward_last_quarter"] > three["reward_first_quarter"],
            "three_channel_heldout_reward_rises": three["eval_after"] > three["eval_before"],
        },
        "runs": results,
    }


def table(report: dict[str, Any]) -> str:
    s = report["summary"]
    rows = [
        ("median step time (s)", "median_step_s", "{:.3f}"),
        ("  sampling + reward (s)", "median_gen_reward_s", "{:.3f}"),
        ("  loss + backward + opt (s)", "median_loss_s", "{:.3f}"),
        ("mean reward, first quarter", "reward_first_quarter", "{:.3f}"),
        ("mean reward, last quarter", "reward_last_quarter", "{:.3f}"),
        ("held-out greedy reward before", "eval_before", "{:.3f}"),
        ("held-out greedy reward after", "eval_after", "{:.3f}"),
        ("held-out greedy reward, best", "eval_best", "{:.3f}"),
    ]
    names = list(s)
    width = max(len(r[0]) for r in rows) + 2
    lines = [" " * width + "".join(f"{n:>16}" for n in names)]
    for label, key, fmt in rows:
        lines.append(f"{label:<{width}}" + "".join(f"{fmt.format(s[n][key]):>16}" for n in names))
    r = report["ratios"]
    lines.append(f"step-time ratio (three / one): {r['step_time_ratio']:.3f}   loss-part ratio: {r['loss_part_ratio']:.3f}")
    c = report["controlled_timing"]
    lines.append(
        f"same batch ({c['rows']} completions, {c['hinted_rows']} hinted, {c['replay_pairs']} replay pairs): "
        f"loss+backward {c['loss_backward_one_s']:.3f}s -> {c['loss_backward_three_s']:.3f}s "
        f"(x{r['controlled_loss_backward_ratio']:.2f}), implied step-time ratio {r['controlled_step_time_ratio']:.3f}"
    )
    lines.append("criteria: " + ", ".join(f"{k}={v}" for k, v in report["criteria"].items()))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path, smooth: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [2, 1.3, 1]})
    colors = {"channel 1 only": "tab:blue", "three channels": "tab:red", "channels 1+2": "tab:green", "channels 1+3": "tab:orange"}
    for name, run_ in report["runs"].items():
        rewards = [m["reward_mean"] for m in run_["metrics"]]
        ax1.plot(rewards, color=colors[name], alpha=0.25, lw=1)
        ax1.plot(moving_average(rewards, smooth), color=colors[name], lw=2, label=f"{name} ({smooth}-step mean)")
    ax1.set_xlabel("inner step")
    ax1.set_ylabel("mean reward of sampled completions")
    ax1.set_title("training prompts, sampled (same prompt order in every run)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    for name, run_ in report["runs"].items():
        xs, ys = zip(*run_["eval_curve"])
        ax3.plot(xs, ys, marker="o", color=colors[name], label=name)
    ax3.set_xlabel("inner step")
    ax3.set_ylabel("greedy reward, held-out problems")
    ax3.set_title("held-out problems, greedy (unseen function names)")
    ax3.legend()
    ax3.grid(alpha=0.3)
    s = report["summary"]
    names = list(s)
    gen = [s[n]["median_gen_reward_s"] for n in names]
    loss = [s[n]["median_loss_s"] for n in names]
    labels = [n.replace(" ", "\n", 1) for n in names]
    ax2.bar(labels, gen, color="lightgray", label="sampling + reward")
    ax2.bar(labels, loss, bottom=gen, color=[colors[n] for n in names], label="loss + backward + opt")
    ax2.set_ylabel("median seconds per step")
    r = report["ratios"]
    ax2.set_title(f"step time x{r['step_time_ratio']:.2f} (same batch x{r['controlled_step_time_ratio']:.2f})")
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=OUT / "trainer.json", help="where to write the JSON report")
    p.add_argument("--png", type=Path, default=OUT / "trainer.png", help="where to write the plot")
    p.add_argument("--out-dir", type=Path, default=OUT, help="warm-start cache directory")
    p.add_argument("--no-cache", action="store_true", help="redo the warm start even if cached")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared machine)")
    p.add_argument("--warmup-steps", type=int, default=150)
    p.add_argument("--warmup-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=60, help="inner steps per configuration")
    p.add_argument("--timing-skip", type=int, default=2, help="first steps left out of the timing medians")
    p.add_argument("--timing-repeats", type=int, default=20, help="repeats of the same-batch loss timing")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--replay-batch-size", type=int, default=2)
    p.add_argument("--sdpo-weight", type=float, default=0.1, help="trainer.sdpo_weight (channel 2)")
    p.add_argument("--ablations", action="store_true", help="also run channels 1+2 and channels 1+3")
    p.add_argument("--ablation-sdpo-weight", type=float, default=0.5, help="sdpo_weight of the channels 1+2 ablation")
    p.add_argument("--dpo-weight", type=float, default=0.5, help="trainer.dpo_weight (channel 3)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--eval-every", type=int, default=10, help="held-out greedy eval every N steps (0: only before/after)")
    p.add_argument("--eval-examples", type=int, default=32)
    p.add_argument("--sandbox-workers", type=int, default=2)
    p.add_argument("--smooth", type=int, default=10)
    p.add_argument("--from-json", type=Path, help="re-print and re-plot a saved report instead of running")
    args = p.parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        print(table(report))
        plot(report, args.png, args.smooth)
        print(f"wrote {args.png}")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("transformers", "trl", "composer_cloud"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    report = run(args)
    print(table(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str))
    plot(report, args.png, args.smooth)
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
