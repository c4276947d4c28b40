"""The environment a replica job gets from its executor (never a secret).

Every executor starts ``python -m composer_cloud.replica`` with the variables
of :func:`job_env`; the local executor layers them over its own environment,
the remote ones (Modal, HF Jobs) send them with the job. Secrets travel only
through each backend's secret mechanism, never here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_cloud import env as cc_env

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
    # The digests of the code bundle and of uploaded local files travel with the job, not only through the
    # (untrusted) store; JobEnv owns how each variable is spelled.
    env = {"PYTHONUNBUFFERED": "1", **cc_env.JobEnv(store_options=dict(spec.store_options or {}),
                                                    code_ref=spec.code.ref, files=spec.code.files).to_environ()}
    if forward:
        env.update(cc_env.present(FORWARDED))
    return env


__all__ = ["FORWARDED", "job_env"]
