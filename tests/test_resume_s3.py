"""The kill -9 + resume matrix of test_resume.py on an S3 store (moto): a module of its own so that
pytest-xdist's ``--dist loadscope`` runs it beside the file:// matrix instead of after it.

On S3 the phases that leave a round's objects half-written: a payload upload and the global state's upload
(``reduce`` on S3 is SeaweedFS's case in test_store_faults.py; ``inner_step`` writes nothing, and a torn
background checkpoint is told by its missing manifest on any store: both are the file:// matrix's alone).
The resumed model must equal the file:// baseline."""

from __future__ import annotations

import pytest

from support.resume import check_resume_after_sigkill


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["upload", "global_upload"])
def test_resume_after_sigkill_on_s3_is_bitwise_exact(phase, tmp_path, baselines, s3_endpoint):
    check_resume_after_sigkill("s3", phase, tmp_path, baselines)
