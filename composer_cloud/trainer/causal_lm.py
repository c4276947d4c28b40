"""Plain next-token (causal LM) training on the built-in corpus, the stdlib corpus, or your own dataset.

Each replica reads its own shard of the corpus (``rank::world_size``) in an
order drawn from a seeded ``torch.Generator``; the data position and the
generator state are part of :meth:`CausalLMTrainer.state_dict`, so a resumed
replica sees exactly the batches it would have seen.

``[model] precision = "bf16"`` runs the forward and backward under bfloat16
autocast (on a GPU and on a CPU); parameters, gradients and AdamW's state stay
as the model was loaded (float32).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from composer_cloud.corpus import heldout_corpus, train_corpus
from composer_cloud.model import compute_precision
from composer_cloud.trainer.base import TrainerContext
from composer_cloud.trainer.parallel import data_parallel, full_value, local_rows, loss_weight, reshard
from composer_cloud.trainer.optim import build_inner_optimizer, load_optimizer_state, optimizer_state
from composer_cloud.trainer.settings import CausalLMSettings

logger = logging.getLogger(__name__)


def _pack(tokenizer: Any, texts: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate ``texts`` (eos-separated) and cut into ``[n, seq_len]`` rows."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"corpus too small for seq_len={seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def _row_text(row: dict[str, Any], columns: dict[str, str]) -> str | None:
    """A row's training text: its ``text`` column, else ``prompt`` + newline + ``answer`` (None: neither)."""
    text = row.get(columns.get("text", "text"))
    if isinstance(text, str):
        return text
    prompt, answer = row.get(columns.get("prompt", "prompt")), row.get(columns.get("answer", "answer"))
    if prompt is None or answer is None:
        return None
    return f"{prompt}\n{answer}"


def dataset_texts(settings: CausalLMSettings, *, seed: int) -> tuple[list[str], list[str]]:
    """``(train, held-out)`` texts of ``settings.dataset``: ``eval_split``, else a seeded ``eval_fraction``
    of the rows (the same on every replica and launch). ``ValueError`` naming the columns when a row has
    neither a text nor a prompt and an answer."""
    import random

    from composer_cloud.trainer.data import load_rows

    def texts(split: str) -> list[str]:
        rows = load_rows(settings.dataset, split, config=settings.dataset_config, data_files=settings.data_files)
        out = [_row_text(r, settings.columns) for r in rows]
        if rows and any(t is None for t in out):
            raise ValueError(f"trainer.dataset {settings.dataset!r} (split {split!r}): a row has neither a 'text' "
                             f"column nor 'prompt' and 'answer' (its columns: {', '.join(rows[0])}); map them "
                             "with trainer.columns")
        return [t for t in out if t is not None]

    train = texts(settings.dataset_split)
    if settings.eval_split:
        return train, texts(settings.eval_split)
    order = list(range(len(train)))
    random.Random(f"dataset-eval:{seed}").shuffle(order)
    n_eval = 0 if settings.eval_fraction == 0 or len(train) < 2 else \
        min(len(train) - 1, max(1, round(len(train) * settings.eval_fraction)))
    held = set(order[:n_eval])
    return [t for i, t in enumerate(train) if i not in held], [train[i] for i in sorted(held)]


class CausalLMTrainer:
    """Next-token prediction with AdamW; one :meth:`step` = one optimizer step.

    Settings: :class:`~composer_cloud.trainer.settings.CausalLMSettings` (an
    unknown or mistyped key is a ``ValueError`` naming ``trainer.<key>``).
    """

    def __init__(self, ctx: TrainerContext) -> None:
        self.settings = settings = CausalLMSettings.from_settings(ctx.settings)
        self.model = ctx.model
        self.device = ctx.device
        self.batch_size = settings.batch_size
        if settings.dataset is not None:
            train, held = dataset_texts(settings, seed=ctx.seed)
            rows = _pack(ctx.tokenizer, train, settings.seq_len)
            try:
                self.heldout = _pack(ctx.tokenizer, held, settings.seq_len)[: settings.eval_rows]
            except ValueError:  # fewer held-out tokens than one row: no evaluation
                self.heldout = rows[:0]
        elif settings.corpus == "stdlib":
            from composer_cloud.stdlib_corpus import token_rows

            rows = token_rows(ctx.tokenizer, "train", settings.seq_len, max_bytes=settings.corpus_bytes)
            self.heldout = token_rows(ctx.tokenizer, "heldout", settings.seq_len, max_rows=settings.eval_rows)
        else:
            rows = _pack(ctx.tokenizer, train_corpus(settings.corpus_size), settings.seq_len)
            self.heldout = _pack(ctx.tokenizer, heldout_corpus(), settings.seq_len)[: settings.eval_rows]
        self.rows = rows[ctx.rank :: ctx.world_size]
        # A multi-GPU replica: every local rank draws the replica's batch, trains on its rows (trainer/parallel.py).
        # FSDP replaces the parameters with their shards: wrap first, then build the optimizer over them.
        self.local_rank, self.local_world = ctx.local_rank, ctx.local_world
        self.forward_model = data_parallel(self.model, ctx.local_world, ctx.parallelism)
        self.optimizer = build_inner_optimizer(self.model, ctx.inner_optimizer)
        self.bf16 = compute_precision(self.model) == "bf16"
        self.grad_clip = float(ctx.inner_optimizer.get("grad_clip", 1.0))
        self.generator = torch.Generator().manual_seed(ctx.seed * 1000 + ctx.rank)
        self.epoch = 0
        self.position = 0
        self._order = torch.randperm(len(self.rows), generator=self.generator)

    def _next_batch(self) -> torch.Tensor:
        idx: list[int] = []
        while len(idx) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = torch.randperm(len(self.rows), generator=self.generator)
            take = min(self.batch_size - len(idx), len(self._order) - self.position)
            idx.extend(self._order[self.position : self.position + take].tolist())
            self.position += take
        return self.rows[idx].to(self.device)

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def step(self) -> dict[str, float]:
        self.model.train()
        batch = self._next_batch()
        mine = batch[local_rows(len(batch), self.local_rank, self.local_world)]
        with self._autocast():
            loss = self.forward_model(input_ids=mine, labels=mine).loss
        # Rows are full (no padding): a rank's share of the predicted tokens is its share of the rows.
        (loss * loss_weight(len(mine), len(batch), self.local_world) if self.local_world > 1 else loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip) if self.grad_clip else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        out = {"loss": float(loss.detach()), "tokens": int(batch.numel())}  # this rank's rows' loss
        if grad_norm is not None:
            out["grad_norm"] = float(full_value(grad_norm))  # FSDP: a replicated DTensor
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if len(self.heldout) == 0:
            return {}
        self.model.eval()
        losses = []
        for start in range(0, len(self.heldout), self.batch_size):
            batch = self.heldout[start : start + self.batch_size].to(self.device)
            with self._autocast():
                losses.append(float(self.model(input_ids=batch, labels=batch).loss))
        reshard(self.model)  # FSDP: the forward left the root's parameters gathered
        loss = sum(losses) / max(1, len(losses))
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = optimizer_state(self.optimizer, model=self.model)
        tensors["data/order"] = self._order.clone()
        tensors["data/generator"] = self.generator.get_state()
        meta["data"] = {"epoch": self.epoch, "position": self.position}
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        load_optimizer_state(self.optimizer, tensors, meta, model=self.model)
        self._order = tensors["data/order"].clone()
        self.generator.set_state(tensors["data/generator"])
        self.epoch = int(meta["data"]["epoch"])
        self.position = int(meta["data"]["position"])


def build_causal_lm_trainer(ctx: TrainerContext) -> CausalLMTrainer:
    return CausalLMTrainer(ctx)
