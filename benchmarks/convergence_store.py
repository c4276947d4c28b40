"""The store engine of ``benchmarks/convergence.py``: W replica processes over a real store.

DiLoCo is torchft's ``DiLoCo`` on ``composer_cloud.sync.lockstep.manager.ObjectStoreManager`` (exactly what
``composer_cloud.replica`` runs); the sync baseline all-reduces the flattened gradients every step with
``ObjectStoreAllReduce``. Bytes are the store's own counters. See ``convergence.py``'s docstring for the method.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict
from typing import Any

import torch

from convergence import (POLL_INITIAL_S, POLL_MAX_S, Config, Recorder, batch_loss, build_replica, flat_grads,
                         set_flat_grads, sync_every, tail_mean)
from support.processes import run_processes  # tests/ is on the path via convergence


def prepare(store: str | None) -> tuple[str | None, Any, str]:
    """``(tmp dir or None, fork context, base URI)`` for the store engine's runs (``store``: ``--store`` or None).

    Imports what the replicas need in this process first, so that the forked workers start in a second.
    """
    import multiprocessing as mp

    from composer_cloud.storage.store import Store

    # A tmpfs when there is one: the store fsyncs every object, and the sync baseline makes
    # 4 x 7 objects per step; on a shared disk that, not training, would dominate the runtime.
    tmp = tempfile.mkdtemp(prefix="cc-bench-convergence-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    base_uri = f"{(store or 'file://' + tmp).rstrip('/')}/convergence-{uuid.uuid4().hex[:8]}"
    Store(base_uri).check_access()
    # Replicas are forked from this process, which has imported everything and trained the
    # tokenizer (cached) but run no parallel torch op: the workers start in a second, not 20.
    import torchft.local_sgd  # noqa: F401

    import composer_cloud.sync.lockstep.manager  # noqa: F401
    import composer_cloud.trainer.causal_lm  # noqa: F401

    return tmp, mp.get_context("fork"), base_uri


def store_worker(q: Any, rank: int, method: str, cfg_dict: dict[str, Any], uri: str) -> None:
    """One replica process of ``method`` (``sync``, ``diloco_h<H>`` or ``single``)."""
    try:
        cfg = Config(**cfg_dict)
        torch.set_num_threads(cfg.threads)
        from composer_cloud.retry import PollPolicy
        from composer_cloud.spec import spec_from_dict
        from composer_cloud.storage import layout
        from composer_cloud.storage.store import Store
        from composer_cloud.sync.lockstep import rounds
        from composer_cloud.sync.lockstep.allreduce import AllReduceConfig, ObjectStoreAllReduce
        from composer_cloud.sync.lockstep.diloco import LockstepConfig, build_diloco

        POLL = PollPolicy(initial_s=POLL_INITIAL_S, max_s=POLL_MAX_S)
        t_build = time.monotonic()
        model, trainer, sched = build_replica(cfg, rank)
        rec = Recorder(cfg, method, trainer)
        lead = rank == 0
        if lead:
            rec.maybe(0)
        build_s = time.monotonic() - t_build
        t0 = time.monotonic()
        train: list[float] = []
        out: dict[str, Any] = {"rank": rank}
        sync_s = 0.0
        if method == "single":
            for s in range(1, cfg.steps + 1):
                train.append(trainer.step()["loss"])
                sched.step()
                rec.maybe(s)
            out.update(syncs=0, allreduce_bytes=0, other_store_bytes=0)
        else:
            w = cfg.replicas
            store = Store(uri, poll=POLL)
            codec = cfg.codec_of(method)
            lr, momentum = (cfg.sparse_outer_lr, cfg.sparse_outer_momentum) if codec == "sparse" else \
                (cfg.outer_lr, cfg.outer_momentum)
            sync_settings: dict[str, Any] = {
                "codec": codec, "quorum_timeout_s": cfg.timeout_s, "round_timeout_s": cfg.timeout_s,
                "heal_timeout_s": 2 * cfg.timeout_s, "io_threads": 4}  # the spec wants quorum <= heal / 2
            if codec == "sparse":  # the run's [sync.sparse]: what `composer-cloud launch` would run
                sync_settings["sparse"] = {"density": cfg.sparse_density, "chunk": cfg.sparse_chunk,
                                           "value_bits": cfg.sparse_bits, "decay": cfg.sparse_decay,
                                           "exchange": "two_level" if cfg.sparse_group_size else "gather",
                                           "group_size": cfg.sparse_group_size or None}
            spec = spec_from_dict({
                "replicas": w, "min_replicas": w, "inner_steps": 1 if method == "sync" else sync_every(method),
                "outer_optimizer": {"lr": lr, "momentum": momentum, "nesterov": momentum > 0},
                "sync": sync_settings})
            ar_config = AllReduceConfig.from_spec(spec)
            ar_bytes, payload = 0, 0
            if method == "sync":
                ar = ObjectStoreAllReduce(store, rank, ar_config)
                opt = trainer.optimizer
                for s in range(1, cfg.steps + 1):
                    opt.zero_grad(set_to_none=True)
                    loss = batch_loss(model, trainer)
                    loss.backward()
                    flat = flat_grads(model)
                    ts = time.monotonic()
                    res = ar.allreduce(s - 1, flat)
                    sync_s += time.monotonic() - ts
                    if not (res.committed and res.participated):
                        raise RuntimeError(f"round {s - 1} not committed: {res.reason}")
                    ar_bytes += res.bytes_read + res.bytes_written
                    payload = res.payload_bytes
                    set_flat_grads(model, flat)
                    if cfg.grad_clip:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    sched.step()
                    train.append(float(loss.detach()))
                    if lead:
                        rec.maybe(s)
                        # Every replica has finished round s-2 once round s-1 committed: drop its
                        # payloads so 2000 rounds do not leave gigabytes in the store.
                        if s >= 2:
                            for att in rounds.attempts(store, s - 2):
                                for sub in layout.ATTEMPT_PAYLOADS:
                                    store.delete(f"{layout.attempt_prefix(s - 2, att)}/{sub}", recursive=True)
                ar.close()
                out.update(syncs=cfg.steps, allreduce_bytes=ar_bytes, payload_bytes=payload, other_store_bytes=0)
            else:
                syncs: list[Any] = []
                n_syncs = 0
                loop = build_diloco(store=store, rank=rank, model=model, inner_optimizer=trainer.optimizer,
                                    config=LockstepConfig.from_spec(spec), on_sync=syncs.append)
                with loop:
                    for s in range(1, cfg.steps + 1):
                        train.append(trainer.step()["loss"])
                        sched.step()
                        if syncs:
                            r = syncs.pop()
                            if not r.committed:
                                raise RuntimeError(f"round {r.round} not committed")
                            n_syncs += 1
                            ar_bytes += r.result.bytes_read + r.result.bytes_written
                            payload = r.result.payload_bytes
                            sync_s += r.result.wall_s
                            if lead:
                                rec.maybe(s)
                loop.close()
                total = store.bytes_read + store.bytes_written
                # Everything else this replica moved: the leader's global-state checkpoints
                # (backup parameters + outer momentum, after every commit) and round-discovery reads.
                out.update(syncs=n_syncs, allreduce_bytes=ar_bytes, payload_bytes=payload,
                           other_store_bytes=total - ar_bytes)
        out.update(curve=rec.curve, train_loss_last50=tail_mean(train), loop_s=time.monotonic() - t0,
                   sync_s=sync_s, build_s=build_s)
        q.put((rank, out))
    except Exception:
        q.put((rank, {"error": traceback.format_exc()}))


def run_store(cfg: Config, method: str, ctx: Any, base_uri: str) -> dict[str, Any]:
    w = 1 if method == "single" else cfg.replicas
    # One torch thread per process by default: on a shared 2-core machine, multi-threaded
    # intra-op parallelism loses more to contention than it gains.
    threads = cfg.threads or 1
    cfg_dict = asdict(cfg) | {"threads": threads}
    uri = f"{base_uri}/{method}"
    t0 = time.monotonic()
    reports = dict(enumerate(run_processes(
        store_worker, [(method, cfg_dict, uri)] * w, ctx=ctx, timeout=cfg.timeout_s,
        failure=lambda r, rep: f"{method} replica {r} failed:\n{rep['error']}" if "error" in rep else None)))
    wall = time.monotonic() - t0
    lead = reports[0]
    ranks = sorted(reports)
    return {
        "curve": lead["curve"],
        "syncs": lead["syncs"],
        "bytes_per_replica": sum(reports[r]["allreduce_bytes"] for r in ranks) / w if method != "single" else 0,
        "bytes_per_replica_max": max(reports[r]["allreduce_bytes"] for r in ranks),
        "payload_bytes": lead.get("payload_bytes", 0),
        "other_store_bytes_max": max(reports[r].get("other_store_bytes", 0) for r in ranks),
        "train_loss_last50": sum(reports[r]["train_loss_last50"] for r in ranks) / w,
        "sync_s_mean": sum(reports[r]["sync_s"] for r in ranks) / w,
        "loop_s_max": max(reports[r]["loop_s"] for r in ranks),
        "build_s_max": max(reports[r]["build_s"] for r in ranks),
        "threads_per_process": threads,
        "wall_s": wall,
    }
