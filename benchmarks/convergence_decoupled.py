#!/usr/bin/env python
"""Convergence of decoupled DiLoCo (``sync.mode = "decoupled"``) through a real store, per wire codec.

    python benchmarks/convergence_decoupled.py --corpus stdlib --h 50 --steps 2000 \\
        --codecs fp32 sparse --sparse-density 0.046875
    python benchmarks/convergence_decoupled.py --corpus stdlib --h 10 --steps 40 --replicas 2   # smoke

Every replica is what ``composer-cloud`` runs in decoupled mode: the replica's own
:class:`~composer_cloud.replica.decoupled.DecoupledBoundary` (publish the contribution through
``ContributionEncoder`` -- the sparse codec's error feedback included --, ``try_merge``'s write-once
merge and ``outer_step``, adopt the newest global, write the inner state every ``checkpoint_every``
contributions) over a ``file://`` store on tmpfs, built from a spec with ``sync.mode = "decoupled"`` and
``sync.codec`` per run. Model, corpus, data order, inner optimizer and schedule are
``benchmarks/convergence.py``'s (its flags are accepted here: ``--corpus``, ``--steps``, ``--h``,
``--replicas``, ``--sparse-*``, ...); the outer optimizer is the spec's default for the codec in decoupled
mode (fp32: Nesterov lr 1.0, momentum 0.3; sparse: plain SGD lr 1, no momentum).

Drives (``--drive``):

``interleaved`` (default)
    The W replicas in one process, one inner step each in rank order, so every replica reaches its
    boundaries in the same order in every run: the merges (``min_quorum`` replicas: ranks 0+1 and 2+3 at
    W = 4), staleness and adoptions are identical for every codec and the comparison isolates the codec.
    The grace window is set to ``--grace-s`` (default 60 s) so that only the quorum decides merges.
``processes``
    One forked process per replica, each on its own clock (merges composed by arrival order, as in a real
    fleet; not reproducible run to run).

Held-out loss: the final global version (``decoupled/final.json``, what ``export`` writes) evaluated with
``CausalLMTrainer.evaluate()``, after ``W x steps`` inner steps in all (the fleet's budget is
``replicas x rounds`` contributions of H steps). The curve is replica 0's own evaluation after each adopt (the
boundary's ``eval_loss``). Bytes are the store's byte counters around each boundary (publish, merge,
adopt; what ``bytes_read`` / ``bytes_written`` of a decoupled round row say), mean per replica per round;
``contributions``: the store's bytes of contribution objects alone (blob and meta, written by their replica and
read by the merger), per replica per round; ``bytes_by_kind_per_replica_round`` in the JSON splits every
store call of the run by kind (contributions, globals, merge records, inner states, other).
``--codecs`` run concurrently (one process each) with the interleaved drive. Output: a table and
``OUT_DIR/convergence-decoupled.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import convergence as conv  # noqa: E402
from convergence import Config, build_replica  # noqa: E402
from convergence_report import human_bytes  # noqa: E402
from support.processes import run_processes  # noqa: E402  (tests/ is on the path via convergence)


def _store_class() -> type:
    """:class:`~composer_cloud.storage.store.Store` that also tallies its byte counters per kind of object."""
    from composer_cloud.storage import layout
    from composer_cloud.storage.store import Store

    kinds = [(layout.CONTRIBUTIONS, "contributions"), (layout.MERGES, "merge records"),
             (layout.DECOUPLED_REPLICAS, "inner states"), (layout.CHECKPOINTS, "globals")]

    class KeyedStore(Store):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.by_kind: dict[str, list[int]] = {}  # kind -> [read, written]

        def _tally(self, key: str, fn: Any) -> Any:
            r0, w0 = self.bytes_read, self.bytes_written
            try:
                return fn()
            finally:
                kind = next((k for prefix, k in kinds if key.startswith(prefix + "/")), "other")
                acc = self.by_kind.setdefault(kind, [0, 0])
                acc[0] += self.bytes_read - r0
                acc[1] += self.bytes_written - w0

        def get_plain(self, key: str, *, max_bytes: int | None = None) -> bytes:
            return self._tally(key, lambda: super(KeyedStore, self).get_plain(key, max_bytes=max_bytes))

        def put(self, key: str, payload: Any, *, durable: bool = True) -> int:
            return self._tally(key, lambda: super(KeyedStore, self).put(key, payload, durable=durable))

        def put_plain(self, key: str, payload: Any) -> int:
            return self._tally(key, lambda: super(KeyedStore, self).put_plain(key, payload))

        def create(self, key: str, payload: Any, *, settle: bool = True) -> bool:
            return self._tally(key, lambda: super(KeyedStore, self).create(key, payload, settle=settle))

    return KeyedStore


@dataclass
class DecoupledReplica:
    """One replica of the benchmark: the replica's own boundary around convergence.py's model and trainer."""

    rank: int
    model: torch.nn.Module
    trainer: Any
    sched: Any
    boundary: Any  # composer_cloud.replica.decoupled.DecoupledBoundary
    segment: Any  # composer_cloud.replica.boundary.Segment
    tokens_per_step: int
    steps: int = 0
    done: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""  # non-empty: print a line at each boundary (progress of a long run)

    def step(self) -> None:
        """One pass of the replica's inner loop (``runtime._inner_loop``): ask, step, maybe reach a boundary."""
        from composer_cloud.replica.boundary import Segment

        if not self.boundary.running(self.segment):
            self.done = True
            return
        t0 = time.monotonic()
        out = self.trainer.step()
        self.sched.step()
        self.steps += 1
        self.segment.add(out, compute_s=time.monotonic() - t0, tokens=int(out.get("tokens", self.tokens_per_step)))
        row = self.boundary.after_step(self.segment)  # a RoundRow (composer_cloud.storage.records.metrics)
        if row is not None:
            self.rows.append({**self.segment.fill(row).to_json(), "step": self.steps})
            if self.label:
                print(f"[{self.label}] replica {self.rank} step {self.steps}: version {row.get('merged_version')}"
                      + (f", eval {row.extra['eval_loss']:.4f}" if "eval_loss" in row.extra else ""), flush=True)
            self.segment = Segment()


#: ``--codecs`` entries besides the wire codecs: fp32 with the sparse codec's outer step (a control)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32_sgd": ("fp32", {"lr": 1.0, "momentum": 0.0, "nesterov": False}),
}


def decoupled_spec(cfg: Config, variant: str, *, grace_s: float | None, min_quorum: int | None) -> Any:
    """The run's spec: decoupled mode, the variant's codec (``[sync.sparse]`` from ``cfg``) and outer step (the
    spec's default unless :data:`VARIANTS` says), H and rounds from ``cfg``."""
    from composer_cloud.spec import spec_from_dict

    codec, outer = VARIANTS.get(variant, (variant, {}))
    h = cfg.h[0]
    sync: dict[str, Any] = {"mode": "decoupled", "codec": codec}
    if codec == "sparse":
        sync["sparse"] = {"density": cfg.sparse_density, "chunk": cfg.sparse_chunk, "value_bits": cfg.sparse_bits,
                          "decay": cfg.sparse_decay}
    if grace_s is not None:
        sync |= {"grace_min_s": grace_s, "grace_max_s": grace_s}
    if min_quorum is not None:
        sync["min_quorum"] = min_quorum
    return spec_from_dict({"replicas": cfg.replicas, "min_replicas": cfg.replicas, "rounds": cfg.steps // h,
                           "inner_steps": h, "sync": sync} | ({"outer_optimizer": outer} if outer else {}))


def make_replica(cfg: Config, spec: Any, uri: str, rank: int, *, label: str = "") -> DecoupledReplica:
    """Replica ``rank``: convergence.py's model/trainer/schedule, a store of its own, the decoupled boundary."""
    from composer_cloud.hooks import NO_HOOKS
    from composer_cloud.replica.boundary import ReplicaContext, Segment
    from composer_cloud.replica.decoupled import DecoupledBoundary
    from composer_cloud.replica.telemetry import Telemetry
    from composer_cloud.retry import PollPolicy
    from composer_cloud.storage.run import Run

    store = _store_class()(uri, poll=PollPolicy(initial_s=conv.POLL_INITIAL_S, max_s=conv.POLL_MAX_S))
    model, trainer, sched = build_replica(cfg, rank)
    ctx = ReplicaContext(run=Run(uri=uri, store=store, spec=spec), rank=rank, model=model, trainer=trainer,
                         device=torch.device("cpu"), hooks=NO_HOOKS,
                         telemetry=Telemetry(store, rank, rounds=spec.rounds, inner_steps=spec.inner_steps,
                                             progress_every_s=spec.progress_every_s))
    boundary = DecoupledBoundary(ctx)
    boundary.start()
    return DecoupledReplica(rank=rank, model=model, trainer=trainer, sched=sched, boundary=boundary,
                            segment=Segment(), tokens_per_step=cfg.batch_size * cfg.seq_len,
                            label=label if rank == 0 else "")


def drive(replicas: list[DecoupledReplica]) -> None:
    """Step ``replicas`` in rank order until the fleet's budget is published, then let each finish."""
    while not all(r.done for r in replicas):
        for r in replicas:
            if not r.done:
                r.step()
    for r in replicas:
        r.boundary.finish(r.steps)


def final_loss(cfg: Config, spec: Any, uri: str, replica: DecoupledReplica | None = None) -> tuple[int, float]:
    """``(version, held-out loss)`` of the run's final global version (read back and verified)."""
    from composer_cloud.replica.boundary import copy_into
    from composer_cloud.storage.store import Store
    from composer_cloud.sync.decoupled.outer import FRAGMENT_KEY
    from composer_cloud.sync.decoupled.versions import GlobalVersions

    versions = GlobalVersions(Store(uri))
    version = versions.final()
    if version is None:
        raise RuntimeError(f"{uri}: the run did not finish (no verified decoupled/final.json)")
    if replica is None:
        model, trainer, _ = build_replica(cfg, 0)
    else:
        model, trainer = replica.model, replica.trainer
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    copy_into(model, versions.load(version, shapes)[FRAGMENT_KEY]["original_parameters"])
    return version, trainer.evaluate()["eval_loss"]


def process_worker(q: Any, rank: int, cfg_dict: dict[str, Any], spec_json: dict[str, Any], uri: str,
                   label: str) -> None:
    """``--drive processes``: replica ``rank`` alone in this process."""
    try:
        from composer_cloud.spec import spec_from_dict

        torch.set_num_threads(1)
        cfg = Config(**cfg_dict)
        replica = make_replica(cfg, spec_from_dict(spec_json), uri, rank, label=label)
        drive([replica])
        q.put((rank, {"rows": replica.rows, "steps": replica.steps, "by_kind": replica.boundary.store.by_kind}))
    except Exception:
        q.put((rank, {"error": traceback.format_exc()}))


def run_codec(cfg: Config, codec: str, base_uri: str, *, drive_mode: str, grace_s: float,
              min_quorum: int | None, verbose: bool = False) -> dict[str, Any]:
    """One decoupled run of ``cfg`` with ``codec``; its curve, final loss, bytes and merge schedule."""
    from composer_cloud.sync.sparse import settings_of

    torch.set_num_threads(1)
    spec = decoupled_spec(cfg, codec, grace_s=grace_s if drive_mode == "interleaved" else None,
                          min_quorum=min_quorum)
    uri = f"{base_uri}/{codec}"
    t0 = time.monotonic()
    lead = None
    if drive_mode == "interleaved":
        replicas = [make_replica(cfg, spec, uri, r, label=codec if verbose else "") for r in range(cfg.replicas)]
        drive(replicas)
        rows = {r.rank: r.rows for r in replicas}
        steps = {r.rank: r.steps for r in replicas}
        by_kind = [r.boundary.store.by_kind for r in replicas]
        lead = replicas[0]
    else:
        reports = run_processes(process_worker, [(asdict(cfg), spec.model_dump(mode="json"), uri, codec if verbose else "")] * cfg.replicas,
                                ctx=mp.get_context("fork"), timeout=cfg.timeout_s,
                                failure=lambda r, rep: f"replica {r} failed:\n{rep['error']}" if "error" in rep
                                else None)
        rows = {r: rep["rows"] for r, rep in enumerate(reports)}
        steps = {r: rep["steps"] for r, rep in enumerate(reports)}
        by_kind = [rep["by_kind"] for rep in reports]
    wall = time.monotonic() - t0
    version, loss = final_loss(cfg, spec, uri, lead)
    all_rows = [row for rs in rows.values() for row in rs]
    boundary = [row["bytes_read"] + row["bytes_written"] for row in all_rows]
    n = len(all_rows)  # contributions: replica-rounds
    kinds = {k: [sum(b.get(k, [0, 0])[i] for b in by_kind) / n for i in (0, 1)]
             for k in sorted({k for b in by_kind for k in b})}
    settings = settings_of(spec)
    return {
        "codec": codec, "wire_codec": spec.sync.codec, "final_version": version, "final_heldout_loss": loss,
        "inner_steps_per_replica": steps, "inner_steps_total": sum(steps.values()),
        "contributions": len(all_rows), "syncs_per_replica": {r: len(rs) for r, rs in rows.items()},
        "curve_rank0": [(row["step"], row["eval_loss"]) for row in rows[0] if "eval_loss" in row],
        "bytes_per_replica_round": sum(boundary) / len(boundary),
        "bytes_by_kind_per_replica_round": kinds,  # [read, written], every store call of the run
        "contribution_bytes_per_replica_round": sum(kinds.get("contributions", [0, 0])),
        "upload_bytes_per_contribution": kinds.get("contributions", [0, 0])[1],
        "merges": [{"rank": r, "round": row["round"], "merged_here": row["merged_here"],
                    "reason": row["merge_reason"], "staleness": row["staleness"]}
                   for r, rs in rows.items() for row in rs if row["merged_here"] is not None],
        "outer_optimizer": spec.outer_optimizer.model_dump(mode="json"),
        "sparse": settings.model_dump(mode="json") if settings is not None else None,
        "min_quorum": spec.sync.min_quorum, "grace_s": [spec.sync.grace_min_s, spec.sync.grace_max_s],
        "wall_s": wall,
    }


def codec_worker(q: Any, index: int, codec: str, cfg_dict: dict[str, Any], base_uri: str,
                 options: dict[str, Any]) -> None:
    try:
        q.put((index, run_codec(Config(**cfg_dict), codec, base_uri, **options)))
    except Exception:
        q.put((index, {"error": traceback.format_exc()}))


def parse_args(argv: list[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # "--h" is H, not help
    p.add_argument("--codecs", nargs="+", choices=["fp32", "sparse", *VARIANTS],
                   default=["fp32", "sparse"])
    p.add_argument("--drive", choices=["interleaved", "processes"], default="interleaved")
    p.add_argument("--grace-s", type=float, default=60.0, help="interleaved: grace_min_s = grace_max_s")
    p.add_argument("--min-quorum", type=int, default=None, help="sync.min_quorum (default: the spec's, ceil(W/2))")
    p.add_argument("--help", action="store_true")
    own, rest = p.parse_known_args(argv)
    if own.help:
        print(__doc__)
        conv.parse_args(["--help"])
    cfg, a = conv.parse_args(rest + ["--methods", "diloco"])
    if len(cfg.h) != 1:
        raise SystemExit("give one --h")
    for k, v in vars(own).items():
        setattr(a, k, v)
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    cfg, a = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    os.makedirs(a.out_dir, exist_ok=True)
    json_path = a.json or os.path.join(a.out_dir, "convergence-decoupled.json")
    if cfg.corpus == "stdlib":
        from composer_cloud import stdlib_corpus

        stdlib_corpus.build_tokenizer(cfg.vocab)  # trained once here, cached for the forked runs
    import composer_cloud.replica.decoupled  # noqa: F401  (imported before forking)
    import composer_cloud.trainer.causal_lm  # noqa: F401

    tmp = tempfile.mkdtemp(prefix="cc-bench-decoupled-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    base_uri = f"{(a.store or 'file://' + tmp).rstrip('/')}/decoupled-{uuid.uuid4().hex[:8]}"
    options = {"drive_mode": a.drive, "grace_s": a.grace_s, "min_quorum": a.min_quorum, "verbose": True}
    print(f"decoupled, W={cfg.replicas}, H={cfg.h[0]}, {cfg.steps} steps per replica, codecs {a.codecs}, "
          f"drive {a.drive}; load average {os.getloadavg()[0]:.2f}", flush=True)
    t0 = time.monotonic()
    try:
        if a.drive == "interleaved":
            runs = run_processes(codec_worker, [(c, asdict(cfg), base_uri, options) for c in a.codecs],
                                 ctx=mp.get_context("fork"), timeout=cfg.timeout_s,
                                 failure=lambda i, rep: f"codec {a.codecs[i]} failed:\n{rep['error']}"
                                 if "error" in rep else None)
        else:
            runs = [run_codec(cfg, c, base_uri, **options) for c in a.codecs]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = {r["codec"]: r for r in runs}
    base = results.get("fp32")
    for r in runs:
        if base is not None:
            r["loss_vs_fp32_pct"] = 100 * (r["final_heldout_loss"] / base["final_heldout_loss"] - 1)
            r["bytes_reduction_vs_fp32"] = base["bytes_per_replica_round"] / r["bytes_per_replica_round"]
            r["contribution_reduction_vs_fp32"] = (base["contribution_bytes_per_replica_round"]
                                                   / r["contribution_bytes_per_replica_round"])
    control = results.get("fp32_sgd")
    for r in runs:
        if control is not None:
            r["loss_vs_fp32_sgd_pct"] = 100 * (r["final_heldout_loss"] / control["final_heldout_loss"] - 1)
    print_table(runs)
    doc = {"config": asdict(cfg), "drive": a.drive, "grace_s": a.grace_s, "min_quorum": a.min_quorum,
           "total_s": time.monotonic() - t0, "cores": os.cpu_count(),
           "bytes_source": "store byte counters around each boundary (publish, merge, adopt), mean per replica "
                           "per round; upload: bytes written at boundaries without a merge", "runs": results}
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {json_path}")
    return 0


def print_table(runs: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="decoupled DiLoCo: held-out loss of the final global version at equal steps")
    for col in ["codec", "held-out loss", "vs fp32", "syncs / replica", "bytes / replica / round", "x fewer",
                "contributions / replica / round", "x fewer", "wall s"]:
        t.add_column(col, justify="left" if col == "codec" else "right")
    for r in runs:
        ratio, up = r.get("bytes_reduction_vs_fp32"), r.get("contribution_reduction_vs_fp32")
        t.add_row(r["codec"], f"{r['final_heldout_loss']:.4f}",
                  f"{r['loss_vs_fp32_pct']:+.2f}%" if "loss_vs_fp32_pct" in r else "-",
                  str(min(r["syncs_per_replica"].values())), human_bytes(r["bytes_per_replica_round"]),
                  f"{ratio:.1f}x" if ratio else "-", human_bytes(r["contribution_bytes_per_replica_round"]),
                  f"{up:.1f}x" if up else "-", f"{r['wall_s']:.0f}")
    Console(width=150).print(t)


if __name__ == "__main__":
    sys.exit(main())
