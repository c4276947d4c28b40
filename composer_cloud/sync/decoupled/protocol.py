"""Decoupled DiLoCo through the object store: contributions, write-once merge records, merged globals.

No replica ever waits for another. A replica publishes a *contribution* (its
pseudo-gradient since its last boundary, the tokens behind it, the global
version it started from) every ``inner_steps`` steps; at the same boundary it
may *merge* the pending contributions into a new global version, and it adopts
the newest durable global. The protocol (``docs/decoupled.md`` has the
reasoning) lives here; the training side is :mod:`composer_cloud.decoupled_loop`.

Layout under the run (``<v>``, ``<seq>`` zero-padded to 8 digits)::

    decoupled/contrib/<rank>/<seq>.safetensors  pseudo-gradient (fp32, keyed by parameter name)
    decoupled/contrib/<rank>/<seq>.json         write-once meta, written AFTER the blob: sha256, tokens, base...
    decoupled/merge/<v>.json                    write-once merge record: base v-1, exact contributions + sha256,
                                                weights, per-rank cursor (highest seq consumed through v)
    checkpoints/<v>/global-a0-0-of-1.*          global version v (params + Nesterov momentum), the lock-step
    checkpoints/<v>/manifest.json               checkpoint layout, so export/resume/status read it unchanged
    decoupled/replica/<rank>/<seq>.{safetensors,json}  replica inner state (optimizer, data, RNG, local params)
    decoupled/final.json                        write-once: the final version (the fleet's budget of
                                                replicas x rounds contributions is merged; nothing merges after it)

Invariants:

* **Write-once decisions.** Version ``v`` exists iff ``merge/<v>.json`` does;
  exactly one record wins per ``v`` (:meth:`Store.create`). Its global state
  is a pure function of the record and the bytes it names (the global ``v-1``
  and the listed contributions, each pinned by sha256), computed on CPU in a
  fixed order, so any replica can (re)compute it and every writer writes the
  same bytes; the global's marker is write-once too.
* **Consumed once.** Contribution ``(rank, seq)`` is pending at ``v`` iff
  ``seq > cursor_v[rank]``. A replica publishes its seqs in order, one at a
  time, so the visible contributions of a rank are always a prefix of its
  seqs and a cursor never skips an unseen one.
* **Verified before use.** Meta schema and ranges, run id, sha256 of the
  blob, tensor names/shapes/dtype, finite values and (with >= 3 inputs) the
  outlier norm bound are checked before a contribution is merged; a bad one is
  listed under ``rejected`` in the record (it is never retried) and costs nothing else.
  Globals are read back through the marker's crc32 and checked finite and shaped.
* **No pickle.** Tensors are safetensors, records JSON.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import statistics
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from composer_cloud.errors import BadObject, ChecksumMismatch, ObjectNotFound, StoreError, StoreUnavailable
from composer_cloud.storage.store import Store
from composer_cloud.storage import layout

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

PREFIX = "decoupled"
FRAGMENT_KEY = "StreamingDiLoCoFragment_0"  # torchft's key: export/load_global_parameters read it
_NUM = re.compile(r"^(\d{8})\.json$")


class InvalidObject(BadObject):
    """A decoupled object failed validation; names the key and the check."""


# ------------------------------------------------------------------ keys
def contrib_key(rank: int, seq: int) -> str:
    return f"{PREFIX}/contrib/{rank}/{seq:08d}"


def merge_key(version: int) -> str:
    return f"{PREFIX}/merge/{version:08d}.json"


def replica_key(rank: int, seq: int) -> str:
    return f"{PREFIX}/replica/{rank}/{seq:08d}"


FINAL_KEY = f"{PREFIX}/final.json"


@dataclass(frozen=True)
class DecoupledConfig:
    """What the protocol needs from the spec. Seconds for times, tokens as counts."""

    run_id: str
    replicas: int
    min_quorum: int
    grace_min_s: float
    grace_max_s: float
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    outlier_factor: float | None = 10.0
    keep_checkpoints: int = 2

    @classmethod
    def from_spec(cls, spec: Any) -> "DecoupledConfig":
        s = spec.sync
        return cls(run_id=spec.run_id, replicas=spec.replicas,
                   min_quorum=s.min_quorum if s.min_quorum is not None else math.ceil(spec.replicas / 2),
                   grace_min_s=s.grace_min_s, grace_max_s=s.grace_max_s, outer_lr=spec.outer_optimizer.lr,
                   outer_momentum=spec.outer_optimizer.momentum, nesterov=spec.outer_optimizer.nesterov,
                   outlier_factor=s.outlier_factor, keep_checkpoints=spec.keep_checkpoints)


# ------------------------------------------------------------------ validation helpers
def _int(rec: Mapping[str, Any], name: str, key: str, *, lo: int = 0) -> int:
    v = rec.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise InvalidObject(key, f"field {name!r} must be an integer >= {lo}, got {v!r:.40}")
    return v


def _float(rec: Mapping[str, Any], name: str, key: str) -> float:
    v = rec.get(name)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise InvalidObject(key, f"field {name!r} must be a finite number, got {v!r:.40}")
    return float(v)


def _sha(rec: Mapping[str, Any], name: str, key: str) -> str:
    v = rec.get(name)
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v):
        raise InvalidObject(key, f"field {name!r} must be a sha256 hex digest")
    return v


def _read_json(store: Store, key: str) -> Any | None:
    """JSON at ``key``; None if absent. Damaged/forged objects raise :class:`InvalidObject` (outages propagate)."""
    try:
        return store.get_json(key)
    except ObjectNotFound:
        return None
    except ChecksumMismatch as exc:
        raise InvalidObject(key, str(exc)) from None


# ------------------------------------------------------------------ contributions
@dataclass(frozen=True)
class Contribution:
    """A validated contribution's meta. ``time`` is the publisher's wall clock (seconds since the epoch)."""

    rank: int
    seq: int
    base_version: int
    tokens: int
    inner_steps: int
    sha256: str
    time: float

    def entry(self) -> dict[str, Any]:
        return {"rank": self.rank, "seq": self.seq, "base_version": self.base_version, "tokens": self.tokens,
                "inner_steps": self.inner_steps, "sha256": self.sha256, "time": self.time}


def parse_contribution(rec: Any, key: str, *, run_id: str, rank: int, seq: int, replicas: int) -> Contribution:
    """Validate a contribution meta record (or a merge record's entry) read from ``key``."""
    if not isinstance(rec, dict):
        raise InvalidObject(key, "not a JSON object")
    if "run_id" in rec and rec["run_id"] != run_id:
        raise InvalidObject(key, f"belongs to run {rec.get('run_id')!r:.60}, not {run_id!r}")
    c = Contribution(rank=_int(rec, "rank", key), seq=_int(rec, "seq", key, lo=1),
                     base_version=_int(rec, "base_version", key), tokens=_int(rec, "tokens", key, lo=1),
                     inner_steps=_int(rec, "inner_steps", key, lo=1), sha256=_sha(rec, "sha256", key),
                     time=_float(rec, "time", key))
    if c.rank != rank or c.seq != seq or not 0 <= rank < replicas:
        raise InvalidObject(key, f"names rank {c.rank} seq {c.seq}, stored as rank {rank} seq {seq} "
                                 f"of {replicas} replicas")
    return c


def publish_contribution(store: Store, cfg: DecoupledConfig, *, rank: int, seq: int, base_version: int,
                         tokens: int, inner_steps: int, delta: Mapping[str, torch.Tensor]) -> Contribution:
    """Write contribution ``seq`` of ``rank``: the blob, then (write-once) its meta. Never waits on anyone.

    Ordering: the meta names the blob's sha256 and is created only after the
    blob is complete, so a lister that sees the meta can read the blob. A
    second publisher of the same ``(rank, seq)`` (a zombie) loses the create
    and raises: seqs are never reused (see :func:`next_seq`).
    """
    from composer_cloud.storage.tensors import save_tensors

    blob = save_tensors({k: v.detach().to("cpu", dtype=_fp32()).contiguous() for k, v in delta.items()},
                        {"run_id": cfg.run_id, "rank": str(rank), "seq": str(seq)})
    c = Contribution(rank=rank, seq=seq, base_version=base_version, tokens=int(tokens), inner_steps=inner_steps,
                     sha256=hashlib.sha256(blob).hexdigest(), time=time.time())
    key = contrib_key(rank, seq)
    store.put(f"{key}.safetensors", blob)
    if not store.create_json(f"{key}.json", {**c.entry(), "run_id": cfg.run_id, "bytes": len(blob)}):
        raise StoreError(f"{key}.json exists: contribution {seq} of replica {rank} was already published "
                         "(another process runs this rank?)")
    return c


def list_contributions(store: Store, cfg: DecoupledConfig, cursor: Mapping[int, int]) -> tuple[
        list[Contribution], list[dict[str, Any]]]:
    """Pending contributions (``seq > cursor[rank]``), sorted by (rank, seq), and the rejected metas.

    A meta that fails validation is returned as a rejection ``{"rank", "seq", "reason"}`` (the merge
    record lists it, so it is never looked at again).
    """
    pending: list[Contribution] = []
    rejected: list[dict[str, Any]] = []
    for rank_dir in store.list_dirs(f"{PREFIX}/contrib"):
        if not rank_dir.isdigit() or not 0 <= int(rank_dir) < cfg.replicas:
            logger.warning("ignoring %s/contrib/%s: not a rank of this run", PREFIX, rank_dir)
            continue
        rank = int(rank_dir)
        for name in store.list_dirs(f"{PREFIX}/contrib/{rank}"):
            m = _NUM.match(name)
            if not m or int(m.group(1)) <= cursor.get(rank, 0):
                continue
            seq = int(m.group(1))
            key = f"{contrib_key(rank, seq)}.json"
            try:
                pending.append(parse_contribution(_read_json(store, key), key, run_id=cfg.run_id, rank=rank,
                                                  seq=seq, replicas=cfg.replicas))
            except InvalidObject as exc:
                logger.warning("skipping contribution %s", exc)
                rejected.append({"rank": rank, "seq": seq, "reason": exc.reason[:200]})
    pending.sort(key=lambda c: (c.rank, c.seq))
    return pending, rejected


def load_contribution(store: Store, c: Contribution, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The verified pseudo-gradient of ``c``: sha256 as in its meta, the model's names/shapes, fp32, finite."""
    import torch
    from safetensors.torch import load as st_load

    key = f"{contrib_key(c.rank, c.seq)}.safetensors"
    try:
        raw = bytes(store.get(key))
    except ObjectNotFound:
        raise InvalidObject(key, "blob missing") from None
    except ChecksumMismatch as exc:
        raise InvalidObject(key, str(exc)) from None
    if hashlib.sha256(raw).hexdigest() != c.sha256:
        raise InvalidObject(key, "sha256 differs from its meta record (replaced or tampered)")
    try:
        tensors = st_load(raw)
    except Exception as exc:  # noqa: BLE001 - any decode failure is a bad object
        raise InvalidObject(key, f"not safetensors ({type(exc).__name__})") from None
    check_tree(tensors, shapes, key)
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise InvalidObject(key, f"tensor {name!r} is {t.dtype}, expected float32")
    return tensors


def check_tree(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], key: str) -> None:
    """Names and shapes equal ``shapes``; every value finite. Raises :class:`InvalidObject`."""
    import torch

    if set(tensors) != set(shapes):
        extra, missing = sorted(set(tensors) - set(shapes))[:3], sorted(set(shapes) - set(tensors))[:3]
        raise InvalidObject(key, f"tensors differ from the model's (extra {extra}, missing {missing})")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(shapes[name]):
            raise InvalidObject(key, f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shapes[name])}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InvalidObject(key, f"tensor {name!r} has non-finite values")


# ------------------------------------------------------------------ merge records
@dataclass(frozen=True)
class MergeRecord:
    """A validated ``merge/<v>.json``: version ``v`` = global ``v-1`` + outer step on the weighted contributions."""

    version: int
    contributions: tuple[Contribution, ...]
    weights: tuple[float, ...]
    cursor: dict[int, int]
    final: bool
    time: float
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def ranks(self) -> list[int]:
        return sorted({c.rank for c in self.contributions})


def token_weights(contributions: Sequence[Contribution], replicas: int) -> list[float]:
    """The weights of a merge: ``tokens_i / sum(tokens) * k / replicas`` for its ``k`` contributions.

    Within a merge, contributions count by tokens. The merge as a whole counts
    as the fraction ``k / replicas`` of a fleet round: a merge of all replicas'
    contributions is lock-step's average (weights sum to 1), and two merges of
    half the fleet each move the global as far as one full round would, rather
    than each taking a full outer step (which, with Nesterov momentum, doubles
    the effective outer learning rate and overshoots). float64, exact in JSON.
    """
    total = sum(c.tokens for c in contributions)
    share = len(contributions) / replicas
    return [c.tokens / total * share for c in contributions]


def parse_merge(rec: Any, key: str, cfg: DecoupledConfig, version: int) -> MergeRecord:
    """Validate a merge record: version, base, contributions, weights (= token weights), cursor."""
    if not isinstance(rec, dict):
        raise InvalidObject(key, "not a JSON object")
    if rec.get("run_id") != cfg.run_id:
        raise InvalidObject(key, f"belongs to run {rec.get('run_id')!r:.60}, not {cfg.run_id!r}")
    if _int(rec, "version", key, lo=1) != version or _int(rec, "base", key) != version - 1:
        raise InvalidObject(key, f"names version {rec.get('version')!r}/base {rec.get('base')!r}, stored as {version}")
    entries = rec.get("contributions")
    if not isinstance(entries, list) or len(entries) > 100_000:
        raise InvalidObject(key, "field 'contributions' must be a list")
    contribs = []
    for e in entries:
        if not isinstance(e, dict):
            raise InvalidObject(key, "a contribution entry is not an object")
        contribs.append(parse_contribution(e, key, run_id=cfg.run_id, rank=e.get("rank"), seq=e.get("seq"),
                                           replicas=cfg.replicas))
    if len({(c.rank, c.seq) for c in contribs}) != len(contribs) or contribs != sorted(
            contribs, key=lambda c: (c.rank, c.seq)):
        raise InvalidObject(key, "contributions must be unique and sorted by (rank, seq)")
    weights = rec.get("weights")
    if not isinstance(weights, list) or weights != token_weights(contribs, cfg.replicas):
        raise InvalidObject(key, "field 'weights' must equal tokens / sum(tokens) x contributions / replicas")
    cur = rec.get("cursor")
    if not isinstance(cur, dict):
        raise InvalidObject(key, "field 'cursor' must be an object")
    cursor: dict[int, int] = {}
    for k, v in cur.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) < cfg.replicas and isinstance(v, int) and v >= 0):
            raise InvalidObject(key, f"cursor entry {k!r:.20}: {v!r:.20} is not rank: seq")
        cursor[int(k)] = v
    if any(c.seq > cursor.get(c.rank, 0) for c in contribs):
        raise InvalidObject(key, "a contribution lies beyond the cursor")
    if not isinstance(rec.get("final", False), bool):
        raise InvalidObject(key, "field 'final' must be a boolean")
    return MergeRecord(version=version, contributions=tuple(contribs), weights=tuple(weights), cursor=cursor,
                       final=rec.get("final", False), time=_float(rec, "time", key), raw=rec)


def merge_versions(store: Store) -> list[int]:
    """Versions with a merge record, ascending (records are not read)."""
    return sorted(int(m.group(1)) for n in store.list_dirs(f"{PREFIX}/merge") if (m := _NUM.match(n)))


def read_merge(store: Store, cfg: DecoupledConfig, version: int) -> MergeRecord | None:
    """Merge record ``version``, validated; None if absent. A bad one raises :class:`InvalidObject`."""
    key = merge_key(version)
    rec = _read_json(store, key)
    return None if rec is None else parse_merge(rec, key, cfg, version)


def newest_merge(store: Store, cfg: DecoupledConfig) -> MergeRecord | None:
    """The newest merge record (None: only version 0 exists).

    Records are write-once and decide the version chain; one that fails
    validation (forged, another run's) poisons its version: it is reported
    and the chain stops below it (see docs/decoupled.md, limits).
    """
    versions = merge_versions(store)
    return read_merge(store, cfg, versions[-1]) if versions else None


# ------------------------------------------------------------------ global state (checkpoints/<v>)
def initial_state(params: Mapping[str, torch.Tensor], cfg: DecoupledConfig) -> dict[str, Any]:
    """Version 0's state tree: the parameters and a fresh (empty) outer optimizer state."""
    import torch

    plist = [torch.nn.Parameter(p.detach().to("cpu").clone()) for p in params.values()]
    opt = torch.optim.SGD(plist, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov)
    return {FRAGMENT_KEY: {"original_parameters": {n: p.detach().to("cpu").clone() for n, p in params.items()},
                           "outer_optimizer": opt.state_dict()}}


def outer_step(state: Mapping[str, Any], deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
               cfg: DecoupledConfig) -> dict[str, Any]:
    """Global ``v-1`` -> ``v``: SGD(nesterov) step with grad = sum_i w_i * delta_i. A pure CPU function.

    The weighted sum runs in float32 in the given order, the step is
    ``torch.optim.SGD`` with the config's hyper-parameters (the stored ones
    are ignored: the bucket is untrusted), so equal inputs give equal bytes in
    every process. With no deltas the state is returned unchanged (no step:
    momentum must not move on nothing).
    """
    import torch

    frag = state[FRAGMENT_KEY]
    names = list(frag["original_parameters"])
    if not deltas:
        return {FRAGMENT_KEY: {"original_parameters": {n: frag["original_parameters"][n].clone() for n in names},
                               "outer_optimizer": frag["outer_optimizer"]}}
    plist = [torch.nn.Parameter(frag["original_parameters"][n].detach().to(_fp32()).clone()) for n in names]
    opt = torch.optim.SGD(plist, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov)
    opt.load_state_dict(frag["outer_optimizer"])
    for g in opt.param_groups:  # never the stored hyper-parameters
        g.update(lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov, dampening=0.0,
                 weight_decay=0.0, maximize=False)
    with torch.no_grad():
        for n, p in zip(names, plist):
            acc = torch.zeros_like(p)
            for d, w in zip(deltas, weights):
                acc.add_(d[n], alpha=float(w))
            p.grad = acc
    opt.step()
    dtypes = {n: frag["original_parameters"][n].dtype for n in names}
    new_state = opt.state_dict()
    return {FRAGMENT_KEY: {"original_parameters": {n: p.detach().to(dtypes[n]).clone() for n, p in zip(names, plist)},
                           "outer_optimizer": new_state}}


def has_version(store: Store, version: int) -> bool:
    from composer_cloud.sync.checkpoint import global_state as ckpt

    return ckpt.has_global_state(store, version, num_shards=1, attempt=0)


def write_version(store: Store, version: int, tree: dict[str, Any], *, writer: int,
                  meta: dict[str, Any] | None = None) -> None:
    """Global ``version`` as checkpoint ``version``: blob, write-once marker, then (write-once) the manifest.

    Idempotent: an existing marker is kept (the blob is not rewritten) and a second manifest is refused,
    so a completer finishes whatever a dead writer left, in order. Contributions are pruned only after
    the manifest exists, so ``resume`` (which discards checkpoints without one) never drops a version
    whose inputs are gone.
    """
    from composer_cloud.sync.checkpoint import global_state as ckpt

    ckpt.write_global_state(store, version, tree, writer=writer, num_shards=1, attempt=0)
    marker = ckpt.shard_markers(store, version, attempt=0).by_count[1][0]
    entry = ckpt.BlobEntry(key=layout.slice_name(0, 0, 1) + ".safetensors", bytes=marker.bytes, crc32=marker.crc32)
    manifest = ckpt.Manifest(round=version, attempt=0, slices=[entry], replicas={},
                             participants=(meta or {}).get("ranks", []), time=time.time(),
                             extra={"decoupled": meta or {}})
    store.create_json(layout.manifest_key(version), manifest.to_json())


def load_version(store: Store, version: int, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """Global ``version``, read once through its marker's crc32, shapes and finiteness checked.

    Raises :class:`InvalidObject` (or ``CorruptCheckpoint``) naming the checkpoint.
    """
    from composer_cloud.sync.checkpoint import global_state as ckpt

    tree = ckpt.load_global(store, version, num_shards=1)
    key = ckpt.checkpoint_prefix(version)
    try:
        frag = tree[FRAGMENT_KEY]
        params = frag["original_parameters"]
        check_tree(params, shapes, key)
        opt_state = frag["outer_optimizer"]["state"]
        for i, st in opt_state.items():
            buf = st.get("momentum_buffer") if isinstance(st, dict) else None
            name = list(shapes)[int(i)]
            if buf is not None:
                check_tree({name: buf}, {name: shapes[name]}, f"{key} momentum")
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise InvalidObject(key, f"not a decoupled global state ({type(exc).__name__}: {exc})") from None
    return tree


def newest_version(store: Store, *, floor: int = -1) -> int | None:
    """Newest version > ``floor`` whose global state is durable (None if none)."""
    from composer_cloud.sync.checkpoint import global_state as ckpt

    for v in sorted((r for r in ckpt.checkpoint_rounds(store) if r > floor), reverse=True):
        if has_version(store, v):
            return v
    return None


def ensure_initial(store: Store, cfg: DecoupledConfig, params: Mapping[str, torch.Tensor], *, rank: int) -> None:
    """Create version 0 from ``params`` unless it exists (every replica starts from version 0's bytes).

    Racing creators write the same bytes: models are built on CPU from the run's seed (``model.load_model``)
    before moving to a device. Were they to differ, the write-once marker pins the first writer's crc32 and
    a reader of a replaced blob gets a loud ``CorruptCheckpoint``, never other bytes.
    """
    if not has_version(store, 0) or not _has_manifest(store, 0):
        write_version(store, 0, initial_state(params, cfg), writer=rank, meta={"ranks": [], "initial": True})


# ------------------------------------------------------------------ the merge decision
@dataclass
class MergeOutcome:
    """What :func:`try_merge` did. ``version`` is the newest merged version it knows durable."""

    version: int | None
    base: int = 0  # the newest decided version when this call looked
    merged: int | None = None  # the version this call decided and wrote (None: no merge by this call)
    reason: str = ""
    grace_s: float = 0.0
    pending: int = 0


def grace_window(times: Sequence[float], cfg: DecoupledConfig) -> float:
    """1.5x the median gap between consecutive contribution times, clamped to [grace_min_s, grace_max_s].

    With fewer than 2 times there is no rate to adapt to: ``grace_max_s``.
    """
    ts = sorted(times)
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    if not gaps:
        return cfg.grace_max_s
    return min(cfg.grace_max_s, max(cfg.grace_min_s, 1.5 * statistics.median(gaps)))


def complete_version(store: Store, cfg: DecoupledConfig, record: MergeRecord, shapes: Mapping[str, tuple[int, ...]],
                     *, rank: int, deltas: Sequence[Mapping[str, torch.Tensor]] | None = None,
                     depth: int = 0) -> None:
    """Write global ``record.version`` from its record (a merger, or anyone finishing a dead merger's work).

    Deterministic: global ``v-1`` and the listed contributions (sha256-pinned)
    in record order, :func:`outer_step` on CPU. Writers race safely: same bytes,
    write-once marker and manifest.
    """
    v = record.version
    if has_version(store, v):
        if not _has_manifest(store, v):  # the writer died between marker and manifest: finish it
            write_version(store, v, load_version(store, v, shapes), writer=rank, meta=_version_meta(record, rank))
        return
    if not has_version(store, v - 1):
        if depth > 8:
            raise InvalidObject(layout.checkpoint_prefix(v - 1), "missing, and could not be rebuilt")
        prev = read_merge(store, cfg, v - 1) if v - 1 > 0 else None
        if prev is None:
            raise InvalidObject(layout.checkpoint_prefix(v - 1), "neither durable nor decided by a merge record")
        complete_version(store, cfg, prev, shapes, rank=rank, depth=depth + 1)
    base = load_version(store, v - 1, shapes)
    if deltas is None:
        try:
            deltas = [load_contribution(store, c, shapes) for c in record.contributions]
        except InvalidObject:
            # Its merger may have finished meanwhile and pruned the inputs: then there is nothing to do.
            if has_version(store, v):
                complete_version(store, cfg, record, shapes, rank=rank, depth=depth)
                return
            raise
    tree = outer_step(base, deltas, record.weights, cfg)
    write_version(store, v, tree, writer=rank, meta=_version_meta(record, rank))
    logger.info("global version %d written (%d contributions from replicas %s)", v, len(record.contributions),
                record.ranks)


def _version_meta(record: MergeRecord, rank: int) -> dict[str, Any]:
    return {"ranks": record.ranks, "contributions": len(record.contributions), "final": record.final,
            "decided_by": record.raw.get("decided_by"), "written_by": rank}


def _has_manifest(store: Store, version: int) -> bool:
    from composer_cloud.sync.checkpoint import global_state as ckpt

    return store.exists(layout.manifest_key(version))


def try_merge(store: Store, cfg: DecoupledConfig, shapes: Mapping[str, tuple[int, ...]], *, rank: int,
              final: bool = False, now: float | None = None) -> MergeOutcome:
    """At a boundary: finish an unfinished merge if it is overdue, then merge the pending contributions
    if a quorum of replicas or the grace window says so (``final``: whatever is pending). Never waits.

    Losing the write-once race for ``merge/<v>`` is not an error: the winner's
    version is the one every replica adopts.
    """
    now = time.time() if now is None else now
    latest = newest_merge(store, cfg)
    base = latest.version if latest else 0
    if not has_version(store, base) or (latest is not None and not _has_manifest(store, base)):
        # The merger of ``base`` died after its record (or is still writing). Finish it once the record
        # is older than the grace bound (or now, when finishing the run): same inputs, same bytes.
        if latest is None or not (final or now - latest.time >= cfg.grace_max_s):
            return MergeOutcome(version=newest_version(store), base=base, reason="previous merge still being written")
        logger.warning("replica %d completes merge %d (its merger did not write the global state)", rank, base)
        complete_version(store, cfg, latest, shapes, rank=rank)
    if latest is not None and latest.final:  # the run's last merge happened: nothing merges after it
        return MergeOutcome(version=base, base=base, reason="run finished")
    cursor = dict(latest.cursor) if latest else {}
    pending, rejected = list_contributions(store, cfg, cursor)
    history = [c.time for c in (latest.contributions if latest else ())]
    grace = grace_window(history + [c.time for c in pending], cfg)
    ranks = {c.rank for c in pending}
    if not pending and not rejected and not final:
        return MergeOutcome(version=base, base=base, reason="nothing pending", grace_s=grace)
    waited = now - min(c.time for c in pending) if pending else 0.0
    if final:
        reason = "final"
    elif len(ranks) >= cfg.min_quorum:
        reason = f"quorum ({len(ranks)} replicas >= {cfg.min_quorum})"
    elif pending and waited >= grace:
        reason = f"grace ({waited:.2f}s >= {grace:.2f}s)"
    else:
        return MergeOutcome(version=base, base=base, reason="waiting for a quorum or the grace window", grace_s=grace,
                            pending=len(pending))
    # Verify every input before deciding: a bad contribution is recorded as rejected, not merged.
    accepted: list[Contribution] = []
    deltas: list[dict[str, torch.Tensor]] = []
    norms: list[float] = []
    for c in pending:
        try:
            d = load_contribution(store, c, shapes)
        except InvalidObject as exc:
            logger.warning("replica %d rejects contribution %d of replica %d: %s", rank, c.seq, c.rank, exc)
            rejected.append({"rank": c.rank, "seq": c.seq, "reason": exc.reason[:200]})
            continue
        accepted.append(c)
        deltas.append(d)
        norms.append(_norm(d))
    if cfg.outlier_factor is not None and len(norms) >= 3:
        median = statistics.median(norms)
        keep = [i for i, n in enumerate(norms) if median <= 0 or n <= cfg.outlier_factor * median]
        for i in sorted(set(range(len(norms))) - set(keep)):
            c = accepted[i]
            why = f"norm {norms[i]:.4g} > outlier_factor={cfg.outlier_factor} x median {median:.4g}"
            rejected.append({"rank": c.rank, "seq": c.seq, "reason": why})
        accepted, deltas = [accepted[i] for i in keep], [deltas[i] for i in keep]
    for c in pending:
        cursor[c.rank] = max(cursor.get(c.rank, 0), c.seq)
    for r in rejected:
        cursor[r["rank"]] = max(cursor.get(r["rank"], 0), r["seq"])
    v = base + 1
    record = {"run_id": cfg.run_id, "version": v, "base": base, "contributions": [c.entry() for c in accepted],
              "weights": token_weights(accepted, cfg.replicas), "cursor": {str(k): cursor[k] for k in sorted(cursor)},
              "rejected": sorted(rejected, key=lambda r: (r["rank"], r["seq"])),
              "staleness": [base - c.base_version for c in accepted], "grace_s": grace, "reason": reason,
              "final": final, "decided_by": rank, "time": now}
    if not store.create_json(merge_key(v), record):
        logger.info("replica %d lost the race for merge %d; adopting the winner's", rank, v)
        return MergeOutcome(version=newest_version(store), base=base, reason="lost the race", grace_s=grace)
    parsed = parse_merge(record, merge_key(v), cfg, v)  # won the write-once create: the stored record is ours
    complete_version(store, cfg, parsed, shapes, rank=rank, deltas=deltas)
    prune(store, cfg, newest=v, record=parsed)
    return MergeOutcome(version=v, base=base, merged=v, reason=reason, grace_s=grace, pending=len(pending))


def _norm(d: Mapping[str, torch.Tensor]) -> float:
    from composer_cloud.sync.checks import l2

    return math.sqrt(sum(l2(t.reshape(-1)) ** 2 for t in d.values()))


def _fp32() -> Any:
    import torch

    return torch.float32


# ------------------------------------------------------------------ pruning
def prune(store: Store, cfg: DecoupledConfig, *, newest: int, record: MergeRecord) -> None:
    """After global ``newest`` is durable: drop its consumed contributions, old globals and old records.

    A contribution is needed only to (re)compute the version that consumed
    it, so once that version is durable it goes; globals beyond
    ``keep_checkpoints`` go once a newer one is durable; merge records older
    than the oldest kept global go (the newest record carries the cursor).
    """
    from composer_cloud.sync.checkpoint import global_state as ckpt

    try:
        for c in record.contributions:
            for ext in ("safetensors", "json"):
                store.delete(f"{contrib_key(c.rank, c.seq)}.{ext}")
        for r in record.raw.get("rejected", []):
            if isinstance(r, dict) and isinstance(r.get("rank"), int) and isinstance(r.get("seq"), int):
                for ext in ("safetensors", "json"):
                    store.delete(f"{contrib_key(r['rank'], r['seq'])}.{ext}")
        ckpt.prune_checkpoints(store, keep=cfg.keep_checkpoints, newest=newest)
        kept = ckpt.checkpoint_rounds(store)
        for v in merge_versions(store):
            if kept and v < kept[0]:
                store.delete(merge_key(v))
    except (BadObject, ObjectNotFound) as exc:  # pruning is housekeeping: never fail a merge on it
        logger.warning("pruning after version %d failed: %s", newest, exc)


# ------------------------------------------------------------------ replica inner state
def write_replica(store: Store, rank: int, seq: int, tree: dict[str, Any], *, version: int,
                  world_size: int, keep: int = 2) -> None:
    """Replica ``rank``'s inner state after its boundary ``seq`` (blob, then marker; older ones pruned)."""
    from composer_cloud.storage.tensors import encode_state

    blob = encode_state(tree, metadata={"rank": str(rank), "seq": str(seq), "version": str(version)})
    key = replica_key(rank, seq)
    store.put(f"{key}.safetensors", blob)
    store.put_json(f"{key}.json", {"rank": rank, "seq": seq, "version": version, "world_size": world_size,
                                   "bytes": len(blob), "crc32": zlib.crc32(blob), "time": time.time()})
    seqs = sorted(int(m.group(1)) for n in store.list_dirs(f"{PREFIX}/replica/{rank}") if (m := _NUM.match(n)))
    for old in seqs[:-keep]:
        for ext in ("safetensors", "json"):
            store.delete(f"{replica_key(rank, old)}.{ext}")


@dataclass(frozen=True)
class ReplicaResume:
    seq: int
    version: int
    tree: dict[str, Any]


def load_replica(store: Store, rank: int, *, world_size: int) -> ReplicaResume | None:
    """Newest verified inner state of ``rank`` (None: none usable; the replica starts fresh from a global)."""
    from composer_cloud.storage.tensors import decode_state

    seqs = sorted((int(m.group(1)) for n in store.list_dirs(f"{PREFIX}/replica/{rank}") if (m := _NUM.match(n))),
                  reverse=True)
    for seq in seqs:
        key = replica_key(rank, seq)
        try:
            rec = _read_json(store, f"{key}.json")
            if not isinstance(rec, dict) or rec.get("rank") != rank or rec.get("seq") != seq:
                raise InvalidObject(f"{key}.json", "marker does not name this rank and seq")
            if rec.get("world_size") != world_size:
                raise InvalidObject(f"{key}.json", f"written with {rec.get('world_size')!r} replicas, now {world_size}")
            version = _int(rec, "version", f"{key}.json")
            raw = store.get(f"{key}.safetensors")
            if zlib.crc32(raw) != rec.get("crc32"):
                raise InvalidObject(f"{key}.safetensors", "crc32 differs from its marker")
            return ReplicaResume(seq=seq, version=version, tree=decode_state(raw))
        except (BadObject, ObjectNotFound, ValueError, KeyError) as exc:
            logger.warning("replica %d: inner state %d unusable (%s); trying an older one", rank, seq, exc)
    return None


def next_seq(store: Store, cfg: DecoupledConfig, rank: int, own: int) -> int:
    """The next contribution seq of ``rank``: past its own state, its visible contributions and the cursor.

    A replica restarted from an older inner state never reuses a seq it
    already published (the steps since that state are contributed again:
    at-least-once, see docs/decoupled.md).
    """
    try:
        latest = newest_merge(store, cfg)
    except InvalidObject as exc:  # a bad record says nothing about my seqs; the listing still does
        logger.warning("next seq of replica %d ignores %s", rank, exc)
        latest = None
    return max(own, _published(store, rank, latest)) + 1


def _published(store: Store, rank: int, latest: MergeRecord | None) -> int:
    """The highest seq ``rank`` published: merged (the record's cursor) or still listed."""
    seen = [latest.cursor.get(rank, 0) if latest else 0]
    seen += [int(m.group(1)) for n in store.list_dirs(f"{PREFIX}/contrib/{rank}") if (m := _NUM.match(n))]
    return max(seen)


def published_total(store: Store, cfg: DecoupledConfig) -> int:
    """Contributions the whole fleet has published so far (merged or pending), summed over ranks.

    The run's work budget is ``replicas * rounds`` contributions of ``inner_steps``
    each, whoever does them: a replica 3x slower contributes fewer, a dead one
    none, and the run still ends after the same amount of work.
    """
    try:
        latest = newest_merge(store, cfg)
    except InvalidObject as exc:
        logger.warning("published total ignores %s", exc)
        latest = None
    return sum(_published(store, r, latest) for r in range(cfg.replicas))


# ------------------------------------------------------------------ finishing
def read_final(store: Store) -> int | None:
    """The final version if the run finished (``final.json`` present and well-formed and durable)."""
    try:
        rec = store.try_get_json(FINAL_KEY)
    except BadObject:
        return None
    v = rec.get("version") if isinstance(rec, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def finish(store: Store, cfg: DecoupledConfig, shapes: Mapping[str, tuple[int, ...]], *, rank: int,
           rounds: int) -> int | None:
    """Once the fleet published its budget (``replicas * rounds`` contributions): the final merge.

    Returns the final version, or None while the budget is not reached.
    The final merge takes whatever is pending and is flagged ``final`` in its
    write-once record; nothing merges after it (:func:`try_merge`), so the
    final version is also the newest checkpoint. Racing finishers agree: the
    first final record wins, later ones adopt it; ``final.json`` (write-once)
    is written only after the version was read back and verified.
    """
    done = read_final(store)
    if done is not None:
        return done
    if published_total(store, cfg) < cfg.replicas * rounds:
        return None
    latest = None
    for _ in range(cfg.replicas + 3):  # each retry means a non-final merge won the race for that version
        try_merge(store, cfg, shapes, rank=rank, final=True)
        latest = newest_merge(store, cfg)
        if latest is not None and latest.final:
            break
    else:
        raise StoreError("the final merge lost every race to non-final merges; resume the run to retry")
    complete_version(store, cfg, latest, shapes, rank=rank)  # durable with its manifest, whoever wrote it
    load_version(store, latest.version, shapes)  # read back: "completed" means durable and verified
    if not store.create_json(FINAL_KEY, {"version": latest.version, "time": time.time(), "by": rank}):
        logger.info("replica %d: another finisher recorded the final version", rank)
    final = read_final(store)
    if final != latest.version:
        raise StoreError(f"{FINAL_KEY} says version {final}, but the final merge record is version {latest.version}")
    return final


def progress(store: Store) -> tuple[int, int | None]:
    """(merged versions, final version or None) for status: cheap, reads no tensors."""
    versions = merge_versions(store)
    return (versions[-1] if versions else 0), read_final(store)
