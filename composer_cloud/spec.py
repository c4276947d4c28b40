"""The run spec: one TOML file (or none) plus CLI overrides, validated on load.

The spec as launched is stored at ``<run>/spec.json`` and every replica reads
it from there, so replicas on different executors agree on every setting.
Validation is strict (pydantic, ``extra="forbid"``): unknown keys, wrong types
and out-of-range values are rejected with the dotted name of the field.
No secret value is ever part of a spec: secrets are referred to by name only.
"""

from __future__ import annotations

import datetime as _dt
import functools
import re
import secrets as _secrets
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from composer_cloud.errors import SpecError, url_has_credentials
from composer_cloud.spec_errors import error_from_validation
from composer_cloud.spec_sync import GATHER_MAX_REPLICAS, Strict, SyncSpec

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # use fullmatch: "$" accepts a trailing "\n"
# Option names that would carry a secret if written into a spec.
_SECRET_OPTION = re.compile(r"(secret|token|password|passwd|credential|key$|^key|session|access_key|key_id)",
                            re.IGNORECASE)


DEFAULT_STORE = "file://./runs"  # a no-flag launch stores its runs under ./runs/
MAX_STORE_BYTES = 768  # a store URI's bound: a run's keys (~80 more) must fit S3's 1,024-byte keys
# A "module:attribute" reference as a ``[trainer]`` string value could spell it (the trainer's settings class
# declares which settings do: ``TrainerPlugin.CODE_SETTINGS``; this check needs no list).
_REFERENCE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class ExecutorShare(NamedTuple):
    """One entry of ``executor``: a backend and how many replicas it runs (None: all of them)."""

    backend: str
    replicas: int | None


@functools.cache
def parse_executor(text: str) -> tuple[ExecutorShare, ...]:
    """``executor`` as typed shares, parsed once per distinct string: ``"local"`` -> ``(("local", None),)``,
    ``"local:1,modal:2"`` -> ``(("local", 1), ("modal", 2))``. Raises ``ValueError`` naming ``executor`` for a
    malformed one. Backend names are checked against the registry by ``jobs.assign_ranks``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("executor: empty executor name")
    if len(parts) == 1 and ":" not in parts[0]:
        return (ExecutorShare(parts[0], None),)
    shares = []
    for part in parts:
        name, sep, count = part.partition(":")
        if not sep or not count.isdigit() or int(count) < 1:
            raise ValueError(f"executor: {part!r} must be NAME:COUNT with COUNT >= 1")
        shares.append(ExecutorShare(name, int(count)))
    return tuple(shares)


class LoraSpec(Strict):
    """``[model.lora]``: train low-rank adapters (PEFT LoRA) instead of the whole model.

    Only the adapter parameters are trained, synced and checkpointed; the base
    model stays as loaded. ``alpha / r`` scales the adapter's update.
    ``target_modules`` is PEFT's: ``"all-linear"`` (every linear layer but the
    output head) or a list of module-name suffixes (``["q_proj", "v_proj"]``).
    """

    r: int = Field(default=16, gt=0, le=4096)
    alpha: float = Field(default=32.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: str | list[str] = "all-linear"

    @field_validator("target_modules")
    @classmethod
    def _modules_named(cls, v: str | list[str]) -> str | list[str]:
        if (isinstance(v, str) and not v) or (isinstance(v, list) and (not v or not all(v))):
            raise ValueError('name at least one module ("all-linear", or e.g. ["q_proj", "v_proj"])')
        return v


class ModelSpec(Strict):
    """``name`` is ``"tiny"`` (built in) or a Hugging Face model id / local directory.

    ``precision = "bf16"`` computes forwards and backwards in bfloat16 under
    autocast (GPU and CPU) while parameters, gradients and optimizer state stay
    float32, so DiLoCo's pseudo-gradients are float32 and a CPU resume stays
    bitwise. Under LoRA the frozen base is stored in bfloat16 (it never
    changes) and the adapters in float32.
    """

    name: str = "tiny"
    # Shape overrides for the built-in tiny model only. Bounds: well above any released model's, far
    # below what would exhaust a machine's memory before the first step (a typo, not a setting).
    hidden_size: int = Field(default=256, gt=0, le=65_536)
    num_hidden_layers: int = Field(default=4, gt=0, le=1024)
    num_attention_heads: int = Field(default=4, gt=0, le=1024)
    num_key_value_heads: int = Field(default=2, gt=0, le=1024)
    intermediate_size: int = Field(default=688, gt=0, le=262_144)
    precision: Literal["fp32", "bf16"] = "fp32"
    #: Recompute activations in the backward pass (less memory, ~30% more compute).
    gradient_checkpointing: bool = False
    #: ``auto``: flash-attention 2 on a CUDA GPU with bf16 where ``flash_attn`` is installed, else SDPA.
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    lora: LoraSpec | None = None

    @model_validator(mode="after")
    def _heads_fit(self) -> "ModelSpec":
        if self.hidden_size % self.num_attention_heads:
            raise SpecError("model.num_attention_heads", f"{self.num_attention_heads} heads do not divide "
                            f"model.hidden_size ({self.hidden_size}); each head needs an equal share")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpecError("model.num_key_value_heads", f"{self.num_key_value_heads} key/value heads do not "
                            f"divide model.num_attention_heads ({self.num_attention_heads})")
        return self

    @field_validator("precision", mode="before")
    @classmethod
    def _no_fp16(cls, v: Any) -> Any:
        if v == "fp16":
            raise ValueError('"fp16" is not supported: it needs loss scaling, which would skip optimizer steps '
                             'that DiLoCo counts; use "bf16" (GPUs since Ampere, and CPUs) or "fp32"')
        return v


class InnerOptimizerSpec(Strict):
    """AdamW, stepped once per inner step on each replica."""

    #: <= 1: AdamW moves each weight by ~lr per step whatever the gradient's scale (fine-tuning: 1e-6..1e-3).
    lr: float = Field(default=4e-4, gt=0, le=1.0)
    #: <= 1: AdamW scales every weight by 1 - lr x wd per step; with lr <= 1 this keeps it >= 0 (never flipped).
    weight_decay: float = Field(default=0.1, ge=0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(default=1.0, ge=0)

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_list(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"{list(v)}: each of AdamW's betas must be in [0, 1), e.g. [0.9, 0.95]")
        return v


# Outer optimizer defaults per sync mode (lr, momentum). Lock-step: DiLoCo's. Decoupled: merges apply
# pseudo-gradients computed against older globals, and asynchrony acts as implicit momentum (Mitliagkas et
# al., "Asynchrony begets momentum", 2016), so explicit momentum is lowered; measured in docs/chaos.md.
OUTER_DEFAULTS: dict[str, tuple[float, float]] = {"lockstep": (0.7, 0.9), "decoupled": (1.0, 0.3)}


class OuterOptimizerSpec(Strict):
    """Nesterov SGD on the averaged pseudo-gradient, once per round (per merge in decoupled mode).

    ``lr`` and ``momentum`` left unset take the sync mode's defaults (:data:`OUTER_DEFAULTS`);
    the stored spec holds the values used.
    """

    #: <= 10: lr x the replicas' whole movement of a round (DiLoCo: 0.7); more overshoots every round.
    lr: float | None = Field(default=None, gt=0, le=10.0)
    momentum: float | None = Field(default=None, ge=0, lt=1)
    nesterov: bool = True


class TrainerSpec(Strict):
    """``name`` selects the trainer; other keys are that trainer's settings."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str = "three-channel"
    batch_size: int = Field(default=8, gt=0, le=1 << 20)
    seq_len: int = Field(default=64, gt=0, le=1 << 20)

    @model_validator(mode="after")
    def _no_stdlib_factories(self) -> "TrainerSpec":
        # A "module:factory" setting is called in every replica: a stdlib function (os:system) is never
        # a trainer, task, hint source or reward, and calling one with the settings' arguments is harmful.
        for key, value in {"name": self.name, **(self.model_extra or {})}.items():
            if isinstance(value, str) and _REFERENCE.fullmatch(value):
                top = value.partition(":")[0].split(".")[0]
                if top in sys.stdlib_module_names or top in sys.builtin_module_names:
                    raise SpecError(f"trainer.{key}", f"{value!r} names the standard library module {top!r}; "
                                    "name a factory in your own code (\"my_tasks:make_task\") or a registered name")
        return self

    def settings(self) -> dict[str, Any]:
        return dict(self.model_extra or {}) | {"batch_size": self.batch_size, "seq_len": self.seq_len}


class CodeSpec(Strict):
    """User code that travels with the run (packed by :mod:`composer_cloud.runs.packaging`, installed by :mod:`composer_cloud.replica.usercode`).

    Modules named by ``"module:factory"`` settings (``trainer.task``,
    ``trainer.hint_source``) are packaged automatically; ``include`` adds files
    or folders, relative to the directory ``launch`` runs in. ``ref`` (the
    bundle's key and sha256) and ``files`` are set by the launcher, never by hand.
    """

    include: list[str] = Field(default_factory=list)
    ref: dict[str, Any] | None = None
    #: Set by the launcher for cloud executors: ``{setting: store key}`` of the local files and folders the
    #: spec names (``model.name``, ``trainer.pairs``, ``trainer.dataset``, ``trainer.data_files.<i>``),
    #: uploaded content-addressed; each replica fetches them and uses its local copy.
    files: dict[str, str] = Field(default_factory=dict)


class ModalSpec(Strict):
    #: Modal GPU type of each replica's container ("H100", "A100-80GB", ...; "cpu" for none). Each call gets
    #: ``gpus_per_replica`` of them (``"H100:8"`` is accepted when the count agrees).
    gpu: str = "H100"
    timeout_s: int = Field(default=24 * 3600, gt=0)
    retries: int = Field(default=0, ge=0, le=10)
    secrets: list[str] = Field(default_factory=list)
    app_name: str = "composer-cloud"


class HFJobsSpec(Strict):
    flavor: str = "a10g-small"
    namespace: str | None = None
    # Python 3.11 with uv; the bootstrap installs torch 2.13.0 (CUDA 13) and the rest from the pinned
    # constraints: the numeric stack of every executor (composer_cloud.stack.HF_JOBS_DEFAULT_IMAGE).
    image: str = "ghcr.io/astral-sh/uv:python3.11-bookworm-slim"
    timeout_s: int = Field(default=24 * 3600, gt=0)
    secrets: list[str] = Field(default_factory=list)


class RolloutsSpec(Strict):
    """``[rollouts]``: rollout workers, jobs that generate the trainers' completions and feed them through the store.

    ``workers = 0`` (the default): every replica generates its own rollouts, as without this table. ``N > 0``: N
    worker jobs (job ranks ``replicas .. replicas + N - 1``) answer the trainers' rollout requests; worker ``w``
    serves replica ``r`` when ``r % N == w``, and any worker takes over a request left unanswered for half of
    ``deadline_s`` (docs/rollouts.md, "Rollout workers").
    """

    #: Rollout worker jobs (0: colocated generation, no workers).
    workers: int = Field(default=0, ge=0, le=1024)
    #: Policy versions a batch may lag the round that consumes it: round t's batches are sampled from the global
    #: model of round ``max(0, t - max_staleness)`` exactly (one version per round, so a rerun reads the same
    #: batches); 0 is on-policy at the round's start. A batch of any other version is refused and counted.
    max_staleness: int = Field(default=1, ge=0, le=1000)
    #: Seconds a trainer waits for a worker's batch before ``on_deadline`` applies (> 0).
    deadline_s: float = Field(default=120.0, gt=0, le=7 * 24 * 3600)
    #: What a trainer does when no batch arrived by the deadline: "generate" (it samples the batch itself, from
    #: the same policy version and seed, and records it under the same key) or "wait" (until one arrives).
    on_deadline: Literal["generate", "wait"] = "generate"
    #: The backend the workers run on ("local", "modal", "hf-jobs"; null: the run's first executor). A worker takes
    #: that backend's own settings ([modal] gpu, [hf_jobs] flavor).
    executor: str | None = Field(default=None, pattern=r"^[a-z][a-z0-9-]*$")


class RunSpec(Strict):
    """A composer-cloud run. See ``examples/*.toml`` for a commented example."""

    run_id: str = ""
    store: str = DEFAULT_STORE
    store_options: dict[str, Any] = Field(default_factory=dict)
    #: Whether the run's objects are HMAC-signed (see ``docs/store.md``). Unset (the default): signed, with
    #: ``COMPOSER_CLOUD_RUN_KEY`` or a key ``launch`` creates, unless ``COMPOSER_CLOUD_UNSIGNED=1``; ``false``:
    #: an explicit opt-out (warned about). ``launch`` records the decision (true/false) in ``spec.json``.
    signed: bool | None = None
    #: Set by ``launch`` (signed runs), kept by ``resume``: with the run id it derives the signing key from the run
    #: key, so another run's objects never verify here, even under one key and id (docs/store.md).
    run_salt: str = Field(default="", pattern=r"^([0-9a-f]{32})?$")
    #: ``"NAME"`` or ``"NAME:COUNT,NAME:COUNT"`` in TOML, on the CLI and in ``spec.json``; typed: :attr:`executors`.
    executor: str = "local"
    replicas: int = Field(default=2, ge=1, le=1024)
    min_replicas: int = Field(default=1, ge=1)
    rounds: int = Field(default=4, ge=1, le=10_000_000)
    inner_steps: int = Field(default=10, ge=1, le=10_000_000)
    seed: int = Field(default=0, ge=0, lt=2**63)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: Local ranks per replica job (one GPU each; CPU processes with gloo on ``device = "cpu"``). Above 1 the
    #: replica is launched by torch.distributed's elastic agent, each rank syncs its own shard of the
    #: pseudo-gradient through the store, and the round is still one decision per replica (docs/multi-gpu.md).
    gpus_per_replica: int = Field(default=1, ge=1, le=8)
    #: How the local ranks of a replica hold the model: "ddp" replicates it (the default: fastest while one
    #: GPU holds the model and its optimizer state), "fsdp" shards it with FSDP2's ``fully_shard``.
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    checkpoint_every: int = Field(default=1, ge=1, le=10_000_000)
    keep_checkpoints: int = Field(default=2, ge=1, le=10_000)
    max_restarts: int = Field(default=0, ge=0, le=1000)
    #: Seconds between a replica's progress heartbeats (step, loss, reward, steps/s) in ``replicas/<rank>.json``.
    #: >= 0.1 s: each heartbeat is a store write (a PUT); more often is a request per step that tells nothing new.
    progress_every_s: float = Field(default=5.0, ge=0.1, le=3600)
    #: Trackers (TRL's names) an attached launch writes the run's metrics to when it ends; docs/metrics.md.
    report_to: list[Literal["tensorboard", "trackio", "wandb", "mlflow"]] = Field(default_factory=list)
    model: ModelSpec = Field(default_factory=ModelSpec)
    inner_optimizer: InnerOptimizerSpec = Field(default_factory=InnerOptimizerSpec)
    outer_optimizer: OuterOptimizerSpec = Field(default_factory=OuterOptimizerSpec)
    sync: SyncSpec = Field(default_factory=SyncSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    code: CodeSpec = Field(default_factory=CodeSpec)
    modal: ModalSpec = Field(default_factory=ModalSpec)
    hf_jobs: HFJobsSpec = Field(default_factory=HFJobsSpec)
    rollouts: RolloutsSpec = Field(default_factory=RolloutsSpec)

    @field_validator("run_id")
    @classmethod
    def _run_id_safe(cls, v: str) -> str:
        if v and (not RUN_ID_PATTERN.fullmatch(v) or ".." in v):
            raise ValueError(
                f"{v!r} is not a valid run id: use letters, digits, '.', '_' and '-' "
                "(no '/', no '..'), starting with a letter or digit"
            )
        return v

    @field_validator("store_options")
    @classmethod
    def _no_secrets_in_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name in _walk_keys(v):
            if _SECRET_OPTION.search(name):
                raise ValueError(
                    f"option {name!r} looks like a credential; credentials never go into a spec "
                    "(use the standard AWS_* environment variables or a named executor secret)"
                )
        for name, value in _walk_values(v):
            if isinstance(value, str) and url_has_credentials(value):
                raise ValueError(f"option {name!r} is a URL that carries credentials (user:password@, or a secret "
                                 "query parameter such as ?token= or ?X-Amz-Signature=); credentials never go into "
                                 "a spec (use the standard AWS_* environment variables or a named executor secret)")
        return v

    @field_validator("store")
    @classmethod
    def _no_credentials_in_store(cls, v: str) -> str:
        # S3 keys are <= 1,024 bytes (a run appends ~80); file systems refuse names over 255 bytes (NAME_MAX).
        longest = max(len(part.encode()) for part in v.split("://", 1)[-1].split("/"))
        if len(v.encode()) > MAX_STORE_BYTES or longest > 255:
            raise ValueError(f"the store URI is too long ({len(v.encode())} bytes long, its longest name {longest}): "
                             f"at most {MAX_STORE_BYTES} bytes (S3 keys are <= 1,024 and a run appends its own) and "
                             "255 per name (file systems)")
        if url_has_credentials(v):
            raise ValueError("the store URI carries credentials (user:password@, or a secret query parameter); put "
                             "them in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or executor secrets), not the URI")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> "RunSpec":
        if self.min_replicas > self.replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > replicas ({self.replicas})")
        frags = self.sync.fragments
        if self.inner_steps % frags != 0:
            raise ValueError(f"inner_steps ({self.inner_steps}) must be a multiple of sync.fragments ({frags})")
        if self.sync.fragment_sync_delay >= self.inner_steps // frags:
            raise ValueError(
                f"sync.fragment_sync_delay ({self.sync.fragment_sync_delay}) must be < "
                f"inner_steps / sync.fragments ({self.inner_steps // frags})"
            )
        sync = self.sync
        if sync.min_quorum is not None and sync.min_quorum > self.replicas:
            raise SpecError("sync.min_quorum", f"{sync.min_quorum} > replicas ({self.replicas})")
        if sync.grace_min_s > sync.grace_max_s:
            raise SpecError("sync.grace_min_s", f"{sync.grace_min_s} > sync.grace_max_s ({sync.grace_max_s})")
        if sync.mode == "decoupled" and frags > 1:
            raise SpecError("sync.fragments", f"{frags} fragments are not supported with sync.mode = \"decoupled\" "
                            "(it merges whole models); set sync.fragments = 1")
        _check_compute(self)
        _check_rollouts(self)
        if sync.codec == "sparse" and sync.sparse.exchange == "gather" and self.replicas > GATHER_MAX_REPLICAS:
            raise SpecError("sync.sparse.exchange", f"the flat gather serves at most {GATHER_MAX_REPLICAS} "
                            f"replicas ({self.replicas} asked); use \"two_level\" or \"auto\" (docs/scale.md)")
        outer = self.outer_optimizer
        if outer.lr is None or outer.momentum is None:  # assigning re-validates once, with both set
            lr, momentum = OUTER_DEFAULTS[sync.mode]
            update: dict[str, Any] = {}
            if sync.codec == "sparse":  # SparseLoCo: error feedback replaces outer momentum (docs/sparse.md)
                lr, momentum = 1.0, 0.0
                if "nesterov" not in outer.model_fields_set and not outer.momentum:
                    update["nesterov"] = False
            update |= {"lr": outer.lr if outer.lr is not None else lr,
                       "momentum": outer.momentum if outer.momentum is not None else momentum}
            self.outer_optimizer = outer.model_copy(update=update)
            return self
        if outer.nesterov and outer.momentum == 0:
            raise SpecError("outer_optimizer.momentum", "Nesterov needs momentum > 0; set outer_optimizer.nesterov "
                            "= false for plain SGD")
        return self

    # ------------------------------------------------------------------ helpers
    @property
    def executors(self) -> tuple[ExecutorShare, ...]:
        """``executor`` as typed ``(backend, replicas)`` shares (:func:`parse_executor`, cached)."""
        return parse_executor(self.executor)

    @property
    def worker_ranks(self) -> range:
        """The job ranks of the rollout workers: ``replicas .. replicas + rollouts.workers - 1`` (empty without)."""
        return range(self.replicas, self.replicas + self.rollouts.workers)

    def with_run_id(self) -> "RunSpec":
        """Return a copy with a generated ``run_id`` if none was given."""
        if self.run_id:
            return self
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        return self.model_copy(update={"run_id": f"run-{stamp}-{_secrets.token_hex(3)}"})

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _check_compute(spec: "RunSpec") -> None:
    """Refuse ``[model]`` / ``trainer.rollout`` combinations that cannot run, whatever machine checks them."""
    model = spec.model
    if model.attention == "flash_attention_2":
        if spec.device == "cpu":
            raise SpecError("model.attention", 'flash_attention_2 runs on CUDA GPUs only; use "sdpa" on device = "cpu"')
        if model.precision != "bf16":
            raise SpecError("model.attention", 'flash_attention_2 computes in half precision; set model.precision = '
                            '"bf16" or use "sdpa"')
    rollout = (spec.trainer.model_extra or {}).get("rollout")
    if rollout == "vllm" and spec.device == "cpu":
        raise SpecError("trainer.rollout", '"vllm" generates on a CUDA GPU; use rollout = "hf" with device = "cpu"')


def _check_rollouts(spec: "RunSpec") -> None:
    """Refuse ``[rollouts] workers > 0`` where nothing would consume their batches, naming the field to change."""
    if spec.rollouts.workers == 0:
        return
    if spec.trainer.name != "three-channel":
        raise SpecError("rollouts.workers", f"rollout workers feed the three-channel (GRPO) trainer; trainer.name is "
                        f"{spec.trainer.name!r}, which does not sample rollouts. Set rollouts.workers = 0")
    if spec.sync.mode != "lockstep":
        raise SpecError("rollouts.workers", "rollout workers need sync.mode = \"lockstep\" (a batch is named by its "
                        "round, and its policy is a round's global model); set rollouts.workers = 0 for a decoupled run")
    if spec.gpus_per_replica != 1:
        raise SpecError("rollouts.workers", f"rollout workers feed replicas of one local rank; gpus_per_replica is "
                        f"{spec.gpus_per_replica}. Set gpus_per_replica = 1 or rollouts.workers = 0")


def check_device(spec: "RunSpec", *, executors: list[str], local_cuda: bool) -> None:
    """Refuse ``device = "cuda"`` where the replicas will find no GPU (a launch-time check).

    ``executors``: the executor names of the run (``jobs.assign_ranks``); ``local_cuda``: whether this
    machine, where ``local`` replicas run, has a CUDA GPU. Not a validator: a spec is also read on
    machines that do not run it (``status`` on a laptop).
    """
    if spec.device != "cuda":
        return
    if "local" in executors and not local_cuda:
        raise SpecError("device", '"cuda", but this machine has no CUDA GPU for the local executor\'s replicas; '
                        'use device = "auto" (a GPU when there is one) or "cpu", or a GPU executor')
    if "hf-jobs" in executors and spec.hf_jobs.flavor.startswith("cpu"):
        raise SpecError("hf_jobs.flavor", f'{spec.hf_jobs.flavor!r} has no GPU, but device = "cuda"; pick a GPU '
                        'flavor (e.g. "a10g-small") or device = "auto"')


def _walk_values(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted name, leaf value)`` of every leaf of nested dicts and lists."""
    if isinstance(d, dict):
        return [item for k, v in d.items() for item in _walk_values(v, f"{prefix}{k}.")]
    if isinstance(d, list):
        return [item for i, v in enumerate(d) for item in _walk_values(v, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), d)]


def _walk_keys(d: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    if isinstance(d, dict):
        for k, v in d.items():
            out.append(str(k))
            out.extend(_walk_keys(v, f"{prefix}{k}."))
    return out


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpecError(dotted, f"{part!r} is not a table")
    node[parts[-1]] = value


def spec_from_dict(data: dict[str, Any], *, source: str = "spec", given: frozenset[str] = frozenset()) -> RunSpec:
    """Validate ``data``; :class:`SpecError` naming the first bad field and listing every other one.

    ``given``: the dotted keys that came from ``--set``/overrides rather than from ``source``."""
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        raise error_from_validation(exc, source, given, root=RunSpec) from None


def load_spec(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunSpec:
    """Load a spec from TOML (or defaults when ``path`` is None), then apply ``overrides``.

    ``overrides`` maps dotted field names (``"sync.codec"``) to values; ``None``
    values are ignored so CLI flags that were not given leave the file alone.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise SpecError("--config", f"file not found: {p}") from None
        except IsADirectoryError:
            raise SpecError("--config", f"{p} is a directory; give the run spec's .toml file") from None
        except (PermissionError, UnicodeDecodeError) as exc:
            raise SpecError("--config", f"cannot read {p}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SpecError("--config", f"{p} is not valid TOML: {exc}") from None
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(data, key, value)
    spec = spec_from_dict(data, source=source,
                          given=frozenset(k for k, v in (overrides or {}).items() if v is not None))
    # The launcher sets these from what it packaged and uploaded; a hand-set value would point the
    # replicas at code or files the launcher never checked.
    if spec.code.ref is not None:
        raise SpecError("code.ref", "is set by `launch` (the packaged user code's key and sha256), never by hand; "
                        "remove it and name your code with \"module:factory\" settings or [code] include")
    if spec.code.files:
        raise SpecError("code.files", "is set by `launch` (the local files it uploaded), never by hand; remove it "
                        "and name local paths in model.name / trainer.dataset / trainer.pairs")
    return spec
