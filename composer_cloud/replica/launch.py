"""The local ranks of a multi-GPU replica: started by torch.distributed's elastic agent, one owner.

When ``spec.gpus_per_replica = N > 1`` the replica's entry point does not train itself: it starts ``N``
local ranks with :func:`torch.distributed.launcher.api.elastic_launch` (the agent behind ``torchrun``), each
``python -m composer_cloud.replica --run RUN --rank R --local-ranks N --agent-pid P`` with torch's ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (a rendezvous on the job's loopback: nothing leaves the
job), so no executor builds a ``torchrun`` command.

Where no GPU can be in use (``device = "cpu"``, or ``"auto"`` on a machine without GPU device files; Linux;
``COMPOSER_CLOUD_LOCAL_FORK`` not ``0``) the agent forks the ranks instead (``start_method="fork"``, a function
entrypoint): a fresh interpreter spends ~8 CPU-seconds importing torch and transformers before it trains, the
agent has them imported already. A forked rank starts as a new interpreter would (default signal handlers, its
own output streams) and runs the same entry point with the same argv; CUDA never meets a fork.

Failure semantics (docs/multi-gpu.md): ``max_restarts = 0`` inside the job. A local rank that dies (a crash,
``kill -9``, an OOM) makes the agent stop the others and :func:`launch_local_ranks` return 1, so the job
fails as a whole and the executor's ``max_restarts`` restarts the whole replica, which resumes like any
restarted replica. A rank never outlives its replica, and a replica never commits a round without all its
shards (:mod:`composer_cloud.sync.lockstep.sharded`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from composer_cloud import forking

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalRanks:
    """This process's place in its replica: local rank ``index`` of ``count`` (``count = 1``: no local ranks)."""

    index: int = 0
    count: int = 1

    @property
    def leader(self) -> bool:
        """Local rank 0 writes what belongs to the replica (heartbeats, metrics, checkpoints, summaries)."""
        return self.index == 0


def launch_local_ranks(run_uri: str, rank: int, count: int, *, fork_main: Callable[[list[str]], int] | None = None,
                       monitor_interval_s: float = 0.2) -> str | None:
    """Run ``count`` local ranks of replica ``rank`` under the elastic agent: each a fork of this process running
    ``fork_main(argv)`` (the entry point's ``main``, where :func:`~composer_cloud.forking.fork_safe`), else each a new
    ``python -m composer_cloud.replica ARGV``.

    Returns None when every rank finished, else what failed first (``"local rank 1 exited with -9 ..."``).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=count, run_id=f"replica-{rank}-{uuid.uuid4().hex}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=monitor_interval_s, start_method="spawn" if fork_main is None else "fork")
    argv = ["--run", run_uri, "--rank", str(rank), "--local-ranks", str(count), "--agent-pid", str(os.getpid())]
    logger.info("replica %d: starting %d local ranks%s", rank, count, "" if fork_main is None else " (forked)")
    for stream in (sys.stdout, sys.stderr):  # a forked rank must not inherit (and write again) buffered lines
        stream.flush()
    try:
        if fork_main is not None:
            elastic_launch(config, run_forked_rank)(fork_main, argv)
        else:
            elastic_launch(config, sys.executable)("-m", "composer_cloud.replica", *argv)
    except ChildFailedError as exc:
        local, failure = exc.get_first_failure()
        what = f"local rank {local} exited with {failure.exitcode} ({failure.message or 'no message'})"
        logger.error("replica %d: %s; its other ranks were stopped (the executor may restart the replica)",
                     rank, what)
        return what
    return None


def run_forked_rank(main: Callable[[list[str]], int], argv: list[str]) -> None:
    """A forked local rank's entry point (torch's worker wrapper calls it with the rank's environment set).

    Ordering: the agent's signal handlers (torch's, which raise in the main thread), its output streams and its
    log handlers (bound to the old streams, naming the agent) go first, so the rank starts as
    ``python -m composer_cloud.replica ARGV`` would. A non-zero exit
    leaves by ``SystemExit`` (torch's wrapper would report a returned code as success); ``KeyboardInterrupt``
    too, since torch's wrapper swallows it and its agent would then wait for a result that never comes.
    """
    forking.start_as_new_interpreter()
    for handler in logging.root.handlers[:]:  # the entry point configures its own (named for this rank)
        logging.root.removeHandler(handler)
    sys.argv = [sys.argv[0], *argv]  # the agent's is the entry point's path, as `python -m` set it
    try:
        code = main(argv)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if code:
        raise SystemExit(code)


def die_with_agent(agent_pid: int) -> None:
    """Make this local rank die with the agent that started it (the agent starts each rank in its own session).

    A replica's job that is killed as a whole (a lost machine, ``cancel``, ``kill -9`` of its process group)
    then leaves no rank behind that could go on writing to the store. Linux: ``PR_SET_PDEATHSIG``; elsewhere a
    thread that exits the process once the parent is gone.
    """
    import signal
    import threading
    import time

    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    else:
        def watch() -> None:
            while os.getppid() == agent_pid:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="die-with-agent", daemon=True).start()
    if os.getppid() != agent_pid:  # the agent died before the signal was armed
        os._exit(1)


def init_local_group(local: LocalRanks, *, device_type: str, timeout_s: float) -> object:
    """Join the replica's process group (NCCL on GPUs, gloo on CPU); returns the gloo group the sync uses.

    ``timeout_s`` bounds every collective: a rank that stops answering fails its peers' next collective
    instead of hanging them (the agent stops the job first when the rank died).
    """
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    if dist.get_world_size() != local.count or dist.get_rank() != local.index:
        raise RuntimeError(f"local rank {local.index} of {local.count}: the process group says rank "
                           f"{dist.get_rank()} of {dist.get_world_size()}")
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


__all__ = ["LocalRanks", "die_with_agent", "init_local_group", "launch_local_ranks", "run_forked_rank"]
