"""Bitwise-resume helpers: export a run's weights, compare them, and the shared uninterrupted baselines.

The baseline is the exported model of an uninterrupted run of :data:`~support.specs.RESUME_SPEC`
(or of another spec: ``baselines.of(spec)``) on a ``file://`` store. Every module that compares against
it (resume, failover, store faults, on file://, moto and SeaweedFS; the sparse kill matrix and the
twin-run replays) shares it: a run's model does not depend on its store, so a resumed S3
run that ends on the file:// run's weights also shows that. The ``baselines`` fixture builds it once
per test session, in a cache directory that pytest-xdist's workers share (the first worker to need
it builds it under a file lock; the others wait and read it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from safetensors.torch import load_file

from composer_cloud.runs.status import RunStatus
from composer_cloud.storage.store import Store
from support.cli import cli, cli_here, status_here
from support.local_jobs import kill_run, launch_stalled
from support.specs import RESUME_SPEC
from support.stores import store_uri_for

Weights = dict[str, torch.Tensor]


def launch_run(cwd: Path, store: str, run_id: str, spec: str = RESUME_SPEC, *, env: dict | None = None,
               timeout: float = 300):
    """``composer-cloud launch`` of ``spec`` (written to ``cwd/spec.toml``), attached, to completion."""
    cfg = cwd / "spec.toml"
    cfg.write_text(spec)
    return cli("launch", "--config", str(cfg), "--store", store, "--run-id", run_id, cwd=cwd, env=env,
               timeout=timeout)


def launch_and_wait(cwd: Path, store: str, run_id: str, spec: str = RESUME_SPEC, *,
                    timeout: float = 300) -> RunStatus:
    """``composer_cloud.launch`` of ``spec`` (written to ``cwd/spec.toml``) from this process, followed to its end
    (``composer_cloud.wait``); asserts it completed and returns its final status.

    For the runs a test only reads (baselines, the runs it compares): a ``composer-cloud launch`` process would
    import torch and transformers again for its launch checks (~3 s of CPU each on the 2-core box). The replicas
    are the same processes either way, with this process's environment. Tests that assert what the CLI's launch
    prints or exits with use :func:`launch_run`.
    """
    import composer_cloud as cc

    cfg = cwd / "spec.toml"
    cfg.write_text(spec)
    run = cc.launch(config=cfg, overrides={"store": store, "run_id": run_id})
    final = cc.wait(run, timeout_s=timeout, interval_s=2.0)
    assert final.state == "completed", final.to_json()
    return final


def one_thread(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with one torch thread per replica.

    What the local executor gives each replica of a 2-replica run on 2 cores anyway; a 1-replica run would get
    every core, which on a loaded machine makes each step ~40x slower (threads wait on each other), and
    would make its model depend on the machine's core count (float reductions in another order).
    """
    from composer_cloud import env

    return {**(os.environ if environ is None else environ), env.THREADS: "1"}


def export_weights(cwd: Path, run_uri: str, name: str) -> Weights:
    """The run's latest checkpoint exported into ``cwd/name`` (what ``composer-cloud export`` writes); its weights.

    In this process, through the library: a CLI subprocess would import torch and transformers again for
    every comparison (~3.5 s of CPU each on the 2-core box). The CLI's own ``export`` is tested end to end
    in test_cli.py, test_first_hour.py and test_lora_e2e.py.
    """
    from composer_cloud.runs import open_run
    from composer_cloud.runs.export import export_model

    out = cwd / name
    out.mkdir(parents=True, exist_ok=True)
    export_model(open_run(run_uri), out)
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    return load_file(out / "model.safetensors")


def same_weights(a: Weights, b: Weights) -> bool:
    """Bitwise equality of two exported models (names, dtypes, every element)."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)


def kill_run_at(cwd: Path, store: str, run_id: str, phase: str, *, spec: str = RESUME_SPEC) -> None:
    """Launch, wait until rank 0 stalls at ``phase`` of round 2, SIGKILL launcher and every replica."""
    cfg = cwd / "spec.toml"
    cfg.write_text(spec)
    launcher = launch_stalled(cwd, cfg, store, run_id, phase=phase, round=2, rank=0, capture=False)
    time.sleep(0.5)  # let the other replica get deep into its own waits
    kill_run(f"{store}/{run_id}", launcher)


def check_resume_after_sigkill(kind: str, phase: str, tmp_path: Path, baselines: Baselines) -> None:
    """Kill launcher and every replica at ``phase`` of round 2, resume: the model equals the uninterrupted one.

    The matrix of ``test_resume.py`` (file://) and ``test_resume_s3.py`` (S3, its own module so the two run
    on separate workers).
    """
    expected = baselines.get(tmp_path)
    store = store_uri_for(kind, tmp_path)
    run_id = f"killed-{phase}"
    kill_run_at(tmp_path, store, run_id, phase)
    run_uri = f"{store}/{run_id}"
    # status and resume in this process: a CLI process would only add its imports (the kill above is of processes)
    st = status_here(run_uri, tmp_path)
    if phase == "checkpoint":
        # Checkpoint writes run in the background: training may have gone on,
        # but the stalled round-2 checkpoint is torn (no manifest).
        assert not Store(run_uri).exists("checkpoints/00000002/manifest.json")
    else:
        assert st["rounds_committed"] < 4
    res = cli_here("resume", run_uri, cwd=tmp_path)
    assert res.exit_code == 0, res.output
    got = export_weights(tmp_path, run_uri, f"resumed-{phase}")
    assert same_weights(got, expected), f"resume after a kill at {phase} diverged"


class Baselines:
    """The exported weights of an uninterrupted run of one spec on ``file://``, built once per session.

    Args:
        cache: a directory every xdist worker of the session sees.
        spec: the run's spec (TOML); :data:`RESUME_SPEC` unless another mode's baseline is asked for
            (:meth:`of`). A run's model depends on its spec only (not on its run id, store or signing).
    """

    def __init__(self, cache: Path, spec: str = RESUME_SPEC) -> None:
        self.cache = cache
        self.spec = spec
        self._loaded: Weights | None = None
        self._others: dict[str, Baselines] = {}

    def of(self, spec: str) -> "Baselines":
        """The baseline of ``spec``, in the same shared cache (e.g. a sparse or decoupled run's)."""
        if spec == self.spec:
            return self
        return self._others.setdefault(spec, Baselines(self.cache, spec))

    def shared_run(self, spec: str, run_id: str) -> str:
        """The URI of one uninterrupted run of ``spec`` on ``file://``, launched once per session (first worker
        to ask, under the cache's lock) and kept whole: its store, metrics and checkpoints, for the modules that
        read more of a run than its exported weights (e.g. the 2 x 2 multi-GPU run of test_multi_gpu_e2e.py and
        test_multi_gpu_local_ranks.py). Read it; never write to it (export into the test's own folder)."""
        key = hashlib.sha256(f"{run_id}\n{spec}".encode()).hexdigest()[:12]
        folder = self.cache / f"run-{key}"
        done = folder.with_suffix(".uri")
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder) + ".lock"):
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)  # a worker killed mid-launch leaves no half run
                folder.mkdir()
                store = store_uri_for("file", folder)
                launch_and_wait(folder, store, run_id, spec)
                tmp = done.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(f"{store}/{run_id}")
                os.replace(tmp, done)
        return done.read_text()

    @property
    def path(self) -> Path:
        key = hashlib.sha256(self.spec.encode()).hexdigest()[:12]
        return self.cache / f"file-{key}.safetensors"

    def get(self, tmp_path: Path) -> Weights:
        """The baseline's weights, built in ``tmp_path`` if no worker has built them yet."""
        if self._loaded is None:
            path = self.path
            path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(path) + ".lock"):
                if not path.exists():
                    self._build(tmp_path, path)
            self._loaded = load_file(path)
        return self._loaded

    def _build(self, tmp_path: Path, path: Path) -> None:
        work = tmp_path / f"baseline-{path.stem}"
        work.mkdir()
        store = store_uri_for("file", work)
        res = launch_run(work, store, "baseline", self.spec, env=one_thread())
        assert res.returncode == 0, res.stdout + res.stderr
        export_weights(work, f"{store}/baseline", "model")
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        shutil.copyfile(work / "model" / "model.safetensors", tmp)
        os.replace(tmp, path)  # whole or absent: a worker killed mid-copy leaves no baseline behind


@pytest.fixture(scope="session")
def baselines(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Baselines:
    """The uninterrupted run's weights, shared by every module and xdist worker of the session."""
    root = tmp_path_factory.getbasetemp()
    shared = root if worker_id == "master" else root.parent  # xdist: pytest-N/popen-gwK -> pytest-N
    return Baselines(shared / "resume-baselines")
