"""Running on the versions people have: the checkpointing compat layer, and one-line "too old" refusals.

These run on whatever transformers is installed (CI runs them on the newest allowed and, in the
lowest-versions stage of ``.ci/run``, on the oldest), so they assert behaviour that holds on both
sides of transformers 5.23's rename of gradient to activation checkpointing.
"""

from __future__ import annotations

import tomllib
import warnings
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from composer_cloud import compat_transformers as compat
from composer_cloud import stack
from composer_cloud.errors import SpecError
from composer_cloud.spec import spec_from_dict

REQUIRES = ["torch>=2.7", "transformers<6,>=5.0", "peft>=0.18", 's3fs>=2024.10; extra == "s3"',
            'composer-cloud[s3]; extra == "cloud"']


def _fake_versions(**fake: str):
    """``importlib.metadata.version`` with some distributions replaced (names as given, ``-``/``_`` alike)."""
    real = metadata.version
    fake = {k.replace("_", "-"): v for k, v in fake.items()}

    def version(name: str) -> str:
        return fake.get(name.replace("_", "-").lower(), None) or real(name)

    return version


# ---------------------------------------------------------------- checkpointing across the rename


@pytest.mark.parametrize("enabled", [True, False])
def test_grpo_config_gets_checkpointing_under_the_names_this_transformers_knows(enabled):
    from trl import GRPOConfig

    kwargs = compat.activation_checkpointing_args(enabled, {"use_reentrant": False})
    args = GRPOConfig(output_dir="unused", use_cpu=True, report_to="none", **kwargs)
    # Both names read the same after __post_init__ on >= 5.23; only the old one exists before.
    assert args.gradient_checkpointing is enabled  # TRL's own default (True) must not win when False is asked
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}


def test_old_transformers_gets_the_gradient_names(monkeypatch):
    monkeypatch.setattr(compat, "training_args_use_activation_names", lambda: False)
    assert compat.activation_checkpointing_args(True, {"use_reentrant": False}) == {
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    monkeypatch.setattr(compat, "training_args_use_activation_names", lambda: True)
    assert compat.activation_checkpointing_args(False) == {
        "activation_checkpointing": False, "activation_checkpointing_kwargs": {}}


class _OldModel(torch.nn.Module):
    """A model with only the pre-5.23 API (what transformers 5.17-5.22 models have)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.calls.append(dict(gradient_checkpointing_kwargs or {}))

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(self.calls)


def test_a_model_with_only_the_old_api_is_enabled_and_read_through_it():
    model = _OldModel()
    assert compat.is_activation_checkpointing(model) is False
    compat.enable_activation_checkpointing(model, {"use_reentrant": False})
    assert model.calls == [{"use_reentrant": False}]
    assert compat.is_activation_checkpointing(model) is True
    assert compat.is_activation_checkpointing(torch.nn.Linear(2, 2)) is False  # not a transformers model


def test_a_real_model_is_checkpointed_and_its_deprecated_alias_no_longer_warns():
    from composer_cloud.model import TinyModelConfig, load_model

    model, _ = load_model("tiny", seed=0, tiny=TinyModelConfig(hidden_size=16, num_hidden_layers=1,
                                                               num_attention_heads=2, num_key_value_heads=1,
                                                               intermediate_size=32))
    compat.enable_activation_checkpointing(model, {"use_reentrant": False})
    assert compat.is_activation_checkpointing(model) is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.silence_deprecated_checkpointing_aliases()
        assert model.is_gradient_checkpointing is True  # what TRL and PEFT read (deprecated from 5.23)
        warnings.warn("some other deprecation", FutureWarning)
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert messages == ["some other deprecation"]  # only the alias messages are filtered


# ---------------------------------------------------------------- "too old", in one line


def test_a_too_old_package_is_one_line_naming_package_found_and_needed():
    reqs = stack.declared_requirements((), requires=REQUIRES)
    assert [r.name for r in reqs] == ["torch", "transformers", "peft"]  # core only: no extra, no self-reference
    assert [r.name for r in stack.declared_requirements(("s3",), requires=REQUIRES)][-1] == "s3fs"
    problems = stack.too_old(reqs, version_of=_fake_versions(transformers="4.57.6", torch="2.13.0", peft="0.18.0"))
    assert len(problems) == 1 and "\n" not in problems[0]
    line = problems[0]
    assert line.startswith("transformers 4.57.6 is too old")
    assert "found 4.57.6" in line and ">=5.0" in line
    # Above the cap is a warning (it may work), not a refusal; a missing package is someone else's check.
    assert stack.too_old(reqs, version_of=_fake_versions(transformers="6.1.0", torch="2.13.0", peft="0.18.0")) == []


def test_the_spec_decides_which_extras_are_checked():
    assert stack.spec_extras(spec_from_dict({})) == ()
    spec = spec_from_dict({"store": "s3://bucket/prefix", "report_to": ["tensorboard"]})
    assert stack.spec_extras(spec) == ("s3", "tracking")
    with pytest.raises(stack.PackageTooOldError) as err:
        stack.check_packages(spec, requires=REQUIRES, version_of=_fake_versions(s3fs="2024.9.0"))
    assert str(err.value).startswith("s3fs 2024.9.0 is too old: found 2024.9.0, needs s3fs>=2024.10")
    stack.check_packages(spec_from_dict({}), requires=REQUIRES, version_of=_fake_versions(s3fs="2024.9.0"))


def _installed_floor(name: str) -> str:
    """The floor composer-cloud's installed metadata declares for ``name``."""
    req = next(r for r in stack.declared_requirements() if r.name == name)
    low = stack._lowest(req)
    assert low is not None, f"{name} has no floor in composer-cloud's metadata"
    return str(low)


def test_launch_refuses_local_replicas_with_the_same_line(monkeypatch, tmp_path):
    from composer_cloud.runs.lifecycle import check_before_launch

    floor = _installed_floor("transformers")
    monkeypatch.setattr(metadata, "version", _fake_versions(transformers="4.57.6"))
    spec = spec_from_dict({"store": f"file://{tmp_path}/runs", "replicas": 2})
    with pytest.raises(SpecError) as err:
        check_before_launch(spec, base_dir=tmp_path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("transformers 4.57.6 is too old: found 4.57.6, needs transformers")
    assert f">={floor}" in message


def test_a_replica_with_a_too_old_package_exits_at_start_in_one_line(monkeypatch, tmp_path, caplog):
    from composer_cloud.replica.__main__ import main
    from composer_cloud.storage import layout
    from composer_cloud.storage.store import Store

    uri = f"file://{tmp_path}/runs/r"
    Store(uri).put_json("spec.json", spec_from_dict({"run_id": "r", "store": f"file://{tmp_path}/runs",
                                                     "replicas": 1}).to_json_dict())
    monkeypatch.setattr(metadata, "version", _fake_versions(huggingface_hub="0.30.0"))
    with caplog.at_level("ERROR", logger="composer_cloud.replica"):
        assert main(["--run", uri, "--rank", "0"]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0]
    assert "huggingface_hub 0.30.0 is too old: found 0.30.0, needs huggingface_hub" in errors[0]
    beat = Store(uri).get_json(layout.heartbeat_key(0))  # where `status` reads why it died
    assert beat["state"] == "failed" and errors[0].split(": ", 1)[1] in beat["error"]


def test_hf_jobs_refuses_a_hub_without_the_jobs_api_in_one_line():
    from composer_cloud.jobs.base import ExecutorError
    from composer_cloud.jobs.hf_jobs import HUB_JOBS_MIN, require_jobs_hub

    with pytest.raises(ExecutorError) as err:
        require_jobs_hub("1.33.0")
    message = str(err.value)
    assert "\n" not in message
    assert "huggingface_hub>=" + HUB_JOBS_MIN in message and "found 1.33.0" in message
    require_jobs_hub(HUB_JOBS_MIN)
    require_jobs_hub("2.4.0")


# ---------------------------------------------------------------- the floors CI tests are pyproject's floors

ROOT = Path(__file__).resolve().parents[1]
#: Constraint lines that are not the pyproject floor, each explained in .ci/lowest-constraints.txt.
NOT_THE_FLOOR = {"torch", "fsspec"}


def _constraints() -> dict[str, Requirement]:
    lines = (ROOT / ".ci" / "lowest-constraints.txt").read_text().splitlines()
    reqs = [Requirement(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return {canonicalize_name(r.name): r for r in reqs}


def test_the_lowest_constraints_pin_every_direct_dependency_at_its_pyproject_floor():
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    pins = _constraints()
    assert set(pins) == {canonicalize_name(d.name) for d in deps}, "one line per direct dependency, no more"
    text = (ROOT / ".ci" / "lowest-constraints.txt").read_text()
    for dep in deps:
        name = canonicalize_name(dep.name)
        (pin,) = pins[name].specifier
        assert pin.operator == "==", f"{pins[name]}: pin the floor with =="
        assert dep.specifier.contains(pin.version), f"{pins[name]} is outside pyproject's {dep}"
        if name in NOT_THE_FLOOR:
            assert f"not the floor: {dep.name}" in text, f"say in the file why {name} is not at its floor"
        else:
            assert Version(pin.version) == stack._lowest(dep), f"{pins[name]} is not pyproject's floor ({dep})"


def test_ci_runs_the_readme_test_command_then_the_lowest_versions_stage():
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if 'pip install -e ".[test]"' in line).split(" && ")[-1]
    assert command.startswith("python -m pytest")
    run = (ROOT / ".ci" / "run").read_text()
    assert run.index(command) < run.index("bash .ci/lowest"), "the README's command first, as written"
    lowest = (ROOT / ".ci" / "lowest").read_text()
    assert "-c .ci/lowest-constraints.txt" in lowest and '-m "not slow"' in lowest
