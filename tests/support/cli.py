"""The ``composer-cloud`` CLI in a subprocess, as a user runs it, or in this process (:func:`cli_here`)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

CLI = [sys.executable, "-m", "composer_cloud.cli"]


def cli(*args: str, cwd: str | Path, env: Mapping[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``composer-cloud ARGS`` in ``cwd`` to completion; output captured as text.

    ``env`` replaces the environment (default: this process's); ``timeout`` (s)
    only guards against a hang, it asserts nothing.
    """
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=dict(env) if env is not None else None)


def start_cli(*args: str, cwd: str | Path, env: Mapping[str, str] | None = None,
              capture: bool = True) -> subprocess.Popen:
    """Start ``composer-cloud ARGS`` in its own session (so a test can kill its whole group).

    With ``capture``, stdout and stderr go to one text pipe (read it with
    ``communicate``); otherwise both are discarded.
    """
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen([*CLI, *args], cwd=cwd, env=dict(env) if env is not None else None,
                            start_new_session=True, stdout=out,
                            stderr=subprocess.STDOUT if capture else subprocess.DEVNULL, text=True)


def cli_here(*args: str, cwd: str | Path, timeout: float = 300):
    """``composer-cloud ARGS`` in this process (typer's runner; a ``click.testing.Result``: ``exit_code``,
    ``stdout``, ``stderr``), in ``cwd`` (as :func:`cli` runs it: a local replica's job folder is under the
    working folder when the store is not ``file://``), for commands whose output and exit code a test reads but
    whose process it does not: a subprocess imports the package again, and torch and transformers for export or a
    refusal after the model checks (1-8 CPU-s each on the 2-core box).

    ``timeout`` (s) guards against a hang as :func:`cli`'s does: a ``SIGALRM`` raises :class:`TimeoutError` in the
    command (its ``Result.exception``, exit code 1), so an attached ``resume`` of a run that never ends fails the
    test instead of holding its worker."""
    from typer.testing import CliRunner

    from composer_cloud.cli import app

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"composer-cloud {' '.join(args)}: still running after {timeout:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with contextlib.chdir(cwd):
            return CliRunner().invoke(app, list(args))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def status_here(run_uri: str, cwd: str | Path, *options: str) -> dict:
    """``composer-cloud status RUN --json [OPTIONS]`` in this process, in ``cwd`` (:func:`cli_here`), parsed (exit
    1 for a failed or cancelled run still prints the status)."""
    res = cli_here("status", run_uri, "--json", *options, cwd=cwd)
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)
