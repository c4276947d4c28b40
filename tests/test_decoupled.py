"""Decoupled DiLoCo (sync.mode = "decoupled"): merge math, write-once races, recovery, untrusted inputs,
and multi-process runs with a slowed and a killed replica."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from composer_cloud.runs.metrics import read_metrics
import torch

from composer_cloud import env
from composer_cloud.env import JobEnv
from composer_cloud.errors import BadObject, ConfigError
from composer_cloud.hooks import NO_HOOKS
from composer_cloud.replica.faults import EnvFaults
from composer_cloud.spec import SpecError, load_spec, spec_from_dict
from composer_cloud.storage import layout
from composer_cloud.storage.store import Store
from composer_cloud.sync.decoupled import outer
from composer_cloud.sync.decoupled import protocol as dc
from composer_cloud.sync.decoupled.versions import GlobalVersions
from composer_cloud.sync.outer import OuterOptimizerConfig
from support.cli import cli, cli_here, status_here
from support.faults import slow_env, with_faults
from support.local_jobs import kill_replica, kill_run, launch_stalled, replica_log
from support.resume import export_weights
from support.specs import SMALL_RUN_TOML

SHAPES = {"w": (3,), "b": (2,)}
# The merge math below is checked with DiLoCo's lr 0.7 / momentum 0.9, set in the spec like any other setting.
CFG = dc.DecoupledConfig.from_spec(spec_from_dict({
    "run_id": "run", "replicas": 3, "keep_checkpoints": 10, "outer_optimizer": {"lr": 0.7, "momentum": 0.9},
    "sync": {"mode": "decoupled", "min_quorum": 2, "grace_min_s": 0.5, "grace_max_s": 5.0}}))


def proto(store: Store, cfg: dc.DecoupledConfig = CFG) -> dc.DecoupledProtocol:
    """The protocol of this module's run (``CFG``, or ``cfg``) over ``store``."""
    return dc.DecoupledProtocol(store, cfg)


def _params() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([-1.0, 0.5])}


def _delta(scale: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([0.1, -0.2, 0.3]) * scale, "b": torch.tensor([0.05, 0.0]) * scale}


def _publish(store: Store, rank: int, seq: int, scale: float, tokens: int, base: int = 0) -> dc.Contribution:
    return proto(store).publish(rank=rank, seq=seq, base_version=base, tokens=tokens, inner_steps=4,
                                delta=_delta(scale))


def _global(store: Store, v: int) -> dict[str, torch.Tensor]:
    return GlobalVersions(store).load(v, SHAPES)[outer.FRAGMENT_KEY]["original_parameters"]


def _blob(store: Store, v: int) -> bytes:
    return bytes(store.get(f"checkpoints/{v:08d}/global-a0-0-of-1.safetensors"))


@pytest.fixture
def store(tmp_path) -> Store:
    s = Store(f"file://{tmp_path}/run")
    proto(s).ensure_initial(_params(), rank=0)
    return s


# ------------------------------------------------------------------ spec
def test_spec_refuses_fragments_with_decoupled_and_names_the_field():
    with pytest.raises(SpecError) as err:
        spec_from_dict({"inner_steps": 4, "sync": {"mode": "decoupled", "fragments": 2}})
    assert err.value.field == "sync.fragments"
    with pytest.raises(SpecError) as err:
        spec_from_dict({"replicas": 2, "sync": {"mode": "decoupled", "min_quorum": 3}})
    assert err.value.field == "sync.min_quorum"
    with pytest.raises(SpecError) as err:
        spec_from_dict({"sync": {"mode": "decoupled", "adopt_global_weight": 0.0}})
    assert err.value.field == "sync.adopt_global_weight"
    with pytest.raises(SpecError, match="renamed sync.adopt_global_weight") as err:  # torchft's name, other meaning
        spec_from_dict({"sync": {"mode": "decoupled", "fragment_update_alpha": 0.5}})
    assert err.value.field == "sync.fragment_update_alpha"
    spec = spec_from_dict({"sync": {"mode": "decoupled"}})
    assert spec.sync.mode == "decoupled" and spec_from_dict({}).sync.mode == "lockstep"


@pytest.mark.parametrize(("mode", "setting", "value"), [
    ("decoupled", "codec", '"bf16"'), ("decoupled", "codec", '"int8"'), ("decoupled", "max_attempts", "5"),
    ("decoupled", "heal_timeout_s", "100.0"), ("lockstep", "min_quorum", "1"), ("lockstep", "grace_max_s", "5.0"),
    ("lockstep", "adopt_global_weight", "0.5")])
def test_a_sync_setting_its_mode_never_reads_is_refused_at_load_by_name(tmp_path, mode, setting, value):
    toml = tmp_path / "run.toml"
    toml.write_text(f'[sync]\nmode = "{mode}"\n{setting} = {value}\n')
    with pytest.raises(SpecError) as err:
        load_spec(toml)
    assert err.value.field == f"sync.{setting}" and mode in str(err.value)
    # What the mode reads is accepted, and a stored spec (every default written out) loads again.
    spec = load_spec(None, {"sync.mode": mode})
    assert spec_from_dict(spec.to_json_dict()).sync.mode == mode


def test_the_decoupled_config_takes_the_spec_defaults_of_its_mode():
    """The outer optimizer's defaults are the spec's, per sync mode, and nowhere else."""
    decoupled = dc.DecoupledConfig.from_spec(spec_from_dict({"replicas": 4, "sync": {"mode": "decoupled"}}))
    assert decoupled.outer == OuterOptimizerConfig(lr=1.0, momentum=0.3, nesterov=True)
    assert decoupled.min_quorum == 2 and decoupled.keep_checkpoints == 2
    assert OuterOptimizerConfig.from_spec(spec_from_dict({})) == OuterOptimizerConfig(lr=0.7, momentum=0.9,
                                                                                      nesterov=True)


def test_fault_hooks_are_read_once_from_the_job_environment():
    assert EnvFaults.from_env(JobEnv.from_environ({})) is NO_HOOKS  # production: no fault code at all
    hooks = EnvFaults.from_env(JobEnv.from_environ({env.SLOW: "2:3,0:1.5", env.STALL_AT: "upload:4:1"}))
    assert hooks.slow == {2: 3.0, 0: 1.5} and hooks.stall == ("upload", 4, 1)
    assert hooks.after_step(1, 10.0) == 0.0 and hooks.after_step(2, 0.001) == pytest.approx(0.002)
    hooks.at("reduce", 4, 1)  # not the stall point: returns at once
    for bad, name in (({env.SLOW: "oops"}, "COMPOSER_CLOUD_SLOW"), ({env.SLOW: "0:0.5"}, "COMPOSER_CLOUD_SLOW"),
                      ({env.STALL_AT: "sleep:1:0"}, "COMPOSER_CLOUD_STALL_AT")):
        with pytest.raises(ConfigError, match=name):
            EnvFaults.from_env(JobEnv.from_environ(bad))


# ------------------------------------------------------------------ merge math
def test_merge_is_token_weighted_nesterov_step(store):
    _publish(store, 0, 1, 1.0, tokens=100)
    out = proto(store).try_merge(SHAPES, rank=0)
    assert out.merged is None and "waiting" in out.reason  # 1 replica < quorum 2, well inside the grace window
    _publish(store, 1, 1, -3.0, tokens=300)
    out = proto(store).try_merge(SHAPES, rank=1)
    assert out.merged == 1 and out.reason.startswith("quorum")
    rec = proto(store).read_merge(1)
    # By tokens within the merge; the merge as a whole is 2 of the 3 replicas' share of a round.
    share = 2 / 3
    assert rec.weights == (0.25 * share, 0.75 * share)
    assert [(c.rank, c.seq) for c in rec.contributions] == [(0, 1), (1, 1)]
    lr, m = 0.7, 0.9
    g1 = {k: share * (0.25 * _delta(1.0)[k] + 0.75 * _delta(-3.0)[k]) for k in SHAPES}
    # torch SGD nesterov, first step: buf = g; p -= lr * (g + m * buf)
    want1 = {k: _params()[k] - lr * (g1[k] + m * g1[k]) for k in SHAPES}
    got1 = _global(store, 1)
    for k in SHAPES:
        torch.testing.assert_close(got1[k], want1[k], rtol=0, atol=1e-6)
    # Second merge: momentum carries over from version 1's stored state.
    _publish(store, 0, 2, 2.0, tokens=100, base=1)
    _publish(store, 2, 1, 2.0, tokens=100, base=0)
    out = proto(store).try_merge(SHAPES, rank=2)
    assert out.merged == 2
    assert proto(store).read_merge(2).staleness == (0, 1)  # rank 2 started from version 0
    g2 = {k: share * v for k, v in _delta(2.0).items()}
    buf2 = {k: m * g1[k] + g2[k] for k in SHAPES}
    want2 = {k: want1[k] - lr * (g2[k] + m * buf2[k]) for k in SHAPES}
    for k in SHAPES:
        torch.testing.assert_close(_global(store, 2)[k], want2[k], rtol=0, atol=1e-6)


def test_grace_window_adapts_and_merges_a_lonely_contribution(store):
    grace_window = proto(store).grace_window
    assert grace_window([]) == CFG.grace_max_s
    assert grace_window([0.0, 1.0, 2.0, 3.0]) == 1.5
    assert grace_window([0.0, 0.01, 0.02]) == CFG.grace_min_s
    assert grace_window([0.0, 100.0]) == CFG.grace_max_s
    c = _publish(store, 0, 1, 1.0, tokens=10)
    assert proto(store).try_merge(SHAPES, rank=0, now=c.time + 1.0).merged is None
    out = proto(store).try_merge(SHAPES, rank=0, now=c.time + CFG.grace_max_s)
    assert out.merged == 1 and out.reason.startswith("grace")


# ------------------------------------------------------------------ races and recovery
def test_write_once_merge_race_loser_adopts_the_winner(store, monkeypatch):
    _publish(store, 0, 1, 1.0, tokens=100)
    _publish(store, 1, 1, 2.0, tokens=100)
    stale_view = proto(store).newest_merge()  # both mergers read "no merge yet"
    # The loser listed before the winner pruned.
    monkeypatch.setattr(dc.DecoupledProtocol, "prune", lambda *a, **k: None)
    assert proto(store).try_merge(SHAPES, rank=0).merged == 1
    winner = _blob(store, 1)
    _publish(store, 2, 1, 5.0, tokens=100)  # the loser also sees a third contribution: a different record
    monkeypatch.setattr(dc.DecoupledProtocol, "newest_merge", lambda self: stale_view)
    out = proto(store).try_merge(SHAPES, rank=1)
    monkeypatch.undo()
    assert out.merged is None and out.reason == "lost the race" and out.version == 1
    assert _blob(store, 1) == winner and len(proto(store).read_merge(1).contributions) == 2
    # rank 2's contribution was not consumed by the winner: it is still pending for version 2.
    pending, _ = proto(store).pending(proto(store).read_merge(1).cursor)
    assert [(c.rank, c.seq) for c in pending] == [(2, 1)]
    assert proto(store).try_merge(SHAPES, rank=1, final=True).merged == 2


def test_merger_killed_after_the_record_is_completed_bytewise(tmp_path, monkeypatch):
    def scenario(root: Path, kill: bool) -> bytes:
        s = Store(f"file://{root}")
        proto(s).ensure_initial(_params(), rank=0)
        _publish(s, 0, 1, 1.0, tokens=100)
        _publish(s, 1, 1, -2.0, tokens=50)
        if kill:
            def die(*a, **k):
                raise KeyboardInterrupt("killed after winning the merge record")
            with monkeypatch.context() as mp:
                mp.setattr(dc.DecoupledProtocol, "complete_version", die)
                with pytest.raises(KeyboardInterrupt):
                    proto(s).try_merge(SHAPES, rank=1)
            assert proto(s).read_merge(1) is not None and not GlobalVersions(s).durable(1)
            rec = proto(s).read_merge(1)
            # Too early: the merger may still be writing; nobody duplicates its work yet.
            early = proto(s).try_merge(SHAPES, rank=2, now=rec.time + 0.1)
            assert early.merged is None and not GlobalVersions(s).durable(1)
            out = proto(s).try_merge(SHAPES, rank=2, now=rec.time + CFG.grace_max_s)
            assert out.version == 1 and GlobalVersions(s).durable(1)
        else:
            assert proto(s).try_merge(SHAPES, rank=1).merged == 1
        return _blob(s, 1)

    assert scenario(tmp_path / "killed", True) == scenario(tmp_path / "clean", False)


def test_completer_racing_a_live_merger_that_pruned_the_inputs_is_not_an_error(store, monkeypatch):
    """A finisher completes merge v while its merger is alive; the merger writes v and prunes v's inputs
    first. The completer finds the inputs gone and the version durable: done, no error (seen in chaos.py)."""
    _publish(store, 0, 1, 1.0, tokens=100)
    _publish(store, 1, 1, 2.0, tokens=100)
    with monkeypatch.context() as mp:
        # the merger has the record, not the state yet
        mp.setattr(dc.DecoupledProtocol, "complete_version", lambda *a, **k: None)
        mp.setattr(dc.DecoupledProtocol, "prune", lambda *a, **k: None)
        proto(store).try_merge(SHAPES, rank=0)
    rec = proto(store).read_merge(1)
    assert not GlobalVersions(store).durable(1)
    real_load = dc.DecoupledProtocol.load_contribution
    raced = []

    def merger_finishes_first(self: dc.DecoupledProtocol, c: dc.Contribution, shapes: dict) -> dict:
        if not raced:  # the live merger wins the race and prunes the inputs
            raced.append(True)
            monkeypatch.setattr(dc.DecoupledProtocol, "load_contribution", real_load)
            proto(self.store).complete_version(rec, SHAPES, rank=0)
            proto(self.store).prune(newest=1, record=rec)
        return real_load(self, c, shapes)

    monkeypatch.setattr(dc.DecoupledProtocol, "load_contribution", merger_finishes_first)
    proto(store).complete_version(rec, SHAPES, rank=2)
    assert GlobalVersions(store).durable(1) and store.exists("checkpoints/00000001/manifest.json")


# ------------------------------------------------------------------ untrusted inputs
def test_tampered_foreign_and_nan_contributions_are_skipped(store):
    _publish(store, 0, 1, 1.0, tokens=100)
    _publish(store, 1, 1, 1.0, tokens=100)
    _publish(store, 2, 1, 1.0, tokens=100)
    # Tampered: blob replaced by other (well-formed) tensors; its meta's sha256 no longer matches.
    from composer_cloud.storage.tensors import save_tensors
    store.put(layout.contribution_key(1, 1, "safetensors"), save_tensors(_delta(100.0), {}))
    # Foreign: a contribution of another run copied into this one.
    meta = store.get_json(layout.contribution_key(2, 1, "json"))
    store.put_json(layout.contribution_key(2, 1, "json"), {**meta, "run_id": "other-run"})
    # NaN: a correctly published contribution whose values are not finite.
    bad = _delta(1.0)
    bad["w"][1] = float("nan")
    proto(store).publish(rank=0, seq=2, base_version=0, tokens=100, inner_steps=4, delta=bad)
    _publish(store, 1, 2, 2.0, tokens=100)
    out = proto(store).try_merge(SHAPES, rank=1)
    assert out.merged == 1
    rec = proto(store).read_merge(1)
    assert [(c.rank, c.seq) for c in rec.contributions] == [(0, 1), (1, 2)]
    rejected = {(r.rank, r.seq): r.reason for r in rec.rejected}
    assert set(rejected) == {(0, 2), (1, 1), (2, 1)}
    assert "non-finite" in rejected[(0, 2)] and "sha256" in rejected[(1, 1)] and "other-run" in rejected[(2, 1)]
    # Looked at once: valid metas move the cursor; the foreign one (it fails validation) moves nothing and
    # counts for nothing, and is pruned with the record.
    assert rec.cursor == {0: 2, 1: 2} and rec.merged == {0: 1, 1: 1, 2: 0}
    assert not store.exists(layout.contribution_key(2, 1, "json"))
    for k, t in _global(store, 1).items():
        assert torch.isfinite(t).all(), k


def test_forged_merge_record_and_global_are_refused(store):
    _publish(store, 0, 1, 1.0, tokens=100)
    _publish(store, 1, 1, 1.0, tokens=100)
    assert proto(store).try_merge(SHAPES, rank=0).merged == 1
    rec = store.get_json(layout.merge_key(1))
    with pytest.raises(BadObject, match="weights"):
        proto(store).parse_merge({**rec, "weights": [0.9, 0.1]}, "k", 1)
    with pytest.raises(BadObject, match="other"):
        proto(store).parse_merge({**rec, "run_id": "other"}, "k", 1)
    # A global whose values are not finite (written with a valid marker) is never adopted.
    tree = outer.initial_state({"w": torch.tensor([float("inf"), 0, 0]), "b": torch.zeros(2)}, CFG.outer)
    GlobalVersions(store).write(5, tree, writer=0)
    with pytest.raises(BadObject, match="non-finite"):
        GlobalVersions(store).load(5, SHAPES)


def test_final_merge_once_the_fleet_published_its_budget(store):
    cfg = CFG
    for r in range(3):
        _publish(store, r, 1, 1.0 + r, tokens=100)
    assert proto(store, cfg).published_total() == 3
    assert proto(store, cfg).finish(SHAPES, rank=0, rounds=2) is None  # budget 6: not reached
    _publish(store, 0, 2, 1.0, tokens=100)  # a fast replica makes more than its share
    _publish(store, 0, 3, 1.0, tokens=100)
    _publish(store, 0, 4, 1.0, tokens=100)
    v = proto(store, cfg).finish(SHAPES, rank=0, rounds=2)
    assert v is not None and GlobalVersions(store).final() == v
    assert proto(store, cfg).finish(SHAPES, rank=1, rounds=2) == v  # a racing finisher agrees
    p = proto(store, cfg)
    merged = {(c.rank, c.seq) for u in p.versions.decided() for c in p.read_merge(u).contributions}
    assert merged == {(0, 1), (1, 1), (2, 1), (0, 2), (0, 3), (0, 4)}
    assert GlobalVersions(store).progress() == (v, v)
    # Nothing merges after the final record: a late contribution stays out of the final model.
    _publish(store, 1, 2, 5.0, tokens=100)
    out = proto(store, cfg).try_merge(SHAPES, rank=1, final=True)
    assert out.merged is None and out.reason == "run finished"
    assert GlobalVersions(store).decided()[-1] == v and GlobalVersions(store).newest() == v


def test_final_merge_with_nothing_pending_still_closes_merging(store):
    for r in range(3):
        _publish(store, r, 1, 1.0, tokens=100)
    assert proto(store).try_merge(SHAPES, rank=0).merged == 1  # quorum: everything merged
    v = proto(store).finish(SHAPES, rank=2, rounds=1)
    assert v == 2 and proto(store).read_merge(2).final
    before, after = GlobalVersions(store).load(1, SHAPES), GlobalVersions(store).load(2, SHAPES)
    for n in SHAPES:  # an empty final merge is no step: same parameters, same momentum
        key = outer.FRAGMENT_KEY
        assert torch.equal(before[key]["original_parameters"][n], after[key]["original_parameters"][n])


def test_writer_killed_between_marker_and_manifest_is_finished_and_seqs_are_never_reused(store):
    _publish(store, 0, 1, 1.0, tokens=100)
    _publish(store, 1, 1, 1.0, tokens=100)
    _publish(store, 2, 1, 1.0, tokens=100)
    assert proto(store).try_merge(SHAPES, rank=0).merged == 1
    store.delete("checkpoints/00000001/manifest.json")  # the writer died after the marker
    assert proto(store).finish(SHAPES, rank=2, rounds=1) == 2  # the final merge completes version 1 first
    assert store.exists("checkpoints/00000001/manifest.json")
    # A replica whose inner state is at seq 0 but which published seq 1 continues at seq 2.
    assert proto(store).next_seq(2, 0) == 2 and proto(store).next_seq(0, 5) == 6


def test_protocol_on_real_s3_servers(s3_store, monkeypatch):
    """Write-once merge records, listing and pruning behave the same on moto and SeaweedFS."""
    store = Store(f"s3://{s3_store.bucket}/decoupled-{time.time_ns()}")
    proto(store).ensure_initial(_params(), rank=0)
    _publish(store, 0, 1, 1.0, tokens=100)
    _publish(store, 1, 1, -1.0, tokens=300)
    stale = proto(store).newest_merge()
    monkeypatch.setattr(dc.DecoupledProtocol, "prune", lambda *a, **k: None)
    assert proto(store).try_merge(SHAPES, rank=0).merged == 1
    monkeypatch.setattr(dc.DecoupledProtocol, "newest_merge", lambda self: stale)
    assert proto(store).try_merge(SHAPES, rank=1).reason == "lost the race"
    monkeypatch.undo()
    assert proto(store).finish(SHAPES, rank=2, rounds=1) is None  # 2 of the budget's 3 published
    _publish(store, 2, 1, 1.0, tokens=100)
    assert proto(store).finish(SHAPES, rank=2, rounds=1) == 2
    assert proto(store).read_merge(2).cursor == {0: 1, 1: 1, 2: 1}
    assert not store.list(layout.contribution_prefix(2))  # consumed and durable: pruned


# ------------------------------------------------------------------ multi-process runs
SPEC = """
replicas = 3
rounds = 4
inner_steps = 3
keep_checkpoints = 3
[sync]
mode = "decoupled"
min_quorum = 2
grace_min_s = 0.5
grace_max_s = 10
""" + SMALL_RUN_TOML


def _heartbeats(run: Store, n: int) -> list[dict]:
    return [run.get_json(f"replicas/{r}.json") for r in range(n)]


def _rounds(run: Store, rank: int) -> list[dict]:
    return read_metrics(run, rank=rank, kind="round")


@pytest.mark.slow
def test_slow_replica_does_not_stall_the_others_and_the_run_exports(tmp_path):
    cfg = tmp_path / "spec.toml"
    cfg.write_text(SPEC)
    env = with_faults(slow_env({2: 8}))
    res = cli("launch", "--config", str(cfg), "--store", f"file://{tmp_path}/store", "--run-id", "slow", cwd=tmp_path,
              env=env, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = Store(f"file://{tmp_path}/store/slow")
    beats = _heartbeats(run, 3)
    assert all(b["state"] == "completed" for b in beats), beats
    rows = {r: _rounds(run, r) for r in range(3)}
    assert all(row["wait_s"] == 0.0 for r in rows for row in rows[r])
    # The fleet's budget (3 x 4 contributions) is made mostly by the fast replicas: the slow one makes fewer.
    assert sum(map(len, rows.values())) >= 12 and len(rows[2]) < max(len(rows[0]), len(rows[1])), rows
    final = GlobalVersions(run).final()
    assert final is not None and beats[2].get("final_version") == final
    last = proto(run, _cfg("slow")).read_merge(GlobalVersions(run).decided()[-1])
    assert last.final and last.version == final and sum(last.cursor.values()) >= 12, last.cursor
    st = status_here(run.uri, tmp_path)
    assert st["state"] == "completed", st
    assert export_weights(tmp_path, run.uri, "model")  # through the library (the CLI's export: test_cli.py)


def _cfg(run_id: str) -> dc.DecoupledConfig:
    """The config the replicas of a run built from ``SPEC`` use (to read its records)."""
    return dc.DecoupledConfig.from_spec(spec_from_dict({**tomllib.loads(SPEC), "run_id": run_id}))


def _with_rounds(rounds: int) -> str:
    """SPEC with another fleet budget (``replicas × rounds`` contributions)."""
    spec = SPEC.replace("rounds = 4\n", f"rounds = {rounds}\n")
    assert spec != SPEC
    return spec


def _start_stalled(tmp_path: Path, run_id: str, rank: int, seq: int, extra: str = "",
                   slow: dict[int, float] | None = None, spec: str = SPEC) -> subprocess.Popen:
    """Launch attached; return once ``rank`` stalls in the inner steps after ``seq`` contributions."""
    cfg = tmp_path / f"{run_id}.toml"
    cfg.write_text(extra + spec)
    return launch_stalled(tmp_path, cfg, f"file://{tmp_path}/store", run_id, phase="inner_step", round=seq,
                          rank=rank, extra_env=slow_env(slow) if slow else None, timeout=120)


@pytest.mark.slow
def test_stalled_then_killed_replica_does_not_stall_others_and_rejoins(tmp_path):
    # The others run 5x slower towards a 36-contribution budget, so replica 1 reaches its stall point first even
    # when it started seconds after them on a loaded machine (at full speed and 12 they once finished without it).
    rounds = 12
    launcher = _start_stalled(tmp_path, "kill", rank=1, seq=2, extra="max_restarts = 1\n", slow={0: 5, 2: 5},
                              spec=_with_rounds(rounds))
    run = Store(f"file://{tmp_path}/store/kill")
    try:
        # While replica 1 hangs (like a SIGSTOPped job), the others make the fleet's budget and finish the run.
        deadline = time.monotonic() + 90
        while not all((run.try_get_json(f"replicas/{r}.json") or {}).get("state") == "completed" for r in (0, 2)):
            assert time.monotonic() < deadline, "replicas 0 and 2 waited for the stalled replica"
            time.sleep(0.3)
        final = GlobalVersions(run).final()
        assert final is not None  # completed without the straggler
        kill_replica(run.uri, 1)
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, out[-3000:]
    log = replica_log(run.uri, 1)
    # The restarted replica resumed its own state, found the run finished and stopped.
    assert "resumed its inner state after contribution 2" in log, log[-3000:]
    assert GlobalVersions(run).final() == final
    last = proto(run, _cfg("kill")).read_merge(final)
    assert last.final and last.cursor[1] == 2 and sum(last.cursor.values()) >= 3 * rounds
    st = status_here(run.uri, tmp_path)
    assert st["state"] == "completed", st


@pytest.mark.slow
def test_resume_after_everything_is_killed(tmp_path):
    # The others run 10x slower towards a 36-contribution budget, so they are far from it when everything is
    # killed, even when rank 0 started seconds after them on a loaded machine (at 4x and 12 they once made it).
    rounds = 12
    launcher = _start_stalled(tmp_path, "resumed", rank=0, seq=2, slow={1: 10, 2: 10}, spec=_with_rounds(rounds))
    time.sleep(0.5)  # let the others publish and merge more
    run = Store(f"file://{tmp_path}/store/resumed")
    kill_run(run.uri, launcher)
    assert GlobalVersions(run).final() is None
    before = GlobalVersions(run).newest()
    assert before is not None
    res = cli_here("resume", run.uri, cwd=tmp_path, timeout=180)
    assert res.exit_code == 0, res.output[-6000:]
    st = status_here(run.uri, tmp_path)
    assert st["state"] == "completed" and st["rounds_committed"] >= before, st
    log = replica_log(run.uri, 0)
    assert "resumed its inner state after contribution 2" in log, log[-3000:]
    last = proto(run, _cfg("resumed")).read_merge(GlobalVersions(run).decided()[-1])
    assert last.final and sum(last.cursor.values()) >= 3 * rounds and GlobalVersions(run).final() == last.version
    res = cli_here("resume", run.uri, cwd=tmp_path)  # a finished decoupled run: nothing to resume
    assert res.exit_code == 0 and "nothing to resume" in res.output, res.output
    assert export_weights(tmp_path, run.uri, "model")
