"""Can this machine launch on an executor? Its SDK, its credentials, and the store's (like ``sky check``).

``composer-cloud doctor --executor modal s3://bucket/prefix`` and every
``launch --dry-run`` run :func:`check_credentials`; each :class:`Check` says
what was looked at and, when it failed, what to do. Nothing here talks to a
backend, and nothing here knows an executor by name: each executor class declares its SDK (``sdk``) and
checks its own credentials (``check_credentials``) the way its SDK finds them (Modal's config:
``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET`` or ``~/.modal.toml``; the Hub's token: ``HF_TOKEN`` or the saved
login). The store's check is here (AWS: botocore's chain or the store options), so a check passes exactly when
the SDK would find something to send. Values are never returned or printed, only where they were found.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from composer_cloud.jobs import assign_jobs, executor_class
from composer_cloud.jobs.credentials import Check, install_hint, sdk_installed
from composer_cloud.spec import RunSpec

logger = logging.getLogger(__name__)

#: The module an s3:// store needs, and the extra that installs it.
S3_SDK = ("s3fs", "s3")


def _is_s3(store: str) -> bool:
    return store.startswith(("s3://", "s3a://"))


def _aws(store_options: Mapping[str, Any]) -> list[Check]:
    if not sdk_installed(S3_SDK[0]):
        return [Check("s3 store: s3fs", False, f"s3fs is not installed; {install_hint('s3')}")]
    if store_options.get("key") or store_options.get("anon"):
        return [Check("s3 store: credentials", True, "from the store options")]
    import botocore.session

    creds = botocore.session.get_session().get_credentials()
    if creds is not None:
        return [Check("s3 store: credentials", True, f"AWS credentials ({creds.method})")]
    return [Check("s3 store: credentials", False, "no AWS credentials on this machine: export AWS_ACCESS_KEY_ID "
                                                  "and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
                                                  "--store-option key=... --store-option secret=...")]


def missing_sdks(executors: list[str], store: str) -> list[str]:
    """One message per SDK the executors (their class's ``sdk``) or the store need that is not installed, each
    naming the extra (``pip install "composer-cloud[modal,s3]"``); empty when everything is there."""
    out = []
    for name in dict.fromkeys(executors):
        sdk = executor_class(name).sdk
        if sdk is not None and not sdk_installed(sdk[0]):
            extras = [sdk[1]] + (["s3"] if sdk[1] != "s3" else [])  # remote jobs need an s3:// (or hub) store
            out.append(f"--executor {name} needs the {sdk[0]} package, which is not installed: "
                       f"{install_hint(*extras)}")
    if _is_s3(store) and not sdk_installed(S3_SDK[0]):
        out.append(f"an s3:// store needs the {S3_SDK[0]} package, which is not installed: {install_hint(S3_SDK[1])}")
    return out


def check_credentials(executors: list[str], store: str, store_options: Mapping[str, Any] | None = None
                      ) -> list[Check]:
    """The SDK and credential checks for ``executors`` (names) and ``store`` (a URI), in that order."""
    checks: list[Check] = []
    for name in dict.fromkeys(executors):
        try:
            cls = executor_class(name)
        except ValueError as exc:  # a typo: say so rather than pass it
            checks.append(Check(f"{name}: unknown executor", False, str(exc)))
            continue
        checks += cls.check_credentials()
    if _is_s3(store):
        checks += _aws(dict(store_options or {}))
    return checks


def spec_credentials(spec: RunSpec) -> list[Check]:
    """:func:`check_credentials` for the executors and store of a spec."""
    return check_credentials([name for name, _ in assign_jobs(spec)], spec.store,
                             spec.store_options)


__all__ = ["Check", "check_credentials", "install_hint", "missing_sdks", "spec_credentials"]
