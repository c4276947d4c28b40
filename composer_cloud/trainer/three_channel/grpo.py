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

import copy
import logging
from typing import Any, Mapping

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, pad, selective_log_softmax

from composer_cloud.trainer.three_channel.loss import (
    DPOInputs,
    LossOutput,
    PGInputs,
    SDPOInputs,
    three_channel_loss,
)
from composer_cloud.trainer.three_channel.replay import ReplayBatch, ReplayBuffer
from composer_cloud.trainer.three_channel.tasks import HintSource, NoHints, apply_hint
from composer_cloud.trainer.three_channel.compat import check_trainer_attributes
from composer_cloud.trainer.three_channel.settings import ThreeChannelConfig, ThreeChannelSettings

logger = logging.getLogger(__name__)

UNSUPPORTED_GRPO_ARGS: dict[str, Any] = {
    # GRPOConfig option -> the only value the three-channel loss implements
    "importance_sampling_level": "token",
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
    "use_vllm": False,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "delta": None,
}


def _check_args(args: GRPOConfig, settings: ThreeChannelSettings | None) -> None:
    """Refuse GRPOConfig options the loss does not implement, and settings that disagree with ``args``."""
    for name, supported in UNSUPPORTED_GRPO_ARGS.items():
        if getattr(args, name, supported) != supported:
            raise ValueError(
                f"three-channel trainer: GRPOConfig.{name} must be {supported!r} (the loss does not implement it)"
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

    ``settings`` (:class:`~.settings.ThreeChannelSettings`) give the channel
    weights and the channel-2/3 options. Channel 1 runs on ``args`` as in stock
    ``GRPOTrainer`` (``loss_type``, ``epsilon``, ``epsilon_high``, ``beta`` as
    the KL coefficient, ``use_bias_correction_kl``, ``max_completion_length``),
    so that with ``sdpo_weight = dpo_weight = 0`` the loss equals stock
    ``GRPOTrainer``'s. Given ``settings`` must agree with ``args`` on every
    field of :meth:`~.settings.ThreeChannelSettings.grpo_kwargs` (a
    ``ValueError`` otherwise); without ``settings`` the defaults are used with
    channel 1's values taken from ``args``. ``loss_type`` must be one of
    ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``; options of ``GRPOConfig``
    listed in :data:`UNSUPPORTED_GRPO_ARGS` must keep their defaults.

    With ``args.beta != 0`` the KL reference is a frozen copy of ``model`` as
    passed in (TRL would otherwise try to download it by name).
    """

    def __init__(
        self,
        *args: Any,
        settings: ThreeChannelSettings | None = None,
        hint_source: HintSource | None = None,
        replay: ReplayBuffer | None = None,
        **kwargs: Any,
    ) -> None:
        grpo_args: GRPOConfig = kwargs.get("args") if "args" in kwargs else args[2]
        model = kwargs.get("model") if "model" in kwargs else args[0]
        _check_args(grpo_args, settings)
        self.hint_source: HintSource = hint_source or NoHints()
        self.replay = replay
        kl_coef = float(grpo_args.beta)
        ref_model = None
        if kl_coef != 0.0:
            # Copy before TRL patches model.forward (a deepcopy of the patched
            # model would keep calling the original's forward), and hide the
            # coefficient from TRL's __init__, which would load the reference by name.
            ref_model = copy.deepcopy(model).eval().requires_grad_(False)
            grpo_args.beta = 0.0
        try:
            super().__init__(*args, **kwargs)
        finally:
            grpo_args.beta = kl_coef
        if ref_model is not None:
            self.beta = kl_coef
            self.ref_model = ref_model.to(self.accelerator.device)
            add_fused_lm_head(self.ref_model, temperature=self.temperature)
        check_trainer_attributes(self)
        if self._is_vlm:
            raise ValueError("three-channel trainer: vision-language models are not supported")
        if self.aux_loss_enabled:
            raise ValueError("three-channel trainer: MoE router aux loss is not supported; set router_aux_loss_coef=0")
        if settings is None:
            # Channel 1 as TRL resolved it from args (e.g. epsilon_high=None means epsilon).
            settings = ThreeChannelSettings(
                loss_type=self.loss_type,
                epsilon=self.epsilon_low,
                epsilon_high=self.epsilon_high,
                kl_coef=kl_coef,
                kl_bias_correction=bool(self.args.use_bias_correction_kl),
                max_completion_length=self.max_completion_length,
            )
        #: The one settings object: the channel weights and channel-2/3 options read here, and the loss's config.
        self.settings: ThreeChannelSettings = settings
        needs_reference = settings.dpo_variant == "sigmoid" and replay is not None and not replay.has_reference
        if settings.dpo_active and needs_reference:
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
        cfg = config or self.settings
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
                ref_logp=inputs.get("ref_per_token_logps") if cfg.kl_coef != 0.0 else None,
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
            if self.settings.sdpo_exclude_eos:
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


__all__ = ["UNSUPPORTED_GRPO_ARGS", "ThreeChannelGRPOTrainer"]
