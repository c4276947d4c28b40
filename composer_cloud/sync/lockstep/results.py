"""What a lock-step round reports: its result, and the errors that end it early.

Split from :mod:`~composer_cloud.sync.lockstep.allreduce` (which re-exports them) so that the exchanges
built on it (the sparse gather, the sharded exchange of multi-GPU replicas) share one definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from composer_cloud.errors import SyncError
from composer_cloud.round_numbers import shown_round
from composer_cloud.storage.records import Outcome


class RoundTimeout(SyncError):
    """A round could not proceed before its deadline; names the missing ranks."""

    def __init__(self, round: int, missing_ranks: Sequence[int], what: str) -> None:
        self.round = round
        self.missing_ranks = sorted(missing_ranks)
        self.aborted = False
        super().__init__(f"round {shown_round(round)}: {what}; missing replicas: {self.missing_ranks}")


def exclusion_note(aborts: Sequence[Outcome], *, min_replicas: int, outlier_factor: float | None) -> str:
    """Why a retry lacks replicas: the earlier attempts' checks that excluded them, and what to change.

    ``aborts``: this round's earlier outcomes (any order); those that excluded nobody are skipped. Empty when
    nobody was excluded (the replicas are simply missing).
    """
    lines = [f"attempt {o.attempt}'s {o.check or 'integrity'} check excluded replicas {o.excluded} ({o.reason})"
             for o in sorted(aborts, key=lambda o: o.attempt) if o.excluded]
    if not lines:
        return ""
    advice = f"lower min_replicas (now {min_replicas})"
    if any(o.check == "outlier" for o in aborts if o.excluded):
        advice = (f"if honest updates can differ that much (replicas whose data gave no gradient), raise "
                  f"sync.outlier_factor (now {outlier_factor}; null: no check), or " + advice)
    return (f": {'; '.join(lines)}. An excluded replica sits out this round's retries, so min_replicas="
            f"{min_replicas} cannot be met without it; {advice}")


class LocalRankLost(SyncError):
    """A local rank of this (multi-GPU) replica died mid-attempt: the replica stops as one, deciding nothing.

    Raised by the sharded exchange when the replica's vote cannot complete (the peer's gloo/NCCL connection
    closed). The surviving ranks create no abort record: the replica is restarted (``max_restarts``), recomputes
    the same pseudo-gradient from its last durable round and rejoins the undecided attempt with it, exactly as
    a whole replica killed mid-upload does, so the round ends bitwise where it would have without the kill
    (DESIGN.md 12, "retry with the payload you sent"; 14, one decision per replica). If it never comes back,
    its peers abort the attempt for the missing replica at ``round_timeout_s``, as for any lost replica.
    """

    def __init__(self, round: int, attempt: int, shard: int, cause: BaseException) -> None:
        self.round, self.attempt, self.shard = round, attempt, shard
        super().__init__(f"round {shown_round(round)} attempt {attempt}: local rank {shard} lost a peer rank of "
                         f"its replica during the vote ({cause!r}); the replica stops without deciding the attempt, "
                         "and its restart rejoins it")


class BehindError(SyncError):
    """The round this replica tried to join is already committed: it must heal first."""

    def __init__(self, round: int) -> None:
        self.round = round
        super().__init__(f"round {shown_round(round)} is already committed; heal from the committed state")


@dataclass
class RoundResult:
    """What happened in a round, from one replica's view (its last attempt, and how many it ran)."""

    round: int
    attempt: int
    participants: list[int]
    participated: bool
    committed: bool
    reason: str = ""
    wall_s: float = 0.0
    quorum_wait_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    payload_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    attempts: int = 1
    excluded: list[int] = field(default_factory=list)
    #: The round committed, but this participant could not verify the committed result: it must heal
    #: from the round's committed global state (never retry the round, never apply unverified bytes).
    heal: bool = False


__all__ = ["BehindError", "LocalRankLost", "RoundResult", "RoundTimeout"]
