"""Decoupled DiLoCo through the object store: contributions, write-once merge records, merged globals.

No replica ever waits for another. A replica publishes a *contribution* (its
pseudo-gradient since its last boundary, the tokens behind it, the global
version it started from) every ``inner_steps`` steps; at the same boundary it
may *merge* the pending contributions into a new global version, and it adopts
the newest durable global. The protocol (``docs/decoupled.md`` has the
reasoning) lives here; the merge arithmetic in :mod:`.outer`; the training side
in :mod:`composer_cloud.replica.decoupled`. Keys: :mod:`composer_cloud.storage.layout`
(``decoupled/...``); records: :mod:`composer_cloud.storage.records`
(:class:`Contribution`, :class:`MergeRecord`, :class:`FinalRecord`). Global
version ``v`` is checkpoint ``v`` (one slice, attempt 0), written and read only
through the version API the protocol owns (:class:`~.versions.GlobalVersions`),
so ``export``, ``resume`` and ``status`` read it like a lock-step checkpoint.
:class:`DecoupledProtocol` is the whole protocol of one run as one object;
:meth:`DecoupledProtocol.boundary` is the same over one boundary's look at the
store (:mod:`.view`).

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
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from composer_cloud.errors import BadObject, ChecksumMismatch, ObjectNotFound
from composer_cloud.storage import layout
from composer_cloud.storage.records import Contribution, FinalRecord, MergeRecord, Rejected
from composer_cloud.storage.store import Store
from composer_cloud.sync.checkpoint import manifests
from composer_cloud.sync.checks import outliers, scale_text, tree_norm
from composer_cloud.sync.decoupled import guard
from composer_cloud.sync.decoupled.outer import initial_state, outer_step, token_weights
from composer_cloud.sync.decoupled.versions import GlobalVersions, Shapes
from composer_cloud.sync.decoupled.view import BoundaryView
from composer_cloud.sync.outer import OuterOptimizerConfig
from composer_cloud.sync.trust import create_over_forged

if TYPE_CHECKING:
    import torch

    from composer_cloud.spec import RunSpec
    from composer_cloud.sync.decoupled.contributions import ContributionEncoder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoupledConfig:
    """What the protocol needs from the spec (:meth:`from_spec`; no defaults here). Seconds for times.

    Attributes:
        min_quorum: distinct replicas with pending contributions that trigger a merge.
        grace_min_s, grace_max_s: bounds of the adaptive grace window (:func:`grace_window`).
        outer: the outer optimizer of a merge.
        outlier_factor: a contribution whose norm exceeds this many medians is rejected (None: no check).
        keep_checkpoints: global versions kept besides the newest.
        sparse: the sparse codec's settings when contributions are sparse (``sync.codec = "sparse"``), else None.
        norm_floor: the no-gradient norm (0.1 % of the synced parameters'), least scale of both checks (:mod:`.guard`).
    """

    run_id: str
    replicas: int
    min_quorum: int
    grace_min_s: float
    grace_max_s: float
    outer: OuterOptimizerConfig
    outlier_factor: float | None
    keep_checkpoints: int
    sparse: Any = None  # composer_cloud.sync.sparse.SparseSettings | None
    norm_floor: float = 0.0

    @classmethod
    def from_spec(cls, spec: RunSpec) -> "DecoupledConfig":
        from composer_cloud.sync.sparse import settings_of  # torch: not for the client's status reads

        s = spec.sync
        return cls(run_id=spec.run_id, replicas=spec.replicas,
                   min_quorum=s.min_quorum if s.min_quorum is not None else math.ceil(spec.replicas / 2),
                   grace_min_s=s.grace_min_s, grace_max_s=s.grace_max_s, outer=OuterOptimizerConfig.from_spec(spec),
                   outlier_factor=s.outlier_factor, keep_checkpoints=spec.keep_checkpoints,
                   sparse=settings_of(spec))


@dataclass
class MergeOutcome:
    """What :meth:`DecoupledProtocol.try_merge` did. ``version`` is the newest merged version it knows durable."""

    version: int | None
    base: int = 0  # the newest decided version when this call looked
    merged: int | None = None  # the version this call decided and wrote (None: no merge by this call)
    reason: str = ""
    grace_s: float = 0.0
    pending: int = 0


class DecoupledProtocol:
    """One run's decoupled protocol over ``store``: contributions, merge records, the merge decision, the budget.

    ``versions`` (:class:`~.versions.GlobalVersions`) is the version API it owns: every read and write of a
    global state goes through it. :meth:`boundary` gives the same protocol over one boundary's look at the
    store (:class:`~.view.BoundaryView`: each folder listed once, each record read once); a replica makes one
    per boundary and never keeps it across boundaries.
    """

    def __init__(self, store: Store, cfg: DecoupledConfig) -> None:
        self.store = store
        self.cfg = cfg
        self.versions = GlobalVersions(store)

    def boundary(self) -> DecoupledProtocol:
        """This protocol over a fresh :class:`~.view.BoundaryView` of the store (one look per folder)."""
        store = self.store.store if isinstance(self.store, BoundaryView) else self.store
        return DecoupledProtocol(BoundaryView(store), self.cfg)

    def _read_json(self, key: str) -> Any | None:
        """JSON at ``key``; None if absent. Damaged or forged objects raise :class:`BadObject`; outages propagate."""
        try:
            return self.store.get_json(key)
        except ObjectNotFound:
            return None

    # -------------------------------------------------------------- contributions
    def publish(self, *, rank: int, seq: int, base_version: int, tokens: int, inner_steps: int,
                delta: Mapping[str, torch.Tensor], encoder: ContributionEncoder | None = None) -> Contribution:
        """Write contribution ``seq`` of ``rank``: the blob, then (write-once) its meta. Never waits on anyone.

        Ordering: the meta names the blob's sha256 and is created only after the
        blob is complete, so a lister that sees the meta can read the blob. A
        second publisher of the same ``(rank, seq)`` (a zombie) loses the create
        and raises: seqs are never reused (see :meth:`next_seq`). ``encoder``: the
        replica's (holds the sparse codec's error feedback, committed once published).
        """
        from composer_cloud.sync.decoupled.contributions import ContributionEncoder

        cfg, store = self.cfg, self.store
        encoder = encoder or ContributionEncoder(cfg.sparse)
        blob = encoder.encode(delta, {"run_id": cfg.run_id, "rank": str(rank), "seq": str(seq)})
        c = Contribution(rank=rank, seq=seq, base_version=base_version, tokens=int(tokens), inner_steps=inner_steps,
                         sha256=hashlib.sha256(blob).hexdigest(), time=time.time())
        store.put(layout.contribution_key(rank, seq, "safetensors"), blob)
        meta_key = layout.contribution_key(rank, seq, "json")
        meta = c.to_json(run_id=cfg.run_id, bytes=len(blob))
        if not create_over_forged(store, meta_key, meta, lambda o: Contribution.from_json(
                o, key=meta_key, run_id=cfg.run_id, rank=rank, seq=seq, replicas=cfg.replicas)):
            raise BadObject(meta_key, f"contribution {seq} of replica {rank} was already published (another "
                                      "process runs this rank?)")
        encoder.commit()
        return c

    def pending(self, cursor: Mapping[int, int]) -> tuple[list[Contribution], list[Rejected]]:
        """Pending contributions (``seq > cursor[rank]``), sorted by (rank, seq), and the metas rejected.

        A meta that fails validation is returned as a :class:`Rejected` (the merge
        record lists it, so it is never looked at again).
        """
        pending: list[Contribution] = []
        rejected: list[Rejected] = []
        for name in self.store.list_dirs(layout.CONTRIBUTIONS):
            rank = layout.parse_small_int(name)
            if rank is None or rank >= self.cfg.replicas:
                logger.warning("ignoring %s/%s: not a rank of this run", layout.CONTRIBUTIONS, name)
                continue
            valid, bad = self._pending_metas(rank, cursor.get(rank, 0))
            pending.extend(valid)
            rejected.extend(bad)
        pending.sort(key=lambda c: (c.rank, c.seq))
        return pending, rejected

    def _pending_metas(self, rank: int, after: int) -> tuple[list[Contribution], list[Rejected]]:
        """``rank``'s metas listed past seq ``after``, read and validated: the valid ones (in a signed run: written
        by a job of the run) and the others (forged, garbage, another run's). A listed name alone decides nothing."""
        valid: list[Contribution] = []
        bad: list[Rejected] = []
        names = self.store.list_dirs(layout.contribution_prefix(rank))
        for seq in sorted(s for s in map(layout.parse_num_json, names) if s is not None):
            if seq <= after:
                continue
            key = layout.contribution_key(rank, seq, "json")
            try:
                valid.append(Contribution.from_json(self._read_json(key), key=key, run_id=self.cfg.run_id, rank=rank,
                                                    seq=seq, replicas=self.cfg.replicas))
            except BadObject as exc:
                logger.warning("skipping contribution %s", exc)
                bad.append(Rejected(rank, seq, exc.reason))
        return valid, bad

    def load_contribution(self, c: Contribution, shapes: Shapes) -> dict[str, torch.Tensor]:
        """The verified pseudo-gradient of ``c``: sha256 as in its meta, the model's names/shapes, fp32, finite
        (sparse contributions decoded with the run's ``cfg.sparse``)."""
        key = layout.contribution_key(c.rank, c.seq, "safetensors")
        try:
            raw = bytes(self.store.get(key))
        except ObjectNotFound:
            raise BadObject(key, "blob missing") from None
        except ChecksumMismatch as exc:
            raise BadObject(key, exc.reason) from None
        if hashlib.sha256(raw).hexdigest() != c.sha256:
            raise BadObject(key, "sha256 differs from its meta record (replaced or tampered)")
        from composer_cloud.sync.decoupled.contributions import decode_contribution

        return decode_contribution(raw, key=key, shapes=shapes, settings=self.cfg.sparse)

    # -------------------------------------------------------------- merge records
    def parse_merge(self, obj: Any, key: str, version: int) -> MergeRecord:
        """A merge record read from ``key``: its schema, and weights that are its contributions' token weights."""
        cfg = self.cfg
        record = MergeRecord.from_json(obj, key=key, run_id=cfg.run_id, version=version, replicas=cfg.replicas)
        if list(record.weights) != token_weights(record.contributions, cfg.replicas):
            raise BadObject(key, "field 'weights' must equal tokens / sum(tokens) x contributions / replicas")
        return record

    def read_merge(self, version: int) -> MergeRecord | None:
        """Merge record ``version``, validated; None if absent. A bad one raises :class:`BadObject`."""
        key = layout.merge_key(version)
        obj = self._read_json(key)
        return None if obj is None else self.parse_merge(obj, key, version)

    def newest_merge(self) -> MergeRecord | None:
        """The newest merge record (None: only version 0 exists).

        Records are write-once and decide the version chain; one that fails
        validation (forged, garbage, another run's) decides nothing: it is
        reported and skipped, and the chain continues from the newest valid record
        below it (in a signed run the next merge replaces it: :func:`create_over_forged`).
        """
        for v in reversed(self.versions.decided()):
            try:
                return self.read_merge(v)
            except BadObject as exc:
                logger.warning("ignoring merge record %d: %s", v, exc)
        return None

    # -------------------------------------------------------------- global versions
    def ensure_initial(self, params: Mapping[str, torch.Tensor], *, rank: int) -> None:
        """Create version 0 from ``params`` unless it is complete (every replica starts from version 0's bytes).

        Racing creators write the same bytes: models are built on CPU from the run's seed (``model.load_model``)
        before moving to a device. Were they to differ, the write-once marker pins the first writer's crc32 and
        a reader of a replaced blob gets a loud ``CorruptCheckpoint``, never other bytes.
        """
        if not self.versions.complete(0):  # complete implies durable
            self.versions.write(0, initial_state(params, self.cfg.outer), writer=rank,
                                meta={"ranks": [], "initial": True})

    def complete_version(self, record: MergeRecord, shapes: Shapes, *, rank: int,
                         deltas: Sequence[Mapping[str, torch.Tensor]] | None = None) -> None:
        """Write global ``record.version`` from its record (a merger, or anyone finishing a dead merger's work).

        Deterministic: global ``v-1`` and the listed contributions (sha256-pinned)
        in record order, :func:`~.outer.outer_step` on CPU. Writers race safely:
        same bytes, write-once marker and manifest. Missing earlier versions are
        rebuilt from their records first, oldest first.
        """
        durable = self.versions.durable
        missing = [record]
        while not durable(missing[-1].version) and not durable(missing[-1].version - 1):
            prev = missing[-1].version - 1
            rec = self.read_merge(prev) if prev > 0 else None
            if rec is None:
                raise BadObject(layout.checkpoint_prefix(prev), "neither durable nor decided by a merge record")
            missing.append(rec)
        for rec in reversed(missing):
            self._complete_one(rec, shapes, rank=rank, deltas=deltas if rec is record else None)

    def _complete_one(self, record: MergeRecord, shapes: Shapes, *, rank: int,
                      deltas: Sequence[Mapping[str, torch.Tensor]] | None) -> None:
        v, versions = record.version, self.versions
        meta = {"ranks": record.ranks, "contributions": len(record.contributions), "final": record.final,
                "decided_by": record.decided_by, "written_by": rank}
        if versions.durable(v):
            if not versions.complete(v):  # the writer died between marker and manifest: finish it
                versions.write(v, versions.load(v, shapes), writer=rank, meta=meta)
            return
        base = versions.load(v - 1, shapes)
        if deltas is None:
            try:
                deltas = [self.load_contribution(c, shapes) for c in record.contributions]
            except BadObject:
                # Its merger may have finished meanwhile and pruned the inputs: then there is nothing to do.
                if versions.durable(v):
                    self._complete_one(record, shapes, rank=rank, deltas=None)
                    return
                raise
        versions.write(v, outer_step(base, deltas, record.weights, self.cfg.outer), writer=rank, meta=meta)
        logger.info("global version %d written (%d contributions from replicas %s)", v, len(record.contributions),
                    record.ranks)

    # -------------------------------------------------------------- the merge decision
    def grace_window(self, times: Sequence[float]) -> float:
        """1.5x the median gap between consecutive contribution times, clamped to [grace_min_s, grace_max_s].

        With fewer than 2 times there is no rate to adapt to: ``grace_max_s``.
        """
        ts = sorted(times)
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        if not gaps:
            return self.cfg.grace_max_s
        return min(self.cfg.grace_max_s, max(self.cfg.grace_min_s, 1.5 * statistics.median(gaps)))

    def try_merge(self, shapes: Shapes, *, rank: int, final: bool = False, now: float | None = None) -> MergeOutcome:
        """At a boundary: finish an unfinished merge if it is overdue, then merge the pending contributions
        if a quorum of replicas or the grace window says so (``final``: whatever is pending). Never waits.

        Losing the write-once race for ``merge/<v>`` is not an error: the winner's
        version is the one every replica adopts.
        """
        cfg, versions = self.cfg, self.versions
        now = time.time() if now is None else now
        latest = self.newest_merge()
        base = latest.version if latest else 0
        if not versions.durable(base) or (latest is not None and not versions.complete(base)):
            # The merger of ``base`` died after its record (or is still writing). Finish it once the record
            # is older than the grace bound (or now, when finishing the run): same inputs, same bytes.
            if latest is None or not (final or now - latest.time >= cfg.grace_max_s):
                return MergeOutcome(version=versions.newest(), base=base, reason="previous merge still being written")
            logger.warning("replica %d completes merge %d (its merger did not write the global state)", rank, base)
            self.complete_version(latest, shapes, rank=rank)
        if latest is not None and latest.final:  # the run's last merge happened: nothing merges after it
            return MergeOutcome(version=base, base=base, reason="run finished")
        cursor = dict(latest.cursor) if latest else {}
        pending, rejected = self.pending(cursor)
        history = [c.time for c in (latest.contributions if latest else ())]
        grace = self.grace_window(history + [c.time for c in pending])
        ranks = {c.rank for c in pending}
        if not pending and not final:
            # Metas that failed validation never move the cursor (a forged name must not skip or count genuine
            # seqs) and never make a merge on their own (it would be a version with no step): dropped here, or
            # listed in the next record and pruned with it.
            self._drop(rejected)
            return MergeOutcome(version=base, base=base, reason="nothing pending", grace_s=grace)
        waited = now - min(c.time for c in pending) if pending else 0.0
        if final:
            reason = "final"
        elif len(ranks) >= cfg.min_quorum:
            reason = f"quorum ({len(ranks)} replicas >= {cfg.min_quorum})"
        elif pending and waited >= grace:
            reason = f"grace ({waited:.2f}s >= {grace:.2f}s)"
        else:
            return MergeOutcome(version=base, base=base, reason="waiting for a quorum or the grace window",
                                grace_s=grace, pending=len(pending))
        refs = {r: guard.Reference(*ref) for r, ref in ((latest.references or {}) if latest else {}).items()}
        accepted, deltas, norms = self._verified(pending, shapes, rank=rank, rejected=rejected, refs=refs)
        refs = guard.updated(refs, [(c.rank, n, c.tokens) for c, n in zip(accepted, norms)], cfg.norm_floor)
        for c in pending:
            cursor[c.rank] = max(cursor.get(c.rank, 0), c.seq)
        merged = {r: (latest.merged_count(r) if latest else 0) + sum(c.rank == r for c in accepted)
                  for r in range(cfg.replicas)}
        v = base + 1
        record = MergeRecord(run_id=cfg.run_id, version=v, contributions=tuple(accepted), merged=merged,
                             references={r: (ref.norm, ref.tokens) for r, ref in refs.items()},
                             weights=tuple(token_weights(accepted, cfg.replicas)), cursor=cursor, final=final,
                             time=now, rejected=tuple(sorted(rejected, key=lambda r: (r.rank, r.seq))),
                             staleness=tuple(base - c.base_version for c in accepted), grace_s=grace, reason=reason,
                             decided_by=rank)
        if not create_over_forged(self.store, layout.merge_key(v), record.to_json(),
                                  lambda o: self.parse_merge(o, layout.merge_key(v), v)):
            logger.info("replica %d lost the race for merge %d; adopting the winner's", rank, v)
            return MergeOutcome(version=versions.newest(), base=base, reason="lost the race", grace_s=grace)
        self.complete_version(record, shapes, rank=rank, deltas=deltas)  # won the create: the record is ours
        self.prune(newest=v, record=record)
        return MergeOutcome(version=v, base=base, merged=v, reason=reason, grace_s=grace, pending=len(pending))

    def _verified(self, pending: list[Contribution], shapes: Shapes, *, rank: int, rejected: list[Rejected],
                  refs: Mapping[int, guard.Reference]
                  ) -> tuple[list[Contribution], list[dict[str, torch.Tensor]], list[float]]:
        """The pending contributions that pass every check, with their tensors and norms; the others go to
        ``rejected``. Checks: the blob (:meth:`load_contribution`), the median rule among this merge's
        contributions, and the guard against each replica's own history (:mod:`.guard`)."""
        cfg = self.cfg
        accepted: list[Contribution] = []
        deltas: list[dict[str, torch.Tensor]] = []
        for c in pending:
            try:
                deltas.append(self.load_contribution(c, shapes))
                accepted.append(c)
            except BadObject as exc:
                logger.warning("replica %d rejects contribution %d of replica %d: %s", rank, c.seq, c.rank, exc)
                rejected.append(Rejected(c.rank, c.seq, exc.reason))
        norms = [tree_norm(d) for d in deltas]
        median, bad = outliers(norms, cfg.outlier_factor, cfg.norm_floor)
        scale, factor = scale_text(median, cfg.norm_floor), cfg.outlier_factor
        why = {i: f"norm {norms[i]:.4g} > outlier_factor={factor} x {scale}" for i in bad}
        for i, c in enumerate(accepted):
            refused = None if i in why else guard.refusal(c.rank, norms[i], c.tokens, refs, factor, cfg.norm_floor)
            if refused:
                why[i] = refused
        for i in sorted(why):
            logger.warning("replica %d rejects contribution %d of replica %d: %s", rank, accepted[i].seq,
                           accepted[i].rank, why[i])
            rejected.append(Rejected(accepted[i].rank, accepted[i].seq, why[i]))
        keep = [i for i in range(len(accepted)) if i not in why]
        return [accepted[i] for i in keep], [deltas[i] for i in keep], [norms[i] for i in keep]

    # -------------------------------------------------------------- pruning
    def _drop(self, rejected: Sequence[Rejected]) -> None:
        """Delete contribution objects that failed validation (nothing merges them; they only cost listings)."""
        for r in rejected:
            for ext in ("safetensors", "json"):
                self.store.delete(layout.contribution_key(r.rank, r.seq, ext))

    def prune(self, *, newest: int, record: MergeRecord) -> None:
        """After global ``newest`` is durable: drop its consumed contributions, old globals and old records.

        A contribution is needed only to (re)compute the version that consumed
        it, so once that version is durable it goes; globals beyond
        ``keep_checkpoints`` go once a newer one is durable; merge records older
        than the oldest kept global go (the newest record carries the cursor).
        """
        try:
            consumed = [(c.rank, c.seq) for c in record.contributions] + [(r.rank, r.seq) for r in record.rejected]
            for rank, seq in consumed:
                for ext in ("safetensors", "json"):
                    self.store.delete(layout.contribution_key(rank, seq, ext))
            states = self.versions.states
            manifests.prune(states, keep=self.cfg.keep_checkpoints, newest=newest)
            kept = states.rounds()
            for v in self.versions.decided():
                if kept and v < kept[0]:
                    self.store.delete(layout.merge_key(v))
        except (BadObject, ObjectNotFound) as exc:  # pruning is housekeeping: never fail a merge on it
            logger.warning("pruning after version %d failed: %s", newest, exc)

    # -------------------------------------------------------------- seqs and the fleet's budget
    def next_seq(self, rank: int, own: int) -> int:
        """The next contribution seq of ``rank``: past its own state, its visible contributions and the cursor.

        A replica restarted from an older inner state never reuses a seq it
        already published (the steps since that state are contributed again:
        at-least-once, see docs/decoupled.md).
        """
        latest = self._newest_merge_or_none(f"next seq of replica {rank}")
        return max(own, self._published(rank, latest)[0]) + 1

    def _newest_merge_or_none(self, what: str) -> MergeRecord | None:
        try:
            return self.newest_merge()
        except BadObject as exc:  # a bad record says nothing about the seqs; the listing still does
            logger.warning("%s ignores %s", what, exc)
            return None

    def _published(self, rank: int, latest: MergeRecord | None) -> tuple[int, int]:
        """``(highest seq, contributions counted)`` of ``rank``: merged (the record's cursor and merged count) and
        pending metas that validate. Names that fail validation count for nothing and move no seq."""
        cursor = latest.cursor.get(rank, 0) if latest else 0
        merged = latest.merged_count(rank) if latest else 0
        valid, _ = self._pending_metas(rank, cursor)
        return max([cursor, *(c.seq for c in valid)]), merged + len(valid)

    def published_total(self) -> int:
        """Contributions the whole fleet has published so far (merged, or pending and valid), summed over ranks.

        The run's work budget is ``replicas * rounds`` contributions of ``inner_steps``
        each, whoever does them: a replica 3x slower contributes fewer, a dead one
        none, and the run still ends after the same amount of work. Only contributions
        that validate count (in a signed run: written by a job of the run), and a
        merged one only if the merge accepted it: forged names, or contributions the
        merge refused, never bring the end of the run closer.
        """
        latest = self._newest_merge_or_none("published total")
        return sum(self._published(r, latest)[1] for r in range(self.cfg.replicas))

    # -------------------------------------------------------------- finishing
    def finish(self, shapes: Shapes, *, rank: int, rounds: int) -> int | None:
        """Once the fleet published its budget (``replicas * rounds`` contributions): the final merge.

        Returns the final version, or None while the budget is not reached.
        The final merge takes whatever is pending and is flagged ``final`` in its
        write-once record; nothing merges after it (:meth:`try_merge`), so the
        final version is also the newest checkpoint. Racing finishers agree: the
        first final record wins, later ones adopt it; ``final.json`` (write-once)
        is written only after the version was read back and verified.
        """
        cfg, versions = self.cfg, self.versions
        done = versions.final()
        if done is not None:
            return done
        if self.published_total() < cfg.replicas * rounds:
            return None
        latest = None
        for _ in range(cfg.replicas + 3):  # each retry means a non-final merge won the race for that version
            self.try_merge(shapes, rank=rank, final=True)
            latest = self.newest_merge()
            if latest is not None and latest.final:
                break
        else:
            raise BadObject(layout.MERGES, "the final merge lost every race to non-final merges; resume the run "
                                           "to retry")
        self.complete_version(latest, shapes, rank=rank)  # durable with its manifest, whoever wrote it
        versions.load(latest.version, shapes)  # read back: "completed" means durable and verified
        final_record = FinalRecord(version=latest.version, by=rank, time=time.time()).to_json()
        if not create_over_forged(self.store, layout.FINAL, final_record,
                                  lambda o: FinalRecord.from_json(o, key=layout.FINAL)):
            logger.info("replica %d: another finisher recorded the final version", rank)
        final = versions.final()
        if final != latest.version:
            raise BadObject(layout.FINAL, f"says version {final}, but the final merge record is version "
                                          f"{latest.version}")
        return final


__all__ = ["DecoupledConfig", "DecoupledProtocol", "MergeOutcome"]
