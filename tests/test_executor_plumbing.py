"""What every executor shares: the protocol (preflight included), the remote executors' plumbing
(status cache, idempotent cancel, roll-back, retries, preflight), the one max_restarts mapping,
the job environment, and the local executor's preflight."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import pytest

from composer_cloud.jobs import EXECUTORS, ExecutorError, JobHandle, LaunchPlan, ServerlessExecutor, get_executor
from composer_cloud.jobs.base import ReplicaState, ReplicaStatus, run_id_of
from composer_cloud.jobs.environment import job_env
from composer_cloud.jobs.hf_jobs import is_transient as hf_transient
from composer_cloud.jobs.local import LocalProcessExecutor
from composer_cloud.jobs.modal_jobs import is_transient as modal_transient
from composer_cloud.jobs.remote import RemoteExecutor, parse_exit_code
from composer_cloud.jobs import executor_class
from composer_cloud.jobs.modal_jobs import MODAL_MAX_RETRIES
from composer_cloud.retry import RetryPolicy
from composer_cloud.spec import spec_from_dict

RUNNING = ReplicaStatus(ReplicaState.RUNNING)
DONE = ReplicaStatus(ReplicaState.SUCCEEDED, 0)


class Flaky(ConnectionError):
    pass


class ScriptedExecutor(RemoteExecutor):
    """A backend whose status and cancel calls follow a script: a value is returned, an exception raised."""

    name = "scripted"
    sdk = None
    transient = staticmethod(lambda exc: isinstance(exc, Flaky))
    retry = RetryPolicy(attempts=3, base_s=0.0, cap_s=0.0)

    @classmethod
    def check_credentials(cls) -> list:
        return []

    @classmethod
    def relaunches(cls, spec) -> int:
        return spec.max_restarts

    def __init__(self, spec, statuses: list, cancels: list | None = None, problems: Sequence[str] = ()):
        super().__init__(spec)
        self.statuses = list(statuses)
        self.cancels = list(cancels or [])
        self.problems = list(problems)
        self.status_calls = 0
        self.cancel_calls: list[str] = []

    def _next(self, script: list):
        item = script.pop(0) if len(script) > 1 else script[0]
        if isinstance(item, BaseException):
            raise item
        return item

    def _fetch_status(self, handle: JobHandle) -> ReplicaStatus:
        def read():
            self.status_calls += 1
            return self._next(self.statuses)
        return self._call(f"status of {handle.job_id}", read)

    def _cancel_job(self, handle: JobHandle) -> None:
        def cancel():
            self.cancel_calls.append(handle.job_id)
            if self.cancels:
                self._next(self.cancels)
        self._call(f"cancelling {handle.job_id}", cancel)

    def _is_gone(self, err: ExecutorError) -> bool:
        return isinstance(err.__cause__, LookupError)

    def _manual_cancel_hint(self, handle: JobHandle) -> str:
        return f"run `scripted kill {handle.job_id}`"

    def _preflight_problems(self) -> list[str]:
        return super()._preflight_problems() + self.problems

    # The rest of the protocol, as a backend would have it.
    def plan(self, run_uri: str, ranks: Sequence[int]) -> LaunchPlan:
        return LaunchPlan(self.name, list(ranks), "img", [], [], [], "none", 0.0, notes=self._problem_notes())

    def launch(self, run_uri: str, ranks: Sequence[int]) -> list[JobHandle]:
        self.preflight(run_uri, ranks)
        return [JobHandle(self.name, r, f"j{r}") for r in ranks]

    def logs(self, handle: JobHandle, *, follow: bool = False) -> Iterator[str]:
        yield from ()


def _spec(**fields):
    return spec_from_dict({"run_id": "run-x", "store": "s3://bucket/runs", **fields})


H = JobHandle("scripted", 0, "j0")


# ---------------------------------------------------------------------- the protocol
@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_every_executor_implements_the_protocol_with_preflight(name, tmp_path):
    spec = _spec(store=f"file://{tmp_path}/store", modal={"secrets": ["aws"]})
    ex = get_executor(name, spec)
    assert isinstance(ex, ServerlessExecutor)
    assert callable(ex.preflight)
    assert "preflight" in ServerlessExecutor.__dict__
    assert isinstance(ScriptedExecutor(spec, [RUNNING]), ServerlessExecutor)


# ---------------------------------------------------------------------- status cache
def test_terminal_status_is_cached_live_ones_are_not():
    ex = ScriptedExecutor(_spec(), [RUNNING, RUNNING, DONE])
    assert [ex.poll(H).state for _ in range(5)] == [ReplicaState.RUNNING, ReplicaState.RUNNING] + [
        ReplicaState.SUCCEEDED] * 3
    assert ex.status_calls == 3


def test_transient_status_errors_are_retried_others_are_not():
    ex = ScriptedExecutor(_spec(), [Flaky("reset"), Flaky("reset"), RUNNING])
    assert ex.poll(H).state is ReplicaState.RUNNING and ex.status_calls == 3
    ex = ScriptedExecutor(_spec(), [Flaky("reset")])  # always down: gives up after retry.attempts calls
    with pytest.raises(ExecutorError, match=r"scripted: status of j0 failed \(Flaky: reset\)"):
        ex.poll(H)
    assert ex.status_calls == 3
    ex = ScriptedExecutor(_spec(), [PermissionError("denied"), RUNNING])
    with pytest.raises(ExecutorError, match="denied"):
        ex.poll(H)
    assert ex.status_calls == 1


# ---------------------------------------------------------------------- idempotent cancel
def test_cancel_leaves_finished_jobs_alone_and_rereads_a_cached_status():
    ex = ScriptedExecutor(_spec(), [DONE])
    ex.poll(H)
    ex.cancel(H)
    assert ex.cancel_calls == [] and ex.status_calls == 2  # the cached status was dropped and read again


def test_cancel_that_loses_a_race_with_the_job_ending_is_a_success():
    ex = ScriptedExecutor(_spec(), [RUNNING, DONE], cancels=[RuntimeError("already finished")])
    ex.cancel(H)
    assert ex.cancel_calls == ["j0"] and ex.poll(H).state is ReplicaState.SUCCEEDED


def test_cancel_of_a_vanished_job_is_a_success_and_a_real_failure_is_raised():
    ScriptedExecutor(_spec(), [RUNNING], cancels=[LookupError("no such job")]).cancel(H)
    ex = ScriptedExecutor(_spec(), [RUNNING], cancels=[RuntimeError("forbidden")])
    with pytest.raises(ExecutorError, match="forbidden"):
        ex.cancel(H)


# ---------------------------------------------------------------------- roll-back
def test_roll_back_cancels_every_created_job_and_says_how_to_stop_the_rest(caplog):
    ex = ScriptedExecutor(_spec(), [RUNNING], cancels=[None, RuntimeError("network down"), None])
    handles = [JobHandle("scripted", r, f"j{r}") for r in range(3)]
    with caplog.at_level(logging.ERROR):
        ex._roll_back(handles)
    assert ex.cancel_calls == ["j0", "j1", "j2"] and ex.status_calls == 0  # no status read first
    assert "j1" in caplog.text and "scripted kill j1" in caplog.text and "j2" not in caplog.text


# ---------------------------------------------------------------------- preflight
def test_preflight_lists_every_problem_and_plan_shows_them(tmp_path):
    ex = ScriptedExecutor(_spec(store=f"file://{tmp_path}"), [RUNNING], problems=["secret X has no value"])
    with pytest.raises(ExecutorError) as err:
        ex.launch(f"file://{tmp_path}/run-x", [0])
    assert str(err.value).startswith("scripted: cannot launch: store file://")
    assert "remote jobs cannot read" in str(err.value) and "secret X has no value" in str(err.value)
    assert [n for n in ex.plan("u", [0]).notes if n.startswith("launch would fail")] == [
        f"launch would fail: store file://{tmp_path} is a local directory, which remote jobs cannot read; "
        "use an s3:// store", "launch would fail: secret X has no value"]
    ScriptedExecutor(_spec(), [RUNNING]).preflight("s3://bucket/runs/run-x", [0])


def test_local_preflight_refuses_a_job_directory_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run_uri = f"file://{blocker}/store/run-x"
    ex = LocalProcessExecutor(_spec(store=f"file://{blocker}/store"))
    with pytest.raises(ExecutorError, match=rf"local: cannot launch: the job directory .* \({blocker} is not a dir"):
        ex.preflight(run_uri, [0])
    with pytest.raises(ExecutorError, match="cannot launch"):
        ex.launch(run_uri, [0])
    assert any(n.startswith("launch would fail") for n in ex.plan(run_uri, [0]).notes)
    LocalProcessExecutor(_spec(store=f"file://{tmp_path}/store")).preflight(f"file://{tmp_path}/store/run-x", [0])
    assert not (tmp_path / "store").exists()  # a preflight creates nothing


# ---------------------------------------------------------------------- each executor's max_restarts mapping
def relaunches(spec, name: str) -> int:
    return executor_class(name).relaunches(spec)


def test_max_restarts_mapping_per_executor():
    spec = _spec(max_restarts=3, modal={"retries": 1})
    assert relaunches(spec, "local") == 3 and relaunches(spec, "hf-jobs") == 3
    assert relaunches(spec, "modal") == 3
    assert relaunches(_spec(max_restarts=1, modal={"retries": 5}), "modal") == 5  # Modal's own setting wins
    assert relaunches(_spec(max_restarts=50), "modal") == MODAL_MAX_RETRIES
    assert LocalProcessExecutor(spec).max_restarts == 3
    with pytest.raises(ValueError, match="unknown executor 'nope'"):
        relaunches(spec, "nope")
    for name in EXECUTORS:  # every registered executor declares what the launcher asks of it
        cls = executor_class(name)
        assert relaunches(_spec(max_restarts=2), name) >= 2  # max_restarts means at least what it says
        assert cls.sdk is None or len(cls.sdk) == 2
        assert all(c.name.startswith(f"{name}: ") for c in cls.check_credentials())


# ---------------------------------------------------------------------- classifiers, environment, names
def test_backend_transient_classifiers():
    import httpx2
    from modal import exception as mexc

    class Answer(Exception):
        def __init__(self, status):
            self.response = type("R", (), {"status_code": status})()

    assert hf_transient(Answer(503)) and hf_transient(Answer(429)) and not hf_transient(Answer(404))
    assert hf_transient(httpx2.ConnectError("refused")) and not hf_transient(ValueError("bad"))
    assert modal_transient(mexc.ConnectionError("lost")) and modal_transient(mexc.InternalFailure("retry"))
    assert not modal_transient(mexc.AuthError("token")) and not modal_transient(mexc.NotFoundError("gone"))


def test_job_env_forwards_only_named_variables(monkeypatch):
    spec = _spec(store_options={"endpoint_url": "http://minio:9000"})
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.local")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "canary")
    env = job_env(spec, forward=True)
    assert env["HF_ENDPOINT"] == "http://hub.local" and "COMPOSER_CLOUD_STORE_OPTIONS" in env
    assert "canary" not in repr(env) and "HF_ENDPOINT" not in job_env(spec)


def test_run_id_and_exit_code_parsing():
    assert run_id_of("s3://bucket/prefix/run-1/") == "run-1" and run_id_of("s3://run-2") == "run-2"
    assert parse_exit_code("process exited with code 3") == 3 and parse_exit_code("exit code: -9") == -9
    assert parse_exit_code("boom") is None and parse_exit_code(None) is None


def test_executor_is_typed_once_and_keeps_its_string_form_in_spec_json():
    from composer_cloud.jobs import assign_ranks
    from composer_cloud.spec import ExecutorShare, parse_executor, spec_from_dict

    spec = spec_from_dict({"executor": "local:1,hf-jobs:2", "replicas": 3})
    assert spec.executors == (ExecutorShare("local", 1), ExecutorShare("hf-jobs", 2))
    assert spec.to_json_dict()["executor"] == "local:1,hf-jobs:2"  # spec.json as before
    assert spec_from_dict({}).executors == (ExecutorShare("local", None),)
    before = parse_executor.cache_info().hits
    assert assign_ranks(spec.executor, 3) == [("local", [0]), ("hf-jobs", [1, 2])]
    assert parse_executor.cache_info().hits > before  # parsed once, then looked up
    with pytest.raises(ValueError, match=r"executor: 'hf-jobs:0' must be NAME:COUNT"):
        parse_executor("local:1,hf-jobs:0")
