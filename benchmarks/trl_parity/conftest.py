"""pytest plugin for running TRL's ``tests/test_grpo_trainer.py`` offline (see ``run.py``).

* ``load_dataset("trl-internal-testing/zen", config)`` reads local JSON Lines written by ``run.py``
  (``$TRL_PARITY_DATA``); other ``trl-internal-testing`` datasets (images) skip the test.
* This machine may have no GPU: ``GRPOConfig``'s bf16 default would refuse to build, so it trains in fp32.
* ``TRL_UNDER_TEST=subclass``: ``trl.GRPOTrainer`` is ``ThreeChannelGRPOTrainer`` with channels 2 and 3 at
  weight 0, so every test of the file runs against the subclass; ``stock`` leaves TRL alone.
"""

import dataclasses
import os
from pathlib import Path

import datasets
import pytest
import torch
import transformers

_load_dataset = datasets.load_dataset


def _offline_load_dataset(path, name=None, split=None, streaming=False, **kwargs):
    if path == "trl-internal-testing/zen":
        data = Path(os.environ["TRL_PARITY_DATA"])
        files = {s: str(data / f"{name}_{s}.jsonl") for s in ("train", "test")}
        return _load_dataset("json", data_files=files, split=split, streaming=streaming)
    if path.startswith("trl-internal-testing/"):
        pytest.skip(f"trl_parity: no offline copy of {path}")
    return _load_dataset(path, name, split=split, streaming=streaming, **kwargs)


datasets.load_dataset = _offline_load_dataset
_post_init = transformers.TrainingArguments.__post_init__


def _cpu_post_init(self):
    if not torch.cuda.is_available():
        self.bf16 = False
    _post_init(self)


transformers.TrainingArguments.__post_init__ = _cpu_post_init

if os.environ.get("TRL_UNDER_TEST") == "subclass":
    import trl

    from composer_cloud.trainer.three_channel.grpo import ThreeChannelGRPOTrainer

    class ChannelOneOnly(ThreeChannelGRPOTrainer):
        """The three-channel trainer with sdpo_weight = dpo_weight = 0: channel 1 alone."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.settings = dataclasses.replace(self.settings, sdpo_weight=0.0, dpo_weight=0.0)

    trl.GRPOTrainer = ChannelOneOnly
