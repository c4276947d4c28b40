"""The kill -9 + resume matrix of test_resume.py on an S3 store (moto): a module of its own so that
pytest-xdist's ``--dist loadscope`` runs it beside the file:// matrix instead of after it."""

from __future__ import annotations

import pytest

from composer_cloud.hooks import PHASES
from test_resume import baselines, check_resume_after_sigkill  # noqa: F401 - baselines is a fixture


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_resume_after_sigkill_on_s3_is_bitwise_exact(phase, tmp_path, baselines, s3_endpoint):
    check_resume_after_sigkill("s3", phase, tmp_path, baselines)
