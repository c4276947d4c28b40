"""The three-channel trainer: TRL's ``GRPOTrainer`` with the loss of :mod:`.loss`.

Two layers:

* :class:`ThreeChannelGRPOTrainer` subclasses ``trl.GRPOTrainer`` and keeps
  everything TRL does for a GRPO step (prompt tokenisation, sampling,
  reward calls, group-normalised advantages, the reference model for the KL
  term) and replaces the loss by :func:`~.loss.three_channel_loss`:

  1. **pg**: the policy-gradient loss on the sampled completions;
  2. **sdpo**: a no-grad forward of the *same* model on the hint-augmented
     prompt followed by the *same* completion tokens is the teacher; the
     generalized JSD between its next-token distributions and the student's
     (unhinted) ones, on the completion tokens;
  3. **dpo**: a minibatch of replayed (chosen, rejected) pairs with stored
     reference log-probs.

* :class:`ThreeChannelTrainer` implements the runtime's
  :class:`~composer_cloud.trainer.base.InnerTrainer` around it: ``step()`` is
  exactly one inner optimizer step that *we* drive (``training_step`` on a
  batch from our own seeded prompt stream, clip, ``optimizer.step()``,
  ``zero_grad()``), never ``Trainer.train()``, because torchft's DiLoCo hooks
  that optimizer and the runtime checkpoints at step boundaries. The learning
  rate is constant (no scheduler is ever stepped). ``state_dict()`` holds the
  optimizer state, the data and replay positions, TRL's generation buffer and
  every RNG the step draws from, so a resumed run is bitwise identical to an
  uninterrupted one on CPU.

Compatibility: this module relies on private ``GRPOTrainer`` methods. At
import, :func:`check_trl_compatibility` verifies their signatures and fails
with a message naming the supported TRL range (:data:`TRL_SUPPORTED`, the same
pin as ``pyproject.toml``) when they changed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
import trl
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, pad, selective_log_softmax

from composer_cloud.trainer.base import TrainerContext
from composer_cloud.trainer.loss import (
    DPOInputs,
    LossOutput,
    PGInputs,
    SDPOInputs,
    ThreeChannelConfig,
    three_channel_loss,
)
from composer_cloud.trainer.replay import ReplayBatch, ReplayBuffer, default_pairs_uri, load_pairs
from composer_cloud.trainer.sandbox import SandboxLimits
from composer_cloud.trainer.tasks import (
    DEFAULT_HINT_TEMPLATE,
    HintSource,
    NoHints,
    VerifiableTask,
    apply_hint,
    build_task,
    make_reward_func,
    resolve_hint_source,
)

logger = logging.getLogger(__name__)

TRL_SUPPORTED = ">=1.16,<1.17"  # keep in sync with pyproject.toml
_TRL_MIN, _TRL_MAX = Version("1.16"), Version("1.17")

# Private GRPOTrainer methods this module overrides or calls, with the leading
# parameters it relies on. Extra trailing parameters are fine if they have
# defaults (our calls stay valid); anything else is a break.
_EXPECTED_HOOKS: dict[str, tuple[str, ...]] = {
    "_generate_and_score_completions": ("self", "inputs"),
    "_compute_loss": ("self", "model", "inputs"),
    "_prepare_inputs": ("self", "generation_batch"),
    "_tokenize_prompts": ("self", "prompts"),
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
    ),
    "training_step": ("self", "model", "inputs", "num_items_in_batch"),
}
# Instance attributes of GRPOTrainer read or written here (checked after __init__).
_EXPECTED_ATTRS = ("_step", "_buffered_inputs", "_metrics", "eos_token_ids", "temperature", "num_iterations")


class TRLCompatibilityError(ImportError):
    """The installed TRL's ``GRPOTrainer`` no longer matches what this module overrides."""


def check_trl_compatibility(cls: type = GRPOTrainer, version: str | None = None) -> None:
    """Raise :class:`TRLCompatibilityError` when ``cls`` lacks a hook or a hook's signature changed.

    A version outside :data:`TRL_SUPPORTED` whose hooks still match only logs a warning.
    """
    version = version or trl.__version__
    problems: list[str] = []
    for name, expected in _EXPECTED_HOOKS.items():
        fn = getattr(cls, name, None)
        if fn is None or not callable(fn):
            problems.append(f"GRPOTrainer.{name} is missing")
            continue
        params = list(inspect.signature(fn).parameters.values())
        names = tuple(p.name for p in params[: len(expected)])
        extra_required = [
            p.name
            for p in params[len(expected) :]
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if names != expected or extra_required:
            got = "(" + ", ".join(p.name for p in params) + ")"
            problems.append(f"GRPOTrainer.{name}{got}, expected ({', '.join(expected)}, ...)")
    if problems:
        raise TRLCompatibilityError(
            f"composer_cloud's three-channel trainer supports trl{TRL_SUPPORTED}, but the installed trl "
            f"{version} changed the private GRPOTrainer hooks it overrides: " + "; ".join(problems) + ". "
            f"Install a supported version (pip install 'trl{TRL_SUPPORTED}')."
        )
    v = Version(version)
    if not (_TRL_MIN <= v < _TRL_MAX):
        logger.warning("trl %s is outside the tested range trl%s; its hooks still match", version, TRL_SUPPORTED)


check_trl_compatibility()


# --------------------------------------------------------------------------- the TRL subclass
@dataclass(frozen=True)
class ChannelArgs:
    """Channel 2 and 3 settings of :class:`ThreeChannelGRPOTrainer` (channel 1 comes from ``GRPOConfig``).

    Attributes:
        pg_weight: weight of channel 1 (1 in the paper formula; 0 turns GRPO off).
        alpha: weight of channel 2 (SDPO). 0 skips the teacher forward entirely.
        beta: weight of channel 3 (replay DPO). 0 skips the replay forward entirely.
        jsd_beta: generalized-JSD interpolation (0 forward KL, 1 reverse KL).
        jsd_temperature: softmax temperature of the JSD.
        dpo_beta: DPO inverse temperature (SimPO: its ``beta``).
        dpo_variant: ``"sigmoid"`` (DPO) or ``"simpo"``.
        simpo_gamma: SimPO target margin (nats per token).
        replay_batch_size: pairs per optimizer step in channel 3.
        sdpo_skip_successful: leave completions whose reward is at least
            ``success_reward`` out of channel 2 (TRL SDPO's
            ``dont_reprompt_on_self_success``): a correct answer needs no teacher.
        success_reward: the reward that counts as success.
        sdpo_exclude_eos: leave EOS tokens out of channel 2. The hint changes
            what the teacher's context looks like as a document, which skews
            its end-of-answer prediction more than its content prediction;
            a model that cannot use hints well (e.g. the tiny demo model) is
            otherwise taught to stop less and less often.
        hint_template: how a hint is put before a plain-text prompt.
        max_teacher_prompt_length: the teacher's prompt keeps its last this-many tokens.
    """

    pg_weight: float = 1.0
    alpha: float = 0.1
    beta: float = 0.5
    jsd_beta: float = 0.5
    jsd_temperature: float = 1.0
    dpo_beta: float = 0.1
    dpo_variant: str = "sigmoid"
    simpo_gamma: float = 0.5
    replay_batch_size: int = 2
    sdpo_skip_successful: bool = True
    success_reward: float = 1.0
    sdpo_exclude_eos: bool = True
    hint_template: str = DEFAULT_HINT_TEMPLATE
    max_teacher_prompt_length: int = 1024


_UNSUPPORTED_ARGS: dict[str, Any] = {
    # GRPOConfig option -> the only value the three-channel loss implements
    "importance_sampling_level": "token",
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
    "use_vllm": False,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "delta": None,
}


class ThreeChannelGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose loss is ``pg_weight * pg + alpha * sdpo + beta * dpo``.

    Channel-1 hyper-parameters are read from ``args`` (``loss_type``,
    ``epsilon``, ``epsilon_high``, ``beta`` as the KL coefficient,
    ``use_bias_correction_kl``, ``max_completion_length``) so that with ``alpha = beta = 0`` the loss
    equals stock ``GRPOTrainer``'s. ``loss_type`` must be one of ``grpo``,
    ``bnpo``, ``dr_grpo``, ``dapo``; options of ``GRPOConfig`` listed in
    ``_UNSUPPORTED_ARGS`` must keep their defaults.

    With ``args.beta != 0`` the KL reference is a frozen copy of ``model`` as
    passed in (TRL would otherwise try to download it by name).
    """

    def __init__(
        self,
        *args: Any,
        channel_args: ChannelArgs | None = None,
        hint_source: HintSource | None = None,
        replay: ReplayBuffer | None = None,
        **kwargs: Any,
    ) -> None:
        grpo_args: GRPOConfig = kwargs.get("args") if "args" in kwargs else args[2]
        model = kwargs.get("model") if "model" in kwargs else args[0]
        for name, supported in _UNSUPPORTED_ARGS.items():
            if getattr(grpo_args, name, supported) != supported:
                raise ValueError(
                    f"three-channel trainer: GRPOConfig.{name} must be {supported!r} (the loss does not implement it)"
                )
        self.channel_args = channel_args or ChannelArgs()
        self.hint_source: HintSource = hint_source or NoHints()
        self.replay = replay
        kl_beta = float(grpo_args.beta)
        ref_model = None
        if kl_beta != 0.0:
            # Copy before TRL patches model.forward (a deepcopy of the patched
            # model would keep calling the original's forward), and hide the
            # coefficient from TRL's __init__, which would load the reference by name.
            ref_model = copy.deepcopy(model).eval().requires_grad_(False)
            grpo_args.beta = 0.0
        try:
            super().__init__(*args, **kwargs)
        finally:
            grpo_args.beta = kl_beta
        if ref_model is not None:
            self.beta = kl_beta
            self.ref_model = ref_model.to(self.accelerator.device)
            add_fused_lm_head(self.ref_model, temperature=self.temperature)
        missing = [a for a in _EXPECTED_ATTRS if not hasattr(self, a)]
        if missing:
            raise TRLCompatibilityError(
                f"trl {trl.__version__}: GRPOTrainer instances no longer have {missing}; supported: trl{TRL_SUPPORTED}"
            )
        if self._is_vlm:
            raise ValueError("three-channel trainer: vision-language models are not supported")
        if self.aux_loss_enabled:
            raise ValueError("three-channel trainer: MoE router aux loss is not supported; set router_aux_loss_coef=0")
        ca = self.channel_args
        self.loss_config = ThreeChannelConfig(
            pg_weight=ca.pg_weight,
            alpha=ca.alpha,
            beta=ca.beta,
            loss_type=self.loss_type,
            epsilon=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            kl_beta=kl_beta,
            kl_bias_correction=bool(self.args.use_bias_correction_kl),
            max_completion_length=self.max_completion_length,
            jsd_beta=ca.jsd_beta,
            jsd_temperature=ca.jsd_temperature,
            dpo_beta=ca.dpo_beta,
            dpo_variant=ca.dpo_variant,  # type: ignore[arg-type]
            simpo_gamma=ca.simpo_gamma,
        )
        needs_reference = ca.dpo_variant == "sigmoid" and replay is not None and not replay.has_reference
        if self.loss_config.dpo_active and needs_reference:
            logger.info("replay pairs have no stored reference log-probs; computing them with the initial model")
            self.fill_replay_reference()
        # Set by Trainer.train(), which we never call; one training_step per micro-batch.
        self.current_gradient_accumulation_steps = self.args.gradient_accumulation_steps
        self.last_loss_output: LossOutput | None = None

    # ------------------------------------------------------------------ data for channels 2 and 3
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[no-untyped-def]
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = rewards_per_func  # (all processes' rows, n_funcs); read just below
        return rewards_per_func

    def _local_rewards(self, n: int) -> torch.Tensor:
        """This process's ``n`` rewards of the generation batch being scored (weighted sum over reward functions)."""
        rpf = self._rewards_per_func
        rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
        start = self.accelerator.process_index * n
        return rewards[start : start + n]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._rewards_per_func = None
        output = super()._generate_and_score_completions(inputs)
        if not self.loss_config.sdpo_active:
            return output
        # The teacher prompt of each row: its prompt with the hint in context.
        # Built here, once per generation batch, so the tensors are shuffled
        # and split together with the completions they belong to.
        hints = self.hint_source.hints(inputs)
        if len(hints) != len(inputs):
            raise ValueError(f"hint source returned {len(hints)} hints for {len(inputs)} rows")
        prompts = [row["prompt"] for row in inputs]
        teacher_prompts = [
            p if h is None else apply_hint(p, h, self.channel_args.hint_template) for p, h in zip(prompts, hints)
        ]
        ids, _, _ = self._tokenize_prompts(teacher_prompts)
        keep = self.channel_args.max_teacher_prompt_length
        tensors = [torch.tensor(list(x)[-keep:], dtype=torch.long) for x in ids]
        device = self.accelerator.device
        pad_id = self._tokenizer.pad_token_id
        output["teacher_prompt_ids"] = pad(tensors, padding_value=pad_id, padding_side="left").to(device)
        masks = [torch.ones_like(t) for t in tensors]
        output["teacher_prompt_mask"] = pad(masks, padding_value=0, padding_side="left").to(device)
        has_hint = torch.tensor([h is not None for h in hints], dtype=torch.bool, device=device)
        if self.channel_args.sdpo_skip_successful and self._rewards_per_func is not None:
            has_hint &= ~(self._local_rewards(len(inputs)).to(device) >= self.channel_args.success_reward)
        output["has_hint"] = has_hint
        return output

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self.loss_config.dpo_active and self.replay is not None:
            # Drawn per optimizer micro-step from the buffer's own seeded walk.
            batch = self.replay.sample(self.channel_args.replay_batch_size, self.accelerator.device)
            inputs = {**inputs, "replay": batch}
        return inputs

    # ------------------------------------------------------------------ forwards
    def completion_logits(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
    ) -> torch.Tensor:
        """``(B, logits_to_keep, V)`` logits predicting the last ``logits_to_keep`` tokens, over TRL's temperature."""
        with self.accelerator.autocast():
            out = model(
                input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1, use_cache=False
            )
        return out.logits[:, :-1, :].float() / self.temperature

    def sequence_logps(self, model: torch.nn.Module, batch: ReplayBatch) -> torch.Tensor:
        """``(2n,)`` summed response log-probs of a replay batch (TRL's fused, logits-free path)."""
        logps, _, _ = self._get_per_token_logps_and_entropies(
            model, batch.input_ids, batch.attention_mask, batch.logits_to_keep
        )
        return (logps * batch.response_mask).sum(-1)

    def fill_replay_reference(self) -> None:
        """Store reference log-probs of every replay pair under the current model."""
        if self.replay is None:
            return
        model = self.model
        self.replay.fill_reference(lambda b: self.sequence_logps(model, b), device=self.accelerator.device)

    # ------------------------------------------------------------------ the loss
    def compute_three_channel_loss(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], config: ThreeChannelConfig | None = None
    ) -> LossOutput:
        """The unscaled three-channel loss of one micro-batch (``config`` overrides weights, e.g. in tests)."""
        cfg = config or self.loss_config
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        C = completion_ids.size(1)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)

        has_hint = inputs.get("has_hint")
        sdpo_rows = None
        if cfg.sdpo_active and has_hint is not None and bool(has_hint.any()):
            sdpo_rows = has_hint.nonzero(as_tuple=True)[0]

        pg = sdpo = dpo = None
        entropy = None
        student_logits = None
        if cfg.pg_active and sdpo_rows is not None:
            # One student forward feeds both channels: full logits are needed for the JSD anyway.
            student_logits = self.completion_logits(model, input_ids, attention_mask, C)
            logp = selective_log_softmax(student_logits, completion_ids)
            with torch.no_grad():
                entropy = _masked_entropy(student_logits, mask)
        elif cfg.pg_active:
            # Channel 1 alone: TRL's fused LM head, no (B, C, V) logits.
            logp, ent, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, C, compute_entropy=True
            )
            entropy = (ent * mask).sum() / mask.sum().clamp(min=1)
        elif sdpo_rows is not None:
            student_logits = self.completion_logits(model, input_ids[sdpo_rows], attention_mask[sdpo_rows], C)

        if cfg.pg_active:
            advantages = inputs["advantages"]
            num_items = inputs.get("num_items_in_batch")
            if num_items is not None:
                # TRL's dapo normaliser without the accumulation factor (applied by the caller).
                num_items = num_items / self.accelerator.num_processes / self.args.steps_per_generation
            pg = PGInputs(
                logp=logp,
                advantages=advantages,
                mask=mask,
                old_logp=inputs.get("old_per_token_logps"),
                ref_logp=inputs.get("ref_per_token_logps") if cfg.kl_beta != 0.0 else None,
                num_items=num_items,
            )

        if sdpo_rows is not None:
            assert student_logits is not None
            s_logits = student_logits[sdpo_rows] if student_logits.size(0) != sdpo_rows.numel() else student_logits
            t_ids = torch.cat([inputs["teacher_prompt_ids"][sdpo_rows], completion_ids[sdpo_rows]], dim=1)
            t_mask = torch.cat([inputs["teacher_prompt_mask"][sdpo_rows], completion_mask[sdpo_rows]], dim=1)
            with torch.no_grad():
                t_logits = self.completion_logits(model, t_ids, t_mask, C)
            sdpo_mask = mask[sdpo_rows]
            if self.channel_args.sdpo_exclude_eos:
                eos = torch.tensor(self.eos_token_ids, device=completion_ids.device)
                sdpo_mask = sdpo_mask * ~torch.isin(completion_ids[sdpo_rows], eos)
            sdpo = SDPOInputs(student_logits=s_logits, teacher_logits=t_logits, mask=sdpo_mask)

        replay: ReplayBatch | None = inputs.get("replay")
        if cfg.dpo_active and replay is not None:
            n = replay.n_pairs
            seq = self.sequence_logps(model, replay)
            ref = replay.ref_logp
            dpo = DPOInputs(
                policy_chosen_logp=seq[:n],
                policy_rejected_logp=seq[n:],
                ref_chosen_logp=None if ref is None else ref[:n],
                ref_rejected_logp=None if ref is None else ref[n:],
                chosen_length=replay.lengths[:n],
                rejected_length=replay.lengths[n:],
            )

        out = three_channel_loss(cfg, pg=pg, sdpo=sdpo, dpo=dpo)
        if entropy is not None:
            out.metrics["entropy"] = entropy.detach()
        return out

    def _compute_loss(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
        out = self.compute_three_channel_loss(model, inputs)
        self.last_loss_output = out
        mode = "train" if self.model.training else "eval"
        for k, v in out.metrics.items():
            self._metrics[mode][k].append(float(v))
        # Gradient accumulation: TRL divides grpo/bnpo/dr_grpo by the number of
        # micro-steps and folds it into dapo's token normaliser; dividing the
        # total once is the same for channel 1 and averages channels 2 and 3.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        return out.total / accumulation


@torch.no_grad()
def _masked_entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    m = mask.to(ent.dtype)
    return (ent * m).sum() / m.sum().clamp(min=1)


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class ThreeChannelSettings:
    """The ``[trainer]`` table for ``name = "three-channel"`` (all keys optional).

    Sizes: ``batch_size`` completions per micro-batch (per optimizer step
    when ``gradient_accumulation_steps`` is 1), in groups of
    ``num_generations`` per prompt; ``max_completion_length`` new tokens at
    most (default: the spec's ``seq_len``). See ``docs/trainer.md`` for the rest.
    """

    batch_size: int = 8
    seq_len: int = 64
    num_generations: int = 4
    max_completion_length: int | None = None
    temperature: float = 1.0
    # channel 1
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    kl_beta: float = 0.0
    scale_rewards: str = "group"
    mask_truncated_completions: bool = True
    num_iterations: int = 1
    steps_per_generation: int = 1
    gradient_accumulation_steps: int = 1
    # weights
    pg_weight: float = 1.0
    alpha: float = 0.1
    beta: float = 0.5
    # channel 2
    jsd_beta: float = 0.5
    jsd_temperature: float = 1.0
    hint_source: str = "default"
    hint_template: str = DEFAULT_HINT_TEMPLATE
    sdpo_skip_successful: bool = True
    success_reward: float = 1.0
    sdpo_exclude_eos: bool = True
    # channel 3
    dpo_beta: float = 0.1
    dpo_variant: str = "sigmoid"
    simpo_gamma: float = 0.5
    replay_batch_size: int = 2
    pairs: str = "builtin"
    pairs_storage_options: dict = field(default_factory=dict)
    # task
    task: str = "python-functions"
    task_options: dict = field(default_factory=dict)
    sandbox_timeout_s: float = 5.0
    sandbox_per_test_timeout_s: float = 1.0
    sandbox_memory_mb: int = 256
    sandbox_workers: int = 2
    eval_examples: int = 16
    name: str = "three-channel"

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "ThreeChannelSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"trainer: unknown three-channel settings {unknown}; valid: {sorted(names)}")
        out = cls(**dict(settings))
        if out.batch_size % out.num_generations:
            raise ValueError(
                f"trainer.batch_size ({out.batch_size}) must be a multiple of "
                f"trainer.num_generations ({out.num_generations})"
            )
        if out.num_generations < 2:
            raise ValueError("trainer.num_generations must be >= 2 (group-relative advantages)")
        return out

    @property
    def completion_length(self) -> int:
        return self.max_completion_length or self.seq_len


# --------------------------------------------------------------------------- prompt stream
class PromptStream:
    """This rank's shard of the training rows, walked in a fresh seeded order each epoch.

    Rank ``r`` of ``W`` owns rows ``r, r + W, ...``; its state is ``(epoch, position)``.
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]], *, seed: int, rank: int, world_size: int) -> None:
        self.rows = [dict(r) for r in list(rows)[rank::world_size]]
        if not self.rows:
            raise ValueError(f"rank {rank} of {world_size} has no training rows ({len(rows)} rows in all)")
        self.seed = seed * 1_000_003 + rank
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while len(out) < n:
            order = self._order(self.epoch)
            i = order[self.position]
            out.append(dict(self.rows[i]))
            self.position += 1
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "n_rows": len(self.rows)}

    def load(self, state: Mapping[str, int]) -> None:
        if int(state["n_rows"]) != len(self.rows):
            raise ValueError(f"data state is for {state['n_rows']} rows but this shard has {len(self.rows)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# --------------------------------------------------------------------------- RNG
class _RNGState:
    """The RNG streams one trainer owns: torch CPU (and CUDA), python ``random``, numpy.

    :meth:`scope` swaps them into the global generators for the duration of a
    step and swaps the caller's back afterwards, so that TRL's sampling and
    shuffling (which use the globals) are reproducible and checkpointable
    without disturbing anyone else's streams.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if device.index is not None:
            self.cuda_index = device.index
        else:
            self.cuda_index = torch.cuda.current_device() if self.cuda else 0
        with torch.random.fork_rng(devices=[self.cuda_index] if self.cuda else []):
            torch.manual_seed(seed)
            self.torch_cpu = torch.get_rng_state()
            self.torch_cuda = torch.cuda.get_rng_state(self.cuda_index) if self.cuda else None
        self.python = random.Random(seed).getstate()
        self.numpy = np.random.RandomState(seed % 2**32).get_state()

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        saved_cuda = torch.cuda.get_rng_state(self.cuda_index) if self.cuda else None
        torch.set_rng_state(self.torch_cpu)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        if self.cuda:
            torch.cuda.set_rng_state(self.torch_cuda, self.cuda_index)
        try:
            yield
        finally:
            self.torch_cpu = torch.get_rng_state()
            self.python = random.getstate()
            self.numpy = np.random.get_state()
            if self.cuda:
                self.torch_cuda = torch.cuda.get_rng_state(self.cuda_index)
                torch.cuda.set_rng_state(saved_cuda, self.cuda_index)
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        kind, keys, pos, has_gauss, gauss = self.numpy
        tensors = {
            "torch_cpu": self.torch_cpu.clone(),
            "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        }
        if self.torch_cuda is not None:
            tensors["torch_cuda"] = self.torch_cuda.clone()
        version, internal, gauss_next = self.python
        meta = {
            "python": [version, list(internal), gauss_next],
            "numpy": [kind, int(pos), int(has_gauss), float(gauss)],
        }
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        self.torch_cpu = tensors["torch_cpu"].to(torch.uint8).cpu().clone()
        if self.cuda:
            if "torch_cuda" not in tensors:
                raise ValueError("checkpoint has no CUDA RNG state but this trainer runs on CUDA")
            self.torch_cuda = tensors["torch_cuda"].to(torch.uint8).cpu().clone()
        version, internal, gauss_next = meta["python"]
        self.python = (int(version), tuple(int(x) for x in internal), gauss_next)
        kind, pos, has_gauss, gauss = meta["numpy"]
        keys = tensors["numpy_keys"].numpy().astype(np.uint32)
        self.numpy = (kind, keys, int(pos), int(has_gauss), float(gauss))


# --------------------------------------------------------------------------- InnerTrainer
class ThreeChannelTrainer:
    """One replica's inner loop (:class:`~composer_cloud.trainer.base.InnerTrainer`).

    Invariants:
      * ``step()`` performs exactly one ``optimizer.step()`` (after
        ``gradient_accumulation_steps`` micro-batches) and one ``zero_grad()``;
      * it draws prompts only from this rank's :class:`PromptStream`, replay
        pairs only from the buffer's seeded walk, and random numbers only
        from this trainer's own RNG streams;
      * ``state_dict()`` then ``load_state_dict()`` into a trainer built on the
        same parameters reproduces the following steps bit for bit (CPU).
    """

    STATE_VERSION = 1

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        task: VerifiableTask,
        settings: ThreeChannelSettings,
        hint_source: HintSource | None = None,
        pairs: Sequence[Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        device: torch.device | str = "cpu",
        grad_clip: float = 1.0,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.task = task
        self.settings = settings
        self.grad_clip = float(grad_clip)
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        rank_seed = seed * 1_000_003 + rank
        self.stream = PromptStream(task.examples("train"), seed=seed, rank=rank, world_size=world_size)
        self.rng = _RNGState(rank_seed, self.device)
        self.steps = 0
        self._last_reward: dict[str, float] = {}

        s = settings
        replay = None
        if s.beta != 0.0 and pairs:
            replay = ReplayBuffer(
                pairs, tokenizer, seed=rank_seed, max_response_length=max(s.completion_length, 8) + 1
            )
        args = GRPOConfig(
            output_dir=os.path.join(tempfile.gettempdir(), "composer-cloud-grpo"),
            per_device_train_batch_size=s.batch_size,
            num_generations=s.num_generations,
            max_completion_length=s.completion_length,
            temperature=s.temperature,
            loss_type=s.loss_type,
            epsilon=s.epsilon,
            epsilon_high=s.epsilon_high,
            beta=s.kl_beta,
            scale_rewards=s.scale_rewards,
            mask_truncated_completions=s.mask_truncated_completions,
            num_iterations=s.num_iterations,
            steps_per_generation=s.steps_per_generation,
            gradient_accumulation_steps=s.gradient_accumulation_steps,
            learning_rate=float(optimizer.param_groups[0]["lr"]),
            max_grad_norm=self.grad_clip,
            seed=rank_seed,
            use_cpu=self.device.type == "cpu",
            bf16=False,
            fp16=False,
            activation_checkpointing=False,
            disable_dropout=True,
            shuffle_dataset=False,
            report_to="none",
            save_strategy="no",
            log_completions=False,
            dataloader_num_workers=0,
        )
        from datasets import Dataset  # TRL needs a Dataset object; we never iterate it

        channel_args = ChannelArgs(
            pg_weight=s.pg_weight,
            alpha=s.alpha,
            beta=s.beta if replay is not None else 0.0,
            jsd_beta=s.jsd_beta,
            jsd_temperature=s.jsd_temperature,
            dpo_beta=s.dpo_beta,
            dpo_variant=s.dpo_variant,
            simpo_gamma=s.simpo_gamma,
            replay_batch_size=s.replay_batch_size,
            sdpo_skip_successful=s.sdpo_skip_successful,
            success_reward=s.success_reward,
            sdpo_exclude_eos=s.sdpo_exclude_eos,
            hint_template=s.hint_template,
        )
        # A constant schedule: if anything ever calls Trainer.create_scheduler,
        # TRL must not swap in its default linear decay.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        # GRPOTrainer.__init__ calls set_seed(): keep that away from every global stream.
        with self.rng.scope(), _forked_global_rngs(self.device):
            self.grpo = ThreeChannelGRPOTrainer(
                model=model,
                reward_funcs=make_reward_func(task),
                args=args,
                train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in self.stream.rows[:1]]),
                processing_class=tokenizer,
                optimizers=(optimizer, scheduler),
                channel_args=channel_args,
                hint_source=hint_source if s.alpha != 0.0 else NoHints(),
                replay=replay,
            )
        self._generate_every = s.steps_per_generation * s.num_iterations
        self._batch: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ step
    def _generation_rows(self) -> list[dict[str, Any]]:
        """Rows for TRL's next generation, or the previous ones when TRL reuses its buffer.

        Mirrors ``GRPOTrainer._prepare_inputs``: TRL regenerates when
        ``_step % (steps_per_generation * num_iterations) == 0`` or it has no
        buffer, and ignores its input otherwise. Prompts are drawn only when
        consumed, so the data position in a checkpoint is exact.
        """
        g = self.grpo
        if g._step % self._generate_every == 0 or g._buffered_inputs is None:
            n_prompts = self.settings.batch_size * self.settings.steps_per_generation // self.settings.num_generations
            prompts = self.stream.take(n_prompts)
            # Each prompt repeated num_generations times, consecutively (TRL's RepeatSampler layout).
            self._batch = [dict(r) for r in prompts for _ in range(self.settings.num_generations)]
        return self._batch

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        g = self.grpo
        for values in g._metrics["train"].values():
            values.clear()
        with self.rng.scope():
            self.model.train()
            g.state.global_step = self.steps
            loss = torch.zeros(())
            for _ in range(self.settings.gradient_accumulation_steps):
                loss = loss + g.training_step(self.model, self._generation_rows(), None).detach().cpu()
            params = [p for p in self.model.parameters() if p.requires_grad]
            if self.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
            else:
                grad_norm = torch.linalg.vector_norm(
                    torch.stack([p.grad.detach().norm() for p in params if p.grad is not None])
                )
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return self._metrics(float(loss), float(grad_norm), time.perf_counter() - start)

    def _metrics(self, loss: float, grad_norm: float, seconds: float) -> dict[str, float]:
        m = self.grpo._metrics["train"]

        def last(key: str) -> float | None:
            values = m.get(key)
            return float(np.mean(values)) if values else None

        if last("reward") is not None:  # a generation happened in this step
            self._last_reward = {
                "reward_mean": last("reward"),
                "reward_std": last("reward_std"),
                "frac_reward_zero_std": last("frac_reward_zero_std"),
                "completion_length": last("completions/mean_length"),
            }
        lr = float(self.optimizer.param_groups[0]["lr"])
        out: dict[str, float] = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
        for channel in ("pg", "sdpo", "dpo"):
            out[channel] = last(channel) if last(channel) is not None else 0.0  # 0.0 = skipped this step
        for key in ("clip_low", "clip_high", "kl", "entropy", "dpo_margin", "dpo_accuracy"):
            if last(key) is not None:
                out[key] = last(key)  # type: ignore[assignment]
        out.update({k: v for k, v in self._last_reward.items() if v is not None})
        out["step_time_s"] = seconds
        return out

    # ------------------------------------------------------------------ evaluate
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the task's held-out rows, scored by the task (no parameter or RNG change)."""
        rows = self.task.examples("eval")[: self.settings.eval_examples]
        if not rows:
            return {}
        was_training = self.model.training
        self.model.eval()
        completions: list[str] = []
        try:
            with _forked_global_rngs(self.device):
                for start in range(0, len(rows), 16):
                    chunk = rows[start : start + 16]
                    ids, _, _ = self.grpo._tokenize_prompts([r["prompt"] for r in chunk])
                    tensors = [torch.tensor(list(x), dtype=torch.long) for x in ids]
                    pad_id = self.tokenizer.pad_token_id
                    input_ids = pad(tensors, padding_value=pad_id, padding_side="left").to(self.device)
                    masks = [torch.ones_like(t) for t in tensors]
                    attn = pad(masks, padding_value=0, padding_side="left").to(self.device)
                    out = self.model.generate(
                        input_ids=input_ids,
                        attention_mask=attn,
                        max_new_tokens=self.settings.completion_length,
                        do_sample=False,
                        pad_token_id=self.tokenizer.pad_token_id,
                        eos_token_id=self.grpo.eos_token_ids,
                    )
                    completions += self.tokenizer.batch_decode(out[:, input_ids.size(1) :], skip_special_tokens=True)
        finally:
            self.model.train(was_training)
        scores = [0.0 if r is None else float(r) for r in self.task.reward(completions, rows)]
        return {
            "eval_reward_mean": float(np.mean(scores)),
            "eval_solved": float(np.mean([s >= 1.0 for s in scores])),
            "eval_examples": float(len(rows)),
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {"version": self.STATE_VERSION, "trl": trl.__version__, "steps": self.steps}

        opt = self.optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for pid, st in opt["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim.{pid}.{k}"] = v.detach().clone().contiguous()
                else:
                    scalars.setdefault(str(pid), {})[k] = v
        meta["optimizer"] = {
            "param_groups": opt["param_groups"],
            "scalars": scalars,
            "ids": [str(p) for p in opt["state"]],
        }

        rng_t, rng_m = self.rng.state_dict()
        tensors.update({f"rng.{k}": v for k, v in rng_t.items()})
        meta["rng"] = rng_m
        meta["data"] = self.stream.state()
        meta["batch"] = self._batch

        g = self.grpo
        buf_meta: list[dict[str, Any]] | None = None
        if g._buffered_inputs is not None:
            buf_meta = []
            for i, chunk in enumerate(g._buffered_inputs):
                entry: dict[str, Any] = {}
                for k, v in chunk.items():
                    if isinstance(v, torch.Tensor):
                        tensors[f"buffer.{i}.{k}"] = v.detach().cpu().clone().contiguous()
                        entry[k] = "tensor"
                    else:
                        json.dumps(v)  # fails loudly on anything a JSON checkpoint cannot hold
                        entry[k] = {"value": v}
                buf_meta.append(entry)
        meta["grpo"] = {"step": g._step, "buffer": buf_meta, "last_reward": self._last_reward}

        if g.replay is not None:
            r_t, r_m = g.replay.state_dict()
            tensors.update({f"replay.{k}": v for k, v in r_t.items()})
            meta["replay"] = r_m
        if g.beta != 0.0 and g.ref_model is not None:
            # The KL reference is the model the run started from, not the one a restart starts from.
            for k, v in g.ref_model.state_dict().items():
                tensors[f"kl_ref.{k}"] = v.detach().cpu().clone().contiguous()
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        if meta.get("version") != self.STATE_VERSION:
            raise ValueError(f"three-channel state version {meta.get('version')!r}; expected {self.STATE_VERSION}")
        opt_meta = meta["optimizer"]
        state: dict[int, dict[str, Any]] = {}
        for pid in opt_meta["ids"]:
            st: dict[str, Any] = dict(opt_meta["scalars"].get(pid, {}))
            prefix = f"optim.{pid}."
            for k, v in tensors.items():
                if k.startswith(prefix):
                    st[k[len(prefix) :]] = v
            state[int(pid)] = st
        groups = [
            {k: (tuple(v) if k == "betas" else v) for k, v in group.items()} for group in opt_meta["param_groups"]
        ]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

        self.rng.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("rng.")}, meta["rng"])
        self.stream.load(meta["data"])
        self._batch = [dict(r) for r in meta["batch"]]
        self.steps = int(meta["steps"])

        g = self.grpo
        g._step = int(meta["grpo"]["step"])
        self._last_reward = dict(meta["grpo"].get("last_reward") or {})
        buf_meta = meta["grpo"]["buffer"]
        if buf_meta is None:
            g._buffered_inputs = None
        else:
            device = g.accelerator.device
            g._buffered_inputs = [
                {
                    k: (tensors[f"buffer.{i}.{k}"].to(device) if spec == "tensor" else spec["value"])
                    for k, spec in entry.items()
                }
                for i, entry in enumerate(buf_meta)
            ]
        if g.beta != 0.0 and g.ref_model is not None:
            ref = {k[len("kl_ref.") :]: v for k, v in tensors.items() if k.startswith("kl_ref.")}
            if not ref:
                raise ValueError("checkpoint has no KL reference model but this trainer has kl_beta != 0")
            g.ref_model.load_state_dict(ref)
        if g.replay is not None:
            if "replay" not in meta:
                raise ValueError("checkpoint has no replay state but this trainer replays pairs")
            g.replay.load_state_dict({k[7:]: v for k, v in tensors.items() if k.startswith("replay.")}, meta["replay"])


@contextlib.contextmanager
def _forked_global_rngs(device: torch.device) -> Iterator[None]:
    """Run a block without changing the caller's torch / python / numpy RNG streams."""
    py, nps = random.getstate(), np.random.get_state()
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(nps)


# --------------------------------------------------------------------------- factory
def build_three_channel_trainer(ctx: TrainerContext) -> ThreeChannelTrainer:
    """The runtime's factory: settings from ``ctx.settings``, AdamW from ``ctx.inner_optimizer``."""
    s = ThreeChannelSettings.from_settings(ctx.settings)
    task_options = dict(s.task_options)
    if s.task == "python-functions":
        task_options.setdefault(
            "limits",
            SandboxLimits(
                timeout_s=s.sandbox_timeout_s,
                per_test_timeout_s=s.sandbox_per_test_timeout_s,
                memory_mb=s.sandbox_memory_mb,
            ),
        )
        task_options.setdefault("max_workers", s.sandbox_workers)
        task_options.setdefault("seed", ctx.seed)
    task = build_task(s.task, **task_options)
    hints = resolve_hint_source(s.hint_source, task)
    pairs = None
    if s.beta != 0.0 and s.pairs != "none":
        uri = default_pairs_uri() if s.pairs == "builtin" else s.pairs
        pairs = load_pairs(uri, **s.pairs_storage_options)
    opt_kwargs = dict(ctx.inner_optimizer)
    grad_clip = float(opt_kwargs.pop("grad_clip", 1.0))
    if "betas" in opt_kwargs:
        opt_kwargs["betas"] = tuple(opt_kwargs["betas"])
    optimizer = torch.optim.AdamW([p for p in ctx.model.parameters() if p.requires_grad], **opt_kwargs)
    return ThreeChannelTrainer(
        model=ctx.model,
        tokenizer=ctx.tokenizer,
        optimizer=optimizer,
        task=task,
        settings=s,
        hint_source=hints,
        pairs=pairs,
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=ctx.seed,
        device=ctx.device,
        grad_clip=grad_clip,
    )


__all__ = [
    "ChannelArgs",
    "PromptStream",
    "TRL_SUPPORTED",
    "TRLCompatibilityError",
    "ThreeChannelGRPOTrainer",
    "ThreeChannelSettings",
    "ThreeChannelTrainer",
    "build_three_channel_trainer",
    "check_trl_compatibility",
]
