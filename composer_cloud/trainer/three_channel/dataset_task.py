"""Datasets without code: ``[trainer] dataset = "org/name"`` or a local path, a column mapping, a built-in reward.

A run that names a dataset trains on its rows with :class:`DatasetTask`, a
:class:`~composer_cloud.trainer.three_channel.tasks.VerifiableTask` whose reward is chosen by
name (:data:`REWARDS`), so no user code is needed::

    [trainer]
    dataset = "data/qa.jsonl"        # a hub id, a local file (.jsonl/.json/.csv/.parquet) or a save_to_disk folder
    dataset_split = "train"
    eval_split = "test"              # or leave unset: a deterministic eval_fraction of the rows is held out
    reward = "exact_match"           # | "contains" | "python_tests" | "module:function"
    [trainer.columns]                # canonical name -> the dataset's column
    prompt = "question"
    answer = "solution"

Canonical columns (:data:`CANONICAL`): ``prompt`` (required), ``answer`` (the
reference answer: ``exact_match`` / ``contains``; also the held-out
``eval_loss`` reference), ``tests`` (a list of Python ``assert`` statements,
or one string of them: ``python_tests``) and ``hint`` (channel 2's hint;
``hint_source = "default"`` uses it when mapped or present). Other columns
stay in the rows under their own names.

Loading happens in the replica with :func:`datasets.load_dataset` (local files
by extension through the ``json`` / ``csv`` / ``parquet`` builders; a folder
written by ``Dataset.save_to_disk`` through :func:`datasets.load_from_disk`).
:func:`dataset_columns` reads only a dataset's column names (streaming, first
row), which is what the launcher's preflight checks before anything is
written. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from composer_cloud.registry import resolve
from composer_cloud.trainer.data import (  # re-exported: the loading is shared with the causal-LM trainer
    BUILDERS,
    DatasetError,
    dataset_columns,
    is_local_dataset,
    load_rows,
)

logger = logging.getLogger(__name__)

#: Canonical row keys a column mapping may target.
CANONICAL: tuple[str, ...] = ("prompt", "answer", "tests", "hint")
#: Built-in rewards and the canonical column each one needs.
REWARD_NEEDS: dict[str, str] = {"exact_match": "answer", "contains": "answer", "python_tests": "tests"}
def missing_columns(columns: Mapping[str, str], available: Sequence[str], *, needed: Sequence[str]) -> list[str]:
    """Problems with a column mapping against ``available`` columns (empty: fine)."""
    problems = []
    for canonical in dict.fromkeys(["prompt", *needed, *columns]):
        source = columns.get(canonical, canonical)
        if source not in available and (canonical in ("prompt", *needed) or canonical in columns):
            how = f"trainer.columns.{canonical} = {source!r}" if canonical in columns else f"column {source!r}"
            problems.append(f"{how} is not in the dataset (its columns: {', '.join(available)})"
                            + ("" if canonical in columns else f"; map one with trainer.columns.{canonical} = "
                               "\"<column>\""))
    return problems


# --------------------------------------------------------------------------- rewards
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_MARKER = re.compile(r"(?:####|answer\s*[:=]|answer is)\s*(.+)", re.IGNORECASE)


def normalize_answer(text: str) -> str:
    """Lower-case, whitespace collapsed, surrounding punctuation and ``$`` stripped, ``1,000`` -> ``1000``."""
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", str(text))
    return " ".join(text.lower().split()).strip(" .,;:!$`'\"")


def extract_answer(completion: str) -> str:
    """The answer a completion gives: the last ``\\boxed{...}``, else what follows the last ``####`` /
    ``Answer:`` / ``answer is``, else its first non-empty line."""
    boxed = _BOXED.findall(completion)
    if boxed:
        return boxed[-1]
    markers = _MARKER.findall(completion)
    if markers:
        return markers[-1].strip().splitlines()[0]
    return next((line for line in completion.splitlines() if line.strip()), "")


def exact_match(completions: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """1.0 when the extracted answer equals the row's ``answer`` after :func:`normalize_answer`."""
    return [None if row.get("answer") is None else
            float(normalize_answer(extract_answer(c)) == normalize_answer(row["answer"]))
            for c, row in zip(completions, rows, strict=True)]


def contains(completions: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """1.0 when the normalized ``answer`` occurs in the normalized completion."""
    return [None if row.get("answer") is None else
            float(normalize_answer(row["answer"]) in normalize_answer(c))
            for c, row in zip(completions, rows, strict=True)]


def python_tests(completions: Sequence[str], rows: Sequence[Mapping[str, Any]], *, sandbox: Any = None
                 ) -> list[float | None]:
    """The fraction of the row's ``tests`` (assert statements) that prompt + completion pass, in ``sandbox``.

    ``sandbox`` is a :class:`~composer_cloud.trainer.three_channel.sandbox.Sandbox` (default limits when
    ``None``); :class:`DatasetTask` passes its own, built from the ``sandbox_*`` settings.
    """
    from composer_cloud.trainer.three_channel.sandbox import Sandbox, SandboxLimits
    from composer_cloud.trainer.three_channel.tasks import extract_program

    sandbox = sandbox or Sandbox(SandboxLimits())
    programs = [extract_program(str(row["prompt"]), c) for c, row in zip(completions, rows, strict=True)]
    return [r.score for r in sandbox.run_many(programs, [_as_tests(row.get("tests")) for row in rows])]


RewardFn = Callable[[Sequence[str], Sequence[Mapping[str, Any]]], list[float | None]]
#: Built-in rewards: name -> ``"module:function"`` (user rewards are ``"module:function"`` references).
REWARDS: dict[str, str] = {name: f"{__name__}:{name}" for name in ("exact_match", "contains", "python_tests")}


def _as_tests(value: Any) -> list[str]:
    if isinstance(value, str):
        return [line for line in value.splitlines() if line.strip()]
    return [str(t) for t in value or []]


# --------------------------------------------------------------------------- the task
@dataclass
class DatasetTask:
    """A :class:`~composer_cloud.trainer.three_channel.tasks.VerifiableTask` over a dataset's rows.

    Rows carry the canonical keys of the column mapping (``prompt``, and
    ``answer`` / ``tests`` / ``hint`` when mapped or present) plus every other
    column; ``reference`` is set from ``answer`` so the trainer's held-out
    ``eval_loss`` measures the reference answers. The held-out rows are
    ``eval_split`` when given, else a seeded ``eval_fraction`` of the rows.
    """

    dataset: str
    split: str = "train"
    config: str | None = None
    data_files: Any = None
    eval_split: str | None = None
    eval_fraction: float = 0.1
    columns: Mapping[str, str] = field(default_factory=dict)
    reward_name: str = "exact_match"
    seed: int = 0
    sandbox_limits: Any = None
    max_workers: int = 2
    name: str = "dataset"

    def __post_init__(self) -> None:
        self._splits: dict[str, list[dict[str, Any]]] = {}
        self._sandbox: Any = None
        self._reward: RewardFn = resolve(self.reward_name, REWARDS, setting="trainer.reward")

    def _rename(self, row: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(row)
        for canonical, source in self.columns.items():
            if source not in row:
                raise DatasetError(f"trainer.columns.{canonical} = {source!r} is not in the dataset "
                                   f"(its columns: {', '.join(row)})")
            out[canonical] = row[source]
        if "prompt" not in out:
            raise DatasetError(f"the dataset has no 'prompt' column (its columns: {', '.join(row)}); map one "
                               "with trainer.columns.prompt = \"<column>\"")
        if isinstance(out.get("answer"), (str, int, float)) and "reference" not in row:
            out["reference"] = str(out["answer"])
        return out

    def _load(self) -> None:
        rows = [self._rename(r) for r in load_rows(self.dataset, self.split, config=self.config,
                                                     data_files=self.data_files)]
        if self.eval_split:
            held = [self._rename(r) for r in load_rows(self.dataset, self.eval_split, config=self.config,
                                                         data_files=self.data_files)]
            train = rows
        else:
            order = list(range(len(rows)))
            random.Random(f"dataset-eval:{self.seed}").shuffle(order)
            n_eval = min(len(rows) - 1, max(1, round(len(rows) * self.eval_fraction))) if len(rows) > 1 else 0
            if self.eval_fraction == 0:
                n_eval = 0
            held_idx = set(order[:n_eval])
            held = [rows[i] for i in range(len(rows)) if i in held_idx]
            train = [rows[i] for i in range(len(rows)) if i not in held_idx]
        if not train:
            raise DatasetError(f"trainer.dataset {self.dataset!r}: no training rows in split {self.split!r}")
        self._splits = {"train": train, "eval": held}
        logger.info("dataset %s: %d training rows, %d held out", self.dataset, len(train), len(held))

    def examples(self, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if not self._splits:
            self._load()
        return [dict(r) for r in self._splits[split]]

    def reward(self, completions: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[float | None]:
        if self._reward is python_tests:
            if self._sandbox is None:
                from composer_cloud.trainer.three_channel.sandbox import Sandbox, SandboxLimits

                self._sandbox = Sandbox(self.sandbox_limits or SandboxLimits(), max_workers=self.max_workers)
            return python_tests(completions, rows, sandbox=self._sandbox)
        return list(self._reward(completions, rows))

    def default_hints(self) -> Any:
        """Channel 2's hints: the ``hint`` column when mapped or present, else the reference answer.

        The answer as privileged information is the OPSD/SDFT recipe: the hinted
        model (the teacher) sees the answer, the student does not, and learns to
        put the teacher's probability on its own completions. Without it a freshly
        initialised model on a question/answer dataset gets no gradient at all (no
        reward variance for GRPO, no pairs for channel 3).
        """
        from composer_cloud.trainer.three_channel.tasks import ColumnHints

        rows = self.examples("train")
        if "hint" in self.columns or (rows and "hint" in rows[0]):
            return ColumnHints("hint")
        if rows and "answer" in rows[0]:
            return AnswerHints()
        return None


@dataclass(frozen=True)
class AnswerHints:
    """Channel 2's hint from the row's reference ``answer``: ``"Answer: <answer>"`` (None without one)."""

    prefix: str = "Answer: "

    def hints(self, rows: Sequence[Mapping[str, Any]]) -> list[str | None]:
        return [None if row.get("answer") in (None, "") else f"{self.prefix}{row['answer']}" for row in rows]


def default_hint_column(columns: Mapping[str, str], available: Sequence[str]) -> str | None:
    """What a dataset run's ``hint_source = "default"`` uses, named as the user's column: the hint column,
    else the answer column (:class:`AnswerHints`), else None (channel 2 has nothing to distil)."""
    for canonical in ("hint", "answer"):
        source = columns.get(canonical, canonical)
        if source in available:
            return source
    return None


__all__ = ["AnswerHints", "BUILDERS", "CANONICAL", "DatasetError", "DatasetTask", "REWARDS", "REWARD_NEEDS", "contains", "dataset_columns", "default_hint_column",
           "exact_match", "extract_answer", "is_local_dataset", "load_rows", "missing_columns", "normalize_answer",
           "python_tests"]
