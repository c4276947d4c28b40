"""The metrics rows' one schema (``storage/records/metrics.py``): typed rows, the file format unchanged.

Rows below are spelled as the replicas wrote them before the rows were typed (the keys of
``replica/lockstep.py``, ``replica/decoupled.py``, ``replica/boundary.Segment`` and ``runtime.sync_fields`` at
commit 17bef52): reading one and writing it again gives the same line, and the writer of today writes the
same keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math

import pytest

from composer_cloud.errors import BadObject
from composer_cloud.replica.boundary import Segment
from composer_cloud.replica.telemetry import Telemetry
from composer_cloud.runs.metrics import list_objects, read_metrics, read_rows, to_csv
from composer_cloud.storage.records.metrics import (
    LEADING_COLUMNS,
    ROUND_COLUMNS,
    STEP_COLUMNS,
    DecoupledFields,
    LockstepFields,
    RoundRow,
    StepRow,
    encode_rows,
    parse_row,
)
from composer_cloud.storage import layout
from composer_cloud.storage.records import MetricsDigest
from composer_cloud.storage.store import Store

#: A three-channel step row (a NaN the trainer reported was written as null).
STEP = {"kind": "step", "rank": 1, "launch": 0, "time": 1764245000.25, "round": 2, "step": 9, "time_s": 0.41,
        "loss": 0.5, "grad_norm": 1.25, "lr": 1e-5, "pg": 0.1, "sdpo": 0.0, "dpo": None, "reward_mean": 0.25,
        "reward_std": 0.5, "frac_reward_zero_std": 0.5, "completion_length": 12.0, "clipped_ratio": 0.0,
        "step_time_s": 0.4, "tokens": 64}
#: A lock-step round row of a checkpointed round, evaluated on this replica.
LOCKSTEP = {"kind": "round", "rank": 0, "launch": 1, "time": 1764245001.5, "round": 3, "committed": True,
            "healed_to": None, "participants": [0, 1], "sync_s": 0.8, "quorum_wait_s": 0.1, "bytes_read": 4096,
            "bytes_written": 2048, "train_loss": 2.5, "compute_s": 1.5, "wall_s": 2.4, "reward_mean": 0.3,
            "synced_params": 1000, "synced_fraction": 1.0, "checkpoint_wait_s": 0.0,
            "checkpoint_snapshot_s": 0.02, "eval_loss": 2.25, "eval_ppl": 9.49}
#: A lock-step round this replica healed in, not committed, with a NaN train loss (null).
HEALED = {"kind": "round", "rank": 1, "launch": 0, "time": 1764245002.0, "round": 4, "committed": False,
          "healed_to": 3, "participants": [], "sync_s": 0.0, "quorum_wait_s": 0.0, "bytes_read": 0,
          "bytes_written": 0, "train_loss": None, "compute_s": 1.0, "wall_s": 1.5, "synced_params": 1000,
          "synced_fraction": 0.01}
#: A decoupled boundary that merged nothing (merged_here and grace_s null), with its checkpoint.
DECOUPLED = {"kind": "round", "rank": 0, "launch": 0, "time": 1764245003.0, "round": 5, "committed": True,
             "merged_version": 4, "adopted": False, "merged_here": None, "merge_reason": "waiting",
             "grace_s": None, "staleness": 1, "participants": [0, 2], "tokens": 512, "sync_s": 0.3, "wait_s": 0.0,
             "quorum_wait_s": 0.0, "bytes_read": 100, "bytes_written": 200, "checkpoint_s": 0.05,
             "train_loss": 3.0, "compute_s": 2.0, "wall_s": 2.4, "synced_params": 50, "synced_fraction": 1.0}
ROWS = (STEP, LOCKSTEP, HEALED, DECOUPLED)


@pytest.mark.parametrize("row", ROWS, ids=["step", "lockstep", "healed", "decoupled"])
def test_a_row_of_the_current_format_reads_and_writes_back_unchanged(row):
    typed = parse_row(json.loads(json.dumps(row)), key="k")
    assert type(typed) is (StepRow if row["kind"] == "step" else RoundRow)
    assert typed.to_json() == row and list(typed.to_json()) == sorted(row)  # the file's key order
    assert encode_rows([typed]) == (json.dumps(row, sort_keys=True) + "\n").encode()


def test_read_metrics_returns_rows_of_the_current_format_exactly_as_written(tmp_path):
    """An object as the replicas wrote it before the rows were typed: ``metrics --json``/``--csv`` and the library
    get every row back unchanged, key order included; a superseded row gets its mark last."""
    store = Store(f"file://{tmp_path}/run")
    lines = [dict(r, rank=0, launch=0, round=3) for r in (STEP, LOCKSTEP)] + [{"kind": "round", "rank": 0}]
    body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in lines).encode()  # the last row: no round
    for launch in (0, 1):
        key = layout.metrics_key(0, 3, layout.new_writer_id(launch))
        store.put_plain(key, body)
        store.put_json(layout.metrics_digest_key(key), MetricsDigest(
            sha256=hashlib.sha256(body).hexdigest(), bytes=len(body), rows=3, rank=0, round=3).to_json())
    expected = [json.loads(json.dumps(r, sort_keys=True)) for r in lines[:2]]
    got = read_metrics(store)
    assert got == expected and [list(r) for r in got] == [list(r) for r in expected]
    marked = read_metrics(store, superseded=True)
    assert len(marked) == 4 and list(marked[0])[-1] == "superseded" and marked[0]["superseded"] is True
    assert {k: v for k, v in marked[0].items() if k != "superseded"} == expected[0]


def test_the_rows_are_typed_where_readers_look():
    step, lock, healed, dec = (parse_row(r, key="k") for r in ROWS)
    assert step.extra["grad_norm"] == 1.25 and step.loss == 0.5 and step.time_s == 0.41 and step.step == 9
    assert "round" not in step.extra and "kind" not in step.extra  # typed columns are not figures
    assert lock.lockstep == LockstepFields(healed_to=None, checkpoint_wait_s=0.0, checkpoint_snapshot_s=0.02)
    assert lock.decoupled is None and lock.extra == {"eval_loss": 2.25, "eval_ppl": 9.49}
    assert lock.bytes_moved == 6144 and lock.participants == [0, 1]
    assert healed.lockstep.healed_to == 3 and math.isnan(healed.train_loss) and healed.get("train_loss") is None
    assert dec.lockstep is None and dec.decoupled.merged_version == 4 and dec.decoupled.merged_here is None
    assert dec.decoupled.tokens == 512 and dec.get("merge_reason") == "waiting"


def test_older_rows_default_their_missing_fields_and_unknown_fields_are_kept():
    old = {"kind": "round", "rank": 0, "round": 0, "train_loss": 1.5, "a_future_column": [1, 2]}
    row = RoundRow.from_json(old, key="k")
    assert row.committed is None and row.sync_s is None and row.lockstep is None and row.launch is None
    assert row.extra == {"a_future_column": [1, 2]}
    assert row.to_json() == old  # nothing invented, nothing lost
    modeless = {"kind": "round", "rank": 0, "round": 0, "tokens": 5, "checkpoint_wait_s": 0.5}
    row = RoundRow.from_json(modeless, key="k")  # a mode's columns without the mode's own key: kept as they are
    assert row.decoupled is None and row.lockstep is None and row.extra == {"tokens": 5, "checkpoint_wait_s": 0.5}
    assert row.to_json() == modeless
    step = StepRow.from_json({"kind": "step", "rank": 0, "round": 0, "loss": 1.0}, key="k")
    assert step.step is None and step.time_s is None and step.to_json() == {"kind": "step", "rank": 0, "round": 0,
                                                                             "loss": 1.0}


@pytest.mark.parametrize("bad, field", [
    ({**LOCKSTEP, "committed": "yes"}, "committed"), ({**LOCKSTEP, "participants": ["0"]}, "participants"),
    ({**LOCKSTEP, "round": "3"}, "round"), ({**DECOUPLED, "merged_version": None}, "merged_version"),
    ({**STEP, "kind": "steps"}, "kind"), ({**STEP, "step": 1.5}, "step")])
def test_a_typed_field_of_the_wrong_type_is_refused_by_name(bad, field):
    with pytest.raises(BadObject, match=repr(field)):
        parse_row(bad, key="metrics/0/x.jsonl")


def test_a_figure_cannot_take_a_columns_name():
    with pytest.raises(ValueError, match="'round'"):
        StepRow(rank=0, round=0, extra={"round": 7})
    row = RoundRow(rank=0, round=0, lockstep=LockstepFields(healed_to=None))
    row.extra["healed_to"] = 1  # the mode's columns are the round row's too
    with pytest.raises(ValueError, match="healed_to"):
        row.to_json()
    with pytest.raises(ValueError, match="train_loss"):
        RoundRow(rank=0, round=0, extra={"train_loss": 1.0})


def test_the_column_lists_come_from_the_dataclasses():
    assert set(LOCKSTEP) - set(ROUND_COLUMNS) == {"eval_loss", "eval_ppl"}  # the trainer's, in extra
    assert set(DECOUPLED) <= set(ROUND_COLUMNS)
    assert set(STEP) & set(STEP_COLUMNS) == {"kind", "rank", "launch", "time", "round", "step", "time_s"}
    assert set(LEADING_COLUMNS) - set(STEP_COLUMNS) - set(ROUND_COLUMNS) == {"loss"}  # every trainer's step loss


def test_csv_columns_are_as_before():
    rows = [StepRow.from_json(STEP, key="k").to_json(), RoundRow.from_json(LOCKSTEP, key="k").to_json()]
    header = to_csv(rows).splitlines()[0].split(",")
    first = ["kind", "rank", "round", "step", "launch", "committed", "loss", "train_loss", "reward_mean"]
    assert header == first + sorted((set(STEP) | set(LOCKSTEP)) - set(first))


def _telemetry(tmp_path) -> tuple[Telemetry, Store]:
    store = Store(f"file://{tmp_path}/run")
    tel = Telemetry(store, 0, rounds=2, inner_steps=2, progress_every_s=60)
    tel.start({"python": "3"}, synced=(1000, 1.0))
    return tel, store


def test_the_writer_writes_the_keys_the_replicas_wrote_before(tmp_path):
    tel, store = _telemetry(tmp_path)
    seg = Segment()
    figures = {k: STEP[k] for k in STEP if k not in {"kind", "rank", "launch", "time", "round", "step", "time_s"}}
    for i in (1, 2):
        tel.step(0, i, figures, 0.5)
        seg.add(figures, compute_s=0.5, tokens=64)
    row = tel.round_row(0, committed=True, lockstep=LockstepFields(healed_to=None, checkpoint_wait_s=0.0,
                                                                    checkpoint_snapshot_s=0.02),
                        participants=[0, 1], sync_s=0.8, quorum_wait_s=0.1, bytes_read=4096, bytes_written=2048)
    row.extra.update({"eval_loss": 2.25, "eval_ppl": 9.49})  # the boundary adds the trainer's evaluation
    tel.round(seg.fill(row))
    (obj,) = list_objects(store)
    lines = [json.loads(line) for line in store.get_plain(obj.key).decode().splitlines()]
    assert [set(line) for line in lines] == [set(STEP), set(STEP), set(LOCKSTEP)]
    assert lines[2]["reward_mean"] == 0.25 and lines[2]["synced_params"] == 1000 and lines[1]["step"] == 2
    dec = tel.round_row(1, committed=True, decoupled=DecoupledFields(
        merged_version=4, adopted=False, merged_here=None, merge_reason="waiting", grace_s=None, staleness=1,
        tokens=512, wait_s=0.0, checkpoint_s=0.05), participants=[0, 2], sync_s=0.3, quorum_wait_s=0.0,
        bytes_read=100, bytes_written=200)
    tel.round(_filled(dec))
    assert set(read_metrics(store, kind="round")[1]) == set(DECOUPLED)


def _filled(row: RoundRow) -> RoundRow:
    seg = Segment()
    seg.add({"loss": 3.0}, compute_s=2.0, tokens=512)
    return seg.fill(row)


def test_a_trainer_figure_named_like_a_column_is_left_out_with_a_warning(tmp_path, caplog):
    tel, store = _telemetry(tmp_path)
    with caplog.at_level(logging.WARNING, logger="composer_cloud.replica.telemetry"):
        tel.step(0, 1, {"loss": 1.0, "time": 5.0, "round": 9}, 0.1)
        tel.round(_filled(tel.round_row(0, committed=True)))
    assert "['round', 'time']" in caplog.text
    step, _ = read_rows(store)
    assert step.round == 0 and step.time != 5.0 and step.extra == {"loss": 1.0}


#: The keys a replica wrote before the rows were typed, per row kind and sync mode (17bef52: the stamp, the
#: segment, the boundary's dict, ``runtime.sync_fields``); the optional ones where a round checkpointed or evaluated.
STAMP = {"kind", "rank", "launch", "time", "round"}
SEGMENT = {"train_loss", "compute_s", "wall_s"}
SYNCED = {"synced_params", "synced_fraction"}
BEFORE = {
    "lockstep": (STAMP | SEGMENT | SYNCED | {"committed", "healed_to", "participants", "sync_s", "quorum_wait_s",
                                            "bytes_read", "bytes_written"},
                 {"checkpoint_wait_s", "checkpoint_snapshot_s", "eval_loss", "eval_ppl", "reward_mean"}),
    "decoupled": (STAMP | SEGMENT | SYNCED | {"committed", "merged_version", "adopted", "merged_here", "merge_reason",
                                             "grace_s", "staleness", "participants", "tokens", "sync_s", "wait_s",
                                             "quorum_wait_s", "bytes_read", "bytes_written"},
                  {"checkpoint_s", "eval_loss", "eval_ppl", "reward_mean"}),
}


@pytest.mark.parametrize("mode", ["lockstep", "decoupled"])
def test_a_replica_writes_the_keys_it_wrote_before(tmp_path, mode):
    """The replica itself (one, in this process, the causal-lm trainer on a tiny model) through both boundaries."""
    from composer_cloud.env import JobEnv
    from composer_cloud.hooks import NO_HOOKS
    from composer_cloud.replica.runtime import Replica
    from composer_cloud.spec import RunSpec

    spec = RunSpec.model_validate({
        "run_id": "r", "store": f"file://{tmp_path}/store", "replicas": 1, "min_replicas": 1, "rounds": 2,
        "inner_steps": 2, "signed": False, "sync": {"mode": mode},
        "model": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                  "intermediate_size": 64},
        "trainer": {"name": "causal-lm", "batch_size": 2, "seq_len": 16}})
    uri = f"file://{tmp_path}/store/r"
    store = Store(uri)
    store.create_json(layout.SPEC, spec.to_json_dict())
    Replica(uri, 0, job_env=JobEnv(cache_dir=tmp_path / "cache"), hooks=NO_HOOKS).run()
    rows = read_metrics(store)
    steps, rounds = [r for r in rows if r["kind"] == "step"], [r for r in rows if r["kind"] == "round"]
    assert len(steps) == 4 and len(rounds) == 2
    for r in steps:
        assert set(r) - {"loss", "tokens", "grad_norm"} == STAMP | {"step", "time_s"}, r
    required, optional = BEFORE[mode]
    for r in rounds:
        assert required <= set(r) <= required | optional, set(r) ^ required
    assert {"checkpoint_wait_s", "checkpoint_s"} & set(rounds[-1])  # the last round checkpoints


def test_the_views_name_columns_of_the_schema_or_the_trainers_figures():
    """The report's panels and the tracking's round series pick columns by name: each is typed here, or one every
    built-in trainer reports (its step ``loss``, its evaluation)."""
    from composer_cloud.runs.report import PANELS
    from composer_cloud.runs.tracking import ROUND_SERIES

    figures = {"loss", "eval_loss", "eval_reward_mean"}
    named = {k for _, keys, _ in PANELS for k in keys} | set(ROUND_SERIES)
    assert named - set(STEP_COLUMNS) - set(ROUND_COLUMNS) == figures
