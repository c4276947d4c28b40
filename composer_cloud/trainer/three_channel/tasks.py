"""Verifiable tasks and hint sources for the three-channel trainer.

A *task* supplies prompts (as dataset rows with a ``"prompt"`` key plus the
columns its reward needs) and a reward in ``[0, 1]`` per completion. A *hint
source* supplies, per row, privileged text (a reference solution, feedback,
a worked example) that turns the policy into its own teacher for channel 2.

The built-in demo task, ``"python-functions"``, is agentic-coding flavoured:
the prompt is the head of a short Python function (signature, docstring,
sometimes a first line), the completion is the rest of the body, and the
reward is the fraction of the function's unit tests that pass when run in the
:mod:`~composer_cloud.trainer.three_channel.sandbox`. Several tests per problem, some of
which a partially right body passes (e.g. one branch of an ``if``), give a
group of completions reward variance. Its problems use the same templates as
the built-in corpus (:mod:`composer_cloud.corpus`), so a model that has seen
that corpus can solve some of them; a freshly initialised tiny model scores
~0 (see ``docs/trainer.md``).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Protocol, Sequence, runtime_checkable

from composer_cloud.registry import load_object, reference_for, resolve
from composer_cloud.trainer.three_channel.sandbox import Sandbox, SandboxLimits

if TYPE_CHECKING:
    from composer_cloud.trainer.three_channel.replay import Pair

logger = logging.getLogger(__name__)

Split = Literal["train", "eval"]


@runtime_checkable
class HintSource(Protocol):
    """Privileged context for the channel-2 teacher.

    ``hints(rows)`` returns one entry per row: the hint text, or ``None`` when
    there is no hint for that row (the row then takes no part in channel 2).
    It is called once per generation batch, with the dataset rows (each has
    ``"prompt"`` and the task's columns). It must be deterministic given the
    rows: a resumed run calls it again on the same rows.
    """

    def hints(self, rows: Sequence[Mapping[str, Any]]) -> list[str | None]: ...


@runtime_checkable
class VerifiableTask(Protocol):
    """A task whose completions can be scored without a human.

    ``examples(split)`` returns rows (``dict`` with ``"prompt"``: a string or a
    list of chat messages, plus any other JSON-serialisable columns);
    ``reward(completions, rows)`` returns one float in ``[0, 1]`` (or ``None``
    for "unscorable", which TRL excludes from the group baseline) per
    completion, ``completions[i]`` answering ``rows[i]``. ``default_hints()``
    is the hint source used when the run names none.
    """

    name: str

    def examples(self, split: Split) -> list[dict[str, Any]]: ...

    def reward(self, completions: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[float | None]: ...

    def default_hints(self) -> HintSource | None: ...


# --------------------------------------------------------------------------- hints
@dataclass(frozen=True)
class ColumnHints:
    """Hints read from a dataset column (``None`` or ``""`` means no hint for that row)."""

    column: str = "hint"

    def hints(self, rows: Sequence[Mapping[str, Any]]) -> list[str | None]:
        return [(row.get(self.column) or None) for row in rows]


@dataclass(frozen=True)
class NoHints:
    """Channel 2 off for every row."""

    def hints(self, rows: Sequence[Mapping[str, Any]]) -> list[str | None]:
        return [None] * len(rows)


DEFAULT_HINT_TEMPLATE = "{hint}\n{prompt}"


def apply_hint(prompt: str | list[dict[str, Any]], hint: str, template: str = DEFAULT_HINT_TEMPLATE) -> Any:
    """The teacher's prompt: ``prompt`` with ``hint`` in its context.

    Plain-text prompts become ``template.format(hint=hint, prompt=prompt)``;
    the prompt must stay at the end, because the completion tokens are
    appended right after it. Conversational prompts get the hint as a system
    message in front (the last message, to which the completion answers, is
    untouched).
    """
    if isinstance(prompt, str):
        if not template.endswith("{prompt}"):
            raise ValueError("the hint template must end with '{prompt}' (the completion follows the prompt)")
        return template.format(hint=hint, prompt=prompt)
    return [{"role": "system", "content": hint}, *prompt]


#: Registered hint sources (besides ``"default"``, the task's own, and ``"column:NAME"``): name -> factory.
HINT_SOURCES: dict[str, str] = {"none": f"{__name__}:NoHints"}


def hint_source_reference(spec: str) -> str | None:
    """Check a ``trainer.hint_source`` value without importing anything.

    Returns the ``"module:factory"`` it resolves to, or ``None`` for
    ``"default"`` and ``"column:NAME"`` (which are not looked up).
    """
    if spec == "default" or (spec.startswith("column:") and spec != "column:"):
        return None
    if spec == "column:":
        raise ValueError("trainer.hint_source 'column:': name the column, e.g. 'column:hint'")
    if ":" not in spec and spec not in HINT_SOURCES:  # every value the setting takes, not only the registry's
        raise ValueError(f"trainer.hint_source: unknown hint source {spec!r}; use \"default\" (the task's own), "
                         f"{', '.join(repr(n) for n in sorted(HINT_SOURCES))}, \"column:NAME\" (a dataset column) "
                         "or \"package.module:attribute\"")
    return reference_for(spec, HINT_SOURCES, setting="trainer.hint_source", kind="hint source")


def resolve_hint_source(spec: str | HintSource | None, task: VerifiableTask) -> HintSource:
    """``None``/``"default"``: the task's own; ``"column:NAME"``; a registered name (``"none"``); or ``"module:factory"``.

    A factory is called with the task when it takes a positional parameter,
    else with nothing; it must return a :class:`HintSource`.
    """
    if spec is None or spec == "default":
        return task.default_hints() or NoHints()
    if not isinstance(spec, str):
        return spec
    reference = hint_source_reference(spec)
    if reference is None:
        return ColumnHints(spec.partition(":")[2])
    factory = load_object(reference, setting="trainer.hint_source")
    source = factory(task) if _takes_an_argument(factory) else factory()
    if not isinstance(source, HintSource):
        raise TypeError(
            f"trainer.hint_source {spec!r} returned {type(source).__name__}, which has no hints(rows) method"
        )
    return source


def _takes_an_argument(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it bare
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


# --------------------------------------------------------------------------- demo task
_NAMES = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lam", "rho"]
_VERBS = ["add", "scale", "shift", "clip", "count", "merge", "split", "total", "pick", "sum"]
_OPS = [("+", "plus"), ("-", "minus"), ("*", "times")]
_APPLY: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def _is_eval_name(name: str) -> bool:
    # Held-out problems use function names that no training problem uses.
    return hashlib.sha256(name.encode()).digest()[0] % 5 == 0


def _problem(rng: random.Random, name: str) -> dict[str, Any]:
    """One problem: prompt, reference completion and assert-statement tests."""
    kind = rng.randrange(3)
    k = rng.randrange(1, 10)
    op, word = rng.choice(_OPS)
    f = _APPLY[op]
    if kind == 0:
        prompt = f'def {name}(x):\n    """Return x {word} {k}."""\n    return'
        reference = f" x {op} {k}\n"
        tests = [f"assert {name}({x}) == {f(x, k)}" for x in (0, 1, 2, -3, 7)]
    elif kind == 1:
        prompt = (
            f'def {name}(a, b):\n    """Return a {word} {k} if a > b, else b {word} {k}."""\n'
            "    if a > b:\n        return"
        )
        reference = f" a {op} {k}\n    return b {op} {k}\n"
        pairs = [(5, 1), (3, 2), (9, -4), (1, 5), (2, 2), (-4, 0)]  # half take each branch
        tests = [f"assert {name}({a}, {b}) == {f(a, k) if a > b else f(b, k)}" for a, b in pairs]
    else:
        init = rng.randrange(0, 3) if op != "*" else 1
        prompt = f"def {name}(items):\n    total = {init}\n    for item in items:\n        total = total"
        reference = f" {op} item\n    return total\n"
        lists = [[], [3], [1, 2], [2, 3, 4], [5, -1, 2]]
        tests = []
        for items in lists:
            acc = init
            for it in items:
                acc = f(acc, it)
            tests.append(f"assert {name}({items!r}) == {acc}")
    return {"prompt": prompt, "reference": reference, "tests": tests, "entry_point": name}


def extract_program(prompt: str, completion: str) -> str:
    """The candidate program: ``prompt + completion`` cut where the function ends.

    The function ends at the first non-empty line of the completion that is
    not indented (a new ``def``, an ``assert``, stray text): what a model
    writes after its function is not part of its answer.
    """
    lines = completion.split("\n")
    kept = [lines[0]]
    for line in lines[1:]:
        if line.strip() and not line[0].isspace():
            break
        kept.append(line)
    return prompt + "\n".join(kept).rstrip() + "\n"


@dataclass(frozen=True)
class ReferenceHints:
    """The demo task's hint: the reference completion, as comment lines before the prompt.

    OPSD-style privileged information: the teacher sees a correct answer and
    the student does not; the student learns to put the teacher's probability
    on the same completion tokens. The hint is kept short (the answer only,
    not the whole function again) because its length is what the teacher
    forward costs on top of the student's.
    """

    def hints(self, rows: Sequence[Mapping[str, Any]]) -> list[str | None]:
        out: list[str | None] = []
        for row in rows:
            ref = row.get("reference")
            out.append(None if not ref else "# answer:" + ref.rstrip("\n").replace("\n", "\n# "))
        return out


@dataclass
class PythonFunctionsTask:
    """The demo task (``"python-functions"``): complete short Python functions.

    Rows: ``prompt`` (function head), ``reference`` (a correct completion),
    ``tests`` (assert statements), ``entry_point``, ``task_id``. Training and
    held-out problems use disjoint function names. The reward is the fraction
    of tests passed in the sandbox (0 on a crash, a timeout or a syntax error).
    """

    n_train: int = 512
    n_eval: int = 32
    seed: int = 0
    limits: SandboxLimits = field(default_factory=lambda: SandboxLimits(timeout_s=5.0, per_test_timeout_s=1.0))
    max_workers: int = 2
    name: str = "python-functions"

    def __post_init__(self) -> None:
        self._sandbox = Sandbox(self.limits, max_workers=self.max_workers)
        self._splits: dict[str, list[dict[str, Any]]] = {}

    def examples(self, split: Split) -> list[dict[str, Any]]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if split not in self._splits:
            want_eval = split == "eval"
            n = self.n_eval if want_eval else self.n_train
            rng = random.Random(f"python-functions:{self.seed}:{split}")
            names = [f"{v}_{n_}" for v in _VERBS for n_ in _NAMES if _is_eval_name(f"{v}_{n_}") == want_eval]
            seen: set[str] = set()
            rows: list[dict[str, Any]] = []
            attempts = 0
            while len(rows) < n and attempts < 50 * n:
                attempts += 1
                row = _problem(rng, rng.choice(names))
                if row["prompt"] in seen:
                    continue
                seen.add(row["prompt"])
                row["task_id"] = f"{split}/{len(rows)}"
                rows.append(row)
            self._splits[split] = rows
        return [dict(r) for r in self._splits[split]]

    def reward(self, completions: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[float | None]:
        programs = [extract_program(row["prompt"], c) for c, row in zip(completions, rows, strict=True)]
        results = self._sandbox.run_many(programs, [row["tests"] for row in rows])
        return [r.score for r in results]

    def default_hints(self) -> HintSource:
        return ReferenceHints()


def _mutations(row: Mapping[str, Any], rng: random.Random) -> str:
    """A plausible wrong completion for a demo problem (what a weak student writes)."""
    ref: str = row["reference"]
    choice = rng.randrange(4)
    if choice == 0:  # wrong operator
        for a, b in (("+", "-"), ("-", "*"), ("*", "+")):
            if f" {a} " in ref:
                return ref.replace(f" {a} ", f" {b} ")
    if choice == 1:  # wrong constant
        for d in "123456789":
            if f" {d}\n" in ref:
                return ref.replace(f" {d}\n", f" {int(d) % 9 + 1}\n")
    if choice == 2 and "\n    return" in ref:  # first line only: the function falls off its end
        return ref.split("\n")[0] + "\n"
    return " None\n"


def build_demo_pairs(n: int = 96, *, seed: int = 0) -> list["Pair"]:
    """The pairs shipped as ``composer_cloud/data/pairs.jsonl`` (regenerate with this function).

    A recorded student trace on training problems of :class:`PythonFunctionsTask`
    (wrong completions), and three scripted teachers: two that know the
    reference solution and one that is right only on some problems. Pairs are
    kept where at least 2 of 3 agree (:func:`~composer_cloud.trainer.three_channel.replay.make_pairs`).
    """
    from composer_cloud.trainer.three_channel.replay import TraceStep, make_pairs

    task = PythonFunctionsTask(n_train=max(2 * n, 64), n_eval=1, seed=seed)
    rows = task.examples("train")
    by_prompt = {r["prompt"]: r for r in rows}
    rng = random.Random(f"demo-pairs:{seed}")
    steps = [
        TraceStep(r["prompt"], _mutations(r, rng), {"task_id": r["task_id"], "trace_id": f"demo-{seed}", "step": i})
        for i, r in enumerate(rows)
    ]

    def expert(prompt: str) -> str:
        return by_prompt[prompt]["reference"]

    def sloppy(prompt: str) -> str:
        row = by_prompt[prompt]
        return row["reference"] if len(prompt) % 3 else " None\n"

    pairs = make_pairs(steps, {"expert_a": expert, "expert_b": expert, "sloppy": sloppy}, threshold=2 / 3)
    return pairs[:n]


#: Registered tasks: name -> ``"module:factory"`` (called with ``task_options`` as keyword arguments).
TASKS: dict[str, str] = {"python-functions": f"{__name__}:PythonFunctionsTask"}


def build_task(spec: str | VerifiableTask, **kwargs: Any) -> VerifiableTask:
    """A task by registered name, by ``"module:factory"``, or an instance passed through."""
    if not isinstance(spec, str):
        return spec
    return resolve(spec, TASKS, setting="trainer.task")(**kwargs)


def make_reward_func(task: VerifiableTask) -> Callable[..., list[float | None]]:
    """Adapt ``task.reward`` to TRL's reward-function calling convention.

    TRL calls ``f(prompts=..., completions=..., completion_ids=..., **columns)``
    with every dataset column as a list; the rows are rebuilt from them.
    """

    def reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        names = [k for k, v in columns.items() if isinstance(v, list) and len(v) == len(completions)]
        names = [k for k in names if k != "completion_ids"]
        rows = [{"prompt": p, **{k: columns[k][i] for k in names}} for i, p in enumerate(prompts)]
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return task.reward(texts, rows)

    reward.__name__ = task.name.replace("-", "_")
    return reward


__all__ = [
    "ColumnHints",
    "HINT_SOURCES",
    "HintSource",
    "NoHints",
    "PythonFunctionsTask",
    "ReferenceHints",
    "TASKS",
    "VerifiableTask",
    "apply_hint",
    "build_demo_pairs",
    "build_task",
    "extract_program",
    "hint_source_reference",
    "make_reward_func",
    "resolve_hint_source",
]
