"""Rollout records (``rollouts/requests/...``, ``rollouts/batches/...``): what a trainer asks a rollout worker
for, and the batch that answers it (issue 36).

Both are write-once and named by the position that consumes them, ``(round, replica, step)``, which each record
also carries (a record copied to another key is refused). The bucket is not trusted: ``from_json`` checks every
field's type and range, the shapes (one completion and one log-prob row per prompt row, equal lengths), that
token ids are non-negative and log-probs finite and ``<= 0``, and :data:`ROLLOUT_RECORD_MAX_BYTES` bounds what a
reader reads. Whether a batch answers *this* request (its prompts' digest, its policy version) is the
protocol's check (:mod:`composer_cloud.rollouts.batches`), not the parser's.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from composer_cloud.errors import BadObject
from composer_cloud.storage.records.fields import (
    as_object,
    check_position,
    float_field,
    int_field,
    is_int,
    sha256_field,
)

#: The most bytes of one request or batch a reader reads (a 4,096-row batch of 1,024-token completions is
#: ~60 MiB of JSON; real CPU and single-GPU batches are far smaller).
ROLLOUT_RECORD_MAX_BYTES = 64 << 20
#: The most rows (prompt x generation) of one request.
MAX_ROWS = 1 << 14
#: Token ids are below this (every released vocabulary is < 2^20).
MAX_TOKEN_ID = 1 << 31
#: A sampler's log-prob may round a little above 0 (a certain token): accepted up to this.
LOGP_SLACK = 1e-4


def prompts_digest(prompt_ids: list[list[int]]) -> str:
    """sha256 of the prompts' token ids (canonical JSON): binds a batch to the request it answers."""
    return hashlib.sha256(json.dumps(prompt_ids, separators=(",", ":")).encode()).hexdigest()


def _token_rows(obj: dict[str, Any], name: str, key: str, *, max_rows: int = MAX_ROWS) -> list[list[int]]:
    rows = obj.get(name)
    if not isinstance(rows, list) or not 0 < len(rows) <= max_rows:
        raise BadObject(key, f"field {name!r} must be a list of 1 to {max_rows} token-id lists")
    for row in rows:
        if not isinstance(row, list) or not all(is_int(t) and 0 <= t < MAX_TOKEN_ID for t in row):
            raise BadObject(key, f"field {name!r} must hold lists of token ids in [0, {MAX_TOKEN_ID})")
    return rows


@dataclass(frozen=True)
class RolloutRequest:
    """``rollouts/requests/<r>/<replica>/<step>.json``: replica ``replica`` needs completions for inner step
    ``step`` of round ``round``, of these prompts (token ids, one row per completion: each prompt repeated once
    per generation), sampled from the global model of round ``policy_version`` exactly (see
    :func:`composer_cloud.rollouts.batches.policy_version_for`). ``time``: the trainer's clock (display only)."""

    round: int
    replica: int
    step: int
    policy_version: int
    prompt_ids: list[list[int]]
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "replica": self.replica, "step": self.step,
                "policy_version": self.policy_version, "prompt_ids": self.prompt_ids, "time": self.time}

    @property
    def digest(self) -> str:
        return prompts_digest(self.prompt_ids)

    @classmethod
    def from_json(cls, obj: Any, *, key: str, round: int, replica: int, step: int) -> "RolloutRequest":
        """Parse and check against the key's position; :class:`BadObject` naming the field."""
        obj = as_object(obj, key)
        check_position(obj, key=key, round=round, replica=replica, step=step)
        version = int_field(obj, "policy_version", key)
        if version > round:
            raise BadObject(key, f"field 'policy_version' is {version}, after the round ({round}) that consumes it")
        return cls(round=round, replica=replica, step=step, policy_version=version,
                   prompt_ids=_token_rows(obj, "prompt_ids", key), time=float_field(obj, "time", key))


@dataclass(frozen=True)
class RolloutBatch:
    """``rollouts/batches/<r>/<replica>/<step>.json``: the completions step ``step`` of round ``round`` on replica
    ``replica`` trains on, whoever sampled them (a worker, or the trainer itself after the deadline).

    Attributes:
        policy_version: the global model (a round's) the completions were sampled from.
        prompts_sha256: :func:`prompts_digest` of the request's prompt ids (the batch answers that request only).
        completion_ids: one row of sampled token ids per prompt row (up to and including the first EOS).
        sampler_logps: the sampler's log-prob (natural log, over the processed distribution it drew from) of
            every token of ``completion_ids``, same shape; NaN (JSON null) where the sampler has none; ``None``
            only for a trainer's own fallback sampled without log-probs (``fallback``).
        fallback: the trainer that consumes the batch sampled it itself (no batch by the deadline).
        rewards: per row, the reward the sampler computed, or null (the trainer always scores itself).
        sampler: who sampled it: ``"worker:<w>"`` or ``"trainer:<rank>"``.
        seconds: wall seconds the sampling took (metrics only).
        time: the sampler's clock when it published (display only).
    """

    round: int
    replica: int
    step: int
    policy_version: int
    prompts_sha256: str
    completion_ids: list[list[int]]
    sampler_logps: list[list[float]] | None
    rewards: list[float | None]
    sampler: str
    seconds: float
    time: float
    fallback: bool = False

    @property
    def tokens(self) -> int:
        """Completion tokens in the batch."""
        return sum(len(row) for row in self.completion_ids)

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "replica": self.replica, "step": self.step,
                "policy_version": self.policy_version, "prompts_sha256": self.prompts_sha256,
                "completion_ids": self.completion_ids,
                "sampler_logps": None if self.sampler_logps is None else
                [[None if math.isnan(v) else v for v in row] for row in self.sampler_logps],
                "rewards": self.rewards, "sampler": self.sampler, "seconds": self.seconds, "time": self.time,
                "fallback": self.fallback}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, round: int, replica: int, step: int) -> "RolloutBatch":
        """Parse and check against the key's position and its own shapes; :class:`BadObject` naming the field."""
        obj = as_object(obj, key)
        check_position(obj, key=key, round=round, replica=replica, step=step)
        version = int_field(obj, "policy_version", key)
        if version > round:
            raise BadObject(key, f"field 'policy_version' is {version}, after the round ({round}) that consumes it")
        completions = _token_rows(obj, "completion_ids", key)
        fallback = obj.get("fallback", False)
        if not isinstance(fallback, bool):
            raise BadObject(key, f"field 'fallback' must be true or false, got {fallback!r:.40}")
        logps = obj.get("sampler_logps")
        if logps is None and not fallback:
            raise BadObject(key, "field 'sampler_logps' is null, but only a trainer's own fallback may lack them")
        if logps is not None and (not isinstance(logps, list) or len(logps) != len(completions)):
            raise BadObject(key, f"field 'sampler_logps' must hold one row per completion ({len(completions)})")
        for row, ids in zip(logps or [], completions):
            if (not isinstance(row, list) or len(row) != len(ids)
                    or not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                             and math.isfinite(v) and v <= LOGP_SLACK) for v in row)):
                raise BadObject(key, "field 'sampler_logps' must match 'completion_ids' row for row, with finite "
                                     "log-probs <= 0 (null: none)")
        rewards = obj.get("rewards")
        if not isinstance(rewards, list) or len(rewards) != len(completions) or not all(
                r is None or (isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r))
                for r in rewards):
            raise BadObject(key, "field 'rewards' must hold one finite number or null per completion")
        sampler = obj.get("sampler")
        if not isinstance(sampler, str) or not 0 < len(sampler) <= 64:
            raise BadObject(key, "field 'sampler' must be a short string (worker:<w> or trainer:<rank>)")
        seconds = float_field(obj, "seconds", key)
        if seconds < 0:
            raise BadObject(key, f"field 'seconds' must be >= 0, got {seconds}")
        return cls(round=round, replica=replica, step=step, policy_version=version,
                   prompts_sha256=sha256_field(obj, "prompts_sha256", key), completion_ids=completions,
                   sampler_logps=None if logps is None else
                   [[math.nan if v is None else float(v) for v in row] for row in logps],
                   rewards=[None if r is None else float(r) for r in rewards], sampler=sampler, seconds=seconds,
                   time=float_field(obj, "time", key), fallback=fallback)


__all__ = ["LOGP_SLACK", "MAX_ROWS", "MAX_TOKEN_ID", "ROLLOUT_RECORD_MAX_BYTES", "RolloutBatch", "RolloutRequest",
           "prompts_digest"]
