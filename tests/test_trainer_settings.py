"""The ``[trainer]`` table check the launcher runs before any job starts (no torch, no TRL)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from composer_cloud.registry import BadReference
from composer_cloud.trainer import TRAINERS, TrainerContext, build_trainer, check_settings
from composer_cloud.trainer.settings import CausalLMSettings
from composer_cloud.trainer.three_channel.tasks import build_task, resolve_hint_source
from composer_cloud.trainer.three_channel.settings import ThreeChannelSettings

ROOT = Path(__file__).parents[1]


def test_every_registered_trainer_is_a_settings_class_naming_its_factory():
    from composer_cloud.registry import load_object
    from composer_cloud.trainer.settings import settings_class

    for name in TRAINERS:
        cls = settings_class(name)
        assert cls.TRAINER == name and callable(cls.from_settings)
        assert callable(load_object(cls.FACTORY, setting="trainer.name"))


def test_check_settings_imports_neither_torch_nor_trl():
    code = textwrap.dedent(
        """
        import sys
        from composer_cloud.trainer import check_settings
        check_settings("three-channel", {"batch_size": 8, "seq_len": 64, "sdpo_weight": 0.2, "task_options": {"n": 3}})
        check_settings("causal-lm", {"batch_size": 4, "seq_len": 32})
        try:
            check_settings("three-channel", {"batchsize": 8})
        except ValueError as e:
            assert "trainer.batch_size" in str(e), e
        else:
            raise SystemExit("no error")
        heavy = sorted(m for m in ("torch", "trl", "transformers", "datasets", "numpy") if m in sys.modules)
        print(heavy)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def test_defaults_and_the_shipped_example_are_valid():
    from composer_cloud.spec import TrainerSpec

    for name in TRAINERS:
        check_settings(name, TrainerSpec().settings())  # what the replica receives for an empty [trainer]
    table = dict(tomllib.loads((ROOT / "examples" / "demo.toml").read_text())["trainer"])
    check_settings(table.pop("name"), table)
    check_settings("three-channel", {"name": "three-channel"})  # the table's own selector is accepted


@pytest.mark.parametrize(
    "name, settings, message",
    [
        # unknown keys, with the closest valid key
        ("three-channel", {"batchsize": 8}, r"trainer\.batchsize is not a three-channel setting; did you mean trainer\.batch_size\?"),
        ("three-channel", {"num_generation": 4}, r"did you mean trainer\.num_generations\?"),
        ("causal-lm", {"seqlen": 32}, r"trainer\.seqlen is not a causal-lm setting; did you mean trainer\.seq_len\?"),
        ("causal-lm", {"sdpo_weight": 0.1}, r"trainer\.sdpo_weight is not a causal-lm setting; valid keys: batch_size"),
        # renamed keys name their replacement
        ("three-channel", {"alpha": 0.1}, r"trainer\.alpha was renamed to trainer\.sdpo_weight"),
        ("three-channel", {"beta": 0.5}, r"trainer\.beta was renamed to trainer\.dpo_weight"),
        ("three-channel", {"kl_beta": 0.04}, r"trainer\.kl_beta was renamed to trainer\.kl_coef"),
        # wrong types (TOML types as written: no "8" -> 8, no true -> 1)
        ("three-channel", {"batch_size": "8"}, r"trainer\.batch_size: .*valid integer \(got str\)"),
        ("three-channel", {"sdpo_exclude_eos": 1}, r"trainer\.sdpo_exclude_eos: .*valid boolean"),
        ("three-channel", {"task_options": ["n", 3]}, r"trainer\.task_options: .*valid dictionary"),
        ("causal-lm", {"batch_size": True}, r"trainer\.batch_size: .*valid integer \(got bool\)"),
        ("causal-lm", {"eval_rows": 1.5}, r"trainer\.eval_rows: .*valid integer \(got float\)"),
        # bad values
        ("three-channel", {"loss_type": "ppo"}, r"trainer\.loss_type: .*'dapo' \(got 'ppo'\)"),
        ("three-channel", {"jsd_beta": 1.5}, r"trainer\.jsd_beta: .*less than or equal to 1 \(got 1\.5\)"),
        ("three-channel", {"dpo_weight": -0.5}, r"trainer\.dpo_weight: .*greater than or equal to 0"),
        ("three-channel", {"kl_coef": float("nan")}, r"trainer\.kl_coef: .*finite number"),
        ("three-channel", {"num_generations": 1, "batch_size": 2}, r"trainer\.num_generations: .*greater than or equal to 2"),
        ("three-channel", {"batch_size": 6}, r"trainer\.batch_size × trainer\.steps_per_generation \(6 × 1, the generation batch\) must be a multiple of trainer\.num_generations \(4\)"),
        ("three-channel", {"dpo_variant": "ipo"}, r"trainer\.dpo_variant"),
        ("three-channel", {"hint_template": "{prompt}\n{hint}"}, r"trainer\.hint_template must contain '\{hint\}' and end with"),
        ("three-channel", {"hint_template": "{hint} {x} {prompt}"}, r"trainer\.hint_template: KeyError"),
        ("three-channel", {"task": "my_tasks"}, r"trainer\.task: unknown task 'my_tasks'; choose one of \['python-functions'\]"),
        ("three-channel", {"hint_source": "nope"}, r"trainer\.hint_source: unknown hint source 'nope'; use \"default\".*'none'.*column:NAME"),
        ("three-channel", {"dataset": "d.jsonl", "reward": "f1"}, r"trainer\.reward: unknown reward 'f1'; choose one of \['contains', 'exact_match', 'python_tests'\]"),
        ("three-channel", {"hint_source": "column:"}, r"trainer\.hint_source 'column:'"),
        ("causal-lm", {"seq_len": 0}, r"trainer\.seq_len: .*greater than 0"),
        # the trainer name itself
        ("causal-llm", {}, r"trainer\.name: unknown trainer 'causal-llm'; choose one of \['causal-lm', 'three-channel'\]"),
        ("three-channel", {"name": "causal-lm"}, r"trainer\.name is 'causal-lm'"),
    ],
)
def test_bad_settings_name_the_key(name, settings, message):
    with pytest.raises(ValueError, match=message):
        check_settings(name, settings)


def test_every_problem_is_reported_at_once_and_option_values_are_not_echoed():
    with pytest.raises(ValueError) as e:
        check_settings("three-channel", {"alpha": 0.1, "batchsize": 8})
    assert "trainer.alpha" in str(e.value) and "trainer.batchsize" in str(e.value)
    with pytest.raises(ValueError) as e:
        check_settings("three-channel", {"pairs_storage_options": "AKIAEXAMPLESECRET"})
    assert "trainer.pairs_storage_options" in str(e.value) and "AKIAEXAMPLESECRET" not in str(e.value)


def test_the_replica_applies_the_same_check():
    # The trainers build their settings with the same classes, so launch-time and run-time agree.
    for name, bad in [("causal-lm", {"seqlen": 32}), ("three-channel", {"alpha": 0.1})]:
        ctx = TrainerContext(model=None, tokenizer=None, rank=0, world_size=1, seed=0, device=None, settings=bad)
        with pytest.raises(ValueError) as built:
            build_trainer(name, ctx)
        with pytest.raises(ValueError) as checked:
            check_settings(name, bad)
        assert str(built.value) == str(checked.value)
    s = CausalLMSettings.from_settings({"batch_size": 4, "seq_len": 32})
    assert (s.batch_size, s.seq_len, s.corpus_size, s.eval_rows) == (4, 32, 4000, 64)


def test_settings_values_and_grpo_mapping():
    s = ThreeChannelSettings.from_settings({"seq_len": 32, "kl_coef": 0.04, "epsilon": 1})
    assert s.epsilon == 1.0 and isinstance(s.epsilon, float)  # an int where a float is due is fine
    assert s.completion_length == 32  # max_completion_length defaults to seq_len
    kw = s.grpo_kwargs()
    assert kw["beta"] == 0.04 and kw["max_completion_length"] == 32 and kw["per_device_train_batch_size"] == 8
    assert ThreeChannelSettings(max_completion_length=8, seq_len=32).completion_length == 8
    with pytest.raises(ValueError):
        ThreeChannelSettings(batch_size=6)  # the Python constructor validates too


def test_factory_settings_are_loaded_through_the_registry():
    task = build_task("python-functions")
    with pytest.raises(BadReference, match=r"trainer\.hint_source: cannot import module 'no_such_module_xyz'"):
        resolve_hint_source("no_such_module_xyz:make_hints", task)
    with pytest.raises(BadReference, match=r"trainer\.task: module 'composer_cloud.trainer.three_channel.tasks' has no attribute"):
        build_task("composer_cloud.trainer.three_channel.tasks:no_such_factory")
    assert build_task("composer_cloud.trainer.three_channel.tasks:PythonFunctionsTask").name == task.name


def test_a_trainer_may_be_named_by_its_settings_class():
    # trainer.name resolves through the same registry as tasks and hint sources: a registered
    # name, or "module:SettingsClass" whose FACTORY builds the trainer.
    ref = "composer_cloud.trainer.settings:CausalLMSettings"
    check_settings(ref, {"batch_size": 4, "seq_len": 32})
    with pytest.raises(ValueError, match=r"trainer\.seqlen is not a causal-lm setting"):
        check_settings(ref, {"seqlen": 32})
    with pytest.raises(BadReference, match=r"trainer\.name: module 'composer_cloud.trainer.settings' has no attribute 'Nope'"):
        check_settings("composer_cloud.trainer.settings:Nope", {})
