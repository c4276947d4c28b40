"""``[sync]``: how replicas exchange pseudo-gradients, per sync mode; and the spec's strict base model.

Each mode reads only some settings (:data:`MODE_IGNORES` lists the others): a spec that sets one its mode
never reads is refused at load, naming the key, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from composer_cloud.errors import SpecError


class Strict(BaseModel):
    """The base of every spec table: unknown keys, wrong types, inf and nan are refused."""

    # allow_inf_nan=False: a timeout of inf or nan is a typo, never a setting.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


class SparseSpec(Strict):
    """``[sync.sparse]``: the sparse codec (``sync.codec = "sparse"``; SparseLoCo, see ``docs/sparse.md``).

    Defaults are the recipes measured best in ``docs/sparse.md`` at >= 50x fewer bytes: 2-bit values, chunks
    of 4096, and density and error-feedback decay by sync mode (:data:`SPARSE_RECIPES`: 3/64 and 0.95 in
    lock-step, 11/128 and 0.9 in decoupled mode), filled in when the spec is parsed.
    """

    #: Fraction of each chunk sent (top-k of the error-feedback accumulator, k = density x chunk); null: the
    #: sync mode's recipe.
    density: float | None = Field(default=None, gt=0, le=1)
    #: Bits per sent value: a sign bit and value_bits - 1 bits of per-chunk magnitude level.
    value_bits: int = Field(default=2, ge=1, le=8)
    #: Error-feedback decay beta in e <- beta e + delta (0: no memory); null: the sync mode's recipe.
    decay: float | None = Field(default=None, ge=0, le=1)
    #: Elements per chunk (positions Rice-coded within it). >= 64: below, each chunk's codebook (2 ** (value_bits
    #: - 1) bf16 levels) costs more bits per element than bf16 itself.
    chunk: int = Field(default=4096, ge=64, le=1 << 20)
    #: The exchange: "gather" (flat: every replica reads every contribution, exact), "two_level" (groups
    #: of ~sqrt(W); a group's sum is re-sparsified, its residual fed back), "auto" (two_level from 235
    #: replicas on, where the gather's requests on one key prefix need > 10 s a round; docs/scale.md).
    exchange: Literal["auto", "gather", "two_level"] = "auto"
    #: Members per group of the two-level exchange (null: ceil(sqrt(participants))).
    group_size: int | None = Field(default=None, ge=2)

    @model_validator(mode="after")
    def _one_value_per_chunk(self) -> "SparseSpec":  # below 1/2 a chunk the codec would silently send one
        if self.density is not None and self.density * self.chunk < 0.5:
            raise SpecError("sync.sparse.density", f"{self.density:g} x sync.sparse.chunk ({self.chunk}) is less "
                            f"than one value per chunk; use at least {1 / self.chunk:.3g} (the recipes: 3/64, 11/128)")
        return self


#: ``[sync.sparse]`` density and decay where the spec leaves them out, by ``sync.mode`` (docs/sparse.md, W = 4,
#: H = 50, 40 syncs, stdlib corpus): lock-step -1.36 % held-out loss against fp32 DiLoCo at 56.5x fewer bytes;
#: decoupled +1.75 % / +1.53 % (two seeds) at 51x fewer contribution bytes. Asynchronous merges of stale
#: contributions need denser contributions and an accumulator that forgets faster (decay 0.99 / 0.95 / 0.9 / 0.8
#: at density 1/16: +3.36 / +2.60 / +2.20 / +2.93 %).
SPARSE_RECIPES: dict[str, dict[str, float]] = {
    "lockstep": {"density": 3 / 64, "decay": 0.95},
    "decoupled": {"density": 11 / 128, "decay": 0.9},
}

#: Most replicas the sparse codec's flat gather serves: beyond ~293 it moves more bytes per replica than
#: bf16 scatter-reduce (docs/scale.md, crossovers), and its 2W reads per replica grow with W. The
#: two-level exchange (``sync.sparse.exchange``) serves every run size (about 2 sqrt(W) reads per replica).
GATHER_MAX_REPLICAS = 256


#: ``[sync]`` settings each mode never reads (dotted below ``sync``); set to anything but their default, refused.
#: Decoupled reads codec (fp32 or sparse), sparse.{density, value_bits, decay, chunk}, outlier_factor, min_quorum,
#: grace_*, adopt_global_weight, store_outage_s, and quorum_/round_timeout_s (a multi-GPU replica's local group).
MODE_IGNORES: dict[str, tuple[str, ...]] = {
    "lockstep": ("min_quorum", "grace_min_s", "grace_max_s", "adopt_global_weight"),
    "decoupled": ("fragment_sync_delay", "heal_timeout_s", "io_threads", "max_attempts", "sparse.exchange",
                  "sparse.group_size"),
}


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


class SyncSpec(Strict):
    """How replicas exchange pseudo-gradients through the store.

    Deadlines are in seconds. ``quorum_timeout_s`` is how long a replica that
    reached a sync waits for the others before the round proceeds with those
    present (at least ``min_replicas``); ``round_timeout_s`` bounds every other
    wait of a round (payloads, reduced slots, the commit record).
    ``store_outage_s`` is the store outage a replica rides out (see
    ``docs/store.md``).
    """

    #: ``sparse``: chunk-wise top-k of an error-feedback accumulator, exchanged by a flat gather
    #: (``[sync.sparse]``; its outer step defaults to plain SGD, lr 1, no momentum: docs/sparse.md).
    codec: Literal["fp32", "bf16", "int8", "sparse"] = "fp32"
    sparse: SparseSpec = Field(default_factory=SparseSpec)
    fragments: int = Field(default=1, ge=1)
    fragment_sync_delay: int = Field(default=0, ge=0)
    quorum_timeout_s: float = Field(default=60.0, gt=0, le=7 * 86400)
    round_timeout_s: float = Field(default=600.0, gt=0, le=7 * 86400)
    heal_timeout_s: float = Field(default=600.0, gt=0, le=7 * 86400)
    io_threads: int = Field(default=8, ge=1, le=128)
    #: How long (seconds) a replica keeps retrying a store that fails with transient errors (connection
    #: refused/reset, timeouts, 5xx, SlowDown) before the call fails; counted from the outage's start.
    #: <= a week, like every deadline here: longer, a replica holds its GPU waiting on a dead store.
    store_outage_s: float = Field(default=600.0, gt=0, le=7 * 86400, allow_inf_nan=False)
    #: A participant's pseudo-gradient slot whose L2 norm exceeds this many times the participants' median (or the
    #: no-gradient floor, 0.1 % of the parameters' norm, when larger: docs/allreduce.md) aborts the attempt and is
    #: left out of its retry (null: no outlier check; applies with >= 3 participants).
    outlier_factor: float | None = Field(default=10.0, gt=1)
    #: Attempts of a round run back to back within one sync after an integrity check failed.
    max_attempts: int = Field(default=3, ge=1, le=100)
    #: ``lockstep``: every round is a barrier (torchft's DiLoCo over the object-store manager).
    #: ``decoupled``: no barrier; each replica publishes its pseudo-gradient every ``inner_steps`` steps
    #: and merges/adopts whatever has arrived (see ``docs/decoupled.md``). The keys below apply to it only.
    mode: Literal["lockstep", "decoupled"] = "lockstep"
    #: Decoupled: distinct replicas with pending contributions that trigger a merge (null: ceil(replicas / 2)).
    min_quorum: int | None = Field(default=None, ge=1)
    #: Decoupled: bounds (seconds) of the adaptive grace window: a pending contribution older than the
    #: window is merged even without a quorum. The window is 1.5x the median gap between recent
    #: contributions, clamped to [grace_min_s, grace_max_s]; also how old an unfinished merge must be
    #: before another replica completes it.
    grace_min_s: float = Field(default=1.0, gt=0, le=86400)
    grace_max_s: float = Field(default=60.0, gt=0, le=7 * 86400)
    #: Decoupled: the merged global's weight at adoption, local = w * global + (1 - w) * local (1.0: replace).
    #: (torchft's ``fragment_update_alpha`` is the other weight, the local one.)
    adopt_global_weight: float = Field(default=1.0, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "fragment_update_alpha" in data:
            raise SpecError("sync.fragment_update_alpha", "was renamed sync.adopt_global_weight (same meaning: the "
                            "merged global's weight at adoption; torchft's fragment_update_alpha is the local one)")
        return data

    @model_validator(mode="after")
    def _only_what_the_mode_reads(self) -> "SyncSpec":
        # A setting its mode never reads is refused rather than silently ignored (its default is allowed:
        # stored specs carry every default).
        ignored = [k for k in MODE_IGNORES[self.mode] if _get(self, k) != _get(SyncSpec.model_construct(), k)]
        if self.mode == "decoupled" and self.codec in ("bf16", "int8"):
            ignored.insert(0, "codec")
        if ignored:
            hint = ('contributions are fp32 or "sparse"' if ignored[0] == "codec" else "remove it")
            raise SpecError(f"sync.{ignored[0]}", f"is not read with sync.mode = {self.mode!r} ({hint}); "
                            f"settings this mode ignores: {', '.join('sync.' + k for k in ignored)}")
        return self

    @model_validator(mode="after")
    def _sparse_recipe_of_the_mode(self) -> "SyncSpec":
        # Filled in here, so the stored spec (and a resumed run) holds the values the run used.
        sparse = self.sparse
        unset = {k: v for k, v in SPARSE_RECIPES[self.mode].items() if getattr(sparse, k) is None}
        if unset:
            self.sparse = sparse.model_copy(update=unset)  # assigning re-validates once, with both set
        return self

    @model_validator(mode="after")
    def _survivors_finish_before_a_healer_voids(self) -> "SyncSpec":
        # Lock-step ordering: a committed round's survivors write a lost participant's state slice after
        # quorum_timeout_s; a replica that restarts and heals voids a commit whose state is not durable after
        # min(round_timeout_s, heal_timeout_s / 2) (sync/lockstep/diloco.py). A healer that gives up first
        # voids a round the survivors were about to finish, and the run fails.
        void_after_s = min(self.round_timeout_s, 0.5 * self.heal_timeout_s)
        if self.mode == "lockstep" and self.quorum_timeout_s > void_after_s:
            raise SpecError("sync.quorum_timeout_s", f"{self.quorum_timeout_s:g} s is longer than a restarted "
                            f"replica waits for a committed round's state before voiding it: min(sync.round_timeout_s, "
                            f"sync.heal_timeout_s / 2) = {void_after_s:g} s; the round's survivors, who finish a lost "
                            f"replica's state after quorum_timeout_s, would lose the race. Lower quorum_timeout_s, or "
                            f"raise sync.round_timeout_s and sync.heal_timeout_s to at least "
                            f"{self.quorum_timeout_s:g} and {2 * self.quorum_timeout_s:g}")
        return self


__all__ = ["GATHER_MAX_REPLICAS", "MODE_IGNORES", "SPARSE_RECIPES", "SparseSpec", "Strict", "SyncSpec"]
