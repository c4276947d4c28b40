"""What every fork of composer-cloud shares: where forking is safe, and how a forked child starts clean.

Two places fork a process that then runs as a new interpreter would: the local executor's supervisors and
replicas (:mod:`composer_cloud.jobs.local_fork`) and a multi-GPU replica's local ranks
(:mod:`composer_cloud.replica.launch`). Both fork only where no GPU is in reach (CUDA does not survive a fork),
which is known from the device files without importing torch, and a forked child first drops what belongs to
its parent (:func:`start_as_new_interpreter`).
"""

from __future__ import annotations

import os
import signal
import sys
import weakref
from pathlib import Path


def gpu_device_nodes() -> list[str]:
    """This machine's GPU device files (NVIDIA's ``/dev/nvidia<N>``, AMD ROCm's ``/dev/kfd``): without any,
    torch finds no GPU, which is known without importing it."""
    return sorted(str(p) for p in [*Path("/dev").glob("nvidia[0-9]*"), Path("/dev/kfd")] if p.exists())


def fork_safe(device: str, *, allowed: bool) -> bool:
    """Whether processes computing on ``device`` (a spec's ``device``) may be forked from a preloaded one: Linux,
    ``allowed`` (:func:`~composer_cloud.env.fork_allowed`), and no GPU in reach (``"cpu"``, or ``"auto"``
    without GPU device files)."""
    if sys.platform != "linux" or not hasattr(os, "fork") or not allowed:
        return False
    return device == "cpu" or (device == "auto" and not gpu_device_nodes())


def start_as_new_interpreter() -> None:
    """In a fresh fork, before the child's own code, with fds 1 and 2 already where its output goes.

    * Signal handlers the parent installed (a supervisor's, torch's agent's, which raise in the main thread)
      go back to a new interpreter's defaults.
    * New text streams on fds 1 and 2, line-buffered (log lines reach the file as they are written): the
      inherited objects may be the parent's replacements (a capture, a rich console), not fds 1 and 2.
    * The parent's ``weakref.finalize`` clean-ups never run at the child's exit: run by a child, a parent's
      ``TemporaryDirectory`` was deleted under it (a test's S3 server lost its data folder to a forked child).
      The ``atexit`` handlers stay: they are what the imports registered, as in a new interpreter.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115 - fd 1 stays
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115 - fd 2 stays
    for inherited in list(weakref.finalize._registry):  # noqa: SLF001 - CPython's registry of live finalizers
        inherited.atexit = False


__all__ = ["fork_safe", "gpu_device_nodes", "start_as_new_interpreter"]
