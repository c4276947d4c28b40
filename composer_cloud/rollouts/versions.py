"""Where a rollout worker gets policy version ``v`` (the global model trainers start round ``v`` from).

Two sources; :class:`PolicyVersions` uses one per run:

* the **policy chain** (``policy/``, :mod:`composer_cloud.rollouts.policy`), when the replicas publish it: bf16,
  anchor plus lossless patches, digest-checked;
* the **lock-step checkpoints** the replicas write anyway: version ``v >= 1`` is round ``v - 1``'s committed,
  durable global state, read through its slice markers (crc32, signatures); version 0 is the initial model,
  which the worker builds from the spec exactly as every replica does. Checkpoints are pruned
  (``keep_checkpoints``), so this source alone serves ``max_staleness < keep_checkpoints``; the chain has no
  such limit.

A version that is not available yet reads as ``None`` (the worker tries again later); one that is there but
does not verify raises :class:`~composer_cloud.errors.BadObject` (or ``CorruptCheckpoint``) naming the object.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from composer_cloud.lora import synced_parameters
from composer_cloud.storage.store import Store
from composer_cloud.sync.checkpoint.global_state import GlobalStateStore
from composer_cloud.sync.lockstep.diloco import load_global_parameters, split_fragments
from composer_cloud.sync.lockstep.durable import model_attempt_of

logger = logging.getLogger(__name__)


class CheckpointVersions:
    """Policy versions from the lock-step checkpoints of ``store`` for ``model`` (built from the spec, initial
    weights; ``fragments``: ``sync.fragments``). :meth:`load_into` copies version ``v`` into ``model``."""

    def __init__(self, store: Store, model: torch.nn.Module, *, fragments: int) -> None:
        self.store = store
        self.model = model
        self.states = GlobalStateStore(store)
        self.attempt_of: Callable[[int], int | None] = model_attempt_of(store)
        self.fragments = split_fragments(model, fragments)
        self.initial = {name: p.detach().clone() for name, p in synced_parameters(model).items()}

    def load_into(self, version: int) -> bool:
        """Copy version ``version`` into the model; False when it is not available (yet)."""
        if version == 0:
            with torch.no_grad():
                for name, p in synced_parameters(self.model).items():
                    p.copy_(self.initial[name])
            return True
        round = version - 1
        attempt = self.attempt_of(round)
        if attempt is None or not self.states.durable(round, attempt):
            return False
        load_global_parameters(self.fragments, self.states.load(round, attempt))
        return True


class ChainVersions:
    """Policy versions from the policy chain (``policy/``), applied to ``model`` (bf16 values, exact)."""

    def __init__(self, store: Store, model: torch.nn.Module) -> None:
        from composer_cloud.rollouts.policy import PolicyReader, apply_policy

        self.reader = PolicyReader(store)
        self.model = model
        self._apply: Callable[[torch.nn.Module, Any], None] = apply_policy

    def load_into(self, version: int) -> bool:
        latest = self.reader.latest_version()
        if latest is None or latest < version:
            return False
        self._apply(self.model, self.reader.load(version))
        return True


class PolicyVersions:
    """The worker's policy: version ``v`` loaded into ``model`` from one source, the chain (``chain=True``: the
    replicas publish it) or the checkpoints. One source for the whole run, so a version's weights never depend on
    which source had it first (under LoRA the chain's bf16 adapters and the checkpoints' fp32 ones merge to
    different bf16 weights). :attr:`loaded` is the version the model holds now (None: none yet)."""

    def __init__(self, store: Store, model: torch.nn.Module, *, fragments: int, chain: bool) -> None:
        self.source: ChainVersions | CheckpointVersions = (
            ChainVersions(store, model) if chain else CheckpointVersions(store, model, fragments=fragments))
        self.loaded: int | None = None

    def ensure(self, version: int) -> bool:
        """Make the model hold version ``version``; False when the source does not have it yet."""
        if self.loaded == version:
            return True
        if not self.source.load_into(version):
            return False
        self.loaded = version
        logger.info("rollouts: policy version %d loaded (%s)", version, type(self.source).__name__)
        return True


__all__ = ["ChainVersions", "CheckpointVersions", "PolicyVersions"]
