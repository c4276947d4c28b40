"""Fixtures of a local Hugging Face Jobs server (``tests/hf_jobs_server.py``) and the wheel its jobs install.

Registered in ``tests/conftest.py``. The artifacts (the jobs' Python, the wheel,
the constraints) are built once per session and worker; the server (``hf_server``) is
one per module, as its jobs are.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from composer_cloud.jobs.hf_jobs import REQUIREMENTS_PATH
from composer_cloud.jobs.wheel import build_wheel
from hf_jobs_server import HFJobsServer, make_job_python

TOKEN = "hf_test_" + secrets.token_hex(8)
NAMESPACE = "tester"


@pytest.fixture(scope="session")
def job_python(tmp_path_factory) -> Path:
    return make_job_python(tmp_path_factory.mktemp("job-python"))


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def job_constraints(tmp_path_factory) -> Path:
    """The shipped pins, at the versions this test environment has (jobs install offline from it)."""
    from importlib.metadata import version

    lines = []
    for line in REQUIREMENTS_PATH.read_text().splitlines():
        name = line.split("#", 1)[0].split("==", 1)[0].strip()
        if name:
            lines.append(f"{name}=={version(name).split('+', 1)[0]}")
    path = tmp_path_factory.mktemp("constraints") / "constraints.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def hf_server(job_python, tmp_path_factory):
    with HFJobsServer(namespace=NAMESPACE, token=TOKEN, python_bin_dir=job_python,
                      workdir=tmp_path_factory.mktemp("jobs"), base_env={"PIP_NO_INDEX": "1"}) as srv:
        yield srv


@pytest.fixture
def hf_env(hf_server, monkeypatch, job_constraints):
    """The standard variables: the executor must pick up HF_ENDPOINT and HF_TOKEN by itself.

    Jobs install offline from this environment's packages, so their constraints are this
    environment's versions of the shipped pins (``COMPOSER_CLOUD_CONSTRAINTS``).
    """
    monkeypatch.setenv("HF_ENDPOINT", hf_server.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("COMPOSER_CLOUD_CONSTRAINTS", str(job_constraints))
    hf_server.reject_create = None
    return hf_server
