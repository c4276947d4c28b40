"""The three-channel trainer's settings: one class, checked without torch or TRL.

:class:`ThreeChannelConfig` holds the hyper-parameters of the loss
(:func:`composer_cloud.trainer.three_channel.loss.three_channel_loss`);
:class:`ThreeChannelSettings` extends it with everything else of the
``[trainer]`` table (sampling, the task, channels 2 and 3, the sandbox). Each
key is defined once, here; ``ThreeChannelGRPOTrainer`` and the loss read the
same object, and the ``GRPOConfig`` it runs under is derived from it
(:meth:`ThreeChannelSettings.grpo_kwargs`).

Names. ``total = pg_weight * pg + sdpo_weight * sdpo + dpo_weight * dpo``.
The paper's ``alpha``/``beta`` channel weights are spelled out because TRL
users read ``beta`` as a coefficient *inside* one loss, and TRL itself uses it
for three different ones, each kept here under its trainer's prefix:

* ``kl_coef``: GRPO's KL penalty, ``GRPOConfig.beta`` (whose documentation
  calls it "KL coefficient"; verl and OpenRLHF call it ``kl_coef`` too);
* ``jsd_beta``: the generalized-JSD interpolation, ``GKDConfig.beta``;
* ``dpo_beta``: the DPO / SimPO inverse temperature, ``DPOConfig.beta``.

The old keys ``alpha``, ``beta`` and ``kl_beta`` fail with the new name
(:data:`ThreeChannelSettings.RENAMED`) instead of being silently mapped.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Annotated, Any, ClassVar, Literal, Mapping, Sequence, get_args

from pydantic import Field
from pydantic.dataclasses import dataclass

from composer_cloud.registry import reference_for
from composer_cloud.trainer.settings import (
    SETTINGS_CONFIG,
    BatchSize,
    DatasetSettings,
    FiniteFloat,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    parse_settings,
)
from composer_cloud.trainer.three_channel import signal
from composer_cloud.trainer.three_channel.dataset_task import CANONICAL, REWARD_NEEDS, REWARDS, missing_columns
from composer_cloud.trainer.three_channel.tasks import DEFAULT_HINT_TEMPLATE, TASKS, hint_source_reference

logger = logging.getLogger(__name__)

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
DPOVariant = Literal["sigmoid", "simpo"]
SDPOVariant = Literal["jsd", "taid", "entropy_opd"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
DPO_VARIANTS: tuple[str, ...] = ("sigmoid", "simpo")
Rollout = Literal["auto", "hf", "hf-fast", "vllm"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SDPO_VARIANTS: tuple[str, ...] = ("jsd", "taid", "entropy_opd")
ROLLOUTS: tuple[str, ...] = get_args(Rollout)
UnitFloat = Annotated[float, Field(ge=0.0, le=1.0)]


def resolve_rollout(rollout: str, device_type: str) -> str:
    """The rollout mode a replica on ``device_type`` (``"cuda"``, ``"cpu"``...) runs for the setting ``rollout``.

    ``"auto"`` is ``"hf-fast"`` on CUDA (several times faster than plain ``model.generate`` there, no extra
    package) and ``"hf"`` anywhere else (a CPU run samples with the trainer's own model, bit for bit as
    before the fast mode existed); any other mode is returned as it is.
    """
    if rollout not in ROLLOUTS:
        raise ValueError(f"trainer.rollout: {rollout!r} should be one of {', '.join(ROLLOUTS)}")
    if rollout != "auto":
        return rollout
    return "hf-fast" if device_type == "cuda" else "hf"


@dataclass(frozen=True, config=SETTINGS_CONFIG)
class ThreeChannelConfig:
    """Hyper-parameters of :func:`~composer_cloud.trainer.three_channel.loss.three_channel_loss`.

    ``total = pg_weight * pg + sdpo_weight * sdpo + dpo_weight * dpo``; a
    channel whose weight is 0 is not computed (nor its forward pass).

    Attributes:
        pg_weight: weight of channel 1 (GRPO policy gradient); 0 turns GRPO off.
        sdpo_weight: weight of channel 2 (self-distillation from the hinted model).
        dpo_weight: weight of channel 3 (DPO / SimPO on replayed pairs).
        loss_type: channel-1 aggregation, as ``GRPOConfig.loss_type``.
        epsilon: lower clip range of the ratio (``GRPOConfig.epsilon``).
        epsilon_high: upper clip range (DAPO's clip-higher, ``GRPOConfig.epsilon_high``).
        kl_coef: weight of the per-token k3 KL to the starting model
            (``GRPOConfig.beta``); 0 needs no reference model.
        kl_bias_correction: multiply the KL term by the ratio
            (``GRPOConfig.use_bias_correction_kl``).
        max_completion_length: new tokens at most; ``dr_grpo``'s normaliser.
        sdpo_variant: channel 2's divergence: ``"jsd"`` (generalized JSD),
            ``"taid"`` (TAID) or ``"entropy_opd"`` (entropy-aware on-policy
            distillation); see :mod:`~composer_cloud.trainer.three_channel.distill`.
        jsd_beta: generalized-JSD interpolation in ``[0, 1]`` (0 forward KL,
            1 reverse KL; ``GKDConfig.beta``).
        jsd_temperature: softmax temperature of the JSD.
        taid_schedule: ``"adaptive"`` (TAID's) or ``"linear"``.
        taid_t_start, taid_t_end: TAID's interpolation goes from ``t_start`` to ``t_end``.
        taid_alpha, taid_beta: the adaptive schedule's step size and momentum.
        taid_steps: optimizer steps over which the linear schedule (the
            adaptive one's floor) reaches ``t_end``.
        opd_h_max: entropy (nats) at which entropy-aware OPD is all forward
            KL; default ``log V`` (the uniform distribution's).
        dpo_beta: DPO inverse temperature (SimPO: its ``beta``; ``DPOConfig.beta``).
        dpo_variant: ``"sigmoid"`` (DPO, needs reference log-probs) or ``"simpo"``.
        simpo_gamma: SimPO target margin (nats per token).
    """

    pg_weight: NonNegativeFloat = 1.0
    sdpo_weight: NonNegativeFloat = 0.1
    dpo_weight: NonNegativeFloat = 0.5
    # channel 1
    loss_type: LossType = "dapo"
    epsilon: NonNegativeFloat = 0.2
    epsilon_high: NonNegativeFloat = 0.28
    kl_coef: NonNegativeFloat = 0.0
    kl_bias_correction: bool = True
    max_completion_length: PositiveInt | None = None
    # channel 2
    sdpo_variant: SDPOVariant = "jsd"
    jsd_beta: UnitFloat = 0.5
    jsd_temperature: PositiveFloat = 1.0
    taid_schedule: Literal["adaptive", "linear"] = "adaptive"
    taid_t_start: UnitFloat = 0.4
    taid_t_end: UnitFloat = 1.0
    taid_alpha: UnitFloat = 5e-4
    taid_beta: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.99
    taid_steps: PositiveInt = 1000
    opd_h_max: PositiveFloat | None = None
    # channel 3
    dpo_beta: PositiveFloat = 0.1
    dpo_variant: DPOVariant = "sigmoid"
    simpo_gamma: FiniteFloat = 0.5

    def __post_init__(self) -> None:
        if self.taid_t_start > self.taid_t_end:
            raise ValueError(
                f"trainer.taid_t_start ({self.taid_t_start}) must not exceed trainer.taid_t_end ({self.taid_t_end})"
            )
        if self.loss_type == "dr_grpo" and self.completion_length is None:
            raise ValueError(
                "trainer.max_completion_length: loss_type 'dr_grpo' needs it "
                "(its normaliser is B * max_completion_length)"
            )

    @property
    def completion_length(self) -> int | None:
        """New tokens at most per completion (``None``: not fixed)."""
        return self.max_completion_length

    @property
    def pg_active(self) -> bool:
        return self.pg_weight != 0.0

    @property
    def sdpo_active(self) -> bool:
        return self.sdpo_weight != 0.0

    @property
    def dpo_active(self) -> bool:
        return self.dpo_weight != 0.0


# ThreeChannelSettings field -> GRPOConfig field; max_completion_length is sent as ``completion_length``.
_GRPO_FIELDS: dict[str, str] = {
    "batch_size": "per_device_train_batch_size",
    "num_generations": "num_generations",
    "max_completion_length": "max_completion_length",
    "temperature": "temperature",
    "loss_type": "loss_type",
    "epsilon": "epsilon",
    "epsilon_high": "epsilon_high",
    "kl_coef": "beta",
    "kl_bias_correction": "use_bias_correction_kl",
    "scale_rewards": "scale_rewards",
    "mask_truncated_completions": "mask_truncated_completions",
    "num_iterations": "num_iterations",
    "steps_per_generation": "steps_per_generation",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "vllm_importance_sampling_correction": "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode": "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min": "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max": "vllm_importance_sampling_clip_max",
    "vllm_gpu_memory_utilization": "vllm_gpu_memory_utilization",
}


@dataclass(frozen=True, config=SETTINGS_CONFIG)
class ThreeChannelSettings(ThreeChannelConfig, DatasetSettings):
    """The ``[trainer]`` table for ``name = "three-channel"`` (all keys optional).

    The loss keys are those of :class:`ThreeChannelConfig`. Sizes:
    ``batch_size`` completions per micro-batch (per optimizer step when
    ``gradient_accumulation_steps`` is 1), in groups of ``num_generations``
    per prompt; ``max_completion_length`` new tokens at most (default: the
    spec's ``seq_len``). See ``docs/trainer.md`` for the table with defaults.

    Attributes (beyond the loss's):
        batch_size, seq_len, num_generations, temperature, scale_rewards,
        mask_truncated_completions, num_iterations, steps_per_generation,
            gradient_accumulation_steps: sampling and batching, as the
            ``GRPOConfig`` fields of :meth:`grpo_kwargs`.
        hint_source: ``"default"`` (the task's), ``"none"``, ``"column:NAME"``
            or ``"module:factory"``.
        hint_template: how a hint is put before a plain-text prompt; has
            ``{hint}`` and ends with ``{prompt}``.
        sdpo_skip_successful: leave completions whose reward is at least
            ``success_reward`` out of channel 2 (TRL SDPO's
            ``dont_reprompt_on_self_success``): a correct answer needs no teacher.
        success_reward: the reward that counts as success.
        sdpo_exclude_eos: leave EOS tokens out of channel 2. The hint changes
            what the teacher's context looks like as a document, which skews
            its end-of-answer prediction more than its content prediction;
            a model that cannot use hints well (e.g. the tiny demo model) is
            otherwise taught to stop less and less often.
        max_teacher_prompt_length: the teacher's prompt keeps its last this-many tokens.
        replay_batch_size: pairs per optimizer step in channel 3.
        pairs: ``"auto"`` (the demo's pairs with the demo task, none otherwise), ``"builtin"``,
            ``"none"``, or an fsspec URI / path of a pairs JSONL.
        pairs_storage_options: fsspec options for ``pairs`` (may hold credentials: never logged).
        task: a registered task name or ``"module:factory"``; ``task_options`` are its keyword arguments.
        sandbox_*: limits of the demo task's test sandbox (seconds, MiB, worker processes).
        eval_examples: held-out rows scored by ``evaluate()``.
        log_samples: (prompt, completion, reward) samples of each round's last generation a replica writes to
            the store (TRL's ``log_completions``, bounded: at most 64; 0 writes none).
        dataset, dataset_config, dataset_split, data_files, eval_split, eval_fraction, columns, reward:
            train on a dataset instead of a task (``docs/datasets.md``,
            :mod:`composer_cloud.trainer.three_channel.dataset_task`).
        rollout: ``"auto"`` (default: ``"hf-fast"`` on a CUDA device, ``"hf"`` elsewhere), ``"hf"``
            (``model.generate`` on the trainer's model), ``"hf-fast"`` (a bf16 inference copy with a static,
            compiled KV cache: :mod:`~composer_cloud.trainer.three_channel.fast_rollout`) or ``"vllm"``
            (TRL's colocated vLLM engine, ``[vllm]`` extra).
        vllm_importance_sampling_correction, vllm_importance_sampling_mode, vllm_importance_sampling_clip_min,
            vllm_importance_sampling_clip_max: ``GRPOConfig``'s correction of channel 1 for the gap
            between the sampler's log-probs and the trainer's (``rollout = "vllm"`` and ``"hf-fast"``).
        vllm_gpu_memory_utilization: share of the GPU's memory vLLM may take (the trainer shares the GPU).
    """

    TRAINER: ClassVar[str] = "three-channel"
    FACTORY: ClassVar[str] = "composer_cloud.trainer.three_channel.adapter:build_three_channel_trainer"
    #: old ``[trainer]`` key -> new key; an old key is an error that names the new one.
    RENAMED: ClassVar[dict[str, str]] = {"alpha": "sdpo_weight", "beta": "dpo_weight", "kl_beta": "kl_coef"}
    #: the settings that may name code a replica imports (``hint_source = "column:NAME"`` names a column).
    CODE_SETTINGS: ClassVar[tuple[str, ...]] = ("task", "hint_source", "reward")
    LOSS_CHANNELS: ClassVar[dict[str, str]] = signal.CHANNELS
    DIAGNOSIS: ClassVar[dict[str, str]] = signal.DIAGNOSIS
    LOSS_NAME: ClassVar[str | None] = "three-channel loss (pg_weight·pg + sdpo_weight·sdpo + dpo_weight·dpo)"

    batch_size: BatchSize = 8
    seq_len: PositiveInt = 64
    num_generations: Annotated[int, Field(ge=2)] = 4  # group-relative advantages need two or more
    temperature: PositiveFloat = 1.0
    # channel 1 (beyond the loss's keys)
    scale_rewards: Literal["group", "batch", "none"] = "group"
    mask_truncated_completions: bool = True
    num_iterations: PositiveInt = 1
    steps_per_generation: BatchSize = 1  # multiplies the generation batch: same bound
    gradient_accumulation_steps: BatchSize = 1  # multiplies the optimizer step's batch: same bound
    # channel 2
    hint_source: str = "default"
    hint_template: str = DEFAULT_HINT_TEMPLATE
    sdpo_skip_successful: bool = True
    success_reward: FiniteFloat = 1.0
    sdpo_exclude_eos: bool = True
    max_teacher_prompt_length: PositiveInt = 1024
    # channel 3
    replay_batch_size: BatchSize = 2
    pairs: Annotated[str, Field(min_length=1)] = "auto"
    pairs_storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # task
    task: str = "python-functions"
    task_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    sandbox_timeout_s: PositiveFloat = 5.0
    sandbox_per_test_timeout_s: PositiveFloat = 1.0
    sandbox_memory_mb: PositiveInt = 256
    sandbox_workers: PositiveInt = 2
    eval_examples: NonNegativeInt = 16
    log_samples: Annotated[int, Field(ge=0, le=64)] = 4
    # a dataset instead of a task (the dataset keys: DatasetSettings; composer_cloud.trainer.three_channel.dataset_task)
    reward: str | None = None
    # rollouts (docs/gpu.md)
    rollout: Rollout = "auto"
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: ISMode = "sequence_mask"
    vllm_importance_sampling_clip_min: NonNegativeFloat | None = None
    vllm_importance_sampling_clip_max: PositiveFloat | None = 3.0
    vllm_gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"trainer.vllm_importance_sampling_clip_min ({lo}) must be < "
                             f"trainer.vllm_importance_sampling_clip_max ({hi})")
        if self.vllm_importance_sampling_mode.endswith("_truncate") and lo is None and hi is None:
            raise ValueError("trainer.vllm_importance_sampling_clip_max: a *_truncate mode needs a bound "
                             "(clip_max or clip_min)")
        # TRL's rule: whole groups per generation batch (a micro-batch may split a group).
        if (self.batch_size * self.steps_per_generation) % self.num_generations:
            raise ValueError(
                f"trainer.batch_size × trainer.steps_per_generation ({self.batch_size} × {self.steps_per_generation}, "
                f"the generation batch) must be a multiple of trainer.num_generations ({self.num_generations})"
            )
        if "{hint}" not in self.hint_template or not self.hint_template.endswith("{prompt}"):
            raise ValueError("trainer.hint_template must contain '{hint}' and end with '{prompt}'")
        try:
            self.hint_template.format(hint="", prompt="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"trainer.hint_template: {exc!r}; use only '{{hint}}' and '{{prompt}}' (double other braces)"
            ) from None
        self.check_dataset_keys(CANONICAL, also=("reward",), describe=(
            f"the mapping's keys are {', '.join(CANONICAL)} (canonical name = the dataset's column); other "
            "columns are kept as they are"))
        if self.dataset is not None:
            if self.task != "python-functions":
                raise ValueError(
                    f"trainer.dataset and trainer.task {self.task!r}: a dataset run uses the built-in dataset "
                    "task; drop trainer.task, or load the dataset in your own task"
                )
            reference_for(self.effective_reward, REWARDS, setting="trainer.reward")
        if self.pairs == "builtin" and self.effective_task != "python-functions":
            logger.warning(
                "trainer.pairs = 'builtin' replays the demo task's pairs although the run trains on %s",
                self.effective_task,
            )
        reference_for(self.task, TASKS, setting="trainer.task")
        hint_source_reference(self.hint_source)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "ThreeChannelSettings":
        """From a ``[trainer]`` table; ``ValueError`` naming ``trainer.<key>`` on bad input."""
        return parse_settings(cls, settings, trainer=cls.TRAINER)

    @staticmethod
    def check_lora_dropout(dropout: float) -> None:
        """Refuse LoRA dropout: GRPO's importance ratios compare two forwards of the same tokens.

        One check for both sides: the replica's factory calls it on the built model's adapter config,
        the launcher (``--dry-run`` included) on ``[model.lora] dropout`` through :meth:`check_model`.
        """
        if dropout:
            raise ValueError("model.lora.dropout: the three-channel trainer runs without dropout (GRPO's importance "
                             f"ratios compare two forwards of the same tokens); set it to 0 (got {dropout})")

    @classmethod
    def check_model(cls, model: Any) -> None:
        """Refuse a ``[model]`` table this trainer cannot train (``ValueError`` naming the field); no torch."""
        lora = getattr(model, "lora", None)
        if lora is not None:
            cls.check_lora_dropout(lora.dropout)

    @classmethod
    def names_code(cls, key: str, value: str) -> bool:
        """A ``"module:attr"`` value names code, except ``hint_source = "column:NAME"`` (a dataset column)."""
        if key == "hint_source" and value.startswith("column:"):
            return False
        return super().names_code(key, value)

    def check_launch(self, spec: Any) -> None:
        """``rollout = "vllm"`` only where local replicas can run it (vLLM installed, a GPU); ``ValueError``."""
        if self.rollout != "vllm":
            return  # nothing of TRL is imported for other runs
        from composer_cloud.trainer.three_channel.rollout import check_rollout_before_launch

        check_rollout_before_launch(spec)

    def dataset_problems(self, available: Sequence[str]) -> list[str]:
        """The mapped columns exist, and the reward's column (``REWARD_NEEDS``) is there."""
        needed = [REWARD_NEEDS[self.effective_reward]] if self.effective_reward in REWARD_NEEDS else []
        return missing_columns(self.columns, available, needed=needed)

    def launch_refusal(self, columns: Sequence[str] | None) -> str | None:
        """No channel can produce a gradient (:func:`~composer_cloud.trainer.three_channel.signal.launch_refusal`)."""
        return signal.launch_refusal(self, columns)

    def launch_notes(self, columns: Sequence[str] | None) -> list[str]:
        """What channel 2 distils from on a dataset run (:func:`~.signal.hint_note`)."""
        note = signal.hint_note(self, columns)
        return [note] if note else []

    def training_plan(self, device_type: str) -> list[tuple[str, str]]:
        """Channels and their inputs, data, rollout on ``device_type``, sizes (:func:`~.plan.plan_rows`)."""
        from composer_cloud.trainer.three_channel.plan import plan_rows

        return plan_rows(self, device_type, resolve_rollout(self.rollout, device_type))

    def diagnosis_notes(self, diagnosis: Mapping[str, tuple[float, float]]) -> list[str]:
        """Most groups with equal rewards, most completions truncated (:func:`~.signal.diagnosis_notes`)."""
        return signal.diagnosis_notes(self, diagnosis)

    def silence_reasons(self, steps: Sequence[Mapping[str, Any]]) -> list[str]:
        """Each silent channel and what to change (:func:`~.signal.channel_reasons`)."""
        return signal.channel_reasons(self, steps)

    @property
    def effective_task(self) -> str:
        """``"dataset"`` when ``dataset`` is set, else ``task``."""
        return "dataset" if self.dataset is not None else self.task

    @property
    def effective_reward(self) -> str:
        """The dataset task's reward: ``reward``, default ``"exact_match"``."""
        return self.reward or "exact_match"

    @property
    def effective_pairs(self) -> str:
        """``pairs`` with ``"auto"`` resolved: the demo's pairs only for the demo task, else ``"none"``.

        The built-in pairs are replays of the demo task; training another task on them would teach
        the model the demo's answers, so a custom task or a dataset never gets them by default.
        """
        if self.pairs != "auto":
            return self.pairs
        return "builtin" if self.effective_task == "python-functions" else "none"

    @property
    def completion_length(self) -> int:
        """``max_completion_length``, or ``seq_len`` when that is not set."""
        return self.max_completion_length or self.seq_len

    def grpo_kwargs(self) -> dict[str, Any]:
        """The ``GRPOConfig`` keyword arguments these settings determine (TRL's names).

        ``ThreeChannelGRPOTrainer`` checks that its ``GRPOConfig`` agrees with
        its settings on exactly these, so build the config as
        ``GRPOConfig(**settings.grpo_kwargs(), output_dir=..., ...)``.
        """
        out = {grpo: getattr(self, ours) for ours, grpo in _GRPO_FIELDS.items()}
        out["max_completion_length"] = self.completion_length
        # One GPU per replica: vLLM runs inside the training process (TRL's colocate mode).
        out["use_vllm"] = self.rollout == "vllm"
        out["vllm_mode"] = "colocate"
        return out


__all__ = ["DPO_VARIANTS", "LOSS_TYPES", "ROLLOUTS", "DPOVariant", "ISMode", "LossType", "Rollout",
           "ThreeChannelConfig", "ThreeChannelSettings", "resolve_rollout"]
