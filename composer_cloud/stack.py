"""The numeric stack of a run: what every replica should run, and what each one does run.

DiLoCo averages pseudo-gradients that replicas computed independently, and a
resumed run continues from state another replica wrote: both assume every
replica computes with the same numeric stack (Python, torch build and its CUDA
major, transformers, trl). Every executor's default image is built to that one
stack (:data:`TORCH_VERSION`, :data:`CUDA_MAJOR`, :data:`PYTHON_VERSION`; the
pinned versions in ``composer_cloud/images/requirements.txt``):

* Modal: ``debian_slim`` Python :data:`PYTHON_VERSION` + the pinned requirements,
* HF Jobs: :data:`HF_JOBS_DEFAULT_IMAGE` (Python :data:`PYTHON_VERSION` with
  ``uv``), where the bootstrap installs the staged wheel with the pinned
  requirements as constraints, or the ``Dockerfile`` image built from them,
* local: whatever the launcher's environment has (checked, not forced).

Each replica reports :func:`runtime_versions` (in its heartbeat); the
launcher compares them with :func:`version_skew` and warns when replicas of
one run differ. A skew is a warning, not an error: a user may mix stacks on
purpose, but should know that bit-exact resume across them is not expected.

A package *older* than what a run needs is an error, though: :func:`check_packages`
compares the installed distributions with composer-cloud's own declared requirements
(its installed metadata, i.e. ``pyproject.toml``: the core dependencies plus the extras the
spec uses, :func:`spec_extras`) and raises :class:`PackageTooOldError` with one line naming
the package, the version found and the version needed. A replica runs it before loading
anything; ``launch`` runs it before starting local replicas.
"""

from __future__ import annotations

import logging
import platform
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import metadata
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from composer_cloud.errors import ConfigError

logger = logging.getLogger(__name__)

#: torch of every default image (the PyPI wheel; Linux x86_64 builds bundle CUDA 13.0 libraries).
TORCH_VERSION = "2.13.0"
#: CUDA major of that torch wheel (its metadata requires ``cuda-toolkit==13.0.3`` on Linux).
CUDA_MAJOR = "13"
#: Python of every default image.
PYTHON_VERSION = "3.11"
#: HF Jobs' default image: Python :data:`PYTHON_VERSION` with ``uv`` (astral's image; the same family
#: huggingface_hub's ``run_uv_job`` defaults to). The bootstrap installs torch :data:`TORCH_VERSION`
#: and the rest from the pinned constraints.
HF_JOBS_DEFAULT_IMAGE = f"ghcr.io/astral-sh/uv:python{PYTHON_VERSION}-bookworm-slim"

#: Keys of :func:`runtime_versions`, in display order.
KEYS = ("python", "torch", "cuda", "transformers", "trl", "composer-cloud", "device")
#: Keys whose difference between replicas changes the numbers (``device`` differs legitimately
#: between a CPU and a GPU replica, but is reported too).
NUMERIC_KEYS = ("python", "torch", "cuda", "transformers", "trl", "composer-cloud")


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def runtime_versions(device: str | None = None) -> dict[str, str]:
    """What this process computes with, as strings (JSON-ready, for heartbeats and records).

    Keys (:data:`KEYS`): ``python`` (``3.11.7``), ``torch`` (``2.13.0+cu130``),
    ``cuda`` (torch's CUDA runtime, ``13.0``, or ``none`` for a CPU build),
    ``transformers``, ``trl``, ``composer-cloud`` (distribution versions, or
    ``not installed``), ``device`` (the first CUDA device's name, or ``cpu``).

    Args:
        device: the device the replica trains on, if known (``"cpu"`` or
            ``"cuda"``); ``"cpu"`` reports ``cpu`` even on a GPU machine.
    """
    import torch

    cuda = torch.version.cuda or "none"
    if device != "cpu" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
    else:
        name = "cpu"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": cuda,
        "transformers": _dist_version("transformers"),
        "trl": _dist_version("trl"),
        "composer-cloud": _dist_version("composer-cloud"),
        "device": name,
    }


def _major(cuda: str) -> str:
    return cuda.split(".", 1)[0]


def _normalise(key: str, value: str) -> str:
    """The part of a value that matters: torch's local label (``+cpu``, ``+cu130``) is the CUDA key's job."""
    if key == "torch":
        return value.split("+", 1)[0]
    if key == "cuda":
        return value if value == "none" else _major(value)
    return value


def version_skew(records: Sequence[Mapping[str, object]]) -> list[str]:
    """Human-readable differences between replicas' :func:`runtime_versions` records; ``[]`` when they agree.

    ``records`` are heartbeat-like dicts, each with the versions either at the
    top level or under a ``"versions"`` key, and optionally a ``"rank"``
    (else its position). Records without versions are skipped (an older
    replica, or one that has not reported yet). ``torch`` is compared without
    its local label and ``cuda`` by major version, so ``2.13.0+cu130`` and
    ``2.13.0+cu131`` agree; a CPU replica (``cuda`` ``none``) next to GPU ones is
    reported, since their numbers are not bit-identical. Each line names the
    key, then each distinct value with the ranks that have it, e.g.
    ``"torch differs: 2.13.0 (ranks 0, 1), 2.7.1 (rank 2)"``.
    """
    by_key: dict[str, dict[str, list[str]]] = {}
    for position, record in enumerate(records):
        versions = record.get("versions", record)
        if not isinstance(versions, Mapping):
            continue
        rank = str(record.get("rank", position))
        for key in KEYS:
            value = versions.get(key)
            if value is None:
                continue
            shown = _normalise(key, str(value))
            by_key.setdefault(key, {}).setdefault(shown, []).append(rank)
    out = []
    for key in KEYS:
        values = by_key.get(key, {})
        if len(values) > 1:
            parts = [f"{value} ({'ranks' if len(ranks) > 1 else 'rank'} {', '.join(ranks)})"
                     for value, ranks in sorted(values.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
            label = "cuda major" if key == "cuda" else key
            out.append(f"{label} differs: {', '.join(parts)}")
    return out


def expected_versions() -> dict[str, str]:
    """The stack the default images are built to (``python`` and ``cuda`` as majors/minors)."""
    return {"python": PYTHON_VERSION, "torch": TORCH_VERSION, "cuda": CUDA_MAJOR}


def stack_mismatch(versions: Mapping[str, str]) -> list[str]:
    """How ``versions`` (one :func:`runtime_versions` record) differs from :func:`expected_versions`.

    CUDA is checked only for CUDA builds (a CPU build of the same torch is the
    same stack for this purpose); Python by ``major.minor``.
    """
    out = []
    python = ".".join(str(versions.get("python", "")).split(".")[:2])
    if python and python != PYTHON_VERSION:
        out.append(f"python {versions.get('python')} (default images: {PYTHON_VERSION})")
    torch_v = _normalise("torch", str(versions.get("torch", "")))
    if torch_v and torch_v != TORCH_VERSION:
        out.append(f"torch {versions.get('torch')} (default images: {TORCH_VERSION})")
    cuda = str(versions.get("cuda", "none"))
    if cuda != "none" and _major(cuda) != CUDA_MAJOR:
        out.append(f"CUDA {cuda} (default images: CUDA {CUDA_MAJOR}.x)")
    return out


DISTRIBUTION = "composer-cloud"


class PackageTooOldError(ConfigError, RuntimeError):
    """An installed package is older than a run needs; the message is one line naming package, found and needed."""


def spec_extras(spec: Any) -> tuple[str, ...]:
    """The ``composer-cloud[...]`` extras whose packages a replica of ``spec`` imports.

    ``s3`` for an ``s3://`` store, ``vllm`` for ``trainer.rollout = "vllm"``, ``tracking`` for a
    non-empty ``report_to``. (The executors' SDKs, ``modal`` and ``hf``, run in the launcher only;
    :mod:`composer_cloud.jobs` checks those itself.)
    """
    extras = []
    if str(getattr(spec, "store", "")).startswith(("s3://", "s3a://")):
        extras.append("s3")
    trainer = getattr(spec, "trainer", None)
    if ((getattr(trainer, "model_extra", None) or {}).get("rollout")) == "vllm":
        extras.append("vllm")
    if getattr(spec, "report_to", None):
        extras.append("tracking")
    return tuple(extras)


def declared_requirements(extras: Iterable[str] = (), *, requires: Sequence[str] | None = None) -> list[Requirement]:
    """composer-cloud's declared requirements: the core ones plus those of ``extras`` (``[]`` if not installed).

    ``requires`` defaults to the installed distribution's metadata (``importlib.metadata.requires``);
    references to composer-cloud's own extras (``composer-cloud[s3]``) are left out.
    """
    if requires is None:
        try:
            requires = metadata.requires(DISTRIBUTION) or []
        except metadata.PackageNotFoundError:
            logger.debug("%s is not installed as a distribution: no requirements to check", DISTRIBUTION)
            return []
    wanted = [{"extra": ""}] + [{"extra": e} for e in extras]
    out = []
    for line in requires:
        req = Requirement(line)
        if canonicalize_name(req.name) == DISTRIBUTION:
            continue
        if req.marker is None or any(req.marker.evaluate(env) for env in wanted):
            out.append(req)
    return out


def _lowest(req: Requirement) -> Version | None:
    """The lowest version ``req`` allows by its ``>=``, ``==``, ``~=`` (or ``>``) clauses; ``None`` when unbounded."""
    lows = []
    for spec in req.specifier:
        if spec.operator in (">=", "==", "~=", ">", "==="):
            try:
                lows.append(Version(spec.version.removesuffix(".*")))
            except InvalidVersion:
                continue
    return max(lows) if lows else None


def too_old(requirements: Iterable[Requirement], version_of: Callable[[str], str] | None = None) -> list[str]:
    """One line per installed package below what its requirement allows (not installed: not this check's job).

    A version above the requirement's cap is logged as a warning, not returned: it may work, and the
    TRL guard (:mod:`composer_cloud.trainer.three_channel.compat`) checks what must match.
    Each line reads ``transformers 5.16.0 is too old: found 5.16.0, needs transformers>=5.17,<6 (pip install
    "transformers>=5.17,<6")``.
    """
    version_of = version_of or metadata.version  # looked up per call (tests replace it)
    out = []
    for req in requirements:
        try:
            found = version_of(req.name)
        except metadata.PackageNotFoundError:
            continue
        try:
            version = Version(found)
        except InvalidVersion:
            continue
        low = _lowest(req)
        needed = f"{req.name}{req.specifier}"
        if low is not None and version < low:
            out.append(f"{req.name} {found} is too old: found {found}, needs {needed} (pip install \"{needed}\")")
        elif not req.specifier.contains(version, prereleases=True):
            logger.warning("%s %s is outside the range composer-cloud was tested with (%s)", req.name, found, needed)
    return out


def check_packages(spec: Any, *, version_of: Callable[[str], str] | None = None,
                   requires: Sequence[str] | None = None) -> None:
    """Raise :class:`PackageTooOldError` (one line) when an installed package is older than ``spec`` needs."""
    problems = too_old(declared_requirements(spec_extras(spec), requires=requires), version_of=version_of)
    if problems:
        raise PackageTooOldError("; ".join(problems))


if __name__ == "__main__":  # python -m composer_cloud.stack: this machine's stack
    for k, v in runtime_versions().items():
        sys.stdout.write(f"{k}: {v}\n")
