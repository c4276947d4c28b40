"""Run specs (TOML) the end-to-end tests and the benchmarks share."""

from __future__ import annotations

#: SMALL_RUN_TOML's trainer lines: what a test replaces to train with another trainer (``corpus_size`` is the
#: causal-LM trainer's own key; the three-channel trainer refuses it by name). A quarter of the built-in corpus
#: (~700 rows of 32 tokens; a test run reads fewer than 100 per replica): every replica tokenizes the corpus it
#: packs at start, 0.33 CPU-s for the default 4,000 snippets, 0.09 s for 1,000.
CAUSAL_LM = 'name = "causal-lm"\ncorpus_size = 1000'

#: A model and trainer small enough for multi-process CLI tests on 2 cores.
SMALL_RUN_TOML = f"""
[model]
hidden_size = 64
num_hidden_layers = 2
num_attention_heads = 2
num_key_value_heads = 1
intermediate_size = 128
[trainer]
{CAUSAL_LM}
batch_size = 4
seq_len = 32
"""

#: The kill/resume matrix's run: 2 replicas, 4 lock-step rounds, every checkpoint kept.
RESUME_SPEC = """
replicas = 2
min_replicas = 2
rounds = 4
inner_steps = 4
keep_checkpoints = 10
[sync]
quorum_timeout_s = 60
round_timeout_s = 120
""" + SMALL_RUN_TOML


def with_sync(spec: str, **settings: object) -> str:
    """``spec`` with ``[sync]`` settings replaced or added (values written as TOML literals)."""
    head, sep, sync = spec.partition("[sync]\n")
    if not sep:
        raise ValueError("spec has no [sync] table")
    lines = sync.split("\n")
    body_end = next((i for i, line in enumerate(lines) if line.startswith("[")), len(lines))
    body = [line for line in lines[:body_end] if line.split("=", 1)[0].strip() not in settings]
    body = [line for line in body if line] + [f"{k} = {_toml(v)}" for k, v in settings.items()]
    return head + sep + "\n".join(body) + "\n" + "\n".join(lines[body_end:])


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


#: :data:`RESUME_SPEC` with the sparse codec (test_sparse_resume.py's kill matrix, test_signature_binding.py's
#: sparse replay: one uninterrupted baseline serves both, ``baselines.of(SPARSE_SPEC)``).
SPARSE_SPEC = with_sync(RESUME_SPEC, codec="sparse") + "[sync.sparse]\ndensity = 0.0625\nchunk = 1024\n"


#: The multi-GPU runs (tests/test_multi_gpu_e2e.py, benchmarks/multi_gpu.py): 2 replicas, 3 lock-step rounds of
#: 2 inner steps, every checkpoint kept, ``gpus_per_replica = {n}`` and ``{extra}`` top-level settings.
MULTI_GPU_SPEC = """
replicas = 2
min_replicas = 2
rounds = 3
inner_steps = 2
keep_checkpoints = 10
gpus_per_replica = {n}
{extra}
[sync]
quorum_timeout_s = 45
round_timeout_s = 90
heal_timeout_s = 180
""" + SMALL_RUN_TOML.replace(CAUSAL_LM, 'name = "causal-lm"')  # the whole built-in corpus: the batches
# docs/multi-gpu.md's match (7.86e-7 max abs, under the tests' 1e-6) was measured on; another draw lands at 1.2e-6


#: ``[model.lora]`` of the multi-GPU LoRA runs (appended to :func:`multi_gpu_spec`).
MULTI_GPU_LORA_TOML = """
[model.lora]
r = 4
alpha = 8.0
target_modules = ["q_proj", "v_proj"]
"""


def multi_gpu_spec(n: int, extra: str = "") -> str:
    """:data:`MULTI_GPU_SPEC` with ``n`` local ranks per replica and ``extra`` settings (e.g. ``max_restarts``)."""
    return MULTI_GPU_SPEC.format(n=n, extra=extra)


#: Question/answer rows (exact-match reward) of the rollout-worker runs, written as ``qa.jsonl`` next to the spec.
ROLLOUT_QA = [{"question": f"What is {a} plus {b}?", "solution": str(a + b)} for a in range(6) for b in range(4)]


def rollout_spec(*, rounds: int = 3, inner_steps: int = 2, workers: int | None = None, top: str = "") -> str:
    """The rollout-worker runs (tests/test_rollout_workers_e2e.py, benchmarks/rollouts.py): the three-channel
    trainer on :data:`ROLLOUT_QA` (``qa.jsonl``), lock-step rounds with every checkpoint kept, ``[rollouts]``
    with ``max_staleness = 1`` and ``on_deadline = "wait"`` (a rerun reads the same batches), ``workers`` when
    given (else from ``--set rollouts.workers=N``), ``top``: more top-level settings."""
    trainer = ('name = "three-channel"\ndataset = "qa.jsonl"\nreward = "exact_match"\nnum_generations = 2\n'
               'max_completion_length = 4\neval_examples = 2')
    return (f"min_replicas = 2\nrounds = {rounds}\ninner_steps = {inner_steps}\nkeep_checkpoints = 10\n{top}\n"
            "[sync]\nquorum_timeout_s = 60\nround_timeout_s = 120\n"
            "[rollouts]\nmax_staleness = 1\ndeadline_s = 120\non_deadline = \"wait\"\n"
            + (f"workers = {workers}\n" if workers is not None else "")
            + SMALL_RUN_TOML.replace(CAUSAL_LM, trainer)
            + '[trainer.columns]\nprompt = "question"\nanswer = "solution"\n')
