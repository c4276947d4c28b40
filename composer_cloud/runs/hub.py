"""``export --push-to-hub REPO``: an exported model folder uploaded to a Hugging Face Hub repository.

Through ``huggingface_hub``'s own calls (``create_repo(exist_ok=True)``, then one ``upload_folder`` commit). The
token is huggingface_hub's to find (``HF_TOKEN``, ``hf auth login``) unless one is given; it is never logged or
printed, and an error from the Hub is reported without it.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def check_repo_id(repo_id: str | None) -> None:
    """``ValueError`` naming ``--push-to-hub`` for a repository id that is not ``namespace/name`` (None: no push)."""
    if repo_id is None:
        return
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ValueError(f"--push-to-hub {repo_id!r}: not a Hub repository id (namespace/name): {exc}") from None


def push_folder(folder: str | Path, repo_id: str, *, token: str | None = None, endpoint: str | None = None,
                private: bool | None = None, commit_message: str = "composer-cloud export") -> str:
    """Create ``repo_id`` (a model repository; kept if it exists) and upload ``folder`` to it as one commit;
    returns the commit's URL. ``endpoint``: the Hub's (default: huggingface_hub's, ``HF_ENDPOINT``).

    Raises ``ValueError`` for a repository id that is not ``namespace/name`` or ``name``, and
    ``RuntimeError`` naming the repository and the Hub's status when the Hub refuses.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    check_repo_id(repo_id)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=url.repo_id, repo_type="model",
                                 commit_message=commit_message)
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise RuntimeError(f"--push-to-hub {repo_id}: the Hub refused (HTTP {status}); check the token's write "
                           "access (HF_TOKEN or `hf auth login`) and the repository name") from None
    logger.info("pushed %s to %s", folder, info.commit_url)
    return str(info.commit_url)


__all__ = ["check_repo_id", "push_folder"]
