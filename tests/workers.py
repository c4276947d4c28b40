"""Process entry points for multi-replica tests (importable by forkserver children)."""

from __future__ import annotations

import time
import traceback

import numpy as np
import torch

from composer_cloud.spec import RunSpec, spec_from_dict
from composer_cloud.storage.store import Store
from composer_cloud.sync.lockstep.allreduce import AllReduceConfig, ObjectStoreAllReduce


def run_spec(world: int, *, min_replicas: int = 1, inner_steps: int = 1, outer: dict | None = None,
             **sync: object) -> RunSpec:
    """A spec with ``world`` replicas and these ``[sync]`` settings: configs come from specs only."""
    return spec_from_dict({"replicas": world, "min_replicas": min_replicas, "inner_steps": inner_steps,
                           "outer_optimizer": outer or {}, "sync": sync})


def allreduce_config(world: int, **settings: object) -> AllReduceConfig:
    """The all-reduce settings of a ``world``-replica run (``min_replicas`` and ``[sync]`` keys as keywords)."""
    return AllReduceConfig.from_spec(run_spec(world, **settings))


def payload(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(numel, generator=g) * (1 + rank)).to(dtype)


def allreduce_worker(q, index: int, uri: str, rank: int, world: int, numel: int, codec: str,
                     rounds: int = 1) -> None:
    try:
        ar = ObjectStoreAllReduce(Store(uri), rank, allreduce_config(
            world, min_replicas=world, codec=codec, quorum_timeout_s=30, round_timeout_s=60))
        outs = []
        for r in range(rounds):
            x = payload(rank + 10 * r, numel)
            res = ar.allreduce(r, x)
            assert res.committed and res.participated, res
            outs.append(x.numpy().copy())
        q.put((index, {"outs": outs, "read": res.bytes_read, "written": res.bytes_written,
                       "payload": res.payload_bytes}))
    except Exception:
        q.put((index, {"error": traceback.format_exc()}))


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def fragments_of(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    if n == 1:
        return [model]
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    return [torch.nn.ModuleList(layers[:2]), torch.nn.ModuleList(layers[2:])]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 100003 + step)
    x = torch.randn(8, 6, generator=g)
    return x, torch.sin(x[:, :3] * (rank + 1))


def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


INNER_LR = 0.05
OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)


def diloco_worker(q, index: int, uri: str, rank: int, world: int, *, rounds: int, sync_every: int,
                  fragments: int = 1, min_replicas: int | None = None, quorum_timeout_s: float = 30,
                  delay_before_step: dict[int, float] | None = None, codec: str = "fp32",
                  bucketize: bool = False, wait_before_step: dict[int, list[str]] | None = None) -> None:
    """Runs torchft's DiLoCo on the object-store manager; reports params after every sync.

    ``wait_before_step``: step -> store keys that must exist before that step (an event another replica
    writes, so a test orders replicas by what they did, not by wall-clock windows; 120 s only guard a hang).
    """
    from composer_cloud.sync.lockstep.diloco import LockstepConfig, build_diloco

    try:
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        spec = run_spec(world, min_replicas=min_replicas or world, inner_steps=sync_every, outer=OUTER,
                        fragments=fragments, codec=codec, quorum_timeout_s=quorum_timeout_s, round_timeout_s=60,
                        heal_timeout_s=60)
        syncs = []
        loop = build_diloco(store=Store(uri), rank=rank, model=model, inner_optimizer=inner,
                            config=LockstepConfig.from_spec(spec), fragments=fragments_of(model, fragments),
                            use_bucketization=bucketize, on_sync=syncs.append)
        manager = loop.manager
        snapshots = []
        steps = rounds * sync_every // fragments
        with loop:
            for step in range(steps):
                if delay_before_step and step in delay_before_step:
                    time.sleep(delay_before_step[step])
                for key in (wait_before_step or {}).get(step, []):
                    guard = time.monotonic() + 120
                    while not Store(uri).exists(key):
                        if time.monotonic() > guard:
                            raise TimeoutError(f"rank {rank}: {key} never appeared")
                        time.sleep(0.05)
                inner_step(model, inner, rank, step)
                if (step + 1) % (sync_every // fragments) == 0:
                    snapshots.append([p.detach().numpy().copy() for p in model.parameters()])
        loop.close()
        history = [(h.round, h.committed, h.healed_to, h.result.participants if h.result else None)
                   for h in syncs]
        q.put((index, {"snapshots": snapshots, "history": history, "step": manager.current_step()}))
    except Exception as exc:  # report, so the parent can assert on the error
        q.put((index, {"error": traceback.format_exc(), "type": type(exc).__name__,
                       "missing": getattr(exc, "missing_ranks", None), "message": str(exc)}))


def reference_diloco(world: int, *, rounds: int, sync_every: int, fragments: int = 1) -> list[list[np.ndarray]]:
    """DiLoCo in plain torch, all replicas in one process: the spec the manager must match."""
    replicas = [make_model() for _ in range(world)]
    inners = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in replicas]
    glob = make_model()
    gfrags = fragments_of(glob, fragments)
    outers = [torch.optim.SGD(f.parameters(), **OUTER) for f in gfrags]
    per_frag = sync_every // fragments
    snapshots: list[list[np.ndarray]] = []
    for step in range(rounds * per_frag):
        for r, (m, opt) in enumerate(zip(replicas, inners)):
            inner_step(m, opt, r, step)
        if (step + 1) % per_frag:
            continue
        f = (step + 1) // per_frag - 1
        f %= fragments
        gparams = list(gfrags[f].parameters())
        local = [list(fragments_of(m, fragments)[f].parameters()) for m in replicas]
        with torch.no_grad():
            for i, gp in enumerate(gparams):
                pseudo = torch.stack([gp.detach() - lp[i].detach() for lp in local]).mean(0)
                gp.grad = pseudo
        outers[f].step()
        outers[f].zero_grad()
        with torch.no_grad():
            for lp in local:
                for gp, p in zip(gparams, lp):
                    p.copy_(gp)
        snapshots.append([p.detach().numpy().copy() for p in replicas[0].parameters()])
    return snapshots
