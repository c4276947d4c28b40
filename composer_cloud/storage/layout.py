"""Every key of a run, and its parser: the one module that spells the store layout.

A run lives at ``<store>/<run_id>/``; keys below are relative to it. Numbers
that order objects (rounds, versions, contribution seqs, metrics rounds) are
zero-padded to :data:`NUM_WIDTH` digits so listings sort; attempts, ranks and
slice indices are plain decimals. Parsers take one listed name (or key) and
return its numbers, or ``None`` for a name this layout never writes (a stray
object: the bucket is not trusted, so callers skip it).

::

    spec.json                                           the spec as launched (write-once; resume rewrites it)
    executor/<rank>.json                                job handle (how to find the job again)
    executor/wheel/<sha256[:16]>/<file>.whl             the staged composer-cloud wheel (HF Jobs)
    replicas/<rank>.json                                heartbeat
    metrics/<rank>/<round>-<writer>.jsonl (+ .json)     plain JSONL of one round, then its framed digest
    samples/<rank>/<round>-<writer>.json                a round's sample completions (trainer.log_samples at most)
    resumes/<n>.json                                    the n-th resume
    control/cancel.json                                 the cancel request (write-once)
    code/<sha256>.zip                                   user code bundle (write-once)
    files/<sha256>/<name>, dirs/<sha256>/<name>.zip     local files/folders the spec names (write-once)
    rounds/<r>/<a>/join/<rank>.json                     "I reached sync r"
    rounds/<r>/<a>/quorum.json                          write-once participant set
    rounds/<r>/<a>/grad/<rank>/<slot>                   encoded slot of a participant's pseudo-gradient
    rounds/<r>/<a>/reduced/<slot> (+ .json)             reduced slot, then its write-once digest
    rounds/<r>/<a>/shard/<k>/grad|reduced/...           the same, for shard k of multi-GPU replicas
    rounds/<r>/<a>/sparse/<rank mod S>/<rank>           sparse contribution (sync.codec = "sparse")
    rounds/<r>/<a>/sparse/ack/<rank>.json               digest of the mean a participant computed
    rounds/<r>/<a>/sparse/g<i>/sum (+ .json)            group i's re-sparsified sum (two-level), then its digest
    rounds/<r>/<a>/outcome.json                         write-once: committed or aborted
    rounds/<r>/<a>/void.json                            write-once: the commit was abandoned
    checkpoints/<r>/global-a<a>-<i>-of-<n>.safetensors  slice i of the global state of attempt a
    checkpoints/<r>/global-a<a>-<i>-of-<n>.json         its write-once marker
    checkpoints/<r>/replica-<k>.safetensors (+ .json)   replica k's inner state (lock-step), then its marker
    checkpoints/<r>/manifest.json                       written last: the checkpoint is valid
    decoupled/contrib/<rank>/<seq>.safetensors (+ .json)  a contribution, then its write-once meta
    decoupled/merge/<v>.json                            write-once merge record of version v
    decoupled/replica/<rank>/<seq>.safetensors (+ .json)  replica inner state (decoupled), then its marker
    decoupled/final.json                                write-once: the final version
    rollouts/requests/<r>/<replica>/<step>.json         write-once: a trainer's rollout request (prompt token ids)
    rollouts/batches/<r>/<replica>/<step>.json          write-once: the rollout batch that step consumes
    rollouts/fallbacks/<r>/<replica>/<step>.json        write-once: the batch the trainer sampled itself instead
    policy/<v>.anchor.safetensors | <v>.patch.safetensors  policy version v for rollout workers: bf16 state or patch
    policy/<v>.json                                     write-once record of version v (kind, base, sizes, digest)

Outside a run, at a store's root: :data:`PROBE_PREFIX` (the conformance probe's scratch space).
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass

#: Digits of the zero-padded numbers that order objects (a run of 10^8 rounds still sorts).
NUM_WIDTH = 8

SPEC = "spec.json"
HANDLES = "executor"
WHEELS = f"{HANDLES}/wheel"
HEARTBEATS = "replicas"
METRICS = "metrics"
SAMPLES = "samples"
RESUMES = "resumes"
CANCEL = "control/cancel.json"
CODE = "code"
FILES = "files"
DIRS = "dirs"
#: what export needs besides the weights (model config, generation config, tokenizer), written at launch
MODEL_FILES = "model"
ROUNDS = "rounds"
CHECKPOINTS = "checkpoints"
DECOUPLED = "decoupled"
CONTRIBUTIONS = f"{DECOUPLED}/contrib"
MERGES = f"{DECOUPLED}/merge"
DECOUPLED_REPLICAS = f"{DECOUPLED}/replica"
FINAL = f"{DECOUPLED}/final.json"
#: The policy chain of rollout workers (issue 36): anchors, patches and their records.
POLICY = "policy"
#: The two kinds of policy blob: the whole bf16 state, or a lossless bf16 patch against the previous version.
POLICY_KINDS = ("anchor", "patch")
#: Scratch prefix of the store conformance probe, at the store's root (never inside a run).
PROBE_PREFIX = ".composer-cloud-probe"

_NUM = re.compile(rf"[0-9]{{{NUM_WIDTH},10}}")
_SMALL_INT = re.compile(r"0|[1-9][0-9]{0,8}")
_JSON_NUM = re.compile(rf"([0-9]{{{NUM_WIDTH}}})\.json")
_RANK_JSON = re.compile(r"(0|[1-9][0-9]{0,8})\.json")
_SLICE_MARKER = re.compile(r"global-a(0|[1-9][0-9]{0,8})-(0|[1-9][0-9]{0,8})-of-([1-9][0-9]{0,8})\.json")
_SHA = re.compile(r"[0-9a-f]{64}")
_FILE_KEY = re.compile(rf"({FILES}|{DIRS})/([0-9a-f]{{64}})/([^/]+)")
_WRITER = re.compile(r"[0-9]{4}-[0-9]{13}-[0-9a-f]{4}")
_METRICS_NAME = re.compile(rf"([0-9]{{{NUM_WIDTH}}})-({_WRITER.pattern})\.jsonl")
_POLICY_BLOB = re.compile(rf"([0-9]{{{NUM_WIDTH}}})\.(anchor|patch)\.safetensors")
_SAMPLES_NAME = re.compile(rf"([0-9]{{{NUM_WIDTH}}})-({_WRITER.pattern})\.json")


def num(n: int) -> str:
    """``n`` zero-padded to :data:`NUM_WIDTH` digits (rounds, versions, seqs)."""
    return f"{n:0{NUM_WIDTH}d}"


def parse_num(name: str) -> int | None:
    """The number of a zero-padded directory name (``00000012`` -> 12), else None."""
    return int(name) if _NUM.fullmatch(name) else None


def parse_small_int(name: str) -> int | None:
    """A plain decimal name (attempts, ranks): ``0`` or no leading zero, at most 9 digits; else None."""
    return int(name) if _SMALL_INT.fullmatch(name) else None


def parse_rank_json(name: str) -> int | None:
    """``<rank>.json`` -> rank (join objects, handles, heartbeats), else None."""
    m = _RANK_JSON.fullmatch(name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- launch records
def handle_key(rank: int) -> str:
    return f"{HANDLES}/{rank}.json"


def parse_handle_key(key: str) -> int | None:
    """The rank of an ``executor/<rank>.json`` key (None: the wheel, or a stray object)."""
    head, _, name = key.rpartition("/")
    return parse_rank_json(name) if head == HANDLES else None


def wheel_key(sha256: str, filename: str) -> str:
    """Content-addressed: the first 16 hex digits of the wheel's sha256, then its file name (pip needs it)."""
    return f"{WHEELS}/{sha256[:16]}/{filename}"


def heartbeat_key(rank: int) -> str:
    return f"{HEARTBEATS}/{rank}.json"


def resume_key(n: int) -> str:
    return f"{RESUMES}/{n}.json"


def parse_resume_key(key: str) -> int | None:
    head, _, name = key.rpartition("/")
    return parse_rank_json(name) if head == RESUMES else None


# --------------------------------------------------------------------------- metrics
def new_writer_id(launch: int) -> str:
    """``<launch:04d>-<start ms:013d>-<4 hex>``: names sort by launch, then by process start."""
    return f"{launch:04d}-{int(time.time() * 1000):013d}-{secrets.token_hex(2)}"


def writer_launch(writer: str) -> int:
    return int(writer[:4])


def writer_started(writer: str) -> float:
    """When the process behind ``writer`` started (epoch seconds)."""
    return int(writer.split("-")[1]) / 1000.0


def metrics_prefix(rank: int | None = None) -> str:
    return METRICS if rank is None else f"{METRICS}/{rank}"


def metrics_key(rank: int, round: int, writer: str) -> str:
    return f"{METRICS}/{rank}/{num(round)}-{writer}.jsonl"


def metrics_digest_key(key: str) -> str:
    """``metrics/0/00000003-....jsonl`` -> ``metrics/0/00000003-....json`` (its framed digest)."""
    return key.removesuffix(".jsonl") + ".json"


def parse_metrics_key(key: str) -> tuple[int, int, str] | None:
    """``(rank, round, writer)`` of a metrics object key, else None (digests, strays)."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != METRICS or (rank := parse_small_int(parts[1])) is None:
        return None
    m = _METRICS_NAME.fullmatch(parts[2])
    return (rank, int(m.group(1)), m.group(2)) if m else None


def samples_prefix(rank: int | None = None) -> str:
    return SAMPLES if rank is None else f"{SAMPLES}/{rank}"


def samples_key(rank: int, round: int, writer: str) -> str:
    """A round's sample completions of one replica process (``writer`` as in :func:`metrics_key`)."""
    return f"{SAMPLES}/{rank}/{num(round)}-{writer}.json"


def parse_samples_key(key: str) -> tuple[int, int, str] | None:
    """``(rank, round, writer)`` of a samples key, else None (strays)."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != SAMPLES or (rank := parse_small_int(parts[1])) is None:
        return None
    m = _SAMPLES_NAME.fullmatch(parts[2])
    return (rank, int(m.group(1)), m.group(2)) if m else None


# --------------------------------------------------------------------------- user code and files
def code_key(sha256: str) -> str:
    """The key of the code bundle with this digest."""
    if not _SHA.fullmatch(sha256):
        raise ValueError(f"{sha256!r} is not a sha256 hex digest")
    return f"{CODE}/{sha256}.zip"


def model_file_key(name: str) -> str:
    """``model/<name>``: one file of the model folder export rebuilds (no ``/`` in ``name``)."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"{name!r} is not a plain file name")
    return f"{MODEL_FILES}/{name}"


def file_key(sha256: str, name: str, *, directory: bool) -> str:
    """``files/<sha256>/<name>``, or ``dirs/<sha256>/<name>.zip`` for a folder (zipped)."""
    return f"{DIRS}/{sha256}/{name}.zip" if directory else f"{FILES}/{sha256}/{name}"


def parse_file_key(key: str) -> tuple[bool, str, str] | None:
    """``(directory, sha256, name)`` of a :func:`file_key` (``name`` without ``.zip``), else None."""
    m = _FILE_KEY.fullmatch(key)
    if not m or m.group(3) in (".", ".."):
        return None
    directory = m.group(1) == DIRS
    if directory and not m.group(3).endswith(".zip"):
        return None
    return directory, m.group(2), m.group(3).removesuffix(".zip") if directory else m.group(3)


# --------------------------------------------------------------------------- rounds (lock-step)
def round_prefix(round: int) -> str:
    return f"{ROUNDS}/{num(round)}"


def attempt_prefix(round: int, attempt: int) -> str:
    return f"{round_prefix(round)}/{attempt}"


def join_prefix(round: int, attempt: int) -> str:
    return f"{attempt_prefix(round, attempt)}/join"


def join_key(round: int, attempt: int, rank: int) -> str:
    return f"{join_prefix(round, attempt)}/{rank}.json"


def quorum_key(round: int, attempt: int) -> str:
    return f"{attempt_prefix(round, attempt)}/quorum.json"


def outcome_key(round: int, attempt: int) -> str:
    return f"{attempt_prefix(round, attempt)}/outcome.json"


def void_key(round: int, attempt: int) -> str:
    return f"{attempt_prefix(round, attempt)}/void.json"


def _payload_prefix(round: int, attempt: int, shard: int | None) -> str:
    base = attempt_prefix(round, attempt)
    return base if shard is None else f"{base}/shard/{shard}"


def grad_key(round: int, attempt: int, rank: int, slot: int, *, shard: int | None = None) -> str:
    return f"{_payload_prefix(round, attempt, shard)}/grad/{rank}/{slot}"


def reduced_key(round: int, attempt: int, slot: int, *, shard: int | None = None) -> str:
    return f"{_payload_prefix(round, attempt, shard)}/reduced/{slot}"


def reduced_digest_key(round: int, attempt: int, slot: int, *, shard: int | None = None) -> str:
    return f"{reduced_key(round, attempt, slot, shard=shard)}.json"


@dataclass(frozen=True)
class SlotKeys:
    """The payload keys of a dense exchange: the replica's (``shard=None``) or one shard's of a multi-GPU
    replica (``rounds/<r>/<a>/shard/<k>/...``, exchanged by local rank ``k`` with rank ``k`` of every replica).
    The round's records (join, quorum, outcome) are the replica's whatever the shard."""

    shard: int | None = None

    def grad(self, round: int, attempt: int, rank: int, slot: int) -> str:
        return grad_key(round, attempt, rank, slot, shard=self.shard)

    def reduced(self, round: int, attempt: int, slot: int) -> str:
        return reduced_key(round, attempt, slot, shard=self.shard)

    def reduced_digest(self, round: int, attempt: int, slot: int) -> str:
        return reduced_digest_key(round, attempt, slot, shard=self.shard)


#: Replicas per key prefix of a sparse gather's contributions (S3 limits request rates per prefix).
SPARSE_PER_PREFIX = 32


def sparse_key(round: int, attempt: int, rank: int, replicas: int) -> str:
    """``rank``'s sparse contribution: ``sparse/<rank mod S>/<rank>``, ``S = ceil(replicas / 32)`` prefixes."""
    shards = -(-replicas // SPARSE_PER_PREFIX)
    return f"{attempt_prefix(round, attempt)}/sparse/{rank % shards}/{rank}"


def sparse_group_key(round: int, attempt: int, group: int) -> str:
    """Group ``group``'s re-sparsified sum (two-level exchange): one prefix per group, ``sparse/g<i>/``.

    Every participant reads every group's sum and digest, so these are a round's most-read keys; one
    prefix each spreads them over ``groups`` prefixes (S3 rate-limits requests per prefix).
    """
    return f"{attempt_prefix(round, attempt)}/sparse/g{group}/sum"


def sparse_group_digest_key(round: int, attempt: int, group: int) -> str:
    """The write-once digest of :func:`sparse_group_key` (crc32, input norms, numel)."""
    return f"{sparse_group_key(round, attempt, group)}.json"


def sparse_ack_key(round: int, attempt: int, rank: int) -> str:
    """``rank`` checked every sparse contribution of the attempt: the digest of the mean it computed."""
    return f"{attempt_prefix(round, attempt)}/sparse/ack/{rank}.json"


#: Sub-prefixes of an attempt holding payloads (deleted once a later checkpoint exists); records stay.
ATTEMPT_PAYLOADS = ("grad", "reduced", "join", "sparse", "shard")


# --------------------------------------------------------------------------- checkpoints
def checkpoint_prefix(round: int) -> str:
    """``checkpoints/<r>``: every object of round (or decoupled version) ``r``'s checkpoint lies under it."""
    return f"{CHECKPOINTS}/{num(round)}"


def slice_name(attempt: int, index: int, num_slices: int) -> str:
    return f"global-a{attempt}-{index}-of-{num_slices}"


def slice_blob_key(round: int, attempt: int, index: int, num_slices: int) -> str:
    return f"{checkpoint_prefix(round)}/{slice_name(attempt, index, num_slices)}.safetensors"


def slice_marker_key(round: int, attempt: int, index: int, num_slices: int) -> str:
    return f"{checkpoint_prefix(round)}/{slice_name(attempt, index, num_slices)}.json"


def parse_slice_marker(name: str) -> tuple[int, int, int] | None:
    """``(attempt, index, num_slices)`` of a slice marker's name, else None (index must be < num_slices)."""
    m = _SLICE_MARKER.fullmatch(name)
    if m is None:
        return None
    attempt, index, n = (int(g) for g in m.groups())
    return (attempt, index, n) if index < n else None


def replica_blob_name(rank: int) -> str:
    """The blob's name inside its checkpoint (manifests list blobs by name)."""
    return f"replica-{rank}.safetensors"


def replica_blob_key(round: int, rank: int) -> str:
    return f"{checkpoint_prefix(round)}/{replica_blob_name(rank)}"


def replica_marker_key(round: int, rank: int) -> str:
    return f"{checkpoint_prefix(round)}/replica-{rank}.json"


def manifest_key(round: int) -> str:
    return f"{checkpoint_prefix(round)}/manifest.json"


def in_checkpoint(round: int, name: str) -> str:
    """The key of object ``name`` listed by round ``round``'s manifest or marker (names carry no ``/``)."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not an object name inside a checkpoint")
    return f"{checkpoint_prefix(round)}/{name}"


# --------------------------------------------------------------------------- decoupled
def contribution_prefix(rank: int) -> str:
    return f"{CONTRIBUTIONS}/{rank}"


def contribution_key(rank: int, seq: int, ext: str) -> str:
    """Contribution ``seq`` of ``rank``: ``ext`` is ``safetensors`` (the blob) or ``json`` (the meta)."""
    return f"{CONTRIBUTIONS}/{rank}/{num(seq)}.{ext}"


def merge_key(version: int) -> str:
    return f"{MERGES}/{num(version)}.json"


def decoupled_replica_prefix(rank: int) -> str:
    return f"{DECOUPLED_REPLICAS}/{rank}"


def decoupled_replica_key(rank: int, seq: int, ext: str) -> str:
    return f"{DECOUPLED_REPLICAS}/{rank}/{num(seq)}.{ext}"


# --------------------------------------------------------------------------- rollouts (rollout workers, issue 36)
ROLLOUTS = "rollouts"
ROLLOUT_REQUESTS = f"{ROLLOUTS}/requests"
ROLLOUT_BATCHES = f"{ROLLOUTS}/batches"
ROLLOUT_FALLBACKS = f"{ROLLOUTS}/fallbacks"
_ROLLOUT_NAME = re.compile(rf"([0-9]{{{NUM_WIDTH}}})\.json")


def _rollout_key(base: str, round: int, replica: int, step: int) -> str:
    return f"{base}/{num(round)}/{replica}/{num(step)}.json"


def rollout_request_key(round: int, replica: int, step: int) -> str:
    """Replica ``replica``'s write-once rollout request for inner step ``step`` of round ``round``."""
    return _rollout_key(ROLLOUT_REQUESTS, round, replica, step)


def rollout_batch_key(round: int, replica: int, step: int) -> str:
    """The write-once rollout batch that step ``step`` of round ``round`` on replica ``replica`` consumes."""
    return _rollout_key(ROLLOUT_BATCHES, round, replica, step)


def rollout_fallback_key(round: int, replica: int, step: int) -> str:
    """The write-once batch replica ``replica`` sampled itself for that step (no worker's batch by its deadline)."""
    return _rollout_key(ROLLOUT_FALLBACKS, round, replica, step)


def rollout_round_prefix(round: int, *, base: str = ROLLOUT_REQUESTS) -> str:
    """``<base>/<r>``: every request (``base`` :data:`ROLLOUT_REQUESTS`), batch (:data:`ROLLOUT_BATCHES`) or
    fallback (:data:`ROLLOUT_FALLBACKS`) of round ``round``."""
    if base not in (ROLLOUT_REQUESTS, ROLLOUT_BATCHES, ROLLOUT_FALLBACKS):
        raise ValueError(f"{base!r} is not a rollout prefix")
    return f"{base}/{num(round)}"


def parse_rollout_key(key: str) -> tuple[int, int, int] | None:
    """``(round, replica, step)`` of a rollout request, batch or fallback key, else None (a stray object)."""
    parts = key.split("/")
    if len(parts) != 5 or f"{parts[0]}/{parts[1]}" not in (ROLLOUT_REQUESTS, ROLLOUT_BATCHES, ROLLOUT_FALLBACKS):
        return None
    round, replica = parse_num(parts[2]), parse_small_int(parts[3])
    m = _ROLLOUT_NAME.fullmatch(parts[4])
    if round is None or replica is None or m is None:
        return None
    return round, replica, int(m.group(1))


def parse_num_json(name: str) -> int | None:
    """``<8 digits>.json`` -> the number (merge records, contribution metas, replica markers), else None."""
    m = _JSON_NUM.fullmatch(name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- the policy chain (rollout workers)
def policy_record_key(version: int) -> str:
    """``policy/<v>.json``: the write-once record of policy version ``v`` (written after its blob)."""
    return f"{POLICY}/{num(version)}.json"


def policy_blob_key(version: int, kind: str) -> str:
    """``policy/<v>.<kind>.safetensors``: version ``v``'s bf16 state (``anchor``) or its patch (``patch``)."""
    if kind not in POLICY_KINDS:
        raise ValueError(f"policy blob kind must be one of {POLICY_KINDS}, got {kind!r}")
    return f"{POLICY}/{num(version)}.{kind}.safetensors"


def parse_policy_key(key: str) -> tuple[int, str] | None:
    """``(version, what)`` of a ``policy/`` key, ``what`` being ``record``, ``anchor`` or ``patch``; else None."""
    head, _, name = key.rpartition("/")
    if head != POLICY:
        return None
    if (version := parse_num_json(name)) is not None:
        return version, "record"
    m = _POLICY_BLOB.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("annotations", "re", "secrets", "time")]
