"""The replica entry point every executor runs: ``python -m composer_cloud.replica --run RUN_URI --rank R``.

It reads the job's environment once (:class:`~composer_cloud.env.JobEnv`),
sets up logging (UTC ISO timestamps: ``composer-cloud logs`` merges replicas by
time) and torch's threads, builds the fault hooks only when the environment
asks for them (:mod:`~composer_cloud.replica.faults`; crash tests), and runs
one :class:`~composer_cloud.replica.runtime.Replica`. Exit code 0: this replica
finished; 1: it failed (the error is logged, and written to its heartbeat when
the run could be opened: a replica that may not open the run writes nothing).

A run with ``gpus_per_replica = N > 1``: this process starts the replica's ``N``
local ranks under torch's elastic agent (:mod:`~composer_cloud.replica.launch`)
and exits with their verdict; each local rank is this entry point again, with
``--local-ranks N`` and torch's ``LOCAL_RANK`` in its environment.

A rank at or above the run's ``replicas`` is a rollout worker's job (``[rollouts] workers``): this entry point
runs :class:`~composer_cloud.replica.rollout_job.RolloutJob` for it instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback

logger = logging.getLogger("composer_cloud.replica")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="composer_cloud.replica", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run URI, <store>/<run_id>")
    parser.add_argument("--rank", required=True, type=int)
    parser.add_argument("--local-ranks", type=int, default=None,
                        help="set by the replica itself for its local ranks (gpus_per_replica > 1)")
    parser.add_argument("--agent-pid", type=int, default=None, help="set with --local-ranks: the agent's pid")
    args = parser.parse_args(argv)
    from composer_cloud.env import JobEnv
    from composer_cloud.replica.launch import LocalRanks, die_with_agent

    if args.local_ranks is not None and args.agent_pid is not None:
        die_with_agent(args.agent_pid)
    job_env = JobEnv.from_environ(os.environ)
    local = LocalRanks(index=int(os.environ["LOCAL_RANK"]), count=args.local_ranks) if args.local_ranks else \
        LocalRanks()
    name = f"r{args.rank}" if args.local_ranks is None else f"r{args.rank}.{local.index}"
    logging.Formatter.converter = time.gmtime  # UTC, as runs/logs.py parses it
    logging.basicConfig(level=job_env.log_level, datefmt="%Y-%m-%dT%H:%M:%S",
                        format=f"%(asctime)s.%(msecs)03dZ {name} %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    import torch

    from composer_cloud.replica.faults import EnvFaults
    from composer_cloud.replica.runtime import Replica, local_ranks_of, report_local_failure, worker_rank

    torch.set_num_threads(max(1, job_env.threads // local.count))  # the job's threads, shared by its local ranks
    replica = None
    try:
        if args.local_ranks is None and worker_rank(args.run, args.rank, job_env=job_env):
            from composer_cloud.replica.rollout_job import RolloutJob

            replica = RolloutJob(args.run, args.rank, job_env=job_env)  # a rollout worker ([rollouts] workers)
            replica.run()
            return 0
        count, device = local_ranks_of(args.run, job_env=job_env) if args.local_ranks is None else (1, "")
        if count > 1:
            from composer_cloud.forking import fork_safe
            from composer_cloud.replica.launch import launch_local_ranks

            fork = fork_safe(device, allowed=job_env.fork)
            failed = launch_local_ranks(args.run, args.rank, count, fork_main=main if fork else None)
            if failed is not None:
                report_local_failure(args.run, args.rank, job_env=job_env, error=failed)
            return 0 if failed is None else 1
        replica = Replica(args.run, args.rank, job_env=job_env, local=local,
                          hooks=EnvFaults.from_env(job_env, local_rank=local.index))
        replica.run()
        return 0
    except Exception as exc:
        from composer_cloud.stack import PackageTooOldError

        if isinstance(exc, PackageTooOldError):  # one line: the package, the version found, the version needed
            logger.error("replica %d cannot start: %s", args.rank, exc)
        else:
            logger.error("replica %d failed: %s", args.rank, exc)
            traceback.print_exc()
        if replica is not None:
            try:
                replica.report_failure(exc)
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
