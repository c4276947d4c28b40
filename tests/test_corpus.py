"""The stdlib corpus (split, BPE, token cache), the causal-lm option that uses it, and chaos.py's accounting."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from composer_cloud import env
from composer_cloud import stdlib_corpus as sc
from composer_cloud.trainer.base import TrainerContext

ROOT = Path(__file__).parents[1]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(env.CACHE, str(tmp_path / "cache"))
    return tmp_path / "cache" / "stdlib"


# ----------------------------------------------------------------------------- split
def test_split_is_deterministic_disjoint_and_excludes_tests():
    files = sc.stdlib_files()
    assert list(files) == sorted(files) and len(files) > 100
    splits = {s: sc.split_files(s) for s in sc.SPLITS}
    assert sum(len(v) for v in splits.values()) == len(files)
    assert set(splits["train"]).isdisjoint(splits["heldout"]) and set(splits["bpe"]).isdisjoint(splits["heldout"])
    assert set(splits["train"]).isdisjoint(splits["bpe"])
    assert all(len(v) > 10 for v in splits.values())
    # a pure function of the relative path: the same on every call and every machine
    assert sc.split_of("asyncio/tasks.py") == sc.split_of("asyncio/tasks.py")
    assert splits == {s: sc.split_files(s) for s in sc.SPLITS}
    assert not any(part in sc.EXCLUDED_DIRS for f in files for part in f.split("/")[:-1])
    budget = sc.read_split("train", max_bytes=100_000)
    assert 100_000 <= sum(len(t.encode()) for t in budget) < 100_000 + sc.MAX_FILE_BYTES


def test_bpe_is_deterministic(tmp_path, monkeypatch):
    jsons = []
    for i in range(2):  # two empty caches: trained twice from scratch
        monkeypatch.setenv(env.CACHE, str(tmp_path / f"c{i}"))
        jsons.append(sc.train_bpe_json(vocab_size=512, max_chars=200_000))
    assert jsons[0] == jsons[1]
    assert '"<|endoftext|>"' in jsons[0]
    assert len(list((tmp_path / "c0" / "stdlib").glob("bpe-*.json"))) == 1  # cached: a third call reads it
    assert sc.train_bpe_json(vocab_size=512, max_chars=200_000) == jsons[0]


def test_token_rows_are_cached_and_equal(cache):
    tok = sc.build_tokenizer(512)
    a = sc.token_rows(tok, "heldout", 32, max_bytes=50_000, max_rows=20)
    assert len(list(cache.glob("tokens-heldout-*.safetensors"))) == 1
    b = sc.token_rows(tok, "heldout", 32, max_bytes=50_000, max_rows=20)
    assert a.shape == (20, 32) and torch.equal(a, b)
    assert int(a.max()) < len(tok)


def test_model_dir_loads_with_the_same_tokenizer(cache, tmp_path):
    from composer_cloud.model import TinyModelConfig, load_model

    d = sc.write_model_dir(tmp_path / "m", seed=0, vocab_size=512, config=TinyModelConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64))
    model, tok = load_model(str(d), seed=0)  # the local-path model loading every replica uses
    # transformers loads a Qwen2 directory's tokenizer as Qwen2Tokenizer (its own normalizer and
    # pre-tokenizer): the BPE was trained with those, so both tokenize alike, text, whitespace and unicode.
    text = sc.read_split("heldout", max_bytes=20_000)[0] + "\n\n  x = 'é' # it's\r\n\t\u00e9\u0301"
    assert tok(text)["input_ids"] == sc.build_tokenizer(512)(text)["input_ids"]
    assert tok.eos_token_id == sc.build_tokenizer(512).eos_token_id
    assert model.config.vocab_size == len(tok) and tok.eos_token == "<|endoftext|>"


# ----------------------------------------------------------------------------- trainer
def _ctx(model, tok, settings, rank=0, world=2):
    return TrainerContext(model=model, tokenizer=tok, rank=rank, world_size=world, seed=0,
                          device=torch.device("cpu"), settings=settings, inner_optimizer={"lr": 1e-3})


def test_causal_lm_trains_on_stdlib(cache):
    from composer_cloud.model import TinyModelConfig, build_tiny_model
    from composer_cloud.trainer.causal_lm import CausalLMTrainer

    tok = sc.build_tokenizer(512)
    model = build_tiny_model(tok, seed=0, config=TinyModelConfig(hidden_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, num_key_value_heads=1,
                                                                  intermediate_size=64))
    tr = CausalLMTrainer(_ctx(model, tok, {"corpus": "stdlib", "corpus_bytes": 100_000, "seq_len": 32,
                                           "batch_size": 2, "eval_rows": 8}))
    assert tr.heldout.shape == (8, 32) and len(tr.rows) > 100
    for _ in range(2):
        assert torch.isfinite(torch.tensor(tr.step()["loss"]))
    assert tr.evaluate()["eval_loss"] > 0


def test_builtin_corpus_unchanged():
    """``corpus`` defaults to the built-in one, and its rows are what they were before the option existed."""
    from composer_cloud.corpus import heldout_corpus, train_corpus
    from composer_cloud.model import TinyModelConfig, build_tiny_model, build_tokenizer
    from composer_cloud.trainer.causal_lm import CausalLMTrainer, _pack
    from composer_cloud.trainer.settings import CausalLMSettings

    assert CausalLMSettings().corpus == "builtin"
    tok = build_tokenizer(1024)
    model = build_tiny_model(tok, seed=0, config=TinyModelConfig(hidden_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, num_key_value_heads=1,
                                                                  intermediate_size=64))
    tr = CausalLMTrainer(_ctx(model, tok, {"corpus_size": 400, "seq_len": 32, "eval_rows": 16}, rank=1))
    assert torch.equal(tr.rows, _pack(tok, train_corpus(400), 32)[1::2])
    assert torch.equal(tr.heldout, _pack(tok, heldout_corpus(), 32)[:16])
    digest = hashlib.sha256(tr.rows.numpy().tobytes() + tr.heldout.numpy().tobytes()).hexdigest()
    assert digest == BUILTIN_ROWS_SHA256


#: sha256 of the rows above, computed with the code before ``trainer.corpus`` existed.
BUILTIN_ROWS_SHA256 = "e45702781b72eb6203662ce36180c96bd2d8899dcc3d1df01757916c3a5067ad"


def test_corpus_setting_is_checked():
    from composer_cloud.trainer import check_settings

    check_settings("causal-lm", {"corpus": "stdlib", "corpus_bytes": 1000})
    with pytest.raises(ValueError, match="trainer.corpus"):
        check_settings("causal-lm", {"corpus": "wikipedia"})


# ----------------------------------------------------------------------------- the chaos benchmark's accounting
@pytest.fixture(scope="module")
def chaos():
    spec = importlib.util.spec_from_file_location("chaos_schedule_bench", ROOT / "benchmarks" / "chaos_schedule.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["chaos_schedule_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_chaos_schedule_is_seeded_and_hits_distinct_ranks(chaos):
    kw = dict(replicas=4, base_s=100.0, kill_at=0.25, stop_at=0.5, cold_start_s=15, stop_s=10, slow_factor=3.0)
    a = chaos.make_schedule("chaos", seed=7, **kw)
    assert a == chaos.make_schedule("chaos", seed=7, **kw)
    kill, stop = a.events
    assert (kill.kind, kill.t, kill.duration, stop.kind, stop.t, stop.duration) == ("kill", 25.0, 15, "stop", 50.0, 10)
    assert len({kill.rank, stop.rank, a.slow_rank}) == 3
    mixed = chaos.make_schedule("mixed", seed=7, **kw)
    assert mixed.events == () and mixed.slow_rank == a.slow_rank  # the same slow replica in both scenarios
    assert chaos.make_schedule("baseline", seed=7, **kw).slow_rank is None
    assert chaos.duty_cycle(3.0, 0.3) == pytest.approx((0.1, 0.2))


def _steps(n, t=0.1, rnd=0):
    return [{"kind": "step", "round": rnd, "time_s": t} for _ in range(n)]


def test_chaos_accounting(chaos):
    rows = (_steps(5) + [{"kind": "round", "round": 0, "committed": True}]
            + _steps(5) + [{"kind": "round", "round": 1, "committed": False}]  # left out: healed, wasted
            + _steps(5) + [{"kind": "round", "round": 2, "committed": True, "merged": False}]  # "merged" wins
            + _steps(3))  # killed before the next sync: lost
    acc = chaos.account_rows(rows)
    assert acc == {"steps": 18, "useful_steps": 5, "wasted_steps": 13, "unsynced_steps": 3, "rounds_merged": 1,
                   "rounds_not_merged": 2, "step_time_s": pytest.approx(0.1)}
    # The step that contained the sync is not a measure of speed.
    slow_sync = _steps(4) + [{"kind": "step", "time_s": 9.0}, {"kind": "round", "committed": True}]
    assert chaos.account_rows(slow_sync)["step_time_s"] == pytest.approx(0.1)
    assert chaos.account_rows([{"kind": "round", "committed": True, "steps": 7}])["useful_steps"] == 7


def test_chaos_goodput(chaos):
    fast = _steps(10, 0.1) + [{"kind": "round", "committed": True}]
    slow = _steps(10, 0.3) + [{"kind": "round", "committed": True}]  # slowed 3x: its steps take 3x as long
    lost = _steps(10, 0.1) + [{"kind": "round", "committed": False}]
    g = chaos.goodput([{"billed_s": 1.0, "rows": fast}, {"billed_s": 3.0, "rows": slow}])
    assert g["goodput"] == pytest.approx(1.0)  # each replica busy with merged work all the time, at its own speed
    assert g["useful_steps_per_replica_s"] == pytest.approx(20 / 4.0)
    g = chaos.goodput([{"billed_s": 2.0, "rows": fast}, {"billed_s": 1.0, "rows": lost}])
    assert g["goodput"] == pytest.approx(1.0 / 3.0) and g["wasted_steps"] == 10
    # A step that held a 15-s SIGSTOP, and the step that held the sync, count as ordinary steps.
    stopped = (_steps(4, 0.1) + [{"kind": "step", "time_s": 15.0}] + _steps(4, 0.1)
               + [{"kind": "step", "time_s": 5.0}, {"kind": "round", "committed": True}])
    assert chaos.goodput([{"billed_s": 21.0, "rows": stopped}])["goodput"] == pytest.approx(1.0 / 21.0)
    assert chaos.goodput([{"billed_s": 0.0, "rows": []}])["goodput"] == 0.0
    assert chaos.first_time_at_most([(3, 1.0), (1, 2.0), (5, 0.5)], 1.0) == 3
    assert chaos.first_time_at_least([(1, 10), (2, 30)], 20) == 2


def test_the_chaos_harness_writes_a_signed_run_and_gives_its_replicas_the_key(tmp_path, monkeypatch):
    """chaos.py is its runs' executor: it launches signed, as a launch does by default (it had failed since
    signing landed), its replicas get the run key in their environment, and its own reads open the run."""
    from composer_cloud import env, stdlib_corpus
    from composer_cloud.model import TinyModelConfig
    from composer_cloud.storage.run import open_run

    monkeypatch.delenv(env.UNSIGNED, raising=False)  # the suite's default opt-out; a launch signs without it
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import chaos as bench
    from chaos_harness import Harness

    cfg = bench.Config(**bench.QUICK)
    model_dir = stdlib_corpus.write_model_dir(tmp_path / "model", vocab_size=cfg.vocab, config=TinyModelConfig(
        hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.intermediate))
    schedule = bench.make_schedule("baseline", replicas=cfg.replicas, seed=0, base_s=10.0, kill_at=0.25,
                                   stop_at=0.5, cold_start_s=1.0, stop_s=1.0, slow_factor=3.0)
    harness = Harness(cfg, tmp_path, model_dir, "decoupled", "baseline", schedule)
    harness.store = harness.write_spec()
    run = open_run(harness.store.uri)  # the key from the harness's launch record, as evaluate_versions reads it
    assert run.spec.signed and run.run_key == harness.run_key is not None
    assert run.spec.sync.mode == "decoupled" and run.spec.keep_checkpoints >= cfg.rounds * cfg.replicas

    started = []

    class Started:
        pid = 4242

        def __init__(self, cmd, **kwargs) -> None:
            started.append((cmd, kwargs["env"]))

    monkeypatch.setattr("chaos_harness.subprocess.Popen", Started)
    harness.spawn(1)
    (cmd, environ), = started
    assert cmd[-2:] == ["--rank", "1"] and environ[env.RUN_KEY] == harness.run_key
