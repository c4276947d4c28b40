"""Reading a run's sample completions: per round and replica, the (prompt, completion, reward) the policy wrote.

The replicas write them (:meth:`composer_cloud.replica.telemetry.Telemetry.samples`, ``trainer.log_samples``
per round, TRL's ``log_completions`` made bounded) as one framed (signed) object per round and process
(:func:`composer_cloud.storage.layout.samples_key`). Which objects count follows the metrics' rule
(:mod:`composer_cloud.runs.metrics`): per ``(rank, round)`` the newest on the run's current timeline, so a
resumed or restarted replica's samples replace those of the round it re-ran. Bad objects are skipped with a
warning (the bucket is not trusted). Texts are as the replica stored them: :func:`printable` makes one safe
for a terminal (no escape sequence reaches it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from composer_cloud.errors import BadObject, ObjectNotFound
from composer_cloud.runs.logs import printable
from composer_cloud.runs.metrics import MetricsObject, resume_points, superseded_objects
from composer_cloud.storage import layout
from composer_cloud.storage.records import RoundSamples
from composer_cloud.storage.store import Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleRow:
    """One sample for display: ``round`` counted from 1 (as people count), the run's inner ``step``."""

    rank: int
    round: int
    step: int
    prompt: str
    completion: str
    reward: float | None

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "round": self.round, "step": self.step, "prompt": self.prompt,
                "completion": self.completion, "reward": self.reward}


def read_samples(store: Store, *, rank: int | None = None, last_rounds: int | None = None) -> list[SampleRow]:
    """The run's samples, sorted by (round, rank); ``last_rounds``: only the newest that many rounds."""
    objs = []
    for key in store.list(layout.samples_prefix(rank)):
        parsed = layout.parse_samples_key(key)
        if parsed is not None:
            objs.append(MetricsObject(key, *parsed))
    stale = superseded_objects(objs, resume_points(store)) if objs else set()
    current = sorted((o for o in objs if o.key not in stale), key=lambda o: (o.round, o.rank))
    if last_rounds is not None:
        keep = sorted({o.round for o in current})[-last_rounds:] if last_rounds > 0 else []
        current = [o for o in current if o.round in keep]
    out: list[SampleRow] = []
    for o in current:
        try:
            record = RoundSamples.from_json(store.get_json(o.key), key=o.key, rank=o.rank, round=o.round)
        except (BadObject, ObjectNotFound) as exc:
            logger.warning("ignoring %s: %s", o.key, exc)
            continue
        out += [SampleRow(rank=o.rank, round=o.round + 1, step=record.step, prompt=s.prompt,
                          completion=s.completion, reward=s.reward) for s in record.samples]
    return out


def one_line(text: str, width: int = 120) -> str:
    """``text`` printable (no escape or control sequence), on one line (newlines as ``⏎``), cut to ``width``."""
    flat = printable(text.replace("\r\n", "\n").replace("\n", " ⏎ ").replace("\t", " "))
    return flat if len(flat) <= width else flat[: width - 1] + "…"


__all__ = ["SampleRow", "one_line", "read_samples"]
