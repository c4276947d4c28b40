"""``ThreeChannelGRPOTrainer``: TRL's ``GRPOTrainer`` with the loss of :mod:`composer_cloud.trainer.three_channel.loss`.

It keeps everything TRL does for a GRPO step (prompt tokenisation, sampling,
reward calls, group-normalised advantages, the reference model for the KL
term) and replaces the loss by :func:`~composer_cloud.trainer.three_channel.loss.three_channel_loss`:

1. **pg**: the policy-gradient loss on the sampled completions;
2. **sdpo**: a no-grad forward of the *same* model on the hint-augmented
   prompt followed by the *same* completion tokens is the teacher; the
   generalized JSD between its next-token distributions and the student's
   (unhinted) ones, on the completion tokens;
3. **dpo**: a minibatch of replayed (chosen, rejected) pairs with stored
   reference log-probs.

Importing this module imports :mod:`.compat` first, which checks the
installed TRL's private hooks (the import-time TRL guard).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from typing import Any, Iterator, Mapping

import torch
import trl.trainer.grpo_trainer as trl_grpo
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id, pad, selective_log_softmax

from composer_cloud.lora import is_lora_model
from composer_cloud.trainer.three_channel.distill import TAIDSchedule
from composer_cloud.trainer.three_channel.fast_rollout import FastSampler, InferenceCopy
from composer_cloud.trainer.three_channel.loss import (
    DPOInputs,
    LossOutput,
    PGInputs,
    SDPOInputs,
    three_channel_loss,
)
from composer_cloud.trainer.three_channel.replay import ReplayBatch, ReplayBuffer
from composer_cloud.trainer.three_channel.samples import pick_samples
from composer_cloud.trainer.three_channel.sourced import RolloutKey, SourcedRollouts
from composer_cloud.trainer.three_channel.tasks import HintSource, NoHints, apply_hint
from composer_cloud.trainer.three_channel.compat import check_trainer_attributes
from composer_cloud.trainer.three_channel.settings import (
    LOSS_TYPES,
    ThreeChannelConfig,
    ThreeChannelSettings,
    resolve_rollout,
)

logger = logging.getLogger(__name__)

UNSUPPORTED_GRPO_ARGS: dict[str, Any] = {
    # GRPOConfig option -> the only value the three-channel loss implements
    "importance_sampling_level": "token",
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
    "vllm_mode": "colocate",  # vLLM inside the replica's process; server mode needs a GPU of its own
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "delta": None,
}


def _check_args(args: GRPOConfig, settings: ThreeChannelSettings | None) -> None:
    """Refuse GRPOConfig options the loss does not implement, and settings that disagree with ``args``."""
    if args.loss_type not in LOSS_TYPES:
        raise ValueError(
            f"three-channel trainer: GRPOConfig.loss_type {args.loss_type!r} is not implemented by the three-channel "
            f"loss; use one of {', '.join(LOSS_TYPES)} (docs/trainer.md lists what is refused and why)"
        )
    for name, supported in UNSUPPORTED_GRPO_ARGS.items():
        if getattr(args, name, supported) != supported:
            raise ValueError(
                f"three-channel trainer: GRPOConfig.{name} must be {supported!r}: the three-channel loss does not "
                "implement it (docs/trainer.md lists what is refused and why)"
            )
    if settings is None:
        return
    wrong = [
        f"GRPOConfig.{key} = {getattr(args, key)!r}, settings give {value!r}"
        for key, value in settings.grpo_kwargs().items()
        if getattr(args, key) != value
    ]
    if wrong:
        raise ValueError(
            "three-channel trainer: settings and GRPOConfig disagree (" + "; ".join(wrong) + "); build the "
            "config as GRPOConfig(**settings.grpo_kwargs(), ...)"
        )


class ThreeChannelGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose loss is ``pg_weight * pg + sdpo_weight * sdpo + dpo_weight * dpo``.

    Constructed as ``GRPOTrainer`` is (same positional and keyword
    arguments, ``args`` optional), plus three keyword-only ones:
    ``settings`` (:class:`~.settings.ThreeChannelSettings`: the channel
    weights and the channel-2/3 options), ``hint_source`` (channel 2's hints)
    and ``replay`` (channel 3's pairs). Channel 1 runs on ``args`` as in stock
    ``GRPOTrainer`` (``loss_type``, ``epsilon``, ``epsilon_high``, ``beta`` as
    the KL coefficient, ``use_bias_correction_kl``, ``max_completion_length``),
    so that with ``sdpo_weight = dpo_weight = 0`` loss, gradients and logged
    metrics equal stock ``GRPOTrainer``'s. Given ``settings`` must agree with
    ``args`` on every field of :meth:`~.settings.ThreeChannelSettings.grpo_kwargs`
    (a ``ValueError`` otherwise); without ``settings`` the defaults are used
    with channel 1's values taken from ``args``. ``loss_type`` must be one of
    ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``; options of ``GRPOConfig``
    listed in :data:`UNSUPPORTED_GRPO_ARGS` must keep their defaults.

    The KL reference (``args.beta != 0``): for a model given by name, TRL's
    (it loads the name again); for a model instance, a frozen copy of the
    instance as passed, which TRL then prepares as its own reference (dropout,
    fused head, ``sync_ref_model``). TRL would reload an instance by its
    config's name, which is the same weights for a freshly loaded model and
    fails for one built from a config. A PEFT model is its own reference (TRL
    disables the adapter).

    Rollouts (``settings.rollout``, resolved by
    :func:`~composer_cloud.trainer.three_channel.settings.resolve_rollout` on the
    model's device): ``"hf"`` is TRL's ``model.generate``; ``"vllm"`` TRL's
    engine; ``"hf-fast"`` samples from a bf16 :class:`~.fast_rollout.InferenceCopy`
    (built here, before TRL wraps the model) with a static, compiled KV cache. The
    copy is refreshed before a generation whenever ``state.global_step`` moved
    since its last refresh (TRL's rule for vLLM) and by :meth:`refresh_rollout_copy`
    (parameters replaced outside the optimizer). Its sampling log-probs go through
    TRL's own importance-sampling correction, as vLLM's do.

    Completions from rollout workers (:mod:`.sourced`): with :meth:`set_completion_source`, a training
    generation asks the source for :attr:`rollout_key`'s batch and trains on its completion ids and
    sampler log-probs as on the fast sampler's (TRL's correction, the same knobs); a stale, malformed or
    missing batch makes it generate with the rollout mode above, from a generator seeded by the key.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        *more: Any,
        settings: ThreeChannelSettings | None = None,
        hint_source: HintSource | None = None,
        replay: ReplayBuffer | None = None,
        **kwargs: Any,
    ) -> None:
        if args is None:  # TRL's default config, built the way GRPOTrainer.__init__ builds it
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        _check_args(args, settings)
        #: The rollout mode in use (``"auto"`` resolved): ``"hf"``, ``"hf-fast"`` or ``"vllm"``.
        self.rollout = _resolve_model_rollout(settings, model)
        # Copied before TRL wraps the model (accelerate may replace forward on the instance).
        rollout_copy = InferenceCopy(model) if self.rollout == "hf-fast" else None
        self.hint_source: HintSource = hint_source or NoHints()
        self.replay = replay
        reference = None
        if args.beta != 0.0 and not isinstance(model, str) and not is_lora_model(model):
            # Copied before TRL patches model.forward: a deepcopy of the patched model would keep
            # calling the original's forward (the closure is not copied).
            reference = copy.deepcopy(model).eval().requires_grad_(False)
        with _reference_model(reference):
            super().__init__(model, reward_funcs, args, *more, **kwargs)
        check_trainer_attributes(self)
        self._native_vllm = bool(self.use_vllm)  # TRL's engine samples (rollout = "vllm"): the flag stays raised
        if self._is_vlm:
            raise ValueError("three-channel trainer: vision-language models are not supported")
        #: The last generation's samples (``settings.log_samples`` at most), until :meth:`take_samples`.
        self.samples: list[dict[str, Any]] = []
        #: ``rollout = "hf-fast"``: the sampler over the bf16 inference copy (``None`` otherwise).
        self.fast_sampler: FastSampler | None = None
        #: Completions from rollout workers (:meth:`set_completion_source`); ``None``: this trainer samples.
        self.sourced: SourcedRollouts | None = None
        #: The batch the next training generation consumes (taken by it): set before each step while a source is set.
        self.rollout_key: RolloutKey | None = None
        self._trusted_rewards: list[float] | None = None  # the batch's own rewards, for _calculate_rewards
        self._copy_step = -1  # state.global_step at the copy's last refresh; -1: refresh before the next generation
        if rollout_copy is not None:
            if self.tools or self.rollout_func is not None:
                raise ValueError("trainer.rollout = 'hf-fast' samples single-turn completions; tools and "
                                 "rollout_func need rollout = 'hf'")
            self.fast_sampler = FastSampler(rollout_copy, self.generation_kwargs)
            logger.info("rollouts: bf16 inference copy with a static KV cache (rollout = 'hf-fast')")
        if settings is None:
            # Channel 1 as TRL resolved it from args (e.g. epsilon_high=None means epsilon).
            settings = ThreeChannelSettings(
                loss_type=self.loss_type,
                epsilon=self.epsilon_low,
                epsilon_high=self.epsilon_high,
                kl_coef=float(self.beta),
                kl_bias_correction=bool(self.args.use_bias_correction_kl),
                max_completion_length=self.max_completion_length,
                batch_size=self.args.per_device_train_batch_size,
                num_generations=self.num_generations,
                steps_per_generation=self.args.steps_per_generation,
            )
        #: The one settings object: the channel weights and channel-2/3 options read here, and the loss's config.
        self.settings: ThreeChannelSettings = settings
        needs_reference = settings.dpo_variant == "sigmoid" and replay is not None and not replay.has_reference
        if settings.dpo_active and needs_reference:
            logger.info("replay pairs have no stored reference log-probs; computing them with the initial model")
            self.fill_replay_reference()
        # Set by Trainer.train(); the adapter drives training_step itself.
        self.current_gradient_accumulation_steps = self.args.gradient_accumulation_steps
        self.last_loss_output: LossOutput | None = None
        #: TAID's interpolation schedule (``sdpo_variant = "taid"``); advanced once per optimizer step.
        self.taid: TAIDSchedule | None = None
        self._taid_objectives: list[float] = []
        if settings.sdpo_active and settings.sdpo_variant == "taid":
            self.taid_schedule()  # part of the trainer's state from the first step on

    # ------------------------------------------------------------------ data for channels 2 and 3
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[no-untyped-def]
        trusted, self._trusted_rewards = self._trusted_rewards, None
        if trusted is not None:  # a sourced batch's rewards (SourcedRollouts.trust_rewards), the one function's
            local = torch.tensor([float(r) for r in trusted], dtype=torch.float32, device=self.accelerator.device)
            rewards_per_func = self.accelerator.gather(local[:, None])
        else:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = rewards_per_func  # (all processes' rows, n_funcs); read just below
        if self.model.training:
            self._keep_samples(prompts, completions)
        return rewards_per_func

    def _keep_samples(self, prompts: list[Any], completions: list[Any]) -> None:
        """This generation's ``settings.log_samples`` samples replace the last one's (:func:`.samples.pick_samples`)."""
        start = self.accelerator.process_index * len(prompts)
        local = self._rewards_per_func[start : start + len(prompts)]
        self.samples = pick_samples(prompts, completions, local, self.reward_weights, self.settings.log_samples)

    def take_samples(self) -> list[dict[str, Any]]:
        """The samples kept since the last call (then forgotten): ``[{"prompt", "completion", "reward"}]``."""
        out, self.samples = self.samples, []
        return out

    def _local_rewards(self, n: int) -> torch.Tensor:
        """This process's ``n`` rewards of the generation batch being scored (weighted sum over reward functions)."""
        rpf = self._rewards_per_func
        rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
        start = self.accelerator.process_index * n
        return rewards[start : start + n]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._rewards_per_func = None
        with self._sampler_correction():
            output = super()._generate_and_score_completions(inputs)
        if not self.settings.sdpo_active:
            return output
        # The teacher prompt of each row: its prompt with the hint in context.
        # Built here, once per generation batch, so the tensors are shuffled
        # and split together with the completions they belong to.
        hints = self.hint_source.hints(inputs)
        if len(hints) != len(inputs):
            raise ValueError(f"hint source returned {len(hints)} hints for {len(inputs)} rows")
        prompts = [row["prompt"] for row in inputs]
        teacher_prompts = [
            p if h is None else apply_hint(p, h, self.settings.hint_template) for p, h in zip(prompts, hints)
        ]
        ids, _, _ = self._tokenize_prompts(teacher_prompts)
        keep = self.settings.max_teacher_prompt_length
        tensors = [torch.tensor(list(x)[-keep:], dtype=torch.long) for x in ids]
        device = self.accelerator.device
        pad_id = self._tokenizer.pad_token_id
        output["teacher_prompt_ids"] = pad(tensors, padding_value=pad_id, padding_side="left").to(device)
        masks = [torch.ones_like(t) for t in tensors]
        output["teacher_prompt_mask"] = pad(masks, padding_value=0, padding_side="left").to(device)
        has_hint = torch.tensor([h is not None for h in hints], dtype=torch.bool, device=device)
        if self.settings.sdpo_skip_successful and self._rewards_per_func is not None:
            has_hint &= ~(self._local_rewards(len(inputs)).to(device) >= self.settings.success_reward)
        output["has_hint"] = has_hint
        return output

    @contextlib.contextmanager
    def _sampler_correction(self) -> Iterator[None]:
        """TRL's vLLM importance-sampling correction for any generation that comes with sampler log-probs.

        TRL computes the old log-probs with the trainer's model, the ratio to the sampling
        log-probs, and its truncation or masking (``vllm_importance_sampling_*``) only under
        ``use_vllm``. Inside ``_generate_and_score_completions`` that flag gates nothing else for
        this trainer (no ``rollout_func``, no tools: refused in ``__init__`` and by
        :meth:`set_completion_source`; generation itself is :meth:`_generate_single_turn`'s), so
        :meth:`_generate_single_turn` raises it when its completions carry log-probs (the fast
        sampler's, a source's) and lowers it when they do not (``rollout = "hf"``), for the rest of the
        call: the correction is TRL's code, not a copy of it. Restored here (raised only for ``"vllm"``).
        """
        try:
            yield
        finally:
            self.use_vllm = self._native_vllm

    def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if self.sourced is not None and self.model.training:
            completion_ids, logprobs = self._sourced_generate(prompt_ids, *args, **kwargs)
        else:
            completion_ids, logprobs = self._own_generate(prompt_ids, *args, **kwargs)
        if not self._native_vllm:  # see _sampler_correction
            self.use_vllm = logprobs is not None
        return completion_ids, logprobs

    def _own_generate(self, prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
        """``(completion_ids, sampling log-probs or None)`` from this trainer's rollout mode."""
        if self.fast_sampler is not None:
            return self._fast_generate(prompt_ids)
        # model.generate under the configured autocast (bf16 precision samples in bf16, as
        # the loss computes); TRL runs it outside autocast. vLLM samples on its own.
        if self._native_vllm:
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        with self.accelerator.autocast():
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def set_completion_source(self, sourced: SourcedRollouts | None) -> None:
        """Take training completions from ``sourced`` (``None``: sample here again); see :mod:`.sourced`."""
        if sourced is not None:
            sourced.check_trainer(
                gradient_accumulation_steps=self.args.gradient_accumulation_steps,
                steps_per_generation=self.args.steps_per_generation, num_iterations=self.num_iterations,
                multi_turn=bool(self.tools) or self.rollout_func is not None, reward_functions=len(self.reward_funcs))
        self.sourced = sourced

    def _sourced_generate(self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        """The source's batch for :attr:`rollout_key`, or this trainer's own generation, seeded by the key."""
        assert self.sourced is not None
        key, self.rollout_key = self.rollout_key, None  # one generation per key
        if key is None:
            raise RuntimeError("completion source: no rollout key for this generation; call "
                               "ThreeChannelTrainer.set_rollout_position(round, step) before each step() (the "
                               "replica's inner loop does)")
        vocab = self.accelerator.unwrap_model(self.model).get_input_embeddings().weight.size(0)
        completion_ids, logprobs, self._trusted_rewards = self.sourced.generation(
            key, [list(p) for p in prompt_ids], lambda: self._own_generate(prompt_ids, *args, **kwargs),
            max_completion_length=self.max_completion_length, vocab_size=vocab, device=self.accelerator.device)
        return completion_ids, logprobs

    def _fast_generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """``(completion_ids, sampling log-probs)`` from the inference copy, refreshed first if the policy stepped."""
        assert self.fast_sampler is not None
        copy_ = self.fast_sampler.copy
        if copy_.device != self.accelerator.device:
            copy_.to(self.accelerator.device)
        if self.state.global_step != self._copy_step:
            self.refresh_rollout_copy()
        return self.fast_sampler.generate(
            prompt_ids, pad_token_id=self._tokenizer.pad_token_id, eos_token_ids=self.eos_token_ids
        )

    def refresh_rollout_copy(self) -> None:
        """Copy the policy's current weights into the ``"hf-fast"`` inference copy now (no-op for other modes)."""
        if self.fast_sampler is None:
            return
        self.fast_sampler.copy.refresh()
        self._copy_step = self.state.global_step

    def invalidate_rollout_copy(self) -> None:
        """Make the next ``"hf-fast"`` generation refresh the copy first (e.g. after restored parameters)."""
        self._copy_step = -1

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self.settings.dpo_active and self.replay is not None:
            # Drawn per optimizer micro-step from the buffer's own seeded walk.
            batch = self.replay.sample(self.settings.replay_batch_size, self.accelerator.device)
            inputs = {**inputs, "replay": batch}
        return inputs

    # ------------------------------------------------------------------ forwards
    def completion_logits(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
    ) -> torch.Tensor:
        """``(B, logits_to_keep, V)`` logits predicting the last ``logits_to_keep`` tokens, over TRL's temperature."""
        return self._completion_forward(model, input_ids, attention_mask, logits_to_keep)[0]

    def _completion_forward(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        *,
        aux_loss: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Completion logits and, with ``aux_loss`` (an MoE model), its router load-balancing loss."""
        extra = {"output_router_logits": True} if aux_loss else {}
        with self.accelerator.autocast():
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=logits_to_keep + 1,
                use_cache=False,
                **extra,
            )
        return out.logits[:, :-1, :].float() / self.temperature, (out.aux_loss if aux_loss else None)

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
        """The three-channel loss of one micro-batch, before gradient accumulation (``config`` overrides weights).

        For an MoE model (TRL's ``aux_loss_enabled``) the router load-balancing
        loss of the student forward is added as TRL adds it:
        ``+ router_aux_loss_coef * aux_loss``, outside the channel weights.
        """
        cfg = config or self.settings
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        has_hint = inputs.get("has_hint")
        sdpo_rows = None
        if cfg.sdpo_active and has_hint is not None and bool(has_hint.any()):
            sdpo_rows = has_hint.nonzero(as_tuple=True)[0]

        student = self._student_forward(model, inputs, mask, pg=cfg.pg_active, sdpo_rows=sdpo_rows)
        pg = self._pg_inputs(inputs, student.logp, mask, cfg) if cfg.pg_active else None
        sdpo = self._sdpo_inputs(model, inputs, student.logits, mask, sdpo_rows) if sdpo_rows is not None else None
        replay: ReplayBatch | None = inputs.get("replay")
        dpo = self._dpo_inputs(model, replay) if cfg.dpo_active and replay is not None else None

        out = three_channel_loss(cfg, pg=pg, sdpo=sdpo, dpo=dpo)
        if student.entropy is not None:
            out.metrics["entropy"] = student.entropy
        if student.aux_loss is not None:
            out.total = out.total + self.router_aux_loss_coef * student.aux_loss
            out.metrics["aux_loss"] = student.aux_loss.detach()
            out.metrics["total"] = out.total.detach()
        return out

    def _student_forward(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], mask: torch.Tensor, *, pg: bool,
        sdpo_rows: torch.Tensor | None,
    ) -> "_StudentForward":
        """One forward of the policy on prompt + completion, shared by channels 1 and 2."""
        completion_ids = inputs["completion_ids"]
        C = completion_ids.size(1)
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        aux = self.aux_loss_enabled
        if pg and sdpo_rows is None:
            # Channel 1 alone: TRL's fused LM head, no (B, C, V) logits.
            logp, ent, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, C, compute_entropy=True, compute_aux_loss=aux
            )
            return _StudentForward(logp, None, _masked_mean(ent.detach(), mask), aux_loss)
        if pg:
            # Full logits are needed for the divergence anyway: one forward feeds both channels.
            logits, aux_loss = self._completion_forward(model, input_ids, attention_mask, C, aux_loss=aux)
            logp = selective_log_softmax(logits, completion_ids)
            return _StudentForward(logp, logits, _masked_entropy(logits, mask), aux_loss)
        if sdpo_rows is not None:
            logits, aux_loss = self._completion_forward(
                model, input_ids[sdpo_rows], attention_mask[sdpo_rows], C, aux_loss=aux
            )
            return _StudentForward(None, logits, None, aux_loss)
        return _StudentForward(None, None, None, None)

    def _dapo_normalizer(self, inputs: Mapping[str, Any]) -> torch.Tensor | None:
        """TRL's dapo token normaliser for one micro-batch, before the gradient-accumulation factor.

        ``num_items_in_batch`` counts the completion tokens of the whole
        generation batch; TRL clamps it to >= 1 *before* dividing by the
        processes and (in training only: evaluation neither splits nor
        accumulates) by ``steps_per_generation``.
        """
        num_items = inputs.get("num_items_in_batch")
        if num_items is None:
            return None
        normalizer = num_items.clamp(min=1.0) / self.accelerator.num_processes
        if self.model.training:
            normalizer = normalizer / self.args.steps_per_generation
        return normalizer

    def _pg_inputs(
        self, inputs: Mapping[str, Any], logp: torch.Tensor, mask: torch.Tensor, cfg: ThreeChannelConfig
    ) -> PGInputs:
        return PGInputs(
            logp=logp,
            advantages=inputs["advantages"],
            mask=mask,
            old_logp=inputs.get("old_per_token_logps"),
            ref_logp=inputs.get("ref_per_token_logps") if cfg.kl_coef != 0.0 else None,
            num_items=self._dapo_normalizer(inputs),
            # vLLM rollouts: TRL's truncated/masked importance weights (None with rollout = "hf").
            sampling_ratio=inputs.get("importance_sampling_ratio"),
        )

    def _sdpo_inputs(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], student_logits: torch.Tensor | None,
        mask: torch.Tensor, rows: torch.Tensor,
    ) -> SDPOInputs:
        """The hinted teacher's logits on the student's completion tokens (no grad), for the hinted ``rows``."""
        assert student_logits is not None
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        s_logits = student_logits[rows] if student_logits.size(0) != rows.numel() else student_logits
        t_ids = torch.cat([inputs["teacher_prompt_ids"][rows], completion_ids[rows]], dim=1)
        t_mask = torch.cat([inputs["teacher_prompt_mask"][rows], completion_mask[rows]], dim=1)
        with torch.no_grad():
            t_logits = self.completion_logits(model, t_ids, t_mask, completion_ids.size(1))
        sdpo_mask = mask[rows]
        if self.settings.sdpo_exclude_eos:
            eos = torch.tensor(self.eos_token_ids, device=completion_ids.device)
            sdpo_mask = sdpo_mask * ~torch.isin(completion_ids[rows], eos)
        taid_t = self.taid_schedule().t if self.settings.sdpo_variant == "taid" else None
        return SDPOInputs(student_logits=s_logits, teacher_logits=t_logits, mask=sdpo_mask, taid_t=taid_t)

    def taid_schedule(self) -> TAIDSchedule:
        """TAID's schedule, built from the settings on first use."""
        if self.taid is None:
            s = self.settings
            self.taid = TAIDSchedule(t_start=s.taid_t_start, t_end=s.taid_t_end, alpha=s.taid_alpha,
                                     beta=s.taid_beta, steps=s.taid_steps, adaptive=s.taid_schedule == "adaptive")
        return self.taid

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.taid is not None and self._step % self.current_gradient_accumulation_steps == 0:
            # One optimizer step done: TAID's t moves on, from the step's mean objective.
            values = self._taid_objectives
            self.taid.update(sum(values) / len(values) if values else None)
            self._taid_objectives = []
        return loss

    def _dpo_inputs(self, model: torch.nn.Module, replay: ReplayBatch) -> DPOInputs:
        n = replay.n_pairs
        seq = self.sequence_logps(model, replay)
        ref = replay.ref_logp
        return DPOInputs(
            policy_chosen_logp=seq[:n],
            policy_rejected_logp=seq[n:],
            ref_chosen_logp=None if ref is None else ref[:n],
            ref_rejected_logp=None if ref is None else ref[n:],
            chosen_length=replay.lengths[:n],
            rejected_length=replay.lengths[n:],
        )

    def _compute_loss(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
        out = self.compute_three_channel_loss(model, inputs)
        self.last_loss_output = out
        mode = "train" if self.model.training else "eval"
        for k, v in out.metrics.items():
            self._metrics[mode][k].append(float(v))
        if mode == "train" and "taid_objective" in out.metrics:
            self._taid_objectives.append(float(out.metrics["taid_objective"]))
        # Gradient accumulation: TRL divides grpo/bnpo/dr_grpo and the aux loss by the number of
        # micro-steps and folds it into dapo's token normaliser; dividing the total once is the same
        # for channel 1 and averages channels 2 and 3. Evaluation does not accumulate.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        return out.total / accumulation


def _resolve_model_rollout(settings: ThreeChannelSettings | None, model: Any) -> str:
    """``settings.rollout`` with ``"auto"`` resolved on the model's device (a model given by name: ``"hf"``)."""
    rollout = settings.rollout if settings is not None else "hf"
    if isinstance(model, str):
        if rollout == "hf-fast":
            raise ValueError("trainer.rollout = 'hf-fast' needs a model instance (its copy is built before TRL "
                             "loads a model by name); pass the model, or use rollout = 'hf'")
        return "hf" if rollout == "auto" else rollout
    param = next(model.parameters(), None)
    return resolve_rollout(rollout, param.device.type if param is not None else "cpu")


@dataclasses.dataclass
class _StudentForward:
    """What the policy's forward on the generation micro-batch gave: per-token log-probs (channel 1),
    completion logits (channel 2; ``None`` on the fused path), the masked mean entropy (no grad) and
    the MoE router loss."""

    logp: torch.Tensor | None
    logits: torch.Tensor | None
    entropy: torch.Tensor | None
    aux_loss: torch.Tensor | None


@contextlib.contextmanager
def _reference_model(reference: torch.nn.Module | None) -> Iterator[None]:
    """While TRL's ``__init__`` runs, its reference-model loader returns ``reference`` instead of loading by name.

    TRL builds the KL reference with ``create_model_from_path(<the policy's name>)`` and then
    treats it as its own (dropout off, fp32 head, fused head, device placement,
    ``sync_ref_model``); only the loading is replaced. It is the one call of that loader
    while a model instance is being wrapped (the policy itself is not loaded). The replacement is
    module-wide: build trainers one at a time, not from several threads at once.
    """
    if reference is None:
        yield
        return
    load = trl_grpo.create_model_from_path
    calls = 0

    def give_reference(*_: Any, **__: Any) -> torch.nn.Module:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise RuntimeError("TRL loaded more than one model while building the KL reference")
        return reference

    trl_grpo.create_model_from_path = give_reference
    try:
        yield
    finally:
        trl_grpo.create_model_from_path = load


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1)


@torch.no_grad()
def _masked_entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return _masked_mean(-(logp.exp() * logp).sum(-1), mask)


__all__ = ["UNSUPPORTED_GRPO_ARGS", "ThreeChannelGRPOTrainer"]
