"""Helpers shared by the test modules (and the benchmarks); no test module imports another.

* :mod:`support.cli`: run the ``composer-cloud`` CLI in a subprocess (``cli``, ``start_cli``).
* :mod:`support.specs`: the small model every end-to-end test trains, and the resume matrix's spec.
* :mod:`support.stores`: store URIs per store kind, pointing a test at one of the session's S3 servers.
* :mod:`support.faults`: fault-injection environments (stall a replica at a phase, slow a replica).
* :mod:`support.local_jobs`: launched runs on the local executor: stall, kill, logs, through job handles.
* :mod:`support.resume`: exported weights, bitwise comparison, the shared uninterrupted baseline.
* :mod:`support.failover`: launch a run and SIGKILL one replica where it stalls (the failover modules).
* :mod:`support.processes`: run a function in several forkserver processes.
* :mod:`support.threads`: lock-step DiLoCo with one thread per replica, and a store that damages chosen reads.
* :mod:`support.executors`: executor test helpers (specs, small job commands, waiting for a job).
* :mod:`support.hf_jobs`: fixtures of a local Hugging Face Jobs server and the wheel its jobs install.
* :mod:`support.metrics`: metrics rows as a replica's writer builds them (``log_step``, ``log_round``).

Fixtures (registered in ``tests/conftest.py``): ``baselines``, ``hf_env``, ``hf_server``, ``wheel``,
``job_python``, ``job_constraints``.
"""
