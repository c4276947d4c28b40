"""Can this machine launch on an executor? Its SDK, its credentials, and the store's (like ``sky check``).

``composer-cloud doctor --executor modal s3://bucket/prefix`` and every
``launch --dry-run`` run :func:`check_credentials`; each :class:`Check` says
what was looked at and, when it failed, what to do. Nothing here talks to a
backend: credentials are found the way each SDK finds them (Modal's config:
``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET`` or ``~/.modal.toml``; the Hub's token:
``HF_TOKEN`` or the saved login; AWS: botocore's chain or the store options),
so a check passes exactly when the SDK would find something to send. Values
are never returned or printed, only where they were found.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from composer_cloud.jobs import assign_ranks
from composer_cloud.spec import RunSpec

logger = logging.getLogger(__name__)

#: The extra that installs what each executor (and an s3:// store) needs.
EXTRAS = {"modal": "modal", "hf-jobs": "hf", "s3": "s3"}


@dataclass(frozen=True)
class Check:
    """One credential or SDK check: ``ok``, what was found, and the fix when it failed."""

    name: str
    ok: bool
    detail: str


def install_hint(*extras: str) -> str:
    """``pip install "composer-cloud[modal,s3]"``: the one spelling every message uses."""
    return f'pip install "composer-cloud[{",".join(extras)}]"'


def _sdk(module: str, executor: str) -> Check | None:
    if importlib.util.find_spec(module) is not None:
        return None
    return Check(f"{executor}: {module} SDK", False, f"{module} is not installed; {install_hint(EXTRAS[executor], 's3')}")


def _modal() -> list[Check]:
    missing = _sdk("modal", "modal")
    if missing:
        return [missing]
    from modal.config import config

    if config.get("token_id") and config.get("token_secret"):
        return [Check("modal: token", True, f"token id {config.get('token_id')[:6]}… (profile or MODAL_TOKEN_ID)")]
    return [Check("modal: token", False, "no Modal token: run `modal token new`, or export MODAL_TOKEN_ID and "
                                         "MODAL_TOKEN_SECRET")]


def _hf_jobs() -> list[Check]:
    from huggingface_hub import get_token

    if get_token():
        return [Check("hf-jobs: token", True, "a Hugging Face token (HF_TOKEN or the saved login)")]
    return [Check("hf-jobs: token", False, "no Hugging Face token: export HF_TOKEN=hf_... (a token that may run "
                                           "jobs) or run `hf auth login`")]


def _aws(store_options: Mapping[str, Any]) -> list[Check]:
    missing = _sdk("s3fs", "s3")
    if missing:
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


#: The module each executor (and an s3:// store) imports, and where it is missing what to install.
SDK_MODULES = {"modal": ("modal", "modal"), "hf-jobs": ("httpx", "hf"), "s3": ("s3fs", "s3")}


def missing_sdks(executors: list[str], store: str) -> list[str]:
    """One message per SDK the executors or the store need that is not installed, each naming the extra
    (``pip install "composer-cloud[modal,s3]"``); empty when everything is there."""
    needs = [n for n in dict.fromkeys(executors) if n in SDK_MODULES]
    if store.startswith(("s3://", "s3a://")):
        needs.append("s3")
    out = []
    for name in needs:
        module, extra = SDK_MODULES[name]
        if importlib.util.find_spec(module) is None:
            extras = [extra] + (["s3"] if name in ("modal", "hf-jobs") and extra != "s3" else [])
            out.append(f"{'an s3:// store' if name == 's3' else f'--executor {name}'} needs the {module} package, "
                       f"which is not installed: {install_hint(*extras)}")
    return out


def check_credentials(executors: list[str], store: str, store_options: Mapping[str, Any] | None = None
                      ) -> list[Check]:
    """The SDK and credential checks for ``executors`` (names) and ``store`` (a URI), in that order."""
    checks: list[Check] = []
    for name in dict.fromkeys(executors):
        if name == "modal":
            checks += _modal()
        elif name == "hf-jobs":
            checks += _hf_jobs()
        else:
            checks.append(Check(f"{name}: nothing to sign in to", True, "runs on this machine"))
    if store.startswith(("s3://", "s3a://")):
        checks += _aws(dict(store_options or {}))
    return checks


def spec_credentials(spec: RunSpec) -> list[Check]:
    """:func:`check_credentials` for the executors and store of a spec."""
    return check_credentials([name for name, _ in assign_ranks(spec.executor, spec.replicas)], spec.store,
                             spec.store_options)


__all__ = ["Check", "EXTRAS", "SDK_MODULES", "check_credentials", "install_hint", "missing_sdks", "spec_credentials"]
