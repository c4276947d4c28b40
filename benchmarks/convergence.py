#!/usr/bin/env python
"""Convergence benchmark: DiLoCo vs. synchronous data-parallel vs. one replica alone.

    python benchmarks/convergence.py                       # defaults: 4 replicas x 2000 steps, H in {10, 50}
    python benchmarks/convergence.py --engine sim          # exact in-process simulation (for sweeps)
    python benchmarks/convergence.py --steps 400 --hidden 128 --intermediate 344 --inner-lr 2e-3 --h 10 50 100
    python benchmarks/convergence.py --methods diloco --h 50 --diloco-codec bf16
    python benchmarks/convergence.py --corpus stdlib     # the harder corpus: 1 vs 4 synchronous replicas

Results, settings and tuning notes: ``docs/convergence.md``.

Tiny causal LM (``composer_cloud.model`` "tiny", a small ``TinyModelConfig``)
trained with ``composer_cloud.trainer.causal_lm.CausalLMTrainer`` on the
built-in corpus. Every method runs the same number of inner steps per replica
(``--steps``), from the same initial weights (``--seed``), and replica ``r``
reads the same shard (``rank::W``) in the same order in every method:

``sync``
    The synchronous baseline, i.e. what data-parallel training computes: every
    step each of the W replicas computes the gradient of its own batch, the W
    gradients are averaged (an all-reduce), the average is clipped and ONE
    AdamW step is taken; all replicas hold identical weights throughout.
``diloco_h<H>``
    DiLoCo: each replica takes H AdamW steps on its own (gradient clipping per
    replica), then the pseudo-gradients ``global - local`` are averaged and the
    outer optimizer (Nesterov SGD) updates the global weights, which every
    replica then continues from. Inner optimizer state stays per replica.
``single``
    Replica 0 alone (its own shard only), the same number of steps.

Engines (``--engine``):

``store`` (default)
    The real thing: W replica processes (forked from this process) over a
    temporary ``file://`` store. DiLoCo is torchft's ``DiLoCo`` on
    ``composer_cloud.sync.lockstep.manager.ObjectStoreManager`` (exactly what
    ``composer_cloud.replica`` runs); the sync baseline all-reduces the
    flattened gradients every step with ``ObjectStoreAllReduce``. Bytes are
    the store's own byte counters (read + written, framing and small quorum /
    outcome records included) summed over the run's all-reduce rounds, per
    replica (mean over replicas). DiLoCo's round leader additionally writes the
    committed global state (``checkpoints/<r>/global.safetensors``, for healing
    and resume); that is reported separately (``other_store_bytes_max`` in the
    JSON) because it is a checkpoint, not replica-to-replica traffic, and the
    sync baseline writes no checkpoints either.
``sim``
    The same math in one process, replicas in lockstep (used for tuning
    sweeps). The all-reduce is simulated exactly as the store computes it
    (payload cut into W contiguous slots, each slot encoded with the wire codec,
    summed in float32 in rank order, divided by W, encoded again); bytes are
    computed, not measured: ``(3 - 1/W) * P`` per replica per sync, with ``P``
    the real encoded payload size (``composer_cloud.sync.lockstep.codec.encode``
    of the W slots) -- the traffic formula of the scatter-reduce all-reduce.

Held-out loss is ``CausalLMTrainer.evaluate()`` (mean next-token loss on the
held-out corpus, disjoint seeds from the training corpus, all of its rows) on
the weights every replica agrees on: every ``--eval-every`` steps for
``sync`` and ``single``; for DiLoCo only at syncs (every sync if H >=
``--eval-every``, else the syncs at multiples of it). ``--steps`` must be a
multiple of every H, so the final point is always a global model. The table
also gives the first evaluated step at which each method is within 3% of the
sync baseline's final loss (a speed measure).

Inner learning rate: AdamW with linear warmup (``--warmup``) then cosine decay
to ``--min-lr-ratio`` x lr (``--schedule cosine``) or constant; the same
schedule, step for step, in every method.

Outputs (default ``benchmarks/out/``, gitignored): ``convergence.json``
(config, per-method curves and totals) and ``convergence.png`` (held-out
loss vs. inner step; final loss vs. bytes communicated).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# tests/support (process pools) for the store engine (convergence_store.py) and convergence_decoupled.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
# Store polling for the replicas: start at 5 ms, back off to at most 100 ms (the library default
# backs off to 500 ms, which would dominate a per-step all-reduce of a 0.5 MB payload).
POLL_INITIAL_S, POLL_MAX_S = 0.005, 0.1


# ----------------------------------------------------------------------------- configuration
@dataclass
class Config:
    steps: int = 2000
    replicas: int = 4
    h: list[int] = field(default_factory=lambda: [10, 50])
    methods: list[str] = field(default_factory=lambda: ["sync", "diloco", "single"])
    engine: str = "store"
    seed: int = 0
    # model
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 172
    vocab: int = 1024
    # data
    batch_size: int = 8
    seq_len: int = 64
    corpus_size: int = 16000
    # inner optimizer (AdamW) and schedule
    inner_lr: float = 4e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    warmup: int = 50
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    # outer optimizer (Nesterov SGD)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    codec: str = "fp32"
    diloco_codec: str = ""  # wire codec of DiLoCo's pseudo-gradients; "" = same as codec
    # --diloco-codec sparse: [sync.sparse] settings (composer_cloud.sync.sparse) and its outer step
    sparse_density: float = 1 / 64
    sparse_chunk: int = 4096
    sparse_bits: int = 2
    sparse_decay: float = 0.95
    sparse_warmup_syncs: int = 0  # dense fp32 syncs before the first sparse one
    sparse_group_size: int = 0  # > 0: the two-level exchange with groups of this size (0: flat gather)
    sparse_outer_lr: float = 1.0
    sparse_outer_momentum: float = 0.0
    # evaluation and runtime
    eval_every: int = 100
    threads: int = 0  # torch threads per process; 0 = 1
    timeout_s: float = 1200.0
    # corpus: "builtin" (templated snippets) or "stdlib" (composer_cloud.stdlib_corpus: the standard
    # library's sources, its own BPE of ``vocab`` tokens, held-out files)
    corpus: str = "builtin"
    corpus_bytes: int = 8_000_000  # stdlib only: training bytes (all replicas)
    eval_rows: int = 0  # held-out rows scored (0 = all for builtin, 256 for stdlib)

    def codec_of(self, method: str) -> str:
        return (self.diloco_codec or self.codec) if method.startswith("diloco") else self.codec

    def method_names(self) -> list[str]:
        names = []
        for m in self.methods:
            if m == "diloco":
                names += [f"diloco_h{h}" for h in self.h]
            else:
                names.append(m)
        return names


def sync_every(method: str) -> int | None:
    """H for a DiLoCo method, 1 for ``sync`` (one all-reduce per step), None for ``single``."""
    if method.startswith("diloco_h"):
        return int(method[len("diloco_h"):])
    return 1 if method == "sync" else None


def eval_steps(cfg: Config, method: str) -> list[int]:
    """Steps after which held-out loss is measured (0 = initial weights)."""
    h = sync_every(method) if method.startswith("diloco") else 1
    assert h is not None
    pts = {0, cfg.steps}
    for s in range(h, cfg.steps + 1, h):  # only points where the replicas agree
        if s % cfg.eval_every == 0 or h >= cfg.eval_every:
            pts.add(s)
    return sorted(pts)


def lr_factor(cfg: Config, step: int) -> float:
    """Multiplier of the inner lr for optimizer step ``step`` (0-based)."""
    if cfg.warmup and step < cfg.warmup:
        return (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def traffic_factor(world: int) -> float:
    """Bytes moved per replica per all-reduce, in units of the encoded payload (scatter-reduce)."""
    return 3 - 1 / world


# ----------------------------------------------------------------------------- replicas
def build_replica(cfg: Config, rank: int, model: torch.nn.Module | None = None) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, trainer, scheduler)`` for replica ``rank``; same init weights for every rank."""
    from composer_cloud.model import TinyModelConfig, build_tiny_model, load_model
    from composer_cloud.trainer.base import TrainerContext
    from composer_cloud.trainer.causal_lm import CausalLMTrainer

    tiny = TinyModelConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                           num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                           intermediate_size=cfg.intermediate)
    if cfg.corpus == "stdlib":
        from composer_cloud.stdlib_corpus import build_tokenizer as stdlib_tokenizer

        # The same model a `model.name = stdlib_corpus.write_model_dir(...)` run loads, built in memory.
        tokenizer = stdlib_tokenizer(cfg.vocab)
        m = model if model is not None else build_tiny_model(tokenizer, seed=cfg.seed, config=tiny)
        settings = {"corpus": "stdlib", "corpus_bytes": cfg.corpus_bytes, "eval_rows": cfg.eval_rows or 256}
    else:
        m, tokenizer = load_model("tiny", seed=cfg.seed, tiny=tiny)
        settings = {"corpus_size": cfg.corpus_size, "eval_rows": cfg.eval_rows or 1 << 30}
    model = model if model is not None else m
    trainer = CausalLMTrainer(TrainerContext(
        model=model, tokenizer=tokenizer, rank=rank, world_size=cfg.replicas, seed=cfg.seed,
        device=torch.device("cpu"),
        settings={"batch_size": cfg.batch_size, "seq_len": cfg.seq_len, **settings},
        inner_optimizer={"lr": cfg.inner_lr, "weight_decay": cfg.weight_decay,
                         "betas": (cfg.beta1, cfg.beta2), "grad_clip": cfg.grad_clip}))
    sched = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: lr_factor(cfg, s))
    return model, trainer, sched


def batch_loss(model: torch.nn.Module, trainer: Any) -> torch.Tensor:
    """Loss of the replica's next batch (the same batch ``trainer.step()`` would draw)."""
    model.train()
    batch = trainer._next_batch()
    return model(input_ids=batch, labels=batch).loss


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]).to(torch.float32)


def set_flat_grads(model: torch.nn.Module, flat: torch.Tensor) -> None:
    off = 0
    for p in model.parameters():
        n = p.numel()
        p.grad = flat[off:off + n].view_as(p).clone()
        off += n


def payload_bytes(codec: str, numel: int, world: int) -> int:
    """Encoded bytes of one replica's payload as the store all-reduce sends it (W slots)."""
    from composer_cloud.sync.lockstep import codec as wire
    from composer_cloud.storage.store import iter_chunks

    return sum(len(wire.encode(codec, torch.zeros(e - s))) for s, e in iter_chunks(numel, world))


def simulated_allreduce(codec: str, flats: list[torch.Tensor]) -> torch.Tensor:
    """The mean the store all-reduce produces: per slot, encoded parts summed in rank order / W, encoded again."""
    from composer_cloud.sync.lockstep import codec as wire
    from composer_cloud.storage.store import iter_chunks

    w = len(flats)
    out = torch.empty_like(flats[0])
    for s, e in iter_chunks(flats[0].numel(), w):
        acc = torch.zeros(e - s, dtype=torch.float32)
        for x in flats:
            acc += wire.decode(codec, wire.encode(codec, x[s:e]))
        acc /= w
        out[s:e] = wire.decode(codec, wire.encode(codec, acc))
    return out


class Recorder:
    """Held-out curve of one method."""

    def __init__(self, cfg: Config, method: str, trainer: Any) -> None:
        self.points = set(eval_steps(cfg, method))
        self.trainer = trainer
        self.curve: list[tuple[int, float]] = []

    def maybe(self, step: int) -> None:
        if step in self.points:
            self.curve.append((step, self.trainer.evaluate()["eval_loss"]))


# ----------------------------------------------------------------------------- sim engine
def run_sim(cfg: Config, method: str) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads or 1)
    w = cfg.replicas
    t0 = time.monotonic()
    if method == "single":
        model, trainer, sched = build_replica(cfg, 0)
        rec = Recorder(cfg, method, trainer)
        rec.maybe(0)
        train = []
        for s in range(1, cfg.steps + 1):
            train.append(trainer.step()["loss"])
            sched.step()
            rec.maybe(s)
        return {"curve": rec.curve, "syncs": 0, "bytes_per_replica": 0, "train_loss_last50": tail_mean(train),
                "wall_s": time.monotonic() - t0}

    if method == "sync":
        model, trainer0, sched = build_replica(cfg, 0)
        trainers = [trainer0] + [build_replica(cfg, r, model)[1] for r in range(1, w)]
        opt = trainer0.optimizer
        numel = sum(p.numel() for p in model.parameters())
        per_sync = traffic_factor(w) * payload_bytes(cfg.codec_of(method), numel, w)
        rec = Recorder(cfg, method, trainer0)
        rec.maybe(0)
        train = []
        for s in range(1, cfg.steps + 1):
            flats, losses = [], []
            for t in trainers:
                opt.zero_grad(set_to_none=True)
                loss = batch_loss(model, t)
                loss.backward()
                flats.append(flat_grads(model))
                losses.append(float(loss.detach()))
            set_flat_grads(model, simulated_allreduce(cfg.codec_of(method), flats))
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            train.append(sum(losses) / w)
            rec.maybe(s)
        return {"curve": rec.curve, "syncs": cfg.steps, "bytes_per_replica": per_sync * cfg.steps,
                "payload_bytes": per_sync / traffic_factor(w), "train_loss_last50": tail_mean(train),
                "wall_s": time.monotonic() - t0}

    h = sync_every(method)
    assert h is not None
    reps = [build_replica(cfg, r) for r in range(w)]
    models = [m for m, _, _ in reps]
    glob = [torch.nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
    codec = cfg.codec_of(method)
    lr, momentum = (cfg.sparse_outer_lr, cfg.sparse_outer_momentum) if codec == "sparse" else \
        (cfg.outer_lr, cfg.outer_momentum)
    outer = torch.optim.SGD(glob, lr=lr, momentum=momentum, nesterov=momentum > 0)
    numel = sum(p.numel() for p in glob)
    per_sync = traffic_factor(w) * payload_bytes("fp32" if codec == "sparse" else codec, numel, w)
    exchange = None
    if codec == "sparse":
        from sparse_sim import SparseExchange

        from composer_cloud.sync.sparse import SparseSettings

        exchange = SparseExchange(SparseSettings(density=cfg.sparse_density, chunk=cfg.sparse_chunk,
                                                 value_bits=cfg.sparse_bits, decay=cfg.sparse_decay),
                                  world=w, warmup_syncs=cfg.sparse_warmup_syncs, group_size=cfg.sparse_group_size)
    rec = Recorder(cfg, method, reps[0][1])
    rec.maybe(0)
    train, syncs = [], 0
    for s in range(1, cfg.steps + 1):
        losses = []
        for _, trainer, sched in reps:
            losses.append(trainer.step()["loss"])
            sched.step()
        train.append(sum(losses) / w)
        if s % h == 0:
            with torch.no_grad():
                flats = [torch.cat([(g - p).reshape(-1) for g, p in zip(glob, m.parameters())]) for m in models]
                if exchange is None:
                    mean = simulated_allreduce(codec, flats)
                else:
                    mean = exchange.mean(flats, lambda f: simulated_allreduce("fp32", f), per_sync)
                off = 0
                for g in glob:
                    g.grad = mean[off:off + g.numel()].view_as(g).clone()
                    off += g.numel()
            outer.step()
            outer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for m in models:
                    for g, p in zip(glob, m.parameters()):
                        p.copy_(g)
            syncs += 1
            rec.maybe(s)
    out = {"curve": rec.curve, "syncs": syncs, "bytes_per_replica": per_sync * syncs,
           "payload_bytes": per_sync / traffic_factor(w), "train_loss_last50": tail_mean(train),
           "wall_s": time.monotonic() - t0}
    if exchange is not None:
        out.update(exchange.summary(numel), bytes_per_replica=exchange.bytes_per_replica,
                   fp32_round_bytes=per_sync)
    return out


def tail_mean(xs: list[float], n: int = 50) -> float:
    """Mean of the last ``n`` values (the train loss the tables report)."""
    xs = xs[-n:]
    return sum(xs) / max(1, len(xs))


# ----------------------------------------------------------------------------- main
#: Defaults of ``--corpus stdlib`` (any flag given on the command line wins): the harder benchmark of
#: docs/convergence.md, tuned so that one replica is clearly worse than 4 synchronous ones in a few minutes.
STDLIB_DEFAULTS: dict[str, Any] = {
    "steps": 600, "methods": ["sync", "single"], "h": [50], "hidden": 64, "intermediate": 172, "vocab": 4096,
    "seq_len": 128, "batch_size": 8, "inner_lr": 3e-3, "warmup": 30, "eval_every": 50, "eval_rows": 256,
}


def parse_args(argv: list[str] | None) -> tuple[Config, argparse.Namespace]:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=d.steps, help="inner steps per replica, every method")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--h", type=int, nargs="+", default=d.h, help="DiLoCo sync intervals H")
    p.add_argument("--methods", nargs="+", default=d.methods, choices=["sync", "diloco", "single"])
    p.add_argument("--engine", choices=["store", "sim"], default=d.engine)
    p.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("model (TinyModelConfig)")
    g.add_argument("--hidden", type=int, default=d.hidden)
    g.add_argument("--layers", type=int, default=d.layers)
    g.add_argument("--heads", type=int, default=d.heads)
    g.add_argument("--kv-heads", type=int, default=d.kv_heads)
    g.add_argument("--intermediate", type=int, default=d.intermediate)
    g = p.add_argument_group("data")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per replica per step")
    g.add_argument("--seq-len", type=int, default=d.seq_len)
    g.add_argument("--corpus-size", type=int, default=d.corpus_size, help="training snippets (all replicas)")
    g.add_argument("--corpus", choices=["builtin", "stdlib"], default=d.corpus,
                   help="builtin templates, or the stdlib sources (defaults then: see STDLIB_DEFAULTS)")
    g.add_argument("--corpus-bytes", type=int, default=d.corpus_bytes, help="stdlib: training bytes")
    g.add_argument("--vocab", type=int, default=None, help="tokenizer vocabulary (builtin 1024, stdlib 4096)")
    g.add_argument("--eval-rows", type=int, default=d.eval_rows, help="held-out rows (0: corpus default)")
    g = p.add_argument_group("inner optimizer (AdamW)")
    g.add_argument("--inner-lr", type=float, default=d.inner_lr)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--warmup", type=int, default=d.warmup)
    g.add_argument("--schedule", choices=["cosine", "constant"], default=d.schedule)
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip)
    g = p.add_argument_group("outer optimizer (Nesterov SGD)")
    g.add_argument("--outer-lr", type=float, default=d.outer_lr)
    g.add_argument("--outer-momentum", type=float, default=d.outer_momentum)
    g.add_argument("--codec", choices=["fp32", "bf16", "int8"], default=d.codec, help="wire codec (all methods)")
    g.add_argument("--diloco-codec", choices=["fp32", "bf16", "int8", "sparse"], default=None,
                   help="wire codec of DiLoCo's pseudo-gradients only (default: --codec)")
    g = p.add_argument_group("sparse codec (--diloco-codec sparse; docs/sparse.md)")
    g.add_argument("--sparse-density", type=float, default=d.sparse_density, help="top-k per chunk / chunk")
    g.add_argument("--sparse-chunk", type=int, default=d.sparse_chunk)
    g.add_argument("--sparse-bits", type=int, default=d.sparse_bits, help="bits per sent value")
    g.add_argument("--sparse-decay", type=float, default=d.sparse_decay, help="error-feedback decay")
    g.add_argument("--sparse-warmup-syncs", type=int, default=d.sparse_warmup_syncs,
                   help="dense fp32 syncs before the first sparse one")
    g.add_argument("--sparse-group-size", type=int, default=d.sparse_group_size,
                   help="the two-level exchange with groups of this size (0: the flat gather)")
    g.add_argument("--sparse-outer-lr", type=float, default=d.sparse_outer_lr)
    g.add_argument("--sparse-outer-momentum", type=float, default=d.sparse_outer_momentum,
                   help="outer Nesterov momentum on top of error feedback (0: plain SGD, SparseLoCo's)")
    g = p.add_argument_group("run and outputs")
    g.add_argument("--eval-every", type=int, default=d.eval_every)
    g.add_argument("--threads", type=int, default=d.threads, help="torch threads per process (0 = auto)")
    g.add_argument("--timeout-s", type=float, default=d.timeout_s)
    g.add_argument("--store", default=None, help="store URI for --engine store (default: a temp file:// dir)")
    g.add_argument("--out-dir", default=OUT_DIR)
    g.add_argument("--json", default=None, help="default: OUT_DIR/convergence.json")
    g.add_argument("--plot", default=None, help="default: OUT_DIR/convergence.png")
    a = p.parse_args(argv)
    if a.corpus == "stdlib":
        p.set_defaults(**STDLIB_DEFAULTS)
        a = p.parse_args(argv)
    cfg = Config(steps=a.steps, replicas=a.replicas, h=a.h, methods=a.methods, engine=a.engine, seed=a.seed,
                 hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                 intermediate=a.intermediate, batch_size=a.batch_size, seq_len=a.seq_len,
                 corpus_size=a.corpus_size, inner_lr=a.inner_lr, weight_decay=a.weight_decay,
                 warmup=a.warmup, schedule=a.schedule, min_lr_ratio=a.min_lr_ratio, grad_clip=a.grad_clip,
                 outer_lr=a.outer_lr, outer_momentum=a.outer_momentum, codec=a.codec, diloco_codec=a.diloco_codec or "",
                 eval_every=a.eval_every, threads=a.threads, timeout_s=a.timeout_s, corpus=a.corpus,
                 corpus_bytes=a.corpus_bytes, vocab=a.vocab or d.vocab, eval_rows=a.eval_rows,
                 sparse_density=a.sparse_density, sparse_chunk=a.sparse_chunk, sparse_bits=a.sparse_bits,
                 sparse_decay=a.sparse_decay, sparse_warmup_syncs=a.sparse_warmup_syncs,
                 sparse_group_size=a.sparse_group_size,
                 sparse_outer_lr=a.sparse_outer_lr, sparse_outer_momentum=a.sparse_outer_momentum)
    if cfg.diloco_codec == "sparse" and cfg.engine == "store" and cfg.sparse_warmup_syncs:
        p.error("--sparse-warmup-syncs is a sim-engine experiment; the store engine runs sync.codec = \"sparse\"")
    for h in cfg.h:
        if h < 1 or cfg.steps % h:
            p.error(f"--steps {cfg.steps} must be a positive multiple of every H (got H={h})")
    if cfg.replicas < 2:
        p.error("--replicas must be at least 2")
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    cfg, a = parse_args(argv)
    # The tokenizer is trained here and inherited by forked replicas: keep its thread pool off.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(cfg.threads or 1)
    os.makedirs(a.out_dir, exist_ok=True)
    stem = "convergence" if cfg.corpus == "builtin" else f"convergence-{cfg.corpus}"
    json_path = a.json or os.path.join(a.out_dir, f"{stem}.json")
    plot_path = a.plot or os.path.join(a.out_dir, f"{stem}.png")
    from composer_cloud.model import TinyModelConfig, build_tiny_model, build_tokenizer, count_parameters

    if cfg.corpus == "stdlib":
        from composer_cloud import stdlib_corpus

        tok = stdlib_corpus.build_tokenizer(cfg.vocab)
        print(f"stdlib corpus: {json.dumps(stdlib_corpus.describe()['per_split'])} files "
              f"({stdlib_corpus.stdlib_root()}), training bytes {cfg.corpus_bytes:,}", flush=True)
    else:
        tok = build_tokenizer(cfg.vocab)
    n_params = count_parameters(build_tiny_model(tok, seed=cfg.seed, config=TinyModelConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.intermediate)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    print(f"tiny Qwen2: {n_params:,} parameters; {cfg.replicas} replicas x {cfg.steps} steps x "
          f"{cfg.batch_size}x{cfg.seq_len} tokens; engine={cfg.engine}; {cores} cores, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)

    # The engines and the report import this module's core; main imports them.
    from convergence_report import human_bytes, plot, print_table, summarize
    from convergence_store import prepare, run_store

    tmp, ctx, base_uri = prepare(a.store) if cfg.engine == "store" else (None, None, "")
    results: dict[str, dict[str, Any]] = {}
    t_start = time.monotonic()
    try:
        for name in cfg.method_names():
            t0 = time.monotonic()
            r = run_store(cfg, name, ctx, base_uri) if cfg.engine == "store" else run_sim(cfg, name)
            results[name] = r
            print(f"{name:>12}: held-out loss {r['curve'][-1][1]:.4f}, {r['syncs']} syncs, "
                  f"{human_bytes(r['bytes_per_replica'])}/replica  [{time.monotonic() - t0:.0f}s]", flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    total_s = time.monotonic() - t_start
    rows = summarize(cfg, results)
    print_table(cfg, rows, f"{cfg.corpus} corpus: held-out loss after {cfg.steps} inner steps, {cfg.replicas} replicas "
                           f"({cfg.engine} engine, {total_s:.0f}s)")
    doc = {"config": asdict(cfg), "parameters": n_params, "cores": cores, "total_s": total_s,
           "bytes_source": ("store byte counters of the all-reduce rounds (read + written, incl. framing and "
                            "records), mean over replicas" if cfg.engine == "store" else
                            "computed: (3 - 1/W) x encoded payload bytes x syncs"),
           "rows": rows, "methods": results}
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    plot(cfg, results, rows, plot_path)
    print(f"wrote {json_path} and {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
