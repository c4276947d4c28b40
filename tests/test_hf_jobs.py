"""HFJobsExecutor through the real ``huggingface_hub`` client against a local Jobs server.

Every job here really runs the bootstrap: it reads the wheel staged in a
``file://`` store, verifies it, ``pip install``s it into a job interpreter that
does not have composer-cloud (see ``make_job_python``), then runs the command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import sys
import time
import zipfile
from pathlib import Path

import pytest

from composer_cloud.jobs import get_executor
from composer_cloud.jobs.base import ExecutorError, JobHandle, ReplicaState, ServerlessExecutor
from composer_cloud.jobs.hf_jobs import (
    BOOTSTRAP_PLACEHOLDER,
    LABEL_RANK,
    LABEL_RUN,
    REQUIREMENTS_PATH,
    HFJobsExecutor,
    bootstrap_source,
    flavor_gpus,
    known_flavors,
)
from composer_cloud.jobs.wheel import WHEEL_PREFIX, stage_wheel
from composer_cloud.storage.store import Store
from composer_cloud.spec import spec_from_dict
from hf_jobs_server import HARDWARE
from support.executors import code_argv, executor_spec, wait_finished, wait_state
from support.hf_jobs import NAMESPACE, TOKEN

pytestmark = pytest.mark.jobs_hub  # skipped where huggingface_hub predates the executor's (tests/conftest.py)

# A job that proves it runs the *installed* wheel and can use the store.
PROBE = """
import json, sys, composer_cloud
from composer_cloud.storage.store import Store
run_uri, rank = sys.argv[1], int(sys.argv[2])
Store(run_uri).put_json(f"probe/{rank}.json", {"rank": rank, "package": composer_cloud.__file__})
print(f"probe rank {rank} ok", flush=True)
"""


def make_spec(tmp_path, run_id: str, gpus_per_replica: int = 1, **hf):
    return executor_spec("hf_jobs", store=f"file://{tmp_path}/store", run_id=run_id,
                         gpus_per_replica=gpus_per_replica, **{"flavor": "cpu-basic", **hf})


def run_uri_of(spec) -> str:
    return f"{Store(spec.store).uri}/{spec.run_id}"


# ---------------------------------------------------------------------- launch / poll / logs
def test_two_jobs_run_the_staged_wheel_and_complete(hf_env, tmp_path, wheel):
    spec = make_spec(tmp_path, "run-two")  # no namespace: resolved with whoami
    run_uri = run_uri_of(spec)
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv(PROBE))
    assert isinstance(ex, ServerlessExecutor)
    handles = ex.launch(run_uri, [0, 1])
    assert [h.rank for h in handles] == [0, 1]
    assert len({h.job_id for h in handles}) == 2

    statuses = [wait_finished(ex, h) for h in handles]
    assert [(s.state, s.exit_code) for s in statuses] == [(ReplicaState.SUCCEEDED, 0)] * 2

    store = Store(run_uri)
    for rank in (0, 1):
        probe = store.get_json(f"probe/{rank}.json")
        assert probe["rank"] == rank
        # The job imported composer_cloud from the wheel installed in its own interpreter, not this checkout.
        assert str(Path(probe["package"]).resolve()).startswith(str(Path(hf_env.python_bin_dir).parent.resolve()))
    assert any(k.startswith(f"{WHEEL_PREFIX}/") and k.endswith(".whl") for k in store.list("executor"))

    lines = list(ex.logs(handles[1]))
    # Both jobs share the test server's interpreter: the second may find the first's install of the same
    # wheel (same sha256) and reuse it; either way the bootstrap put this wheel in place.
    assert any(f"composer-cloud bootstrap: installing {wheel.name}" in ln
               or f"composer-cloud bootstrap: {wheel.name}" in ln and "already installed" in ln for ln in lines)
    assert "probe rank 1 ok" in lines

    # What the server received: the real client's request shapes.
    body = hf_env.jobs[handles[0].job_id].body
    assert body["flavor"] == "cpu-basic"
    assert body["dockerImage"] == spec.hf_jobs.image
    assert body["timeoutSeconds"] == spec.hf_jobs.timeout_s
    assert body["labels"][LABEL_RUN] == "run-two" and body["labels"][LABEL_RANK] == "0"
    assert body["command"][:2] == ["python", "-c"] and body["command"][3:5] == ["python", "-c"]
    assert body["environment"]["COMPOSER_CLOUD_WHEEL_URI"].startswith(run_uri + f"/{WHEEL_PREFIX}/")
    assert "secrets" not in body
    assert sum(r["path"] == "/api/whoami-v2" for r in hf_env.requests) >= 1


def test_s3_store_wheel_and_credentials_travel_as_secrets(hf_env, s3_endpoint, wheel):
    """The production path: an s3:// store, credentials only as job secrets (jobs start with a clean env)."""
    aws = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"]
    spec = spec_from_dict({"run_id": "run-s3-" + secrets.token_hex(3), "store": "s3://cc-test/hf-runs",
                           "hf_jobs": {"flavor": "cpu-basic", "namespace": NAMESPACE, "secrets": aws}})
    run_uri = f"{spec.store}/{spec.run_id}"
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv(PROBE))
    assert not [n for n in ex.plan(run_uri, [0]).notes if "launch would fail" in n or "no AWS" in n]
    (handle,) = ex.launch(run_uri, [0])
    status = wait_finished(ex, handle)
    assert status.state is ReplicaState.SUCCEEDED, status.message
    store = Store(run_uri)
    assert store.get_json("probe/0.json")["rank"] == 0  # written by the job, through s3fs, with secret creds
    assert hf_env.jobs[handle.job_id].body["environment"]["COMPOSER_CLOUD_WHEEL_URI"].startswith("s3://cc-test/")
    assert sorted(hf_env.jobs[handle.job_id].body["secrets"]) == sorted(aws)


def test_handles_reattach_from_another_process(hf_env, tmp_path, wheel, monkeypatch):
    spec = make_spec(tmp_path, "run-reattach", namespace=NAMESPACE)
    run_uri = run_uri_of(spec)
    launcher = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv("print('reattached', flush=True)"))
    handles = launcher.launch(run_uri, [0])
    records = [json.dumps(h.to_json()) for h in handles]  # what the CLI stores at <run>/executor/<rank>.json

    # Another process: a fresh executor built by name from its own configuration (HF_ENDPOINT, the spec's
    # namespace); the handle names the job, never where the token goes (test_bucket_attacks).
    other = get_executor("hf-jobs", spec)
    assert other.endpoint == hf_env.endpoint
    handle = JobHandle.from_json(json.loads(records[0]))
    assert wait_finished(other, handle).state is ReplicaState.SUCCEEDED
    assert "reattached" in list(other.logs(handle))
    found = launcher.find(run_uri)
    assert [(h.rank, h.job_id) for h in found] == [(0, handles[0].job_id)]


def test_follow_logs_stream_until_the_job_ends(hf_env, tmp_path, wheel):
    spec = make_spec(tmp_path, "run-follow", namespace=NAMESPACE)
    code = "import time\nfor i in range(5):\n    print(f'tick {i}', flush=True); time.sleep(0.3)\n"
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv(code))
    (handle,) = ex.launch(run_uri_of(spec), [0])
    lines = list(ex.logs(handle, follow=True))
    assert [ln for ln in lines if ln.startswith("tick")] == [f"tick {i}" for i in range(5)]
    assert ex.poll(handle).state is ReplicaState.SUCCEEDED  # follow ends only once the job has ended


def test_failed_job_surfaces_exit_code_and_last_lines(hf_env, tmp_path, wheel):
    spec = make_spec(tmp_path, "run-fail", namespace=NAMESPACE)
    code = "import sys\nfor i in range(40):\n    print(f'step {i}')\nsys.exit(7)\n"
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv(code))
    (handle,) = ex.launch(run_uri_of(spec), [0])
    status = wait_finished(ex, handle)
    assert status.state is ReplicaState.FAILED
    assert status.exit_code == 7
    assert "exit code: 7" in status.message
    assert "step 39" in status.message and "step 38" in status.message
    assert "step 0\n" not in status.message + "\n"  # only the tail, not the whole log


def test_cancel_stops_a_long_job_and_is_idempotent(hf_env, tmp_path, wheel):
    spec = make_spec(tmp_path, "run-cancel", namespace=NAMESPACE)
    code = "import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n"
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv(code))
    (handle,) = ex.launch(run_uri_of(spec), [0])
    wait_state(ex, handle, ReplicaState.RUNNING)
    deadline = time.monotonic() + 60
    while not any(e["data"] == "sleeping" for e in hf_env.jobs[handle.job_id].events):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    started = time.monotonic()
    ex.cancel(handle)
    status = wait_finished(ex, handle, timeout=30)
    assert status.state is ReplicaState.CANCELLED
    assert time.monotonic() - started < 15
    proc = hf_env.jobs[handle.job_id].proc
    assert proc is not None and proc.poll() is not None  # the process is gone, not just relabelled
    ex.cancel(handle)  # again: no error
    assert ex.poll(handle).state is ReplicaState.CANCELLED


def test_max_restarts_becomes_attempts(hf_env, tmp_path, wheel):
    spec = make_spec(tmp_path, "run-retry", namespace=NAMESPACE)
    spec = spec.model_copy(update={"max_restarts": 1})
    code = ("import os, sys\nflag = os.path.join(os.environ['HOME'], 'tried')\n"
            "if not os.path.exists(flag):\n    open(flag, 'w').close(); print('first try fails'); sys.exit(3)\n"
            "print('second try ok')\n")
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv(code))
    (handle,) = ex.launch(run_uri_of(spec), [0])
    assert wait_finished(ex, handle).state is ReplicaState.SUCCEEDED
    job = hf_env.jobs[handle.job_id]
    assert job.body["attempts"] == 2 and job.exit_codes[0] == 3 and job.exit_codes[-1] == 0
    # The restart found the wheel it installed (same sha256) and did not install it again.
    lines = list(ex.logs(handle))
    second = lines[lines.index("first try fails"):]
    assert any("already installed; not reinstalling" in ln for ln in second)
    assert not any("bootstrap: installing" in ln for ln in second)


def test_corrupt_wheel_is_never_installed(hf_env, tmp_path, wheel):
    spec = make_spec(tmp_path, "run-corrupt", namespace=NAMESPACE)
    run_uri = run_uri_of(spec)
    staged = stage_wheel(Store(run_uri), wheel)
    path = Path(Store(run_uri).path(staged.key))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv("print('must not run')"))
    ex._staged[run_uri] = staged  # as if staged earlier in this run; the store object is now damaged
    (handle,) = ex.launch(run_uri, [0])
    status = wait_finished(ex, handle)
    assert status.state is ReplicaState.FAILED and status.exit_code == 97
    assert "corrupt" in status.message
    assert "must not run" not in "\n".join(ex.logs(handle))


# ---------------------------------------------------------------------- stages, errors, rollback
def test_deleted_and_unknown_stages_and_missing_jobs(hf_env, tmp_path, wheel):
    spec = make_spec(tmp_path, "run-stages", namespace=NAMESPACE)
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv("import time; time.sleep(600)"))
    (handle,) = ex.launch(run_uri_of(spec), [0])
    wait_state(ex, handle, ReplicaState.RUNNING)
    job = hf_env.jobs[handle.job_id]
    job.set_stage("PAUSED")  # a stage this code has never heard of
    assert ex.poll(handle).state is ReplicaState.PENDING
    hf_env.cancel(job)
    deadline = time.monotonic() + 30
    while job.stage != "CANCELED":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    job.set_stage("DELETED")  # what the service reports once a job was deleted
    status = ex.poll(handle)
    assert status.state is ReplicaState.CANCELLED and "deleted" in status.message

    ghost = JobHandle(executor="hf-jobs", rank=5, job_id="0123456789abcdef01234567",
                      data={"endpoint": hf_env.endpoint, "namespace": NAMESPACE})
    status = ex.poll(ghost)
    assert status.state is ReplicaState.FAILED and "not found" in status.message
    ex.cancel(ghost)  # nothing to cancel, no error


def test_failed_create_rolls_back_and_is_not_retried(hf_env, tmp_path, wheel):
    spec = make_spec(tmp_path, "run-rollback", namespace=NAMESPACE)
    hf_env.reject_create = lambda body: "no capacity" if body["labels"][LABEL_RANK] == "1" else None
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv("import time; time.sleep(600)"))
    before = set(hf_env.jobs)
    with pytest.raises(ExecutorError, match="rank 1") as err:
        ex.launch(run_uri_of(spec), [0, 1, 2])
    assert "no capacity" in str(err.value) or "500" in str(err.value)
    created = [hf_env.jobs[j] for j in set(hf_env.jobs) - before]
    assert len(created) == 1 and created[0].body["labels"][LABEL_RANK] == "0"
    deadline = time.monotonic() + 30
    while created[0].stage != "CANCELED":
        assert time.monotonic() < deadline, created[0].stage
        time.sleep(0.1)
    posts = [r for r in hf_env.requests if r["method"] == "POST" and r["path"] == f"/api/jobs/{NAMESPACE}"
             and (r["body"] or {}).get("labels", {}).get(LABEL_RUN) == "run-rollback"]
    assert [p["body"]["labels"][LABEL_RANK] for p in posts] == ["0", "1"]  # rank 1 tried once, rank 2 never


def test_bad_token_says_what_to_do(hf_env, tmp_path, wheel, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    spec = make_spec(tmp_path, "run-badtoken")
    ex = HFJobsExecutor(spec, wheel=wheel)
    with pytest.raises(ExecutorError, match="HF_TOKEN"):
        ex.launch(run_uri_of(spec), [0])


def test_file_store_with_a_remote_endpoint_is_refused_before_any_work(tmp_path, wheel, monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    spec = make_spec(tmp_path, "run-remote", namespace=NAMESPACE)
    ex = HFJobsExecutor(spec, endpoint="https://huggingface.co", wheel=wheel)
    with pytest.raises(ExecutorError, match="s3://"):
        ex.launch(run_uri_of(spec), [0])
    assert Store(run_uri_of(spec)).list() == []  # nothing staged
    plan = ex.plan(run_uri_of(spec), [0])
    assert any(n.startswith("launch would fail") and "s3://" in n for n in plan.notes)


def test_unknown_flavor_warns_but_launches(hf_env, tmp_path, wheel):
    spec = make_spec(tmp_path, "run-flavor", gpus_per_replica=8, namespace=NAMESPACE, flavor="h100x8")
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv("print('x')"))
    with pytest.warns(UserWarning, match="h100x8"):
        (handle,) = ex.launch(run_uri_of(spec), [0])
    assert hf_env.jobs[handle.job_id].body["flavor"] == "h100x8"
    assert wait_finished(ex, handle).state is ReplicaState.SUCCEEDED
    # Its count (from the name) must still agree with gpus_per_replica.
    with pytest.raises(ExecutorError, match=r"'h100x8' has 8 GPUs but gpus_per_replica = 4"):
        HFJobsExecutor(make_spec(tmp_path, "run-flavor2", gpus_per_replica=4, flavor="h100x8")).flavor()


def test_launch_runs_each_replica_on_the_xn_flavor_of_its_family(hf_env, tmp_path, wheel):
    """flavor = the family's 1-GPU flavor + gpus_per_replica = N: the job is created with the xN flavor."""
    spec = make_spec(tmp_path, "run-h200x4", gpus_per_replica=4, namespace=NAMESPACE, flavor="h200")
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv("print('x')"))
    (handle,) = ex.launch(run_uri_of(spec), [0])
    assert hf_env.jobs[handle.job_id].body["flavor"] == "h200x4"
    assert handle.data["flavor"] == "h200x4"
    assert wait_finished(ex, handle).state is ReplicaState.SUCCEEDED


# ---------------------------------------------------------------------- secrets
def test_the_run_key_of_a_signed_run_reaches_the_job_only_as_a_secret(hf_env, tmp_path, wheel):
    key = "runkey-" + secrets.token_hex(24)
    spec = make_spec(tmp_path, "run-keyed", namespace=NAMESPACE)
    code = ("import hashlib, os\n"
            "print('sha', hashlib.sha256(os.environ['COMPOSER_CLOUD_RUN_KEY'].encode()).hexdigest(), flush=True)\n")
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv(code), run_key=key)
    (handle,) = ex.launch(run_uri_of(spec), [0])
    assert wait_finished(ex, handle).state is ReplicaState.SUCCEEDED
    assert f"sha {hashlib.sha256(key.encode()).hexdigest()}" in list(ex.logs(handle))
    body = hf_env.jobs[handle.job_id].body
    assert body["secrets"] == {"COMPOSER_CLOUD_RUN_KEY": key}
    assert key not in json.dumps({k: v for k, v in body.items() if k != "secrets"})
    assert key not in json.dumps(handle.to_json()) and key not in " ".join(hf_env.jobs[handle.job_id].argv)


def test_secret_canary_reaches_the_job_only_as_a_secret(hf_env, tmp_path, wheel, monkeypatch, caplog, capsys):
    canary = "canary-" + secrets.token_hex(16)
    monkeypatch.setenv("CANARY_SECRET", canary)
    spec = make_spec(tmp_path, "run-canary", namespace=NAMESPACE, secrets=["CANARY_SECRET"])
    run_uri = run_uri_of(spec)
    code = ("import hashlib, os\n"
            "print('sha', hashlib.sha256(os.environ['CANARY_SECRET'].encode()).hexdigest(), flush=True)\n")
    caplog.set_level("DEBUG")
    ex = HFJobsExecutor(spec, wheel=wheel, replica_argv=code_argv(code))
    plan = ex.plan(run_uri, [0])
    handles = ex.launch(run_uri, [0])
    status = wait_finished(ex, handles[0])
    lines = list(ex.logs(handles[0]))

    # It arrived: the job saw the value (we compare a hash, the job never prints the value).
    assert status.state is ReplicaState.SUCCEEDED
    assert f"sha {hashlib.sha256(canary.encode()).hexdigest()}" in lines
    # ...through `secrets=`, and nowhere else in the request.
    (post,) = [r for r in hf_env.requests if r["method"] == "POST" and (r["body"] or {}).get("labels", {}).get(
        LABEL_RUN) == "run-canary"]
    assert post["body"]["secrets"] == {"CANARY_SECRET": canary}
    rest = {k: v for k, v in post["body"].items() if k != "secrets"}
    assert canary not in json.dumps(rest)
    assert canary not in " ".join(hf_env.jobs[handles[0].job_id].argv)  # the command line
    # Not in our records, plan, logs, or anything we printed; same for the Hub token.
    plan_json = json.dumps(dataclasses.asdict(plan))
    assert plan.secret_names == ["CANARY_SECRET"]
    out = capsys.readouterr()
    for value in (canary, TOKEN):
        assert value not in json.dumps([h.to_json() for h in handles])
        assert value not in plan_json
        assert value not in caplog.text
        assert value not in out.out + out.err
        assert value not in "\n".join(lines)
        assert value not in status.message
    # A run-spec secret that is not set fails before anything is created.
    monkeypatch.delenv("CANARY_SECRET")
    n_jobs = len(hf_env.jobs)
    with pytest.raises(ExecutorError, match="CANARY_SECRET"):
        ex.launch(run_uri, [1])
    assert len(hf_env.jobs) == n_jobs


# ---------------------------------------------------------------------- plan and helpers
def test_plan_is_a_dry_run(hf_env, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    spec = make_spec(tmp_path, "run-plan", gpus_per_replica=2, flavor="a10g-largex2", secrets=["AWS_ACCESS_KEY_ID"],
                     timeout_s=7200)
    spec = spec.model_copy(update={"store_options": {"anon": False}})
    ex = HFJobsExecutor(spec)
    n_requests = len(hf_env.requests)
    plan = ex.plan(run_uri_of(spec), [0, 1, 2])
    # Talked to nobody about jobs: only reads, the price list among them (huggingface_hub may add its own GETs).
    sent = [(r["method"], r["path"]) for r in hf_env.requests[n_requests:]]
    assert ("GET", "/api/jobs/hardware") in sent
    assert all(method == "GET" and not path.startswith(f"/api/jobs/{NAMESPACE}") for method, path in sent), sent
    assert Store(run_uri_of(spec)).list() == []  # built and staged nothing
    assert plan.executor == "hf-jobs" and plan.ranks == [0, 1, 2]
    assert plan.image == spec.hf_jobs.image
    assert plan.command[:3] == ["python", "-c", BOOTSTRAP_PLACEHOLDER]
    assert plan.command[3:] == ["python", "-m", "composer_cloud.replica", "--run", run_uri_of(spec), "--rank", "0"]
    assert {"COMPOSER_CLOUD_WHEEL_URI", "COMPOSER_CLOUD_WHEEL_SHA256", "COMPOSER_CLOUD_STORE_OPTIONS",
            "PYTHONUNBUFFERED", "HF_ENDPOINT", "COMPOSER_CLOUD_SPEC_SHA256"} == set(plan.env_names)
    assert plan.secret_names == ["AWS_ACCESS_KEY_ID"]
    assert plan.estimated_gpu_hours == pytest.approx(3 * 2 * 2.0)
    assert "a10g-largex2" in plan.gpu
    assert any("launch would fail" in n and "AWS_ACCESS_KEY_ID" in n for n in plan.notes)
    # a10g-largex2 costs 50000 micro-USD per minute on the test server: $3/h per job, 3 jobs, 2 h timeout.
    assert plan.hourly_cost_usd == pytest.approx(9.0)
    assert plan.estimated_cost_usd == pytest.approx(18.0)
    assert plan.max_cost_usd == pytest.approx(18.0)  # no restarts
    assert "/api/jobs/hardware" in plan.cost_basis and "a10g-largex2" in plan.cost_basis


def test_flavors():
    assert "a10g-large" in known_flavors() and "h100" not in known_flavors()
    assert [flavor_gpus(f) for f in ("cpu-basic", "t4-small", "a10g-largex4", "h200x8", "l4x1", "rtx-pro-6000")] \
        == [0, 1, 4, 8, 1, 1]


def test_the_flavor_table_is_huggingface_hubs_gpu_flavor_list():
    """GPU_FLAVORS must name exactly the GPU flavors of the installed huggingface_hub (a new one upstream
    fails here until the table says its family and count); each count agrees with the flavor's name."""
    from composer_cloud.jobs.hf_flavors import GPU_FLAVORS

    assert set(GPU_FLAVORS) == {f for f in known_flavors() if not f.startswith("cpu")}
    for name, (family, count) in GPU_FLAVORS.items():
        assert name.startswith(family) and (name.endswith(f"x{count}") or count == 1), name


@pytest.mark.parametrize("flavor,gpus,expected", [
    ("a10g-small", 1, "a10g-small"), ("a10g-large", 2, "a10g-largex2"), ("a10g-small", 4, "a10g-largex4"),
    ("a100-large", 4, "a100x4"), ("a100-large", 8, "a100x8"), ("h200", 2, "h200x2"), ("h200", 8, "h200x8"),
    ("l4x1", 4, "l4x4"), ("l40sx1", 8, "l40sx8"), ("rtx-pro-6000", 2, "rtx-pro-6000x2"),
    ("a100x4", 4, "a100x4"), ("h200x8", 8, "h200x8"),  # the xN flavor itself, agreeing
    ("cpu-basic", 4, "cpu-basic"),  # CPU: N gloo processes, no GPU flavor
])
def test_flavor_for_gpus_per_replica(flavor, gpus, expected):
    from composer_cloud.jobs.hf_flavors import resolve_flavor

    assert resolve_flavor(flavor, gpus) == expected


@pytest.mark.parametrize("flavor,gpus,needles", [
    # A count the family does not offer: the family's flavors and every flavor with that count are named.
    ("a100-large", 2, ["no a100 flavor with 2 GPUs", "a100-large (1), a100x4 (4), a100x8 (8)",
                       "flavors with 2 GPUs: a10g-largex2, h200x2, rtx-pro-6000x2"]),
    ("t4-small", 2, ["no t4 flavor with 2 GPUs", "t4-small (1), t4-medium (1)"]),
    ("l4x1", 8, ["no l4 flavor with 8 GPUs", "l4x1 (1), l4x4 (4)", "l40sx8, a100x8, h200x8"]),
    # An xN flavor that disagrees with gpus_per_replica: both fields named, and both fixes.
    ("a100x4", 8, ["hf_jobs.flavor 'a100x4' has 4 GPUs but gpus_per_replica = 8", "set gpus_per_replica = 4",
                   "'a100-large'"]),
    ("a10g-largex2", 1, ["'a10g-largex2' has 2 GPUs but gpus_per_replica = 1"]),
    # An unknown 1-GPU name cannot be mapped to N GPUs.
    ("b200", 2, ["'b200' is not a flavor this version knows", "write the 2-GPU flavor itself"]),
])
def test_a_flavor_that_does_not_fit_gpus_per_replica_is_refused(hf_env, tmp_path, flavor, gpus, needles):
    spec = make_spec(tmp_path, "run-refuse", gpus_per_replica=gpus, namespace=NAMESPACE, flavor=flavor)
    ex = HFJobsExecutor(spec)
    n_requests = len(hf_env.requests)
    with pytest.raises(ExecutorError) as err:
        ex.preflight(run_uri_of(spec), [0])
    for needle in needles:
        assert needle in str(err.value)
    with pytest.raises(ExecutorError):  # the dry run refuses it too (runs.plan turns it into exit 2)
        ex.plan(run_uri_of(spec), [0])
    assert len(hf_env.requests) == n_requests  # refused before talking to the server


def test_dry_run_plan_of_n_gpus_shows_the_flavor_and_its_price_per_replica_hour(hf_env, tmp_path):
    spec = make_spec(tmp_path, "run-plan-n", gpus_per_replica=2, namespace=NAMESPACE, flavor="a10g-large",
                     timeout_s=3600)
    plan = HFJobsExecutor(spec).plan(run_uri_of(spec), [0, 1, 2])
    assert plan.gpu == "a10g-largex2 (2 GPUs)" and plan.gpus_per_replica == 2
    assert any("'a10g-large' with gpus_per_replica = 2 runs on 'a10g-largex2'" in n for n in plan.notes)
    # a10g-largex2 is listed at 50000 micro-USD per minute on the test server: the flavor's price, all GPUs.
    assert plan.replica_hour_cost_usd == pytest.approx(3.0)
    assert plan.hourly_cost_usd == pytest.approx(3 * 3.0)
    assert plan.estimated_gpu_hours == pytest.approx(3 * 2 * 1.0)
    assert "a10g-largex2 $0.05/minute" in plan.cost_basis


def test_wheel_has_the_package_and_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for required in ("composer_cloud/jobs/hf_jobs.py", "composer_cloud/images/hf_bootstrap.py",
                     "composer_cloud/images/requirements.txt", "composer_cloud/images/Dockerfile",
                     "composer_cloud/data/pairs.jsonl"):
        assert required in names, required
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_stage_wheel_is_content_addressed(tmp_path, wheel):
    store = Store(f"file://{tmp_path}/run")
    a = stage_wheel(store, wheel)
    b = stage_wheel(store, wheel)
    assert a == b and a.sha256 == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert a.key == f"{WHEEL_PREFIX}/{a.sha256[:16]}/{wheel.name}"
    assert bytes(store.get(a.key)) == wheel.read_bytes()


def test_bootstrap_is_stdlib_only():
    """The bootstrap runs before anything is installed: it may import only the standard library."""
    import ast

    from composer_cloud.jobs.hf_jobs import BOOTSTRAP_PATH

    tree = ast.parse(BOOTSTRAP_PATH.read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert top <= set(sys.stdlib_module_names), top - set(sys.stdlib_module_names)


# ---------------------------------------------------------------------- preflight, cost, bootstrap install
def _s3_spec(**hf):
    return spec_from_dict({"run_id": "run-pre", "store": "s3://cc-test/pre", "replicas": 1,
                           "hf_jobs": {"flavor": "cpu-basic", "namespace": NAMESPACE, **hf}})


def test_preflight_refuses_s3_without_aws_credentials_before_anything_is_written(hf_env, monkeypatch, wheel):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-not-real")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-real")
    ex = HFJobsExecutor(_s3_spec(), wheel=wheel)
    with pytest.raises(ExecutorError, match="AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY") as err:
        ex.preflight("s3://cc-test/pre/run-pre", [0])
    assert "[hf_jobs] secrets" in str(err.value)
    with pytest.raises(ExecutorError, match=r"missing AWS_SECRET_ACCESS_KEY\)"):
        HFJobsExecutor(_s3_spec(secrets=["AWS_ACCESS_KEY_ID"])).preflight("s3://cc-test/pre/run-pre", [0])

    # launch refuses the same way before building, staging or creating anything
    n_requests = len(hf_env.requests)
    with pytest.raises(ExecutorError, match="no AWS credentials"):
        ex.launch("s3://cc-test/pre/run-pre", [0])
    assert ex._staged == {} and len(hf_env.requests) == n_requests

    # the key pair, or a public bucket, pass
    HFJobsExecutor(_s3_spec(secrets=["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])).preflight("s3://x/y", [0])
    public = _s3_spec().model_copy(update={"store_options": {"anon": True}})
    HFJobsExecutor(public).preflight("s3://x/y", [0])


def test_preflight_names_secrets_without_a_value(hf_env, monkeypatch):
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-not-real")
    ex = HFJobsExecutor(_s3_spec(secrets=["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]))
    with pytest.raises(ExecutorError, match="AWS_SECRET_ACCESS_KEY, which is not set"):
        ex.preflight("s3://cc-test/pre/run-pre", [0])


def test_cost_estimate_uses_the_servers_unit_costs(hf_env, tmp_path):
    spec = make_spec(tmp_path, "run-cost", flavor="h200", namespace=NAMESPACE, timeout_s=1800)
    spec = spec.model_copy(update={"max_restarts": 2})
    plan = HFJobsExecutor(spec).plan(run_uri_of(spec), [0, 1])
    per_job_hour = 83333 / 1e6 * 60  # h200 on the test server: 83333 micro-USD per minute
    assert plan.hourly_cost_usd == pytest.approx(2 * per_job_hour)
    assert plan.estimated_cost_usd == pytest.approx(2 * per_job_hour * 0.5)  # until the 30 min timeout, once
    assert plan.max_cost_usd == pytest.approx(3 * plan.estimated_cost_usd)  # 3 attempts (max_restarts = 2)
    assert "$0.083333/minute" in plan.cost_basis and "3 attempt" in plan.cost_basis

    # Prices the server does not give become an empty estimate that says why, never an error.
    hf_env.hardware = [h for h in hf_env.hardware if h["name"] != "h200"]
    try:
        plan = HFJobsExecutor(spec).plan(run_uri_of(spec), [0])
        assert plan.estimated_cost_usd is None and plan.max_cost_usd is None
        assert "no price" in plan.cost_basis and "'h200' is not listed" in plan.cost_basis
    finally:
        hf_env.hardware = [dict(h) for h in HARDWARE]


def test_cost_estimate_without_a_reachable_server(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    spec = make_spec(tmp_path, "run-cost-off", namespace=NAMESPACE)
    plan = HFJobsExecutor(spec).plan(run_uri_of(spec), [0])
    assert plan.hourly_cost_usd is None and plan.estimated_cost_usd is None
    assert plan.cost_basis.startswith("no price: hf-jobs: listing job hardware failed")


def test_bootstrap_embeds_the_pinned_constraints(tmp_path, monkeypatch):
    import ast

    monkeypatch.delenv("COMPOSER_CLOUD_CONSTRAINTS", raising=False)
    source = bootstrap_source()
    tree = ast.parse(source)
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", "") == "CONSTRAINTS" for t in n.targets)]
    text = ast.literal_eval(value)
    assert text == REQUIREMENTS_PATH.read_text() and "torch==2.13.0" in text
    override = tmp_path / "pins.txt"
    override.write_text("torch==9.9.9\n")
    monkeypatch.setenv("COMPOSER_CLOUD_CONSTRAINTS", str(override))
    assert "CONSTRAINTS = 'torch==9.9.9\\n'" in bootstrap_source()
    monkeypatch.setenv("COMPOSER_CLOUD_CONSTRAINTS", str(tmp_path / "missing.txt"))
    with pytest.raises(ExecutorError, match="COMPOSER_CLOUD_CONSTRAINTS"):
        bootstrap_source()
    assert bootstrap_source(constraints="x==1\n").count("CONSTRAINTS = 'x==1\\n'") == 1


def test_bootstrap_install_commands():
    from composer_cloud.images import hf_bootstrap

    pip = hf_bootstrap.install_command("install", ["w.whl"], "/tmp/c.txt",
                                       installer=(["/py", "-m", "pip"], ["--no-input"]))
    assert pip == ["/py", "-m", "pip", "install", "--no-input", "-c", "/tmp/c.txt", "w.whl"]
    uv = hf_bootstrap.install_command("install", ["w.whl"], "/tmp/c.txt",
                                      installer=(["/usr/bin/uv", "pip"], ["--python", "/py"]))
    assert uv == ["/usr/bin/uv", "pip", "install", "--python", "/py", "-c", "/tmp/c.txt", "w.whl"]
    assert hf_bootstrap.install_command("uninstall", ["composer-cloud"],
                                        installer=(["/py", "-m", "pip"], []))[-2:] == ["--yes", "composer-cloud"]
    assert "--yes" not in hf_bootstrap.install_command("uninstall", ["composer-cloud"],
                                                       installer=(["/usr/bin/uv", "pip"], ["--python", "/py"]))


def test_default_image_is_the_runs_numeric_stack():
    from composer_cloud import stack
    from composer_cloud.images import modal_image
    from composer_cloud.spec import HFJobsSpec

    assert HFJobsSpec().image == stack.HF_JOBS_DEFAULT_IMAGE
    assert f"python{stack.PYTHON_VERSION}" in HFJobsSpec().image
    assert modal_image.PYTHON_VERSION == stack.PYTHON_VERSION
    assert f"torch=={stack.TORCH_VERSION}" in modal_image.pinned_requirements()
    dockerfile = (Path(modal_image.__file__).parent / "Dockerfile").read_text()
    assert f"FROM python:{stack.PYTHON_VERSION}-slim" in dockerfile
    assert "modal" not in [line.split("==")[0] for line in modal_image.pinned_requirements(exclude=())]
