"""A round's sample completions (``samples/<rank>/<round>-<writer>.json``): what the policy wrote, and its reward.

TRL's ``log_completions`` for a run whose replicas run elsewhere: each replica keeps at most
``trainer.log_samples`` (prompt, completion, reward) triples of the round's last generation and writes them
once, when the round ends. The record is bounded (at most :data:`MAX_SAMPLES` samples, each string at most
:data:`MAX_TEXT_CHARS` characters: longer text is cut on write and refused on read), so that a bucket
writer cannot make a reader hold more than ~1 MiB; strings are stored as written (URL credentials
redacted by the writer) and made printable only where they are shown (``composer-cloud logs --samples``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from composer_cloud.errors import BadObject
from composer_cloud.storage.records.fields import as_object, check_position, int_field

#: The most samples one record may hold (``trainer.log_samples`` is bounded by it).
MAX_SAMPLES = 64
#: The most characters of one prompt or completion kept in the store.
MAX_TEXT_CHARS = 4000


def clip_text(text: str) -> str:
    """``text`` cut to :data:`MAX_TEXT_CHARS` characters (an ellipsis marks the cut)."""
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 1] + "…"


@dataclass(frozen=True)
class Sample:
    """One completion of the policy: its prompt, the completion, and its reward (``None``: not scored)."""

    prompt: str
    completion: str
    reward: float | None

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "completion": self.completion, "reward": self.reward}

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "Sample":
        obj = as_object(obj, key)
        texts = []
        for name in ("prompt", "completion"):
            v = obj.get(name)
            if not isinstance(v, str) or len(v) > MAX_TEXT_CHARS:
                raise BadObject(key, f"sample field {name!r} must be a string of at most {MAX_TEXT_CHARS} characters")
            texts.append(v)
        r = obj.get("reward")
        if r is not None and (not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r)):
            raise BadObject(key, f"sample field 'reward' must be a finite number or null, got {r!r:.40}")
        return cls(prompt=texts[0], completion=texts[1], reward=None if r is None else float(r))


@dataclass(frozen=True)
class RoundSamples:
    """``samples/<rank>/<round>-<writer>.json``: one replica's sample completions of one round (``round``: the
    store's 0-based index; decoupled runs: the contribution count)."""

    rank: int
    round: int
    step: int
    samples: tuple[Sample, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "round": self.round, "step": self.step,
                "samples": [s.to_json() for s in self.samples]}

    @classmethod
    def from_json(cls, obj: Any, *, key: str, rank: int, round: int) -> "RoundSamples":
        """Parse and check against the key's own ``rank`` and ``round``; :class:`BadObject` naming the field."""
        obj = as_object(obj, key)
        check_position(obj, key=key, rank=rank, round=round)
        items = obj.get("samples")
        if not isinstance(items, list) or len(items) > MAX_SAMPLES:
            raise BadObject(key, f"field 'samples' must be a list of at most {MAX_SAMPLES} samples")
        return cls(rank=rank, round=round, step=int_field(obj, "step", key),
                   samples=tuple(Sample.from_json(s, key=key) for s in items))


__all__ = ["MAX_SAMPLES", "MAX_TEXT_CHARS", "RoundSamples", "Sample", "clip_text"]
