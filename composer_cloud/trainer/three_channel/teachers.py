"""Replay pairs from teachers: ask N models behind OpenAI-compatible endpoints what they would do at each step.

``composer-cloud pairs TRACE --teachers teachers.toml --out pairs.jsonl --max-cost 5`` reads a trace (JSON Lines,
one state per line: ``{"prompt": ..., "student_action": ..., "meta": {...}}``), asks every teacher once per
state, keeps a pair ``(chosen = the teachers' agreed answer, rejected = the student's action)`` where at least
``threshold`` of them agree and the student did something else (:func:`~.replay.vote`), normalises the pairs
(:class:`~.replay.PairFilters`, de-duplication) and writes them in the format ``trainer.pairs`` reads. The
teachers file::

    [[teacher]]
    name = "big"
    base_url = "https://api.example.com/v1"
    model = "big-model-2"
    api_key_env = "EXAMPLE_API_KEY"    # the key is read from this variable; never logged or written
    input_price = 0.5                  # USD per million prompt tokens
    output_price = 1.5                 # USD per million completion tokens

Guarantees:

* **A failing teacher costs its answers, not the command.** A timeout, a connection error, an HTTP error or a
  response that is not a completion makes that teacher abstain on that state (it still counts in the agreement
  denominator). After ``max_consecutive_failures`` failures in a row a teacher is marked down and not asked
  again, so a dead endpoint costs ``max_consecutive_failures × timeout`` once, not per state.
* **The dollar ceiling is hard.** Before a request is sent, its worst case (every prompt byte a token, plus
  ``max_tokens`` completion tokens, at the teacher's prices) is reserved against ``max_cost_usd``; a request
  whose reservation does not fit is not sent. The reservation is replaced by the cost of the endpoint's reported
  usage when the answer arrives (by the reservation itself when the endpoint reports none, or when the request
  timed out or failed after it was sent: it may have been billed).
* **Keys never leave the client.** A key is read from its environment variable into the ``openai`` client only;
  error messages are scrubbed of every configured key before they are logged or put in the report.

The result is :class:`PairsReport`: pairs written, agreement, what was dropped and why, and per-teacher calls,
failures, tokens and cost.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping, Sequence

import fsspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from composer_cloud import env as cc_env
from composer_cloud.errors import ComposerCloudError, ConfigError
from composer_cloud.trainer.three_channel.replay import (
    PairFilters,
    TraceStep,
    normalize_pairs,
    read_jsonl,
    vote,
    write_pairs,
)

logger = logging.getLogger(__name__)

#: Worst-case tokens a chat request adds around the prompt (role markers, template), for the budget reservation.
CHAT_OVERHEAD_TOKENS = 64


class TeachersError(ConfigError, ValueError):
    """The trace or the teachers file is not usable; the message names the file, the teacher and the field."""


class TeacherConfig(BaseModel):
    """One ``[[teacher]]`` of the teachers file."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(min_length=1)
    base_url: str = Field(min_length=1)
    model: str = Field(min_length=1)
    api_key_env: str | None = None
    api: Literal["chat", "completions"] = "chat"
    input_price: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    output_price: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    max_tokens: int = Field(default=256, gt=0)
    temperature: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    max_retries: int = Field(default=2, ge=0)
    max_consecutive_failures: int = Field(default=3, gt=0)
    system_prompt: str | None = None

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        """USD for this many tokens at this teacher's prices (per million tokens)."""
        return (input_tokens * self.input_price + output_tokens * self.output_price) / 1e6


def load_teachers(uri: str) -> list[TeacherConfig]:
    """The ``[[teacher]]`` tables of a TOML file; :class:`TeachersError` naming the teacher and field."""
    import tomllib

    try:
        with fsspec.open(uri, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise TeachersError(f"--teachers {uri}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise TeachersError(f"--teachers {uri}: not valid TOML ({exc})") from None
    unknown = sorted(set(raw) - {"teacher"})
    tables = raw.get("teacher")
    if unknown or not isinstance(tables, list) or not tables:
        raise TeachersError(f"--teachers {uri}: expected one or more [[teacher]] tables"
                            + (f" (unknown top-level keys {unknown})" if unknown else ""))
    teachers = []
    for i, table in enumerate(tables):
        where = f"{uri}: teacher {table.get('name', i)!r}" if isinstance(table, dict) else f"{uri}: teacher {i}"
        try:
            teachers.append(TeacherConfig(**table))
        except (ValidationError, TypeError) as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()) \
                if isinstance(exc, ValidationError) else str(exc)
            raise TeachersError(f"{where}: {problems}") from None
    names = [t.name for t in teachers]
    if len(set(names)) != len(names):
        raise TeachersError(f"--teachers {uri}: teacher names must be unique, got {names}")
    return teachers


def load_trace(uri: str) -> list[TraceStep]:
    """A trace: JSON Lines of ``{"prompt": str, "student_action": str, "meta": {...}}``; errors name the line."""
    steps: list[TraceStep] = []
    try:
        for where, obj in read_jsonl(uri):
            if not isinstance(obj, dict) or set(obj) - {"prompt", "student_action", "meta"}:
                raise TeachersError(f"{where}: expected an object with 'prompt', 'student_action' and an optional "
                                    "'meta'")
            prompt, action, meta = obj.get("prompt"), obj.get("student_action"), obj.get("meta", {})
            if not isinstance(prompt, str) or not isinstance(action, str) or not isinstance(meta, dict):
                raise TeachersError(f"{where}: 'prompt' and 'student_action' must be strings, 'meta' an object")
            steps.append(TraceStep(prompt, action, meta))
    except FileNotFoundError:
        raise TeachersError(f"trace {uri}: no such file") from None
    except TeachersError:
        raise
    except ValueError as exc:  # invalid JSON, named by line
        raise TeachersError(str(exc)) from None
    if not steps:
        raise TeachersError(f"trace {uri}: no states")
    return steps


# --------------------------------------------------------------------------- accounting
@dataclass
class TeacherStats:
    """One teacher's calls and spend. ``failures`` counts by kind (exception class, ``"malformed"``)."""

    asked: int = 0
    answered: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    skipped_budget: int = 0
    skipped_down: int = 0
    down: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    last_error: str | None = None


class Budget:
    """A hard dollar ceiling with reservations (thread-safe); see the module docstring."""

    def __init__(self, max_cost_usd: float) -> None:
        self.max_cost_usd = float(max_cost_usd)
        self.spent = 0.0
        self.reserved = 0.0
        self.exhausted = False
        self._lock = threading.Lock()

    def reserve(self, amount: float) -> bool:
        with self._lock:
            if self.spent + self.reserved + amount > self.max_cost_usd:
                self.exhausted = True
                return False
            self.reserved += amount
            return True

    def settle(self, reserved: float, actual: float) -> None:
        with self._lock:
            self.reserved -= reserved
            self.spent += actual


# --------------------------------------------------------------------------- one teacher
class Teacher:
    """An OpenAI-compatible endpoint asked for one answer per state, with its failure count and stats."""

    def __init__(self, config: TeacherConfig, *, secrets: Sequence[str] = ()) -> None:
        try:
            from openai import OpenAI
        except ImportError:
            raise TeachersError("composer-cloud pairs needs the openai client: pip install 'composer-cloud[teachers]'"
                                ) from None

        self.config = config
        key = "EMPTY"  # what keyless servers (vLLM, llama.cpp) accept
        if config.api_key_env:
            key = cc_env.present((config.api_key_env,)).get(config.api_key_env, "")
            if not key:
                raise TeachersError(f"teacher {config.name!r}: environment variable {config.api_key_env} "
                                    "(api_key_env) is not set")
        self._secrets = [s for s in (*secrets, key) if s and s != "EMPTY"]
        self.client = OpenAI(base_url=config.base_url, api_key=key, timeout=config.timeout_s,
                             max_retries=config.max_retries)
        self.stats = TeacherStats()
        self._consecutive_failures = 0
        self._lock = threading.Lock()

    def reservation(self, prompt: str) -> float:
        """The most one request for ``prompt`` can cost (every prompt byte a token)."""
        worst_in = len(prompt.encode("utf-8")) + len((self.config.system_prompt or "").encode("utf-8"))
        return self.config.cost(worst_in + CHAT_OVERHEAD_TOKENS, self.config.max_tokens)

    def ask(self, prompt: str, budget: Budget) -> str | None:
        """The teacher's answer for ``prompt``, or ``None`` (failed, down, or over budget). Never raises."""
        with self._lock:
            if self.stats.down:
                self.stats.skipped_down += 1
                return None
        reserve = self.reservation(prompt)
        if not budget.reserve(reserve):
            with self._lock:
                self.stats.skipped_budget += 1
            return None
        with self._lock:
            self.stats.asked += 1
        actual = reserve
        try:
            text, usage = self._request(prompt)
        except Exception as exc:  # a teacher's failure is its own: record it, abstain, go on
            budget.settle(reserve, 0.0 if _never_sent(exc) else reserve)
            self._failed(type(exc).__name__, str(exc))
            return None
        if usage is not None:
            actual = self.config.cost(*usage)
        budget.settle(reserve, actual)
        with self._lock:
            self._consecutive_failures = 0
            self.stats.answered += 1
            self.stats.cost_usd += actual
            if usage is not None:
                self.stats.input_tokens += usage[0]
                self.stats.output_tokens += usage[1]
        return text

    def _request(self, prompt: str) -> tuple[str, tuple[int, int] | None]:
        c = self.config
        if c.api == "chat":
            messages = ([{"role": "system", "content": c.system_prompt}] if c.system_prompt else [])
            messages.append({"role": "user", "content": prompt})
            resp = self.client.chat.completions.create(model=c.model, messages=messages, max_tokens=c.max_tokens,
                                                       temperature=c.temperature)
            text = resp.choices[0].message.content if _has_choices(resp) else None
        else:
            resp = self.client.completions.create(model=c.model, prompt=prompt, max_tokens=c.max_tokens,
                                                  temperature=c.temperature)
            text = resp.choices[0].text if _has_choices(resp) else None
        if not isinstance(text, str):
            raise MalformedResponse(f"not a completion: {str(resp)[:200]!r}")
        usage = getattr(resp, "usage", None)
        tokens = None
        if usage is not None and isinstance(getattr(usage, "prompt_tokens", None), int):
            tokens = (usage.prompt_tokens, int(getattr(usage, "completion_tokens", 0) or 0))
        else:
            logger.warning("teacher %s reported no token usage; its cost is counted at the worst case", c.name)
        return text, tokens

    def _failed(self, kind: str, message: str) -> None:
        for secret in self._secrets:
            message = message.replace(secret, "***")
        with self._lock:
            self.stats.failures[kind] = self.stats.failures.get(kind, 0) + 1
            self.stats.last_error = f"{kind}: {message[:300]}"
            self._consecutive_failures += 1
            if self._consecutive_failures >= self.config.max_consecutive_failures and not self.stats.down:
                self.stats.down = True
                logger.warning("teacher %s failed %d times in a row (%s); not asking it again", self.config.name,
                               self._consecutive_failures, self.stats.last_error)
        logger.info("teacher %s failed: %s", self.config.name, self.stats.last_error)


class MalformedResponse(ComposerCloudError, RuntimeError):
    """The endpoint answered, but not with a completion."""


def _has_choices(resp: Any) -> bool:
    choices = getattr(resp, "choices", None)
    return isinstance(choices, list) and len(choices) > 0


def _never_sent(exc: BaseException) -> bool:
    """A connection that was never made costs nothing; anything else may have been billed."""
    from openai import APIConnectionError, APITimeoutError

    return isinstance(exc, APIConnectionError) and not isinstance(exc, APITimeoutError)


# --------------------------------------------------------------------------- the command
@dataclass
class PairsReport:
    """What ``composer-cloud pairs`` did. Costs in USD; ``agreement`` is per state (0 when nobody answered)."""

    states: int
    pairs_written: int
    out: str
    threshold: float
    max_cost_usd: float
    cost_usd: float
    budget_exhausted: bool
    outcomes: dict[str, int]
    dropped: dict[str, int]
    agreement_mean: float
    agreement_histogram: dict[str, int]
    teachers: dict[str, TeacherStats]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_teacher_pairs(
    trace: Sequence[TraceStep],
    teachers: Sequence[TeacherConfig],
    *,
    out: str,
    max_cost_usd: float,
    threshold: float = 2 / 3,
    concurrency: int = 8,
    filters: PairFilters = PairFilters(),
    storage_options: Mapping[str, Any] | None = None,
) -> PairsReport:
    """Ask every teacher about every state, vote, normalise, write the pairs to ``out``; see the module docstring.

    States are asked in order, ``concurrency`` requests at a time; the pairs come out in trace order whatever
    the concurrency. Raises :class:`TeachersError` for bad arguments or a missing key variable, and
    :class:`NoPairsError` (``out`` untouched) when no pair came out, naming why.
    """
    if not 0.0 < threshold <= 1.0:
        raise TeachersError(f"--threshold must be in (0, 1], got {threshold}")
    if concurrency < 1:
        raise TeachersError(f"--concurrency must be >= 1, got {concurrency}")
    if not max_cost_usd > 0:
        raise TeachersError(f"--max-cost must be > 0 USD, got {max_cost_usd}")
    if not teachers or not trace:
        raise TeachersError("pairs need at least one teacher and one state of the trace")
    start = time.monotonic()
    clients = [Teacher(t) for t in teachers]
    budget = Budget(max_cost_usd)
    jobs = [(i, j) for i in range(len(trace)) for j in range(len(clients))]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = list(pool.map(lambda job: clients[job[1]].ask(trace[job[0]].prompt, budget), jobs))

    names = [t.name for t in teachers]
    outcomes: Counter[str] = Counter()
    agreements: list[float] = []
    voted = []
    for i, step in enumerate(trace):
        decided = vote(step, dict(zip(names, answers[i * len(names) : (i + 1) * len(names)])), threshold=threshold)
        outcomes[decided.outcome] += 1
        agreements.append(decided.agreement)
        if decided.pair is not None:
            voted.append(decided.pair)
    pairs, dropped = normalize_pairs(voted, filters)
    histogram = Counter(f"{a:.2f}" for a in agreements)
    report = PairsReport(
        states=len(trace), pairs_written=len(pairs), out=out, threshold=threshold, max_cost_usd=max_cost_usd,
        cost_usd=budget.spent, budget_exhausted=budget.exhausted, outcomes=dict(outcomes), dropped=dict(dropped),
        agreement_mean=sum(agreements) / len(agreements), agreement_histogram=dict(sorted(histogram.items())),
        teachers={c.config.name: c.stats for c in clients}, seconds=time.monotonic() - start,
    )
    if not pairs:  # an empty pairs file trains nothing, and a later launch would only find out then
        raise NoPairsError(report, _no_pairs_cause(report, clients, trace))
    try:
        write_pairs(out, pairs, **dict(storage_options or {}))
    except OSError as exc:
        raise TeachersError(f"--out {out}: cannot write the pairs ({type(exc).__name__}: {exc})") from None
    logger.info("pairs: %d states, %d pairs written to %s, %.4f USD", len(trace), len(pairs), out, budget.spent)
    return report


class NoPairsError(TeachersError):
    """``pairs`` kept no pair, so it wrote nothing (an empty file would only fail a later launch). The message
    names the cause (no teacher answered and why, a ceiling below one request, the votes, the filters);
    :attr:`report` is what the command did and spent."""

    def __init__(self, report: PairsReport, cause: str) -> None:
        self.report = report
        super().__init__(f"no pairs, so nothing was written to --out {report.out}: {cause}")


def _no_pairs_cause(report: PairsReport, clients: Sequence[Teacher], trace: Sequence[TraceStep]) -> str:
    """Why no pair came out of ``report``, with what to change."""
    stats = report.teachers
    if not any(s.answered for s in stats.values()):
        if not any(s.asked for s in stats.values()):
            cheapest = min((c.reservation(step.prompt), c.config.name) for c in clients for step in trace)
            return (f"--max-cost {report.max_cost_usd:g} USD is below the worst case of any one request (the "
                    f"cheapest: {cheapest[0]:.4f} USD, teacher {cheapest[1]!r}); raise --max-cost, or lower the "
                    "teachers' max_tokens or prices")
        why = "; ".join(f"{name}: {s.last_error or 'not asked (down or over the ceiling)'}"
                        for name, s in stats.items())
        return f"no teacher answered any of the {report.states} states ({why})"
    what = ", ".join(f"{k} {v}" for k, v in sorted(report.outcomes.items()))
    advice = []
    if report.outcomes.get("below_threshold") or report.outcomes.get("tie"):
        advice.append(f"fewer teachers agreed than --threshold {report.threshold:.2f} asks: lower it")
    if report.outcomes.get("student_agrees"):
        advice.append("where the teachers agreed, the student's action was already theirs")
    if report.dropped:
        advice.append(f"the filters dropped {', '.join(f'{k} {v}' for k, v in sorted(report.dropped.items()))}: "
                      "loosen them (--filter KEY=none)")
    return f"the teachers answered, but no state gave a pair (outcomes: {what})" + "".join(f"; {a}" for a in advice)


def parse_filters(values: Sequence[str] | None) -> PairFilters:
    """``--filter KEY=VALUE`` options over :class:`PairFilters`' defaults (``none`` turns a bound off)."""
    fields = {f: getattr(PairFilters(), f) for f in PairFilters.__dataclass_fields__}
    chosen: dict[str, Any] = {}
    for item in values or ():
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise TeachersError(f"--filter {item!r}: use KEY=VALUE with KEY one of {', '.join(fields)}")
        try:
            chosen[key] = None if raw.lower() == "none" else (float(raw) if key == "max_special_ratio" else int(raw))
        except ValueError:
            raise TeachersError(f"--filter {key}: {raw!r} is not a number (or 'none')") from None
    return PairFilters(**chosen)


def write_report(uri: str, report: PairsReport) -> None:
    with fsspec.open(uri, "wt", encoding="utf-8") as f:
        json.dump(report.to_json(), f, indent=2, sort_keys=True)


def report_table(report: PairsReport) -> Any:
    """A rich table: one row per teacher, the totals in the caption."""
    from rich.table import Table

    where = report.out if report.pairs_written else f"nothing written to {report.out}"
    table = Table(title=f"{report.pairs_written} pairs from {report.states} states -> {where}")
    for column in ("teacher", "answered", "asked", "failed", "skipped", "tokens in/out", "USD", "last error"):
        table.add_column(column)
    for name, s in report.teachers.items():
        skipped = s.skipped_budget + s.skipped_down
        table.add_row(name + (" (down)" if s.down else ""), str(s.answered), str(s.asked), str(sum(s.failures.values())),
                      str(skipped), f"{s.input_tokens}/{s.output_tokens}", f"{s.cost_usd:.4f}", s.last_error or "")
    budget = " (ceiling reached)" if report.budget_exhausted else ""
    table.caption = (f"agreement mean {report.agreement_mean:.2f}; outcomes {report.outcomes}; dropped "
                     f"{report.dropped or '{}'}; cost {report.cost_usd:.4f} of {report.max_cost_usd:.2f} USD{budget}")
    return table


__all__ = [
    "Budget",
    "NoPairsError",
    "PairsReport",
    "Teacher",
    "TeacherConfig",
    "TeacherStats",
    "TeachersError",
    "load_teachers",
    "load_trace",
    "make_teacher_pairs",
    "parse_filters",
    "report_table",
    "write_report",
]
