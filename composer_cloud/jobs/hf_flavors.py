"""HF Jobs GPU flavors by family and GPU count: which flavor runs a replica of ``gpus_per_replica`` GPUs.

The user may write either spelling of ``[hf_jobs] flavor``:

* **a flavor of the family plus** ``gpus_per_replica`` (recommended: one number says how many GPUs and
  local ranks a replica has): ``flavor = "a100-large"`` with ``gpus_per_replica = 4`` runs on ``a100x4``;
  any 1-GPU flavor of a family stands for the family (``a10g-small`` with 2 GPUs runs on
  ``a10g-largex2``, the only 2-GPU A10G flavor);
* **the multi-GPU flavor itself** (``flavor = "a100x4"``), which must then agree with
  ``gpus_per_replica = 4``: a disagreement is an error naming both fields, never a silent choice (a
  4-GPU job running one rank pays for three idle GPUs).

A count the family does not offer is refused, naming the family's flavors and every flavor with that
many GPUs. CPU flavors (``cpu-*``) run ``gpus_per_replica`` gloo processes on CPU and are never mapped.
Flavors not in :data:`GPU_FLAVORS` are passed through when the GPU count in their name (``...xN``)
equals ``gpus_per_replica``: the server decides whether they exist.
"""

from __future__ import annotations

import re

from composer_cloud.jobs.base import ExecutorError

#: GPU flavor -> (family, GPUs per job). Source: ``huggingface_hub.JobHardware`` (huggingface_hub 2.4.0,
#: ``src/huggingface_hub/_jobs_api.py``), read 2026-11-24; ``tests/test_hf_jobs.py`` checks this table
#: against the installed enum, so a new flavor upstream fails a test until it is added here.
GPU_FLAVORS: dict[str, tuple[str, int]] = {
    "t4-small": ("t4", 1), "t4-medium": ("t4", 1),
    "l4x1": ("l4", 1), "l4x4": ("l4", 4),
    "l40sx1": ("l40s", 1), "l40sx4": ("l40s", 4), "l40sx8": ("l40s", 8),
    "a10g-small": ("a10g", 1), "a10g-large": ("a10g", 1), "a10g-largex2": ("a10g", 2), "a10g-largex4": ("a10g", 4),
    "a100-large": ("a100", 1), "a100x4": ("a100", 4), "a100x8": ("a100", 8),
    "h200": ("h200", 1), "h200x2": ("h200", 2), "h200x4": ("h200", 4), "h200x8": ("h200", 8),
    "rtx-pro-6000": ("rtx-pro-6000", 1), "rtx-pro-6000x2": ("rtx-pro-6000", 2),
    "rtx-pro-6000x4": ("rtx-pro-6000", 4), "rtx-pro-6000x8": ("rtx-pro-6000", 8),
}
FLAVORS_TAKEN = "2026-11-24"
_COUNT_SUFFIX = re.compile(r"x(\d+)$")


def flavor_gpus(flavor: str) -> int:
    """GPUs in a flavor: ``cpu-*`` -> 0, the table's count, else from its name (``a10g-largex4`` -> 4)."""
    if flavor.startswith("cpu"):
        return 0
    if flavor in GPU_FLAVORS:
        return GPU_FLAVORS[flavor][1]
    m = _COUNT_SUFFIX.search(flavor)
    return int(m.group(1)) if m else 1


def flavors_with(gpus: int) -> list[str]:
    """Every known flavor with exactly ``gpus`` GPUs per job, in table order."""
    return [name for name, (_, count) in GPU_FLAVORS.items() if count == gpus]


def _family_offer(family: str) -> str:
    return ", ".join(f"{name} ({count})" for name, (fam, count) in GPU_FLAVORS.items() if fam == family)


def resolve_flavor(flavor: str, gpus_per_replica: int) -> str:
    """The flavor a replica of ``gpus_per_replica`` GPUs runs on, given ``[hf_jobs] flavor``.

    Raises :class:`ExecutorError` naming ``hf_jobs.flavor`` and ``gpus_per_replica`` when they disagree
    or the family has no flavor with that many GPUs (listing the flavors that do).
    """
    n = gpus_per_replica
    if flavor.startswith("cpu"):
        return flavor  # no GPU: the ranks are gloo processes on the job's CPUs
    count = flavor_gpus(flavor)
    if count == n:
        return flavor
    others = ", ".join(flavors_with(n)) or "none"
    if count > 1:  # an explicit multi-GPU flavor: the user chose a count, and it is not gpus_per_replica
        hint = f"set gpus_per_replica = {count}"
        if flavor in GPU_FLAVORS:
            family = GPU_FLAVORS[flavor][0]
            base = next(name for name, (fam, c) in GPU_FLAVORS.items() if fam == family and c == 1)
            hint += f", or write the family's 1-GPU flavor ({base!r}) and let gpus_per_replica pick the flavor"
        raise ExecutorError(f"hf_jobs.flavor {flavor!r} has {count} GPUs but gpus_per_replica = {n}; {hint}")
    if flavor not in GPU_FLAVORS:
        raise ExecutorError(f"hf_jobs.flavor {flavor!r} is not a flavor this version knows the multi-GPU "
                            f"variants of, so it cannot be mapped to {n} GPUs; write the {n}-GPU flavor itself "
                            f"(known ones: {others})")
    family = GPU_FLAVORS[flavor][0]
    matches = [name for name, (fam, c) in GPU_FLAVORS.items() if fam == family and c == n]
    if not matches:
        raise ExecutorError(f"gpus_per_replica = {n}: HF Jobs has no {family} flavor with {n} GPUs "
                            f"(hf_jobs.flavor {flavor!r}; the {family} family offers {_family_offer(family)}); "
                            f"flavors with {n} GPUs: {others}")
    return matches[0]
