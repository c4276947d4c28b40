"""The ``[trainer]`` table: one schema per registered trainer, checked without torch or TRL.

Each trainer's settings are a frozen pydantic dataclass (strict types, no
extra keys) in a module that imports neither torch nor TRL, so the launcher
can call :func:`check_settings` before any job starts (a bad key costs a
``ValueError`` at the terminal, not a billed container start). The replica
builds its trainer from the same class, so the launcher and the replica can
never disagree about what is valid.

Every error names the key as the user wrote it, ``trainer.<key>``:
an unknown key (with the closest valid key as a suggestion), a renamed key
(with its new name), a wrong type, or a value out of range. Values are echoed
only for scalars: option tables (``*_options``) may hold credentials.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from typing import Annotated, Any, ClassVar, Literal, Mapping, Sequence, TypeVar

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

from composer_cloud.registry import is_reference, resolve
from composer_cloud.trainer.plugin import TrainerPlugin

logger = logging.getLogger(__name__)

#: pydantic config of every settings class: TOML types as written (no "8" -> 8), no unknown keys.
SETTINGS_CONFIG = ConfigDict(strict=True, extra="forbid")

PositiveInt = Annotated[int, Field(gt=0)]
#: Batch sizes (rows, completions or pairs per step) are at most 2**20, like ``[trainer] batch_size`` in the spec:
#: a step over more rows than that does not fit any accelerator's memory, so a larger value is a typo.
BatchSize = Annotated[int, Field(gt=0, le=1 << 20)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]

#: trainer name -> ``"module:Class"`` of its settings class. The class is the trainer's declaration: it
#: imports neither torch nor TRL, parses the ``[trainer]`` table (``from_settings``) and names the trainer's
#: factory (``FACTORY``, ``"module:function"`` taking a ``TrainerContext``), which only the replica imports.
TRAINERS: dict[str, str] = {
    "causal-lm": "composer_cloud.trainer.settings:CausalLMSettings",
    "three-channel": "composer_cloud.trainer.three_channel.settings:ThreeChannelSettings",
}
DEFAULT_TRAINER = "three-channel"

S = TypeVar("S")


def parse_settings(cls: type[S], settings: Mapping[str, Any], *, trainer: str) -> S:
    """Build ``cls`` from a ``[trainer]`` table, or raise one ``ValueError`` naming every bad key.

    ``settings`` may carry ``name`` (the table's own selector); it must equal
    ``trainer``. ``cls.RENAMED`` (optional) maps old keys to new ones: an old
    key fails with a message naming its replacement rather than being ignored
    or silently mapped (a silently mapped key would hide that the meaning or
    the default changed).
    """
    values = dict(settings)
    name = values.pop("name", trainer)
    if name != trainer:
        raise ValueError(f"trainer.name is {name!r}, but these settings were checked for trainer {trainer!r}")
    fields = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    renamed: Mapping[str, str] = getattr(cls, "RENAMED", {})
    problems: list[str] = []
    for key in sorted(set(values) - set(fields)):
        if key in renamed:
            problems.append(f"trainer.{key} was renamed to trainer.{renamed[key]}")
            continue
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
        hint = f"; did you mean trainer.{close[0]}?" if close else f"; valid keys: {', '.join(sorted(fields))}"
        problems.append(f"trainer.{key} is not a {trainer} setting{hint}")
    if problems:
        raise ValueError(f"[trainer] for {trainer!r}: " + "; ".join(problems))
    try:
        return cls(**values)
    except ValidationError as exc:
        problems = [_describe(e, values) for e in exc.errors()]
        raise ValueError(f"[trainer] for {trainer!r}: " + "; ".join(problems)) from None


def _describe(error: Mapping[str, Any], values: Mapping[str, Any]) -> str:
    """One pydantic error as ``trainer.<key>: what is wrong``."""
    loc = error.get("loc") or ()
    if not loc:  # raised by a __post_init__ cross-field check, which names its keys itself
        cause = (error.get("ctx") or {}).get("error")
        return str(cause) if cause is not None else str(error.get("msg"))
    key = str(loc[0])
    value = values.get(key)
    if error.get("type", "").endswith("_type"):
        shown = f"got {type(value).__name__}"
    elif isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 80):
        shown = f"got {value!r}"
    else:
        shown = "got a value that is out of range"
    return f"trainer.{key}: {error.get('msg')} ({shown})"


def check_settings(name: str, settings: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming ``trainer.<key>`` when ``settings`` are not valid for trainer ``name``.

    Imports neither torch nor TRL (only the trainer's settings module). What
    it cannot know without running user code or touching the network is left
    to the replica: whether a ``"module:factory"`` task or hint source
    imports, whether a pairs URI exists.

    Example::

        check_settings("three-channel", {"batchsize": 8})
        # ValueError: [trainer] for 'three-channel': trainer.batchsize is not a
        # three-channel setting; did you mean trainer.batch_size?
    """
    settings_class(name).from_settings(settings)


def settings_class(name: str) -> Any:
    """The settings class of trainer ``name`` (a registered name or ``"module:Class"``); imports no torch."""
    return resolve(name, TRAINERS, setting="trainer.name", kind="trainer")


def code_references(name: str, settings: Mapping[str, Any], *, import_user_class: bool = False) -> dict[str, str]:
    """``{"setting": "module:attr"}``: what a run's ``[trainer]`` table names as code a replica imports.

    ``trainer.name`` when it is a reference, and the settings its class declares
    (:meth:`TrainerPlugin.code_references`). A registered trainer's class is always asked; a user trainer's
    class only with ``import_user_class`` (the launcher, which imports it anyway), never for a spec nothing
    vouches for (``runs/signing``). The one answer ``launch`` packages and ``signing`` refuses by.
    """
    out = {"trainer.name": name} if is_reference(name) else {}
    if name in TRAINERS or (import_user_class and out):
        cls = settings_class(name)
        if isinstance(cls, type) and issubclass(cls, TrainerPlugin):
            out |= cls.code_references(settings)
    return out


def declared_settings(name: str, settings: Mapping[str, Any]) -> TrainerPlugin:
    """The parsed settings of a run's trainer, as the client asks its questions of them (:class:`TrainerPlugin`).

    Only a registered trainer is imported: a ``"module:Class"`` trainer (user code, maybe from a spec read
    from the store) and settings that no longer parse (an older run) get :class:`TrainerPlugin`'s defaults,
    which claim nothing. For the launch's own checks use :func:`settings_class` (which raises).
    """
    if name not in TRAINERS:
        return TrainerPlugin()
    try:
        parsed = settings_class(name).from_settings(settings)
    except ValueError:
        logger.debug("trainer %r: settings do not parse; the client says nothing trainer-specific", name)
        return TrainerPlugin()
    return parsed if isinstance(parsed, TrainerPlugin) else TrainerPlugin()


# --------------------------------------------------------------------------- causal-lm
@dataclass(frozen=True, config=SETTINGS_CONFIG)
class DatasetSettings(TrainerPlugin):
    """The ``[trainer]`` keys of a run on the user's own dataset (``docs/datasets.md``), one set for every trainer.

    Attributes:
        dataset: a hub id, a local file (``.jsonl``, ``.json``, ``.csv``, ``.parquet``) or a ``save_to_disk``
            folder; None: the trainer's own data (a corpus, a task).
        dataset_config, dataset_split, data_files: as ``datasets.load_dataset`` takes them.
        eval_split: the held-out split; else ``eval_fraction`` of the training split is held out.
        columns: canonical name -> the dataset's column (each trainer names its canonical columns).
    """

    dataset: Annotated[str, Field(min_length=1)] | None = None
    dataset_config: str | None = None
    dataset_split: Annotated[str, Field(min_length=1)] = "train"
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    eval_split: str | None = None
    eval_fraction: Annotated[float, Field(ge=0.0, le=0.5)] = 0.1
    columns: dict[str, str] = dataclasses.field(default_factory=dict)

    def check_dataset_keys(self, canonical: tuple[str, ...], *, also: tuple[str, ...] = (),
                           describe: str) -> None:
        """Refuse dataset keys without ``dataset`` (``also``: the trainer's own such keys), and ``columns``
        keys outside ``canonical``; ``describe`` ends the latter message. Errors name ``trainer.<key>``."""
        if self.dataset is None:
            for key in ("dataset_config", "data_files", "eval_split", *also):
                if getattr(self, key) is not None:
                    raise ValueError(f"trainer.{key} applies to a dataset run; set trainer.dataset too")
            if self.columns:
                raise ValueError("trainer.columns applies to a dataset run; set trainer.dataset too")
        unknown = sorted(set(self.columns) - set(canonical))
        if unknown:
            raise ValueError(f"trainer.columns.{unknown[0]}: {describe}")


@dataclass(frozen=True, config=SETTINGS_CONFIG)
class CausalLMSettings(DatasetSettings):
    """The ``[trainer]`` table for ``name = "causal-lm"`` (all keys optional).

    Attributes:
        batch_size: rows of ``seq_len`` tokens per optimizer step.
        seq_len: tokens per row (the corpus is packed, eos-separated, into rows).
        corpus_size: snippets of the built-in corpus, over all replicas (each
            replica trains on its ``rank::world_size`` share of the rows).
        eval_rows: held-out rows scored by ``evaluate()``.
        corpus: ``"builtin"`` (templated snippets, :mod:`composer_cloud.corpus`) or ``"stdlib"`` (the
            interpreter's standard-library sources, :mod:`composer_cloud.stdlib_corpus`; the model's
            tokenizer should be the stdlib BPE, see ``stdlib_corpus.write_model_dir``).
        corpus_bytes: ``"stdlib"`` only: UTF-8 bytes of training files read (whole files, fixed order).
        dataset: fine-tune on your own data instead of a corpus: a hub id, a local file (``.jsonl``,
            ``.json``, ``.csv``, ``.parquet``) or a ``save_to_disk`` folder, with ``dataset_config``,
            ``dataset_split``, ``data_files``, ``eval_split`` / ``eval_fraction`` as for the three-channel
            trainer (``docs/datasets.md``). Each row's text is its ``text`` column, else ``prompt`` followed by
            ``answer`` on the next line; ``columns`` maps those names to the dataset's.
    """

    TRAINER: ClassVar[str] = "causal-lm"
    FACTORY: ClassVar[str] = "composer_cloud.trainer.causal_lm:build_causal_lm_trainer"
    LOSS_NAME: ClassVar[str | None] = "next-token cross-entropy, nats/token"

    batch_size: BatchSize = 8
    seq_len: PositiveInt = 64
    corpus_size: PositiveInt = 4000
    eval_rows: PositiveInt = 64
    corpus: Literal["builtin", "stdlib"] = "builtin"
    corpus_bytes: PositiveInt = 4_000_000

    #: The canonical names ``columns`` may map for the causal-LM trainer.
    COLUMNS: ClassVar[tuple[str, ...]] = ("text", "prompt", "answer")

    def __post_init__(self) -> None:
        self.check_dataset_keys(self.COLUMNS, describe=f"the causal-lm trainer's columns are "
                                f"{', '.join(self.COLUMNS)} (the text, or a prompt and its answer)")

    def dataset_problems(self, available: Sequence[str]) -> list[str]:
        """A text column, or a prompt and an answer column (after ``columns``); empty: fine."""
        has = {c for c in self.COLUMNS if self.columns.get(c, c) in available}
        if "text" in has or {"prompt", "answer"} <= has:
            return []
        return [f"the causal-lm trainer needs a 'text' column, or 'prompt' and 'answer' (its columns: "
                f"{', '.join(available)}); map them with trainer.columns.text = \"<column>\" (or .prompt and .answer)"]

    def training_plan(self, device_type: str) -> list[tuple[str, str]]:
        """The data and the batch: ``(label, value)`` rows of the dry run's plan (same on every device)."""
        if self.dataset is not None:
            held_out = (f"eval split {self.eval_split!r}" if self.eval_split
                        else f"{self.eval_fraction:g} of it held out")
            data = f"dataset {self.dataset} (split {self.dataset_split!r}, {held_out})"
        elif self.corpus == "stdlib":
            data = f"the standard library's sources ({self.corpus_bytes} bytes)"
        else:
            data = f"the built-in corpus ({self.corpus_size} snippets)"
        return [("data", data), ("batch", f"{self.batch_size} rows x {self.seq_len} tokens per optimizer step")]

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "CausalLMSettings":
        """From a ``[trainer]`` table; ``ValueError`` naming ``trainer.<key>`` on bad input."""
        return parse_settings(cls, settings, trainer=cls.TRAINER)


__all__ = [
    "DEFAULT_TRAINER",
    "SETTINGS_CONFIG",
    "BatchSize",
    "TRAINERS",
    "CausalLMSettings",
    "DatasetSettings",
    "check_settings",
    "code_references",
    "declared_settings",
    "parse_settings",
    "settings_class",
]
