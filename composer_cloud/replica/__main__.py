"""The replica entry point every executor runs: ``python -m composer_cloud.replica --run RUN_URI --rank R``.

It reads the job's environment once (:class:`~composer_cloud.env.JobEnv`),
sets up logging (UTC ISO timestamps: ``composer-cloud logs`` merges replicas by
time) and torch's threads, builds the fault hooks only when the environment
asks for them (:mod:`~composer_cloud.replica.faults`; crash tests), and runs
one :class:`~composer_cloud.replica.runtime.Replica`. Exit code 0: this replica
finished; 1: it failed (the error is logged, and written to its heartbeat when
the run could be opened: a replica that may not open the run writes nothing).
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
    args = parser.parse_args(argv)
    from composer_cloud.env import JobEnv

    job_env = JobEnv.from_environ(os.environ)
    logging.Formatter.converter = time.gmtime  # UTC, as runs/logs.py parses it
    logging.basicConfig(level=job_env.log_level, datefmt="%Y-%m-%dT%H:%M:%S",
                        format=f"%(asctime)s.%(msecs)03dZ r{args.rank} %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    import torch

    from composer_cloud.replica.faults import EnvFaults
    from composer_cloud.replica.runtime import Replica

    torch.set_num_threads(job_env.threads)
    replica = None
    try:
        replica = Replica(args.run, args.rank, job_env=job_env, hooks=EnvFaults.from_env(job_env))
        replica.run()
        return 0
    except Exception as exc:
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
