"""The kill -9 + resume matrix of test_resume.py on an S3 store (moto): a module of its own so that
pytest-xdist's ``--dist loadscope`` runs it beside the file:// matrix instead of after it."""

from __future__ import annotations

import pytest

from support.faults import STALL_PHASES
from support.resume import check_resume_after_sigkill


@pytest.mark.slow
@pytest.mark.parametrize("phase", STALL_PHASES)
def test_resume_after_sigkill_on_s3_is_bitwise_exact(phase, tmp_path, baselines, s3_endpoint):
    check_resume_after_sigkill("s3", phase, tmp_path, baselines)
