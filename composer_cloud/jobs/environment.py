"""The environment a replica job gets from its executor (never a secret).

Every executor starts ``python -m composer_cloud.replica`` with the variables
of :func:`job_env`; the local executor layers them over its own environment,
the remote ones (Modal, HF Jobs) send them with the job. Secrets travel only
through each backend's secret mechanism, never here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_cloud import env as cc_env
from composer_cloud.storage.runkeys import spec_digest

if TYPE_CHECKING:
    from composer_cloud.spec import RunSpec

#: Variables of the launcher's environment that remote jobs get too: ``HF_ENDPOINT``, so a replica
#: downloads models from the same Hub the launcher checked them on.
FORWARDED = ("HF_ENDPOINT",)


def job_env(spec: "RunSpec", *, forward: bool = False) -> dict[str, str]:
    """Environment variables of one replica job of ``spec``; with ``forward``, plus :data:`FORWARDED` ones set here.

    ``spec.store_options`` cannot hold credentials (the spec validator rejects
    credential-like keys), so it may travel as plain environment; it lets code
    open the store before it can read the spec (the HF bootstrap, the replica).
    """
    # The digests of the spec, of the code bundle and of uploaded local files travel with the job, not only
    # through the (untrusted) store: a replica refuses a spec.json replaced after this launch, so nothing in
    # the store chooses the code it runs. JobEnv owns how each variable is spelled.
    env = {"PYTHONUNBUFFERED": "1", **cc_env.JobEnv(store_options=dict(spec.store_options or {}),
                                                    code_ref=spec.code.ref, files=spec.code.files,
                                                    spec_sha256=spec_digest(spec.to_json_dict())).to_environ()}
    if forward:
        env.update(cc_env.present(FORWARDED))
    return env


def job_secrets(run_key: str | None) -> dict[str, str]:
    """The secret variables every job of a signed run gets through its executor's secret mechanism (local: the
    process environment; Modal: a ``modal.Secret``; HF Jobs: job secrets): the run key, never in :func:`job_env`."""
    return {cc_env.RUN_KEY: run_key} if run_key else {}


__all__ = ["FORWARDED", "job_env", "job_secrets"]
