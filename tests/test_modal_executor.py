"""ModalExecutor around a fake seam; the function body run locally; the real seam's exception mapping.

There is no Modal emulator: everything that does not talk to Modal is tested
here, the SDK calls themselves only in the opt-in live test at the bottom
(``COMPOSER_CLOUD_LIVE_MODAL=1``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
import os
import pickle
import secrets
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from composer_cloud.jobs import get_executor
from composer_cloud.jobs.base import ExecutorError, JobHandle, ReplicaState, ServerlessExecutor
from composer_cloud.jobs.modal_jobs import (
    CallState,
    FunctionOptions,
    ModalExecutor,
    ModalSDKSeam,
    PartialSpawnError,
    ReplicaFailed,
    SpawnRequest,
    SpawnResult,
    run_replica_body,
)
from support.executors import code_argv, executor_spec, wait_finished


# ---------------------------------------------------------------------- a fake seam
class FakeSeam:
    """Records every call. ``mode="run"`` runs each spawned body in a thread (a tiny local Modal);
    ``mode="script"`` returns states from ``self.states``."""

    def __init__(self, mode: str = "script", fail_at: int | None = None, error: BaseException | None = None):
        self.mode = mode
        self.fail_at = fail_at
        self.error = error
        self.spawns: list[dict] = []
        self.cancelled: list[str] = []
        self.state_calls: list[str] = []
        self.states: dict[str, CallState] = {}
        self.outputs: dict[str, io.StringIO] = {}
        self._results: dict[str, CallState] = {}
        self._threads: dict[str, threading.Thread] = {}

    def spawn(self, *, app_name: str, options: FunctionOptions, requests: Sequence[SpawnRequest]) -> SpawnResult:
        self.spawns.append({"app_name": app_name, "options": options, "requests": list(requests)})
        if self.error is not None and self.fail_at is None:
            raise self.error
        ids = []
        for i, req in enumerate(requests):
            if self.fail_at is not None and i == self.fail_at:
                raise PartialSpawnError("ap-fake", ids, self.error or RuntimeError("quota exceeded"))
            call_id = f"fc-{len(self.spawns)}-{req.rank}"
            ids.append(call_id)
            self.states[call_id] = CallState("pending")
            if self.mode == "run":
                self.outputs[call_id] = io.StringIO()
                t = threading.Thread(target=self._run, args=(call_id, req), daemon=True)
                self._threads[call_id] = t
                t.start()
        return SpawnResult(app_id="ap-fake", call_ids=ids)

    def _run(self, call_id: str, req: SpawnRequest) -> None:
        try:
            result = run_replica_body(req.argv, req.env, out=self.outputs[call_id])
            self._results[call_id] = CallState("succeeded", result=result)
        except ReplicaFailed as exc:
            self._results[call_id] = CallState("failed", message=str(exc))

    def state(self, call_id: str) -> CallState:
        self.state_calls.append(call_id)
        if self.mode == "run" and call_id in self._threads:
            return self._results.get(call_id) or CallState("running")
        return self.states[call_id]

    def logs(self, call_id: str, *, since: dt.datetime, follow: bool) -> Iterator[str]:
        if follow:
            self._threads[call_id].join()
        yield from self.outputs[call_id].getvalue().splitlines()

    def cancel(self, call_id: str) -> None:
        self.cancelled.append(call_id)
        self.states[call_id] = CallState("cancelled")


def make_spec(store="s3://bucket/runs", gpus_per_replica=1, **modal):
    modal.setdefault("secrets", ["aws-creds"])  # an S3 store needs one (containers get credentials only from secrets)
    return executor_spec("modal", store=store, run_id="run-m", gpus_per_replica=gpus_per_replica, **modal)


RUN_URI = "s3://bucket/runs/run-m"


def argv(code: str):
    return code_argv(code, python=sys.executable)


# ---------------------------------------------------------------------- options
def test_function_options_from_the_spec():
    opts = ModalExecutor(make_spec(gpus_per_replica=2, gpu="H100", timeout_s=3600, retries=2,
                                   secrets=["aws-creds", "hf"])).function_options()
    assert opts == FunctionOptions(gpu="H100:2", timeout_s=3600, retries=2, secret_names=("aws-creds", "hf"))
    assert ModalExecutor(make_spec(gpu="A10G")).function_options().gpu == "A10G"
    assert ModalExecutor(make_spec(gpu="cpu")).function_options().gpu is None
    assert ModalExecutor(make_spec(gpus_per_replica=4, gpu="H100:4")).function_options().gpu == "H100:4"
    assert ModalExecutor(make_spec(gpus_per_replica=2, gpu="L4")).function_options().gpu == "L4:2"
    # max_restarts raises the retry count; Modal allows at most 10.
    spec = make_spec(retries=1).model_copy(update={"max_restarts": 3})
    assert ModalExecutor(spec).function_options().retries == 3
    spec = make_spec(retries=1).model_copy(update={"max_restarts": 50})
    assert ModalExecutor(spec).function_options().retries == 10


def test_each_call_asks_for_gpus_per_replica_gpus_and_refuses_what_modal_cannot_give():
    """gpus_per_replica is the one count: GPU:N in the spawn options, a disagreeing count or one above Modal's
    per-container limit refused (naming the fields and the limit) before anything is spawned."""
    seam = FakeSeam()
    ex = ModalExecutor(make_spec(gpus_per_replica=8, gpu="H100"), seam=seam)
    ex.launch(RUN_URI, [0, 1])
    assert seam.spawns[0]["options"].gpu == "H100:8"
    # A count written in modal.gpu must agree with gpus_per_replica.
    assert ModalExecutor(make_spec(gpus_per_replica=8, gpu="H100:8")).function_options().gpu == "H100:8"
    with pytest.raises(ExecutorError, match=r"modal.gpu 'H100:4' asks for 4 GPUs but gpus_per_replica = 8"):
        ModalExecutor(make_spec(gpus_per_replica=8, gpu="H100:4")).function_options()
    # A10 containers hold at most 4 GPUs (Modal's GPU guide); the error names the types that hold 8.
    assert ModalExecutor(make_spec(gpus_per_replica=4, gpu="A10")).function_options().gpu == "A10:4"
    with pytest.raises(ExecutorError, match=r"at most 4 A10 GPUs.*gpus_per_replica <= 4.*H100") as err:
        ModalExecutor(make_spec(gpus_per_replica=5, gpu="A10"), seam=seam).launch(RUN_URI, [0])
    assert "modal.com/docs/guide/gpu" in str(err.value)
    assert len(seam.spawns) == 1  # the refused launch spawned nothing
    # Unknown types have no limit here (Modal decides); CPU-only calls run N gloo processes, no GPU.
    assert ModalExecutor(make_spec(gpus_per_replica=8, gpu="B300")).function_options().gpu == "B300:8"
    cpu = make_spec(gpus_per_replica=2, gpu="cpu").model_copy(update={"device": "cpu"})
    assert ModalExecutor(cpu).function_options().gpu is None
    wasted = make_spec(gpus_per_replica=2, gpu="L4").model_copy(update={"device": "cpu"})
    assert any('device = "cpu"' in n and "go unused" in n for n in ModalExecutor(wasted).plan(RUN_URI, [0]).notes)


def test_modal_gpu_count_is_gone_and_refused_by_name():
    from composer_cloud.errors import SpecError

    with pytest.raises(SpecError) as err:
        make_spec(gpu="H100", gpu_count=2)
    assert err.value.field == "modal.gpu_count"


def test_dry_run_plan_shows_n_gpus_and_the_price_per_replica_hour():
    from composer_cloud.jobs.modal_jobs import MODAL_GPU_PRICE_PER_S

    plan = ModalExecutor(make_spec(gpus_per_replica=8, gpu="H100", timeout_s=3600), seam=FakeSeam()).plan(
        RUN_URI, [0, 1])
    per_gpu_hour = MODAL_GPU_PRICE_PER_S["H100"][0] * 3600
    assert plan.gpu == "H100:8" and plan.gpus_per_replica == 8
    assert plan.replica_hour_cost_usd == pytest.approx(8 * per_gpu_hour)  # one call = 8 GPUs
    assert plan.hourly_cost_usd == pytest.approx(2 * 8 * per_gpu_hour)  # the run's 2 replicas
    assert plan.estimated_gpu_hours == pytest.approx(2 * 8 * 1.0)
    assert "x 8 GPU(s)" in plan.cost_basis


# ---------------------------------------------------------------------- launch / poll / logs
def test_launch_spawns_one_call_per_rank_and_runs_the_body():
    seam = FakeSeam(mode="run")
    ex = ModalExecutor(make_spec(gpu="L4"), seam=seam,
                       replica_argv=argv("import sys; print('replica', sys.argv[2], flush=True)"))
    assert isinstance(ex, ServerlessExecutor)
    handles = ex.launch(RUN_URI, [3, 5])
    (spawn,) = seam.spawns  # one app run, one spawn per rank inside it
    assert [r.rank for r in spawn["requests"]] == [3, 5]
    assert spawn["requests"][1].argv[-2:] == [RUN_URI, "5"]
    assert spawn["requests"][0].env["PYTHONUNBUFFERED"] == "1"
    assert spawn["app_name"] == "composer-cloud-run-m"
    assert spawn["options"].gpu == "L4"
    assert [(h.rank, h.job_id, h.executor) for h in handles] == [(3, "fc-1-3", "modal"), (5, "fc-1-5", "modal")]
    assert handles[0].data["app_id"] == "ap-fake"
    dt.datetime.fromisoformat(handles[0].data["launched_at"])

    # Re-attach from JSON, as `status` on another machine would.
    again = [JobHandle.from_json(json.loads(json.dumps(h.to_json()))) for h in handles]
    for h in again:
        status = wait_finished(ex, h)
        assert (status.state, status.exit_code) == (ReplicaState.SUCCEEDED, 0)
    assert list(ex.logs(again[1], follow=True)) == ["replica 5"]


def test_failed_body_surfaces_exit_code_and_tail():
    seam = FakeSeam(mode="run")
    code = "import sys\nfor i in range(50): print('line', i)\nsys.exit(9)\n"
    ex = ModalExecutor(make_spec(), seam=seam, replica_argv=argv(code))
    (handle,) = ex.launch(RUN_URI, [0])
    status = wait_finished(ex, handle)
    assert status.state is ReplicaState.FAILED and status.exit_code == 9
    assert "line 49" in status.message and "line 0\n" not in status.message + "\n"


@pytest.mark.parametrize("state, expected, exit_code, words", [
    (CallState("pending"), ReplicaState.PENDING, None, "waiting"),
    (CallState("running"), ReplicaState.RUNNING, None, ""),
    (CallState("succeeded", result={"exit_code": 0}), ReplicaState.SUCCEEDED, 0, ""),
    (CallState("succeeded", result={"exit_code": 4}), ReplicaState.FAILED, 4, "code 4"),
    (CallState("failed", message=str(ReplicaFailed(3, ["boom"]))), ReplicaState.FAILED, 3, "boom"),
    (CallState("failed", message="ExecutionError: could not deserialize"), ReplicaState.FAILED, None, "deserialize"),
    (CallState("init_failed", message="ImportError: x"), ReplicaState.FAILED, None, "failed to start"),
    (CallState("timed_out"), ReplicaState.FAILED, None, "1234 s"),
    (CallState("cancelled"), ReplicaState.CANCELLED, None, "cancelled"),
    (CallState("expired"), ReplicaState.FAILED, None, "expire"),
])
def test_state_mapping(state, expected, exit_code, words):
    seam = FakeSeam()
    ex = ModalExecutor(make_spec(timeout_s=1234), seam=seam, replica_argv=argv("pass"))
    (handle,) = ex.launch(RUN_URI, [0])
    seam.states[handle.job_id] = state
    status = ex.poll(handle)
    assert status.state is expected and status.exit_code == exit_code
    assert words in status.message


def test_terminal_states_are_cached_but_live_ones_are_not():
    seam = FakeSeam()
    ex = ModalExecutor(make_spec(), seam=seam, replica_argv=argv("pass"))
    (handle,) = ex.launch(RUN_URI, [0])
    seam.states[handle.job_id] = CallState("running")
    ex.poll(handle), ex.poll(handle)
    seam.states[handle.job_id] = CallState("succeeded", result={"exit_code": 0})
    ex.poll(handle), ex.poll(handle), ex.poll(handle)
    assert len(seam.state_calls) == 3


def test_partial_spawn_cancels_what_was_spawned():
    seam = FakeSeam(fail_at=2)
    ex = ModalExecutor(make_spec(), seam=seam, replica_argv=argv("pass"))
    with pytest.raises(ExecutorError, match="after 2 of 4") as err:
        ex.launch(RUN_URI, [0, 1, 2, 3])
    assert "quota exceeded" in str(err.value) and "cancelled" in str(err.value)
    assert seam.cancelled == ["fc-1-0", "fc-1-1"]


def test_launch_errors_say_what_to_do():
    class AuthError(Exception):
        pass

    seam = FakeSeam(error=AuthError("token missing"))
    with pytest.raises(ExecutorError, match="modal token new"):
        ModalExecutor(make_spec(), seam=seam, replica_argv=argv("pass")).launch(RUN_URI, [0])

    class NotFoundError(Exception):
        pass

    seam = FakeSeam(error=NotFoundError("Secret 'aws' not found"))
    with pytest.raises(ExecutorError, match="modal secret create"):
        ModalExecutor(make_spec(secrets=["aws"]), seam=seam, replica_argv=argv("pass")).launch(RUN_URI, [0])


def test_cancel_is_idempotent():
    seam = FakeSeam()
    ex = ModalExecutor(make_spec(), seam=seam, replica_argv=argv("pass"))
    a, b = ex.launch(RUN_URI, [0, 1])
    seam.states[a.job_id] = CallState("running")
    ex.cancel(a)
    assert ex.poll(a).state is ReplicaState.CANCELLED
    ex.cancel(a)
    seam.states[b.job_id] = CallState("succeeded", result={"exit_code": 0})
    ex.cancel(b)  # finished: left alone
    assert seam.cancelled == [a.job_id]


def test_a_local_store_is_refused_before_modal_is_called(tmp_path):
    seam = FakeSeam()
    ex = ModalExecutor(make_spec(store=f"file://{tmp_path}"), seam=seam)
    with pytest.raises(ExecutorError, match="s3://"):
        ex.launch(f"file://{tmp_path}/run-m", [0])
    assert seam.spawns == []
    assert any("launch would fail" in n for n in ex.plan(f"file://{tmp_path}/run-m", [0]).notes)


def test_plan():
    from composer_cloud.images import modal_image

    seam = FakeSeam()
    spec = make_spec(gpu="B300", gpus_per_replica=4, timeout_s=1800, secrets=[]).model_copy(
        update={"store_options": {"endpoint_url": "http://minio:9000"}})
    ex = get_executor("modal", spec)
    ex.seam = seam
    plan = ex.plan(RUN_URI, [0, 1])
    assert seam.spawns == []
    assert plan.executor == "modal" and plan.ranks == [0, 1]
    assert plan.command == ["python", "-m", "composer_cloud.replica", "--run", RUN_URI, "--rank", "0"]
    assert "debian_slim" in plan.image and str(len(modal_image.pinned_requirements())) in plan.image
    assert plan.gpu == "B300:4"
    assert plan.estimated_gpu_hours == pytest.approx(2 * 4 * 0.5)
    assert plan.secret_names == []
    assert "COMPOSER_CLOUD_STORE_OPTIONS" in plan.env_names
    assert any("B300" in n and "Modal decides" in n for n in plan.notes)
    assert any(n.startswith("launch would fail") and "no credentials" in n for n in plan.notes)
    ex = get_executor("modal", spec.model_copy(update={"modal": spec.modal.model_copy(update={"secrets": ["aws"]})}))
    ex.seam = seam
    with pytest.warns(UserWarning, match="B300"):
        ex.launch(RUN_URI, [0])


def test_plan_cost_from_the_dated_price_table():
    from composer_cloud.jobs.modal_jobs import MODAL_GPU_PRICE_PER_S, MODAL_GPU_PRICES_TAKEN

    spec = make_spec(gpu="H100", gpus_per_replica=2, timeout_s=1800, retries=1).model_copy(
        update={"max_restarts": 2})
    plan = ModalExecutor(spec, seam=FakeSeam()).plan(RUN_URI, [0, 1, 2])
    per_s, confirmed = MODAL_GPU_PRICE_PER_S["H100"]
    assert confirmed
    assert plan.hourly_cost_usd == pytest.approx(3 * 2 * per_s * 3600)  # 3 calls x 2 GPUs
    assert plan.estimated_cost_usd == pytest.approx(plan.hourly_cost_usd * 0.5)  # until the 30 min timeout
    assert plan.max_cost_usd == pytest.approx(3 * plan.estimated_cost_usd)  # retries = max(1, 2) -> 3 attempts
    assert MODAL_GPU_PRICES_TAKEN in plan.cost_basis and "H100" in plan.cost_basis
    assert "unconfirmed" not in plan.cost_basis

    # Aliases map to the priced type; unconfirmed prices say so; unknown types and CPU have no price.
    a100 = ModalExecutor(make_spec(gpu="A100"), seam=FakeSeam()).plan(RUN_URI, [0])
    assert a100.hourly_cost_usd == pytest.approx(MODAL_GPU_PRICE_PER_S["A100-40GB"][0] * 3600)
    assert "unconfirmed" in a100.cost_basis
    unknown = ModalExecutor(make_spec(gpu="B300"), seam=FakeSeam()).plan(RUN_URI, [0])
    assert unknown.estimated_cost_usd is None and "no price for GPU 'B300'" in unknown.cost_basis
    cpu = ModalExecutor(make_spec(gpu="cpu"), seam=FakeSeam()).plan(RUN_URI, [0])
    assert cpu.hourly_cost_usd is None and "CPU-only" in cpu.cost_basis


def test_preflight_refuses_a_local_store_and_bad_options_before_anything_is_sent():
    seam = FakeSeam()
    with pytest.raises(ExecutorError, match="cannot launch: store file://"):
        ModalExecutor(make_spec(store="file:///tmp/runs"), seam=seam).preflight("file:///tmp/runs/run-m", [0])
    with pytest.raises(ExecutorError, match="gpus_per_replica = 1"):
        ModalExecutor(make_spec(gpu="H100:2"), seam=seam).preflight(RUN_URI, [0])
    with pytest.raises(ExecutorError, match="at most 4 A10G"):
        ModalExecutor(make_spec(gpu="A10G", gpus_per_replica=8), seam=seam).preflight(RUN_URI, [0])
    assert seam.spawns == []
    with pytest.raises(ExecutorError, match=r"modal.secrets is empty.*modal secret create"):
        ModalExecutor(make_spec(secrets=[]), seam=seam).preflight(RUN_URI, [0])
    public = make_spec(secrets=[]).model_copy(update={"store_options": {"anon": True}})
    ModalExecutor(public, seam=seam).preflight(RUN_URI, [0])
    ModalExecutor(make_spec(), seam=seam).preflight(RUN_URI, [0])
    assert seam.spawns == []


def test_secret_canary_never_leaves_modal(monkeypatch, caplog, capsys):
    """Secrets are Modal secret names; this process never reads a value, so none can leak."""
    canary = "canary-" + secrets.token_hex(16)
    for name in ("aws-creds", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "MODAL_TOKEN_SECRET"):
        monkeypatch.setenv(name, canary)
    caplog.set_level("DEBUG")
    seam = FakeSeam(mode="run")
    ex = ModalExecutor(make_spec(secrets=["aws-creds"]), seam=seam, replica_argv=argv("print('hello')"))
    plan = ex.plan(RUN_URI, [0])
    (handle,) = ex.launch(RUN_URI, [0])
    status = wait_finished(ex, handle)
    lines = list(ex.logs(handle))
    assert status.state is ReplicaState.SUCCEEDED and lines == ["hello"]
    (spawn,) = seam.spawns
    assert spawn["options"].secret_names == ("aws-creds",)
    sent = json.dumps([dataclasses.asdict(r) for r in spawn["requests"]] + [dataclasses.asdict(spawn["options"])])
    out = capsys.readouterr()
    for text in (sent, json.dumps(handle.to_json()), json.dumps(dataclasses.asdict(plan)), caplog.text,
                 out.out + out.err, status.message, "\n".join(lines)):
        assert canary not in text


# ---------------------------------------------------------------------- the function body, locally
def test_body_runs_a_replica_and_merges_env(monkeypatch):
    monkeypatch.setenv("FROM_SECRET", "s")
    buf = io.StringIO()
    out = run_replica_body(["python", "-c", "import os; print(os.environ['FROM_SECRET'], os.environ['EXTRA'])"],
                           {"EXTRA": "e"}, out=buf)
    assert out == {"exit_code": 0} and buf.getvalue() == "s e\n"


def test_body_failure_is_a_picklable_replica_failed():
    with pytest.raises(ReplicaFailed) as err:
        run_replica_body(["python", "-c", "print('a'); print('b'); raise SystemExit(6)"], {}, out=io.StringIO())
    exc = pickle.loads(pickle.dumps(err.value))  # how it crosses Modal
    assert exc.exit_code == 6 and exc.tail == ["a", "b"] and "exited with code 6" in str(exc)


def test_body_kills_the_replica_process_group_when_interrupted(tmp_path):
    """Modal cancels an input by raising into the function; no replica process may survive."""
    pidfile = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            f"print('ready', flush=True)\ntime.sleep(600)\n")

    class Interrupting(io.StringIO):
        def write(self, s):
            raise KeyboardInterrupt  # stands in for modal's InputCancellation (also a BaseException)

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_replica_body(["python", "-c", code], {}, out=Interrupting())
    assert time.monotonic() - start < 20
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild):
        assert time.monotonic() < deadline, "the replica's child outlived the cancelled function"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def test_the_modal_function_runs_locally():
    import modal

    from composer_cloud.images import modal_image

    assert modal_image.app.name == modal_image.APP_NAME
    # Our source reaches the container once: through the image's add_local_python_source, not the App too.
    assert modal_image.app._local_state.include_source_default is False
    assert isinstance(modal_image.replica, modal.Function)
    assert modal_image.replica.app is modal_image.app
    assert modal_image.replica.local(argv=["python", "-c", "print('local')"], env={}) == {"exit_code": 0}
    with pytest.raises(ReplicaFailed):
        modal_image.replica.local(argv=["python", "-c", "raise SystemExit(2)"], env={})


# ---------------------------------------------------------------------- the image definition
def test_requirements_are_pinned_and_match_pyproject():
    import tomllib

    from packaging.requirements import Requirement

    from composer_cloud.images import modal_image

    pins = {}
    for line in modal_image.pinned_requirements(exclude=()):
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", line
        pins[req.name.lower().replace("_", "-")] = spec.version
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    for dep in pyproject["project"]["dependencies"]:
        req = Requirement(dep)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{name} is a dependency but not pinned in images/requirements.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (dep, pins[name])
    assert "modal" not in {p.split("==")[0] for p in modal_image.pinned_requirements()}
    dockerfile = (Path(modal_image.__file__).parent / "Dockerfile").read_text()
    assert "requirements.txt" in dockerfile


def test_mounted_source_includes_package_data_but_no_caches():
    from modal import FilePatternMatcher

    from composer_cloud.images import modal_image

    ignore = FilePatternMatcher(*modal_image.SOURCE_IGNORE)
    assert not ignore(Path("data/pairs.jsonl"))
    assert not ignore(Path("images/requirements.txt"))
    assert not ignore(Path("jobs/modal_jobs.py"))
    assert ignore(Path("jobs/__pycache__"))
    assert ignore(Path("jobs/x.pyc"))
    assert ignore(Path(".hidden"))


# ---------------------------------------------------------------------- the real seam
def test_sdk_seam_builds_valid_function_options():
    """The SDK objects for the options are accepted by modal (its validation runs locally)."""
    import modal

    from composer_cloud.images import modal_image

    for retries in (0, 1, 10):
        kwargs = ModalSDKSeam.with_options_kwargs(
            FunctionOptions(gpu="H100:8", timeout_s=24 * 3600, retries=retries, secret_names=("aws", "hf")))
        assert kwargs["gpu"] == "H100:8" and kwargs["timeout"] == 24 * 3600
        assert all(isinstance(s, modal.Secret) for s in kwargs["secrets"]) and len(kwargs["secrets"]) == 2
        assert ("retries" in kwargs) == bool(retries)
        if retries:
            assert kwargs["retries"].max_retries == retries
        assert isinstance(modal_image.replica.with_options(**kwargs), modal.Function)
    cpu = ModalSDKSeam.with_options_kwargs(FunctionOptions(gpu=None, timeout_s=60, retries=0, secret_names=()))
    assert "gpu" not in cpu and cpu["secrets"] == []


class _FakeCall:
    def __init__(self, object_id, get=None, graph=()):
        self.object_id = object_id
        self._get = get
        self._graph = list(graph)

    def get(self, timeout=None):
        if isinstance(self._get, BaseException):
            raise self._get
        return self._get

    def get_call_graph(self):
        return self._graph


def _info(call_id, status, task_id="ta-1"):
    from modal.call_graph import InputInfo
    from modal.types import InputStatus

    return InputInfo("in-1", call_id, task_id, InputStatus[status], "replica", "m", [])


@pytest.mark.parametrize("get, graph, kind", [
    ({"exit_code": 0}, [], "succeeded"),
    (TimeoutError(), [], "running"),  # builtin TimeoutError: no output yet (graph unknown)
    (TimeoutError(), [("PENDING", "")], "pending"),
    (TimeoutError(), [("PENDING", "ta-9")], "running"),
    ("FunctionTimeoutError", [], "timed_out"),
    ("OutputExpiredError", [], "expired"),
    (ReplicaFailed(5, ["x"]), [("FAILURE", "ta-1")], "failed"),
    (RuntimeError("bad import"), [("INIT_FAILURE", "ta-1")], "init_failed"),
    (RuntimeError("stopped"), [("TERMINATED", "ta-1")], "cancelled"),
])
def test_sdk_seam_classifies_real_modal_outcomes(monkeypatch, get, graph, kind):
    import modal
    from modal import exception as mexc

    if isinstance(get, str):
        get = getattr(mexc, get)("x")
    call = _FakeCall("fc-1", get=get, graph=[_info("fc-1", s, t) for s, t in graph])
    monkeypatch.setattr(modal.FunctionCall, "from_id", staticmethod(lambda call_id, client=None: call))
    st = ModalSDKSeam().state("fc-1")
    assert st.kind == kind
    if kind == "failed":
        assert "exited with code 5" in st.message


def test_sdk_seam_raises_client_errors(monkeypatch):
    import modal
    from modal import exception as mexc

    call = _FakeCall("fc-1", get=mexc.AuthError("no token"))
    monkeypatch.setattr(modal.FunctionCall, "from_id", staticmethod(lambda call_id, client=None: call))
    ex = ModalExecutor(make_spec(), seam=ModalSDKSeam())
    with pytest.raises(ExecutorError, match="modal token new"):
        ex.poll(JobHandle(executor="modal", rank=0, job_id="fc-1"))


# ---------------------------------------------------------------------- live (opt-in)
@pytest.mark.live
@pytest.mark.skipif(os.environ.get("COMPOSER_CLOUD_LIVE_MODAL") != "1",
                    reason="set COMPOSER_CLOUD_LIVE_MODAL=1 (and Modal credentials) to run against a real account")
def test_live_modal_launch_logs_and_cancel():
    """Real Modal: a CPU container (COMPOSER_CLOUD_LIVE_MODAL_GPU to pick a GPU) runs a tiny command, then a
    sleeper is cancelled. The first run builds the image (several minutes)."""
    gpu = os.environ.get("COMPOSER_CLOUD_LIVE_MODAL_GPU", "cpu")
    spec = make_spec(gpu=gpu, timeout_s=900)
    ex = ModalExecutor(spec, replica_argv=lambda run_uri, rank: [
        "python", "-c", f"import time; print('live hello', {rank}, flush=True); time.sleep(2 + 600 * {rank})"])
    ok, sleeper = ex.launch(RUN_URI + "-" + secrets.token_hex(3), [0, 1])
    status = wait_finished(ex, ok, timeout=1200)
    assert status.state is ReplicaState.SUCCEEDED, status
    deadline = time.monotonic() + 120
    while not any("live hello 0" in ln for ln in ex.logs(ok)):
        assert time.monotonic() < deadline, "no logs from Modal"
        time.sleep(5)
    ex.cancel(sleeper)
    assert wait_finished(ex, sleeper, timeout=300).state is ReplicaState.CANCELLED
