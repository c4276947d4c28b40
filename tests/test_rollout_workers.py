"""Rollout workers (issue 36): the ``[rollouts]`` settings, the request/batch records and keys, the store protocol
(write-once, signed, forged batches refused), and one worker's serving loop on a tiny model (its takeover rule,
its deterministic sampling). The multi-process runs are in ``test_rollout_workers_e2e.py``."""

from __future__ import annotations

import math

import pytest
import torch

from composer_cloud.errors import BadObject, SpecError
from composer_cloud.jobs import assign_jobs, trusted_handles
from composer_cloud.rollouts.batches import (
    Position,
    RolloutBatches,
    SourceCounters,
    batch_from_samples,
    policy_version_for,
    sampling_seed,
    wait_for_batch,
    worker_of,
)
from composer_cloud.spec import load_spec
from composer_cloud.storage import layout
from composer_cloud.storage.records import JobHandle
from composer_cloud.storage.records.rollouts import RolloutBatch, RolloutRequest
from composer_cloud.storage.store import Store

KEY = b"k" * 32
PROMPTS = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]


def rollouts_spec(**rollouts: object):
    return load_spec(None, {"replicas": 2, **{f"rollouts.{k}": v for k, v in rollouts.items()}})


# ---------------------------------------------------------------------------------------------- settings
def test_rollouts_settings_default_to_no_workers_and_validate_each_field():
    spec = load_spec(None, {})
    assert spec.rollouts.workers == 0 and list(spec.worker_ranks) == []
    spec = rollouts_spec(workers=3)
    assert list(spec.worker_ranks) == [2, 3, 4]
    assert assign_jobs(spec) == [("local", [0, 1]), ("local", [2, 3, 4])]
    with pytest.raises(SpecError, match="rollouts.on_deadline"):
        rollouts_spec(workers=1, on_deadline="skip")
    with pytest.raises(SpecError, match="rollouts.deadline_s"):
        rollouts_spec(workers=1, deadline_s=0)
    with pytest.raises(SpecError, match="rollouts.workers.*lockstep"):
        load_spec(None, {"rollouts.workers": 1, "sync.mode": "decoupled"})
    with pytest.raises(SpecError, match="rollouts.workers.*three-channel"):
        load_spec(None, {"rollouts.workers": 1, "trainer.name": "causal-lm"})


def test_an_unknown_worker_executor_is_named_and_worker_handles_are_trusted_on_theirs():
    from composer_cloud.runs.lifecycle import build_spec

    with pytest.raises(SpecError, match="rollouts.executor.*unknown executor 'nowhere'"):
        build_spec(overrides={"rollouts.workers": 1, "rollouts.executor": "nowhere"})
    spec = rollouts_spec(workers=1, executor="modal")
    assert assign_jobs(spec)[-1] == ("modal", [2])
    ok = JobHandle(executor="modal", rank=2, job_id="fc-1", data={})
    wrong = JobHandle(executor="local", rank=2, job_id="1", data={})  # the spec puts rank 2 on modal
    beyond = JobHandle(executor="modal", rank=3, job_id="fc-2", data={})  # no such job rank
    assert trusted_handles([ok, wrong, beyond], spec) == [ok]


# ---------------------------------------------------------------------------------------------- keys, records
def test_rollout_keys_round_trip_and_strays_are_skipped():
    for key in (layout.rollout_request_key(3, 1, 14), layout.rollout_batch_key(3, 1, 14),
                layout.rollout_fallback_key(3, 1, 14)):
        assert layout.parse_rollout_key(key) == (3, 1, 14)
    for stray in ("rollouts/requests/3/1/14.json", "rollouts/requests/00000003/01/00000014.json",
                  "rollouts/other/00000003/1/00000014.json", "rollouts/batches/00000003/1/00000014.json.tmp"):
        assert layout.parse_rollout_key(stray) is None


def _batch(pos: Position, request: RolloutRequest, **over: object) -> RolloutBatch:
    batch = batch_from_samples(pos, request, completion_ids=[[1, 2], [3], [4, 0], [2]],
                               sampler_logps=[[-0.5, -1.25], [-2.0], [-0.1, math.nan], [0.0]],
                               sampler="worker:0", seconds=0.1)
    return RolloutBatch(**{**batch.__dict__, **over})


def test_batch_records_round_trip_exactly_nan_log_probs_and_fallbacks_included():
    pos = Position(2, 1, 9)
    req = RolloutRequest(round=2, replica=1, step=9, policy_version=1, prompt_ids=PROMPTS, time=0.0)
    batch = _batch(pos, req)
    back = RolloutBatch.from_json(batch.to_json(), key=pos.batch_key, round=2, replica=1, step=9)
    assert back.completion_ids == batch.completion_ids and back.policy_version == 1
    assert back.sampler_logps[0] == [-0.5, -1.25] and math.isnan(back.sampler_logps[2][1])  # NaN <-> null
    fallback = {**batch.to_json(), "sampler_logps": None, "fallback": True}
    assert RolloutBatch.from_json(fallback, key=pos.batch_key, round=2, replica=1, step=9).sampler_logps is None


BAD_BATCHES = {
    "copied to another step": ({}, {"step": 10}),
    "one log-prob too few": ({"sampler_logps": [[-0.5], [-2.0], [-0.1, -1.0], [0.0]]}, {}),
    "a positive log-prob": ({"sampler_logps": [[0.5, -1.0], [-2.0], [-0.1, -1.0], [0.0]]}, {}),
    "a negative token id": ({"completion_ids": [[-1, 2], [3], [4, 0], [2]]}, {}),
    "a policy from the future": ({"policy_version": 3}, {}),
    "a worker's batch without log-probs": ({"sampler_logps": None}, {}),
    "a reward that is not a number": ({"rewards": ["high", None, None, None]}, {}),
}


@pytest.mark.parametrize("what", sorted(BAD_BATCHES))
def test_a_malformed_batch_is_refused_naming_its_key(what):
    pos = Position(2, 1, 9)
    req = RolloutRequest(round=2, replica=1, step=9, policy_version=1, prompt_ids=PROMPTS, time=0.0)
    fields, where = BAD_BATCHES[what]
    with pytest.raises(BadObject, match=pos.batch_key):
        RolloutBatch.from_json({**_batch(pos, req).to_json(), **fields}, key=pos.batch_key,
                               **({"round": 2, "replica": 1, "step": 9} | where))


def test_each_round_samples_one_policy_version_and_each_position_its_own_seed():
    assert [policy_version_for(t, 1) for t in range(4)] == [0, 0, 1, 2]
    assert [policy_version_for(t, 0) for t in range(3)] == [0, 1, 2]
    seeds = {sampling_seed(0, t, r, s) for t in range(3) for r in range(2) for s in range(3)}
    assert len(seeds) == 18 and all(0 <= s < 2**63 for s in seeds)
    assert sampling_seed(0, 1, 0, 2) == sampling_seed(0, 1, 0, 2) != sampling_seed(1, 1, 0, 2)
    assert [worker_of(r, 2) for r in range(4)] == [0, 1, 0, 1]


# ---------------------------------------------------------------------------------------------- protocol
def test_requests_are_write_once_and_open_until_their_batch_exists(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    batches = RolloutBatches(store, max_staleness=1)
    a, b = Position(1, 0, 3), Position(1, 1, 3)
    req = batches.request(a, PROMPTS)
    assert req.policy_version == 0
    again = batches.request(a, PROMPTS)  # a resumed trainer asks again: the first request stands
    assert again.time == req.time
    with pytest.raises(BadObject, match="other prompts"):
        batches.request(a, [[1]])
    batches.request(b, PROMPTS)
    store.put_json("rollouts/requests/00000001/0/stray.json", {})
    assert batches.open_requests() == [a, b]
    assert batches.publish(_batch(a, req))
    assert not batches.publish(_batch(a, req, sampler="worker:1"))  # write-once: the first batch is the batch
    assert batches.read_batch(a).sampler == "worker:0"
    assert batches.open_requests() == [b]


@pytest.mark.parametrize("forgery", ["unsigned", "other-key", "other-prompts"])
def test_a_forged_or_unsigned_batch_is_refused_counted_and_replaced_on_a_signed_run(tmp_path, forgery):
    uri = f"file://{tmp_path}/run"
    store = Store(uri, signing_key=KEY)
    batches = RolloutBatches(store, max_staleness=1)
    pos = Position(2, 0, 5)
    req = batches.request(pos, PROMPTS)
    forged = _batch(pos, req, completion_ids=[[7, 7], [7], [7, 7], [7]])
    if forgery == "unsigned":
        Store(uri).put_json(pos.batch_key, forged.to_json())
    elif forgery == "other-key":
        Store(uri, signing_key=b"x" * 32).put_json(pos.batch_key, forged.to_json())
    else:  # signed by the run, but for other prompts: refused, never replaced (a job of the run wrote it)
        store.put_json(pos.batch_key, _batch(pos, req, prompts_sha256="0" * 64).to_json())
    counters = SourceCounters()
    replaced: list[str] = []

    def replace(key: str) -> None:
        replaced.append(key)
        store.delete(key)

    got = wait_for_batch(batches, pos, req, deadline=0.0, counters=counters, replace=replace)
    assert got is None and counters.refused_bad == 1
    # Only what does not verify is handed to replace(): a verified batch was written by a job of the run.
    assert replaced == ([] if forgery == "other-prompts" else [pos.batch_key])
    if forgery != "other-prompts":
        assert batches.publish(_batch(pos, req))  # the genuine batch takes the key the forgery held
        got = wait_for_batch(batches, pos, req, deadline=0.0, counters=counters, replace=replace)
        assert got is not None and got.completion_ids == [[1, 2], [3], [4, 0], [2]]
        assert counters.refused_bad == 1


# ---------------------------------------------------------------------------------------------- one worker
@pytest.fixture(scope="module")
def tiny():
    from composer_cloud.model import load_spec_model
    from composer_cloud.trainer.three_channel.settings import ThreeChannelSettings

    spec = load_spec(None, {"model.hidden_size": 32, "model.num_hidden_layers": 1, "model.num_attention_heads": 2,
                            "model.num_key_value_heads": 1, "model.intermediate_size": 64})
    model, tokenizer = load_spec_model(spec.model, seed=0)
    settings = ThreeChannelSettings.from_settings({"batch_size": 4, "seq_len": 16, "num_generations": 2,
                                                   "max_completion_length": 6})
    return spec, model.eval(), tokenizer, settings


def test_sampling_is_a_function_of_weights_prompts_and_seed(tiny):
    from composer_cloud.rollouts.sampler import BatchSampler

    _, model, tokenizer, settings = tiny
    a, b = BatchSampler(model, tokenizer, settings), BatchSampler(model, tokenizer, settings)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    x, y = a.sample(PROMPTS, seed=7), b.sample(PROMPTS, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is left alone
    assert x.completion_ids == y.completion_ids and x.logps == y.logps
    assert all(1 <= len(c) <= 6 for c in x.completion_ids)
    assert all(len(c) == len(lp) and all(v <= 0 for v in lp) for c, lp in zip(x.completion_ids, x.logps))
    z = a.sample(PROMPTS, seed=8)
    assert (z.completion_ids, z.logps) != (x.completion_ids, x.logps)


def test_a_worker_serves_its_replicas_and_takes_over_others_after_half_the_deadline(tmp_path, tiny):
    from composer_cloud.rollouts.sampler import BatchSampler
    from composer_cloud.rollouts.versions import PolicyVersions
    from composer_cloud.rollouts.worker import RolloutWorker, WorkerConfig

    spec, model, tokenizer, settings = tiny
    store = Store(f"file://{tmp_path}/run")
    now = [100.0]
    worker = RolloutWorker(store, config=WorkerConfig(index=1, workers=2, seed=0, max_staleness=1, deadline_s=10.0),
                           sampler=BatchSampler(model, tokenizer, settings),
                           versions=PolicyVersions(store, model, fragments=1, chain=False), clock=lambda: now[0])
    batches = RolloutBatches(store, max_staleness=1)
    own, other, later = Position(0, 1, 1), Position(0, 0, 1), Position(2, 1, 5)
    for pos in (own, other, later):
        batches.request(pos, PROMPTS)
    # Its own replica's round-0 request (policy version 0: the initial model) is served; replica 0's is worker 0's;
    # round 2's needs version 1 (round 0's checkpoint), which does not exist yet.
    assert worker.serve_once() == 1 and batches.open_requests() == [other, later]
    now[0] += 4.9
    assert worker.serve_once() == 0
    now[0] += 0.2  # replica 0's request has now waited half the deadline: taken over
    assert worker.serve_once() == 1 and batches.open_requests() == [later]
    assert worker.stats.published == 2 and worker.stats.taken_over == 1 and worker.stats.tokens > 0
    served = batches.read_batch(other)
    assert served.policy_version == 0 and served.sampler == "worker:1"
    # The batch is the one any worker would have sampled: same version, the position's seed.
    from composer_cloud.rollouts.sampler import BatchSampler as Fresh

    again = Fresh(model, tokenizer, settings).sample(PROMPTS, seed=sampling_seed(0, 0, 0, 1))
    assert served.completion_ids == again.completion_ids and served.sampler_logps == again.logps


# ---------------------------------------------------------------------------------------------- the trainer's source
def test_the_store_source_serves_a_workers_batch_and_keeps_a_fallback_for_the_resumed_run(tmp_path):
    from composer_cloud.rollouts.source import StoreCompletionSource
    from composer_cloud.trainer.three_channel.sourced import CompletionSource, RolloutKey, SourcedCompletions

    store = Store(f"file://{tmp_path}/run", signing_key=KEY)
    source = StoreCompletionSource(store, replica=0, max_staleness=1, deadline_s=0.2)
    assert isinstance(source, CompletionSource)
    batches = RolloutBatches(store, max_staleness=1)
    served, missing = RolloutKey(2, 0, 5), RolloutKey(2, 0, 6)
    pos = Position(2, 0, 5)
    batches.publish(_batch(pos, batches.request(pos, PROMPTS)))  # a worker answered before the trainer asked
    got = source.completions(served, PROMPTS, policy_version=2)
    assert got.completion_ids == [[1, 2], [3], [4, 0], [2]] and got.policy_version == 1 and not got.fallback
    assert got.prompt_ids == PROMPTS
    assert source.completions(missing, PROMPTS, policy_version=2) is None  # nobody answers: the deadline
    assert source.take_metrics()["rollouts/timed_out"] == 1.0 and source.take_metrics()["rollouts/timed_out"] == 0
    own = SourcedCompletions(completion_ids=[[9], [9, 9], [9], [9]], logprobs=None, policy_version=2,
                             prompt_ids=PROMPTS, fallback=True)
    source.record_fallback(missing, own)
    again = StoreCompletionSource(store, replica=0, max_staleness=1, deadline_s=0.2)  # a resumed replica
    back = again.completions(missing, PROMPTS, policy_version=2)
    assert back.fallback and back.completion_ids == [[9], [9, 9], [9], [9]] and back.logprobs is None
    assert RolloutBatches(store, max_staleness=1).open_requests() == []  # a recorded fallback answers its request
    # A trainer that fell back although a worker's batch came (late): what it trained on is what a resume reads.
    late = SourcedCompletions(completion_ids=[[8]] * 4, logprobs=None, policy_version=2, prompt_ids=PROMPTS,
                              fallback=True)
    again.record_fallback(served, late)
    again.record_fallback(served, late)  # a resumed run records the same fallback again: nothing changes
    resumed = StoreCompletionSource(store, replica=0, max_staleness=1, deadline_s=0.2)
    assert resumed.completions(served, PROMPTS, policy_version=2).completion_ids == [[8]] * 4
    assert resumed.take_metrics()["rollouts/fallbacks_read"] == 1.0
    with pytest.raises(ValueError, match="replica 1's"):
        source.completions(RolloutKey(2, 1, 5), PROMPTS, policy_version=2)


def test_status_marks_the_rollout_workers_and_sums_the_fleet():
    from composer_cloud.cli_views import fleet_line, status_table
    from composer_cloud.runs.states import RunState
    from composer_cloud.runs.status import ReplicaInfo, RunStatus

    st = RunStatus(run_id="r", run_uri="file:///x/r", state=RunState.RUNNING, rounds=3, rounds_committed=1,
                   replicas=[ReplicaInfo(0, "local", "running", 1),
                             ReplicaInfo(2, "local", "running", None, role="rollout-worker", batches_published=5,
                                         tokens_per_s=10.0),
                             ReplicaInfo(3, "local", "failed", None, role="rollout-worker", batches_published=2,
                                         tokens_per_s=2.5)])
    assert fleet_line(st) == "rollout workers: 2 (1 running), 7 batches published, 12.5 tokens/s"
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(status_table(st))
    text = console.export_text()
    assert "2 (worker)" in text and "3 (worker)" in text and fleet_line(st) in text


def test_status_sums_what_the_trainers_did_with_the_batches():
    """The trainers' side of the fleet line: batches used, refused as stale, sampled themselves, staleness."""
    from composer_cloud.cli_views import fleet_line
    from composer_cloud.runs.states import RunState
    from composer_cloud.runs.status import ReplicaInfo, RolloutUse, RunStatus
    from composer_cloud.storage.records import StepRow

    def row(**figures: float) -> StepRow:
        return StepRow(rank=0, launch=0, time=0.0, round=1, step=1, time_s=0.1, extra={"loss": 1.0, **figures})

    nan = float("nan")
    rows = [row(**{"rollouts/used": 1, "rollouts/staleness": 0.0}),
            row(**{"rollouts/used": 1, "rollouts/staleness": 1.0}),
            row(**{"rollouts/used": 1, "rollouts/staleness": 1.0}),
            row(**{"rollouts/stale": 1, "rollouts/fallback": 1, "rollouts/staleness": nan}), row()]
    use = RolloutUse.from_rows(rows)
    assert use == RolloutUse(used=3, stale=1, fallbacks=1, staleness={0: 1, 1: 2})
    st = RunStatus(run_id="r", run_uri="file:///x/r", state=RunState.RUNNING, rounds=3, rounds_committed=1,
                   replicas=[ReplicaInfo(2, "local", "running", None, role="rollout-worker", batches_published=4)],
                   rollouts=use)
    assert fleet_line(st).endswith("; trainers used 3, refused 1 as stale, sampled 1 themselves; policy versions "
                                   "behind (steps): 0 behind: 1, 1 behind: 2")
    assert st.to_json()["rollouts"] == {"used": 3, "stale": 1, "fallbacks": 1, "staleness": {0: 1, 1: 2}}
