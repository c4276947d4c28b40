"""``ThreeChannelTrainer``: the runtime's :class:`~composer_cloud.trainer.base.InnerTrainer` around the GRPO subclass.

``step()`` is exactly one inner optimizer step that *we* drive
(``training_step`` on a batch from our own seeded prompt stream, clip,
``optimizer.step()``, ``zero_grad()``), never ``Trainer.train()``, because
torchft's DiLoCo hooks that optimizer and the runtime checkpoints at step
boundaries. The learning rate is constant (no scheduler is ever stepped).
``state_dict()`` holds the optimizer state, the data and replay positions,
TRL's generation buffer, the KL reference model and every RNG the step draws
from, so a resumed run is bitwise identical to an uninterrupted one on CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import trl
from trl import GRPOConfig
from trl.trainer.utils import pad

from composer_cloud.compat_transformers import activation_checkpointing_args, is_activation_checkpointing
from composer_cloud.lora import is_lora_model
from composer_cloud.model import compute_precision
from composer_cloud.trainer.base import TrainerContext
from composer_cloud.trainer.three_channel.dataset_task import DatasetTask
from composer_cloud.trainer.three_channel.replay import ReplayBuffer, default_pairs_uri, load_pairs
from composer_cloud.trainer.three_channel.sandbox import SandboxLimits
from composer_cloud.trainer.three_channel.tasks import (
    HintSource,
    NoHints,
    VerifiableTask,
    build_task,
    make_reward_func,
    resolve_hint_source,
)
from composer_cloud.trainer.three_channel.grpo import ThreeChannelGRPOTrainer
from composer_cloud.trainer.three_channel.loss import CLIP_METRICS
from composer_cloud.trainer.three_channel.settings import ThreeChannelSettings
from composer_cloud.trainer.three_channel.sourced import CompletionSource, RolloutKey, SourcedRollouts
from composer_cloud.trainer.three_channel.state import (
    PromptStream,
    RNGState,
    forked_global_rngs,
    pack_generation_buffer,
    pack_optimizer,
    under_prefix,
    unpack_generation_buffer,
    unpack_optimizer,
    with_prefix,
)

logger = logging.getLogger(__name__)


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
        precision: str = "fp32",
        completion_source: CompletionSource | None = None,
        max_staleness: int = 0,
        trust_source_rewards: bool = False,
    ) -> None:
        if precision not in ("fp32", "bf16"):
            raise ValueError(f'model.precision: {precision!r}; use "fp32" or "bf16"')
        self.model = model
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.task = task
        self.settings = settings
        self.grad_clip = float(grad_clip)
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        self.seed = seed
        self._position: tuple[int, int] | None = None  # (round, step) of the next step, from set_rollout_position
        rank_seed = seed * 1_000_003 + rank
        self.stream = PromptStream(task.examples("train"), seed=seed, rank=rank, world_size=world_size)
        self.rng = RNGState(rank_seed, self.device)
        self.steps = 0
        self._last_reward: dict[str, float] = {}
        #: Pushes of the policy's weights into the rollout engine (vLLM's, or the "hf-fast" inference copy) made by
        #: on_params_replaced() (0 with rollout = "hf").
        self.engine_refreshes = 0

        s = settings
        if s.rollout == "vllm":
            from composer_cloud.trainer.three_channel.rollout import ensure_engine_model_dir

            ensure_engine_model_dir(model, tokenizer)
        replay = None
        if s.dpo_weight != 0.0 and pairs:
            replay = ReplayBuffer(
                pairs, tokenizer, seed=rank_seed, max_response_length=max(s.completion_length, 8) + 1
            )
        args = GRPOConfig(
            output_dir=os.path.join(tempfile.gettempdir(), "composer-cloud-grpo"),
            **s.grpo_kwargs(),
            learning_rate=float(optimizer.param_groups[0]["lr"]),
            max_grad_norm=self.grad_clip,
            seed=rank_seed,
            use_cpu=self.device.type == "cpu",
            # bf16: autocast compute (accelerate's, GPU and CPU); parameters and AdamW state stay as loaded (fp32).
            bf16=precision == "bf16",
            fp16=False,
            # As the model was loaded (load_spec_model); TRL then turns it off around its no-grad forwards.
            **activation_checkpointing_args(is_activation_checkpointing(model), {"use_reentrant": False}),
            disable_dropout=True,
            shuffle_dataset=False,
            report_to="none",
            save_strategy="no",
            log_completions=False,
            dataloader_num_workers=0,
        )
        from datasets import Dataset  # TRL needs a Dataset object; we never iterate it

        # A constant schedule: if anything ever calls Trainer.create_scheduler,
        # TRL must not swap in its default linear decay.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        # GRPOTrainer.__init__ calls set_seed(): keep that away from every global stream.
        with self.rng.scope(), forked_global_rngs(self.device):
            self.grpo = ThreeChannelGRPOTrainer(
                model=model,
                reward_funcs=make_reward_func(task),
                args=args,
                train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in self.stream.rows[:1]]),
                processing_class=tokenizer,
                optimizers=(optimizer, scheduler),
                # without pairs there is no channel 3, whatever its weight
                settings=s if replay is not None else dataclasses.replace(s, dpo_weight=0.0),
                hint_source=hint_source if s.sdpo_weight != 0.0 else NoHints(),
                replay=replay,
            )
        self._generate_every = s.steps_per_generation * s.num_iterations
        self._batch: list[dict[str, Any]] = []
        if completion_source is not None:
            self.set_completion_source(completion_source, max_staleness=max_staleness,
                                       trust_rewards=trust_source_rewards)

    # ------------------------------------------------------------------ completions from rollout workers
    def set_completion_source(self, source: CompletionSource | None, *, max_staleness: int = 0,
                              trust_rewards: bool = False) -> None:
        """Train on completions from ``source`` (rollout workers) instead of sampling; ``None``: sample here again.

        ``max_staleness``: rounds a batch's policy may lag this replica's round; ``trust_rewards``: train on
        the batch's rewards instead of scoring (off: see :attr:`.sourced.SourcedRollouts.trust_rewards`).
        Each :meth:`step` then needs :meth:`set_rollout_position` first. Fallback generations are seeded from
        the run seed and the step's key (:mod:`composer_cloud.trainer.three_channel.sourced`).
        """
        sourced = None if source is None else SourcedRollouts(source, max_staleness=max_staleness, seed=self.seed,
                                                              trust_rewards=trust_rewards)
        self.grpo.set_completion_source(sourced)

    def set_rollout_position(self, round: int, step: int) -> None:
        """Where the next :meth:`step` is: the replica's ``round`` and the run's inner ``step`` (its metrics row's).

        With a completion source, that step's generation is :class:`~.sourced.RolloutKey`
        ``(round, self.rank, step)``. Holds for the next :meth:`step` only.
        """
        self._position = (int(round), int(step))

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
        position, self._position = self._position, None
        if position is not None and g.sourced is not None:  # the batch this step's generation consumes
            g.rollout_key = RolloutKey(round=position[0], replica=self.rank, step=position[1])
        with self.rng.scope():
            self.model.train()
            g.state.global_step = self.steps
            loss = torch.zeros(())
            try:
                for _ in range(self.settings.gradient_accumulation_steps):
                    loss = loss + g.training_step(self.model, self._generation_rows(), None).detach().cpu()
            finally:
                g.rollout_key = None  # a step that did not generate leaves it: never for the next step
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
                # completions that hit max_completion_length (masked out when mask_truncated_completions)
                "clipped_ratio": last("completions/clipped_ratio"),
            }
        lr = float(self.optimizer.param_groups[0]["lr"])
        out: dict[str, float] = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
        for channel in ("pg", "sdpo", "dpo"):
            out[channel] = last(channel) if last(channel) is not None else 0.0  # 0.0 = skipped this step
        for key in (*CLIP_METRICS, "kl", "entropy", "aux_loss", "taid_t", "dpo_margin", "dpo_accuracy"):
            if last(key) is not None:
                out[key] = last(key)  # type: ignore[assignment]
        out.update({k: v for k, v in self._last_reward.items() if v is not None})
        if self.grpo.sourced is not None:  # rollouts/used, stale, invalid, missing, fallback, staleness
            out.update(self.grpo.sourced.take_metrics())
        out["step_time_s"] = seconds
        return out

    def take_samples(self) -> list[dict[str, Any]]:
        """The ``trainer.log_samples`` (prompt, completion, reward) of the latest generation since the last call.

        The runtime calls it when a round ends and writes them to the store (``samples/``); never part of the
        trainer's state (reporting only).
        """
        return self.grpo.take_samples()

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
            with forked_global_rngs(self.device), self.grpo.accelerator.autocast():
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
        out = {
            "eval_reward_mean": float(np.mean(scores)),
            "eval_solved": float(np.mean([s >= 1.0 for s in scores])),
            "eval_examples": float(len(rows)),
        }
        ref_loss = self._reference_loss(rows)
        if ref_loss is not None:
            out["eval_loss"] = ref_loss
        return out

    @torch.no_grad()
    def _reference_loss(self, rows: Sequence[Mapping[str, Any]]) -> float | None:
        """Mean per-token NLL (nats) of the held-out rows' reference answers given their prompts.

        Rows with a plain-text ``prompt`` and a ``reference`` string count (the demo task's reference
        solutions; a dataset's mapped ``answer``). Tokenized as the replay pairs are: prompt tokens,
        then the reference's own tokens and EOS. A dense signal that moves long before a tiny model's
        greedy completions pass any test. ``None`` when no row has a reference.
        """
        pairs = [(r["prompt"], r["reference"]) for r in rows
                 if isinstance(r.get("prompt"), str) and isinstance(r.get("reference"), str) and r["reference"]]
        if not pairs:
            return None
        eos = self.tokenizer.eos_token_id
        was_training = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        try:
            with forked_global_rngs(self.device), self.grpo.accelerator.autocast():
                for prompt, ref in pairs:
                    p = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
                    a = list(self.tokenizer(ref, add_special_tokens=False)["input_ids"]) + [eos]
                    ids = torch.tensor([p + a], dtype=torch.long, device=self.device)
                    logits = self.model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
                    nll = torch.nn.functional.cross_entropy(logits, ids[0, len(p):], reduction="sum")
                    total += float(nll)
                    count += len(a)
        finally:
            self.model.train(was_training)
        return total / max(count, 1)


    # ------------------------------------------------------------------ weight refresh
    def on_params_replaced(self) -> None:
        """The model's parameters were replaced outside the optimizer (outer step, heal, adopt, restore).

        With ``rollout = "vllm"`` the new weights are pushed into the engine now,
        with ``"hf-fast"`` into the bf16 inference copy (the push before a
        generation follows only a change of ``global_step``, which a rollback to
        an earlier step does not make); with ``"hf"`` generation reads the live
        parameters and there is nothing to do.
        """
        g = self.grpo
        if g.fast_sampler is not None:
            g.refresh_rollout_copy()
            self.engine_refreshes += 1
            return
        if not g.use_vllm:
            return
        g.vllm_generation.sync_weights()
        g._last_loaded_step = g.state.global_step
        self.engine_refreshes += 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(tensors, JSON meta)``: optimizer, RNGs, data position, TRL's buffer, replay position, KL reference."""
        tensors, opt_meta = pack_optimizer(self.optimizer)
        meta: dict[str, Any] = {"version": self.STATE_VERSION, "trl": trl.__version__, "steps": self.steps}
        meta["optimizer"] = opt_meta

        rng_t, meta["rng"] = self.rng.state_dict()
        tensors.update(with_prefix("rng.", rng_t))
        meta["data"] = self.stream.state()
        meta["batch"] = self._batch

        g = self.grpo
        buf_t, buf_meta = pack_generation_buffer(g._buffered_inputs)
        tensors.update(buf_t)
        meta["grpo"] = {"step": g._step, "buffer": buf_meta, "last_reward": self._last_reward}

        if g.replay is not None:
            r_t, meta["replay"] = g.replay.state_dict()
            tensors.update(with_prefix("replay.", r_t))
        if g.taid is not None:
            meta["taid"] = g.taid.state_dict()  # Python floats: JSON restores them bit-for-bit
        if g.beta != 0.0 and g.ref_model is not None:  # TRL's beta: the KL coefficient (settings.kl_coef)
            # The KL reference is the model the run started from, not the one a restart starts from.
            ref = {k: v.detach().cpu().clone().contiguous() for k, v in g.ref_model.state_dict().items()}
            tensors.update(with_prefix("kl_ref.", ref))
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into a trainer built with the same settings, task and pairs."""
        if meta.get("version") != self.STATE_VERSION:
            raise ValueError(f"three-channel state version {meta.get('version')!r}; expected {self.STATE_VERSION}")
        unpack_optimizer(self.optimizer, tensors, meta["optimizer"])
        self.rng.load_state_dict(under_prefix("rng.", tensors), meta["rng"])
        self.stream.load(meta["data"])
        self._batch = [dict(r) for r in meta["batch"]]
        self.steps = int(meta["steps"])

        g = self.grpo
        if g.use_vllm:  # restored parameters: the engine is pushed again before it next generates
            g._last_loaded_step = -1
        g.invalidate_rollout_copy()  # the same for the "hf-fast" inference copy
        g._step = int(meta["grpo"]["step"])
        self._last_reward = dict(meta["grpo"].get("last_reward") or {})
        g._buffered_inputs = unpack_generation_buffer(tensors, meta["grpo"]["buffer"], g.accelerator.device)
        if "taid" in meta:
            g.taid_schedule().load_state_dict(meta["taid"])
        elif g.settings.sdpo_active and g.settings.sdpo_variant == "taid":
            raise ValueError("checkpoint has no TAID schedule but this trainer has trainer.sdpo_variant = 'taid'")
        if g.beta != 0.0 and g.ref_model is not None:
            ref = under_prefix("kl_ref.", tensors)
            if not ref:
                raise ValueError("checkpoint has no KL reference model but this trainer has trainer.kl_coef != 0")
            g.ref_model.load_state_dict(ref)
        if g.replay is not None:
            if "replay" not in meta:
                raise ValueError("checkpoint has no replay state but this trainer replays pairs")
            g.replay.load_state_dict(under_prefix("replay.", tensors), meta["replay"])


# --------------------------------------------------------------------------- factory
def build_three_channel_trainer(ctx: TrainerContext) -> ThreeChannelTrainer:
    """The runtime's factory: settings from ``ctx.settings``, AdamW from ``ctx.inner_optimizer``."""
    s = ThreeChannelSettings.from_settings(ctx.settings)
    if s.rollout == "vllm":
        from composer_cloud.trainer.three_channel.rollout import check_vllm_rollout

        check_vllm_rollout(torch.device(ctx.device).type)
    lora = ctx.model.peft_config["default"] if is_lora_model(ctx.model) else None
    if lora is not None:
        ThreeChannelSettings.check_lora_dropout(lora.lora_dropout)
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
    if s.dataset is not None:
        task: VerifiableTask = DatasetTask(
            dataset=s.dataset, split=s.dataset_split, config=s.dataset_config, data_files=s.data_files,
            eval_split=s.eval_split, eval_fraction=s.eval_fraction, columns=dict(s.columns),
            reward_name=s.effective_reward, seed=ctx.seed, max_workers=s.sandbox_workers,
            sandbox_limits=SandboxLimits(timeout_s=s.sandbox_timeout_s, per_test_timeout_s=s.sandbox_per_test_timeout_s,
                                         memory_mb=s.sandbox_memory_mb),
        )
    else:
        task = build_task(s.task, **task_options)
    hints = resolve_hint_source(s.hint_source, task)
    pairs = None
    if s.dpo_weight != 0.0 and s.effective_pairs != "none":
        uri = default_pairs_uri() if s.effective_pairs == "builtin" else s.effective_pairs
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
        precision=compute_precision(ctx.model),
    )


__all__ = ["ThreeChannelTrainer", "build_three_channel_trainer"]
