"""Trace-replay preference pairs for channel 3.

A *trace* is a recorded run of the student (or of any agent) as a list of
steps; at each step the context is what the agent saw and the action is what
it did. :func:`make_pairs` asks N external *teachers* (any callables: other
models, API-backed LLMs, scripted experts) for their action at each step;
where at least ``threshold`` of them agree on an action that differs from the
student's, it emits a pair ``(chosen = the agreed action, rejected = the
student's action)``. The pairs are stored as JSON Lines and replayed by
:class:`ReplayBuffer` during training.

Pairs JSONL format (one JSON object per line, UTF-8; blank lines ignored)::

    {"prompt": str,                 # the context, exactly as the model sees it
     "chosen": str,                 # text appended to the prompt (the preferred action)
     "rejected": str,               # text appended to the prompt (the student's action)
     "ref_chosen_logp": float,      # optional: sum of log-probs (nats) of the chosen response tokens
     "ref_rejected_logp": float,    #   and of the rejected ones, under the reference model (both or neither)
     "meta": {...}}                 # optional, free-form (agreement, n_teachers, trace_id, step, ...)

``chosen``/``rejected`` are tokenized on their own and appended to the
tokenized prompt, followed by the tokenizer's EOS token; stored reference
log-probs must be computed the same way with the same model and tokenizer
(sum over the response tokens including EOS, temperature 1). When any pair
lacks them, the trainer computes all of them once, with the model it starts
from, and checkpoints them. Any other top-level key is an error (put extras in
``meta``). Files are read with ``fsspec.open``, so any fsspec URI works
(``file://``, ``s3://``, ``hf://``, ...); a bare path is a local file.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import fsspec
import torch

logger = logging.getLogger(__name__)

Teacher = Callable[[str], str]
"""A teacher maps a context (the prompt text) to an action (the text it would append)."""

_KEYS = {"prompt", "chosen", "rejected", "ref_chosen_logp", "ref_rejected_logp", "meta"}


@dataclass(frozen=True)
class Pair:
    """One preference pair; see the module docstring for the meaning of each field."""

    prompt: str
    chosen: str
    rejected: str
    ref_chosen_logp: float | None = None
    ref_rejected_logp: float | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt": self.prompt, "chosen": self.chosen, "rejected": self.rejected}
        if self.ref_chosen_logp is not None and self.ref_rejected_logp is not None:
            out["ref_chosen_logp"] = self.ref_chosen_logp
            out["ref_rejected_logp"] = self.ref_rejected_logp
        if self.meta:
            out["meta"] = dict(self.meta)
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = "") -> "Pair":
        """Validate one decoded JSON object; errors name ``where`` (e.g. ``file:line``)."""
        at = f"{where}: " if where else ""
        if not isinstance(obj, dict):
            raise ValueError(f"{at}expected a JSON object, got {type(obj).__name__}")
        unknown = set(obj) - _KEYS
        if unknown:
            raise ValueError(f"{at}unknown keys {sorted(unknown)}; allowed: {sorted(_KEYS)} (put extras in 'meta')")
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(obj.get(key), str):
                raise ValueError(f"{at}{key!r} must be a string")
        if obj["chosen"] == obj["rejected"]:
            raise ValueError(f"{at}'chosen' and 'rejected' are identical")
        ref = [obj.get("ref_chosen_logp"), obj.get("ref_rejected_logp")]
        if (ref[0] is None) != (ref[1] is None):
            raise ValueError(f"{at}give both 'ref_chosen_logp' and 'ref_rejected_logp' or neither")
        for value in ref:
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is not None and (not number or not math.isfinite(value) or value > 0):
                raise ValueError(f"{at}reference log-probs must be finite numbers <= 0, got {value!r}")
        meta = obj.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError(f"{at}'meta' must be an object")
        return cls(
            obj["prompt"],
            obj["chosen"],
            obj["rejected"],
            None if ref[0] is None else float(ref[0]),
            None if ref[1] is None else float(ref[1]),
            meta,
        )


def read_jsonl(uri: str, **storage_options: Any) -> Iterator[tuple[str, Any]]:
    """``(where, object)`` for each non-blank line of a JSON Lines file at any fsspec URI; ``where`` is
    ``uri:line``, for errors. Invalid JSON is a ``ValueError`` naming the line."""
    with fsspec.open(uri, "rt", encoding="utf-8", **storage_options) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{uri}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{uri}:{lineno}: invalid JSON ({e.msg})") from None


def load_pairs(uri: str, **storage_options: Any) -> list[Pair]:
    """Read a pairs JSONL file from any fsspec URI. Errors name the line."""
    pairs = [Pair.from_json(obj, where) for where, obj in read_jsonl(uri, **storage_options)]
    logger.info("loaded %d pairs from %s", len(pairs), uri)
    return pairs


def write_pairs(uri: str, pairs: Iterable[Pair], **storage_options: Any) -> int:
    """Write pairs as JSONL (sorted keys, one per line); returns the count."""
    lines = [json.dumps(p.to_json(), sort_keys=True, ensure_ascii=False) for p in pairs]
    with fsspec.open(uri, "wt", encoding="utf-8", **storage_options) as f:
        f.write("".join(line + "\n" for line in lines))
    return len(lines)


def default_pairs_uri() -> str:
    """The demo task's pairs file shipped in the package."""
    from importlib.resources import files

    return str(files("composer_cloud") / "data" / "pairs.jsonl")


# --------------------------------------------------------------------------- make_pairs
@dataclass(frozen=True)
class TraceStep:
    """One step of a recorded trace: the context and what the student did there."""

    prompt: str
    student_action: str
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Vote:
    """The teachers' verdict on one trace step: the pair it yields (or ``None``) and why.

    ``agreement`` is ``count(a*) / n_teachers`` for the most frequent answer
    ``a*`` (0 when nobody answered); ``outcome`` is ``"pair"``,
    ``"no_answer"``, ``"tie"``, ``"below_threshold"`` or ``"student_agrees"``.
    """

    pair: Pair | None
    agreement: float
    outcome: str


def vote(
    step: TraceStep,
    answers: Mapping[str, str | None],
    *,
    threshold: float,
    normalize: Callable[[str], str] = str.strip,
) -> Vote:
    """Decide one step from its teachers' ``answers`` (``None``: the teacher abstained or failed).

    Every teacher counts in the denominator, so a failure can only lower
    agreement. Answers are compared after ``normalize``. A pair
    ``(chosen=a*, rejected=student_action)`` comes out iff ``a*`` is unique
    (no tie for first), ``agreement >= threshold`` and the student did
    something else. ``chosen`` is the first answer (in teacher order) that
    normalizes to ``a*``, so the pair keeps real text; its ``meta`` records
    ``agreement``, ``n_teachers``, the agreeing teachers and the step's ``meta``.
    """
    votes = Counter(normalize(a) for a in answers.values() if a is not None)
    if not votes:
        return Vote(None, 0.0, "no_answer")
    ranked = votes.most_common()
    best, count = ranked[0]
    agreement = count / len(answers)
    if len(ranked) > 1 and ranked[1][1] == count:
        return Vote(None, agreement, "tie")
    if agreement < threshold:
        return Vote(None, agreement, "below_threshold")
    if best == normalize(step.student_action):
        return Vote(None, agreement, "student_agrees")
    agreeing = [n for n, a in answers.items() if a is not None and normalize(a) == best]
    chosen = answers[agreeing[0]]
    assert chosen is not None
    meta = {"agreement": agreement, "n_teachers": len(answers), "teachers": agreeing, **dict(step.meta)}
    return Vote(Pair(step.prompt, chosen, step.student_action, meta=meta), agreement, "pair")


def make_pairs(
    steps: Iterable[TraceStep],
    teachers: Sequence[Teacher] | Mapping[str, Teacher],
    *,
    threshold: float = 2 / 3,
    normalize: Callable[[str], str] = str.strip,
    max_workers: int = 1,
) -> list[Pair]:
    """Build pairs where the teachers agree and the student disagrees (see :func:`vote`).

    For each step, every teacher is called once with ``step.prompt``. A
    teacher that raises abstains. ``max_workers > 1`` calls teachers
    concurrently (useful for API-backed teachers); results do not depend on
    it. For teachers behind OpenAI-compatible endpoints, with a cost ceiling
    and a report, use ``composer-cloud pairs``
    (:mod:`composer_cloud.trainer.three_channel.teachers`).
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    named = dict(teachers) if isinstance(teachers, Mapping) else {f"teacher{i}": t for i, t in enumerate(teachers)}
    if not named:
        raise ValueError("make_pairs needs at least one teacher")
    names = list(named)
    steps = list(steps)

    def ask(job: tuple[int, str]) -> str | None:
        i, name = job
        try:
            out = named[name](steps[i].prompt)
        except Exception as e:  # one bad teacher call must not lose the whole trace
            logger.warning("teacher %s failed on step %d: %s: %s", name, i, type(e).__name__, e)
            return None
        return out if isinstance(out, str) else None

    jobs = [(i, name) for i in range(len(steps)) for name in names]
    if max_workers > 1:
        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            answers = list(pool.map(ask, jobs))
    else:
        answers = [ask(j) for j in jobs]

    pairs: list[Pair] = []
    for i, step in enumerate(steps):
        row = dict(zip(names, answers[i * len(names) : (i + 1) * len(names)]))
        decided = vote(step, row, threshold=threshold, normalize=normalize)
        if decided.pair is not None:
            pairs.append(decided.pair)
    return pairs


# --------------------------------------------------------------------------- normalisation
@dataclass(frozen=True)
class PairFilters:
    """Which pairs are clean enough to train on; each side (chosen and rejected) must pass every bound.

    Lengths are characters of the stripped text, words are whitespace-separated
    tokens, and the special-character ratio is the fraction of non-space
    characters that are neither letters nor digits (code is mostly letters; a
    garbled answer is mostly symbols). ``None`` turns a bound off.
    """

    min_chars: int | None = 1
    max_chars: int | None = 4000
    min_words: int | None = 1
    max_words: int | None = 1000
    max_special_ratio: float | None = 0.5

    def reject_reason(self, text: str) -> str | None:
        """``None`` if ``text`` passes, else the name of the first bound it breaks."""
        stripped = text.strip()
        words = len(stripped.split())
        if self.min_chars is not None and len(stripped) < self.min_chars:
            return "too_short"
        if self.max_chars is not None and len(stripped) > self.max_chars:
            return "too_long"
        if self.min_words is not None and words < self.min_words:
            return "too_few_words"
        if self.max_words is not None and words > self.max_words:
            return "too_many_words"
        visible = [c for c in stripped if not c.isspace()]
        if self.max_special_ratio is not None and visible:
            special = sum(not c.isalnum() for c in visible) / len(visible)
            if special > self.max_special_ratio:
                return "special_chars"
        return None


def normalize_pairs(pairs: Iterable[Pair], filters: PairFilters = PairFilters()) -> tuple[list[Pair], Counter[str]]:
    """Drop pairs that break ``filters`` and exact duplicates (same prompt, and chosen and rejected after
    whitespace normalisation); keep the first of each. Returns the kept pairs and a count of drops by reason."""
    kept: list[Pair] = []
    dropped: Counter[str] = Counter()
    seen: set[tuple[str, str, str]] = set()
    for p in pairs:
        reason = filters.reject_reason(p.chosen) or filters.reject_reason(p.rejected)
        key = (p.prompt, " ".join(p.chosen.split()), " ".join(p.rejected.split()))
        if reason is None and key in seen:
            reason = "duplicate"
        if reason is not None:
            dropped[reason] += 1
            continue
        seen.add(key)
        kept.append(p)
    return kept, dropped


# --------------------------------------------------------------------------- replay buffer
@dataclass
class ReplayBatch:
    """``n`` pairs laid out as ``2n`` rows: chosen rows ``[0, n)``, rejected rows ``[n, 2n)``.

    ``input_ids``/``attention_mask``: ``(2n, P + R)`` with the prompt
    left-padded to ``P`` and the response right-padded to ``R`` (the layout
    of GRPO's prompt + completion). ``response_mask``: ``(2n, R)``.
    ``ref_logp``: ``(2n,)`` stored reference sequence log-probs, or ``None``
    before they are filled. ``lengths``: ``(2n,)`` response tokens.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    ref_logp: torch.Tensor | None
    lengths: torch.Tensor
    indices: list[int]

    @property
    def n_pairs(self) -> int:
        return len(self.indices)

    @property
    def logits_to_keep(self) -> int:
        return self.response_mask.size(1)


ScoreFn = Callable[[ReplayBatch], torch.Tensor]
"""Maps a batch to ``(2n,)`` sequence log-probs (sum over response tokens, nats)."""


class ReplayBuffer:
    """Tokenized pairs, their reference log-probs, and a seeded minibatch sampler.

    Sampling walks a fresh seeded permutation of all pairs per epoch (without
    replacement within an epoch), so the sampler's whole state is
    ``(epoch, position)``: checkpoint it with :meth:`state_dict`.
    """

    def __init__(
        self,
        pairs: Sequence[Pair],
        tokenizer: Any,
        *,
        seed: int = 0,
        max_prompt_length: int = 256,
        max_response_length: int = 64,
    ) -> None:
        if not pairs:
            raise ValueError("ReplayBuffer needs at least one pair")
        self.pairs = list(pairs)
        self.seed = int(seed)
        self.pad_id = tokenizer.pad_token_id
        eos = tokenizer.eos_token_id
        if self.pad_id is None or eos is None:
            raise ValueError("the tokenizer needs a pad and an eos token")

        def enc(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        self._prompt: list[list[int]] = []
        self._chosen: list[list[int]] = []
        self._rejected: list[list[int]] = []
        truncated = 0
        for p in self.pairs:
            prompt, chosen, rejected = enc(p.prompt), enc(p.chosen) + [eos], enc(p.rejected) + [eos]
            truncated += len(prompt) > max_prompt_length or max(len(chosen), len(rejected)) > max_response_length
            self._prompt.append(prompt[-max_prompt_length:])  # keep the end: it is adjacent to the response
            self._chosen.append(chosen[:max_response_length])
            self._rejected.append(rejected[:max_response_length])
        stored = [(p.ref_chosen_logp, p.ref_rejected_logp) for p in self.pairs]
        if truncated:
            had_reference = stored[0][0] is not None
            logger.warning(
                "%d of %d pairs were truncated to %d prompt / %d response tokens%s",
                truncated,
                len(self.pairs),
                max_prompt_length,
                max_response_length,
                "; their stored reference log-probs no longer apply and will be recomputed" if had_reference else "",
            )
            stored = [(None, None)] * len(self.pairs)
        if all(c is not None for c, _ in stored):
            self.ref_chosen = torch.tensor([c for c, _ in stored], dtype=torch.float32)
            self.ref_rejected = torch.tensor([r for _, r in stored], dtype=torch.float32)
        else:
            self.ref_chosen = self.ref_rejected = None
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def has_reference(self) -> bool:
        return self.ref_chosen is not None

    # ----------------------------------------------------------------- batches
    def batch(self, indices: Sequence[int], device: torch.device | str = "cpu") -> ReplayBatch:
        """Collate pairs ``indices`` (see :class:`ReplayBatch` for the layout)."""
        idx = list(indices)
        prompts = [self._prompt[i] for i in idx] * 2
        responses = [self._chosen[i] for i in idx] + [self._rejected[i] for i in idx]
        P = max(len(p) for p in prompts)
        R = max(len(r) for r in responses)
        n = len(prompts)
        ids = torch.full((n, P + R), self.pad_id, dtype=torch.long)
        att = torch.zeros((n, P + R), dtype=torch.long)
        rmask = torch.zeros((n, R), dtype=torch.long)
        for row, (p, r) in enumerate(zip(prompts, responses)):
            ids[row, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
            att[row, P - len(p) : P] = 1
            ids[row, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
            att[row, P : P + len(r)] = 1
            rmask[row, : len(r)] = 1
        ref = None
        if self.ref_chosen is not None and self.ref_rejected is not None:
            ref = torch.cat([self.ref_chosen[idx], self.ref_rejected[idx]]).to(device)
        return ReplayBatch(ids.to(device), att.to(device), rmask.to(device), ref, rmask.sum(1).to(device), idx)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.pairs)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def sample(self, n: int, device: torch.device | str = "cpu") -> ReplayBatch:
        """The next ``n`` pairs of the seeded walk; advances the sampler state."""
        if n <= 0:
            raise ValueError("n must be > 0")
        idx: list[int] = []
        while len(idx) < n:
            order = self._permutation(self.epoch)
            take = min(n - len(idx), len(order) - self.position)
            idx.extend(order[self.position : self.position + take])
            self.position += take
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return self.batch(idx, device)

    @torch.no_grad()
    def fill_reference(self, score: ScoreFn, *, batch_size: int = 16, device: torch.device | str = "cpu") -> None:
        """Compute and store every pair's reference log-probs with ``score`` (e.g. the initial policy)."""
        chosen, rejected = [], []
        for start in range(0, len(self.pairs), batch_size):
            b = self.batch(range(start, min(start + batch_size, len(self.pairs))), device)
            logp = score(b).detach().float().cpu()
            chosen.append(logp[: b.n_pairs])
            rejected.append(logp[b.n_pairs :])
        self.ref_chosen = torch.cat(chosen)
        self.ref_rejected = torch.cat(rejected)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {}
        if self.ref_chosen is not None and self.ref_rejected is not None:
            tensors = {"ref_chosen": self.ref_chosen.clone(), "ref_rejected": self.ref_rejected.clone()}
        return tensors, {"epoch": self.epoch, "position": self.position, "n_pairs": len(self.pairs)}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        if int(meta["n_pairs"]) != len(self.pairs):
            raise ValueError(
                f"replay state is for {meta['n_pairs']} pairs but the buffer has {len(self.pairs)}: "
                "the pairs file changed since the checkpoint"
            )
        self.epoch, self.position = int(meta["epoch"]), int(meta["position"])
        if "ref_chosen" in tensors:
            self.ref_chosen = tensors["ref_chosen"].detach().float().cpu().clone()
            self.ref_rejected = tensors["ref_rejected"].detach().float().cpu().clone()


__all__ = [
    "Pair",
    "PairFilters",
    "ReplayBatch",
    "ReplayBuffer",
    "Teacher",
    "TraceStep",
    "default_pairs_uri",
    "load_pairs",
    "make_pairs",
    "normalize_pairs",
    "read_jsonl",
    "vote",
    "Vote",
    "write_pairs",
]
