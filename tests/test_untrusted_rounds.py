"""The bucket is not trusted: bad round records and payloads cost at most an attempt, never the run.

Replicas run as threads in one process where the point is one round's
protocol, and as real processes (torchft DiLoCo) where it is the whole run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
import zlib
from typing import Any

import numpy as np
import pytest
import torch

from composer_cloud.sync.lockstep import codec as wire
from composer_cloud.sync.lockstep.allreduce import AllReduceConfig, ObjectStoreAllReduce, RoundResult
from composer_cloud.sync.lockstep.rounds import committed_attempt, latest_committed_round
from composer_cloud.errors import BadObject
from composer_cloud.storage.records import Outcome, Quorum
from composer_cloud.storage.framing import HEADER_BYTES, frame
from composer_cloud.storage.store import Store
from support.processes import run_processes
from workers import allreduce_config, diloco_worker, payload, reference_diloco

NUMEL = 999
Q0 = "rounds/00000000/0"


@pytest.fixture(params=["file", "s3"])
def any_store_uri(request, tmp_path) -> str:
    """A file:// store, and an s3:// one on the session's moto server (listing and create differ there)."""
    if request.param == "file":
        return f"file://{tmp_path}/store"
    request.getfixturevalue("s3_endpoint")
    return f"s3://cc-test/untrusted-{uuid.uuid4().hex[:8]}"


def cfg(world: int, **kw: Any) -> AllReduceConfig:
    return allreduce_config(world, **{"min_replicas": min(2, world), "quorum_timeout_s": 30,
                              "round_timeout_s": 30, "io_threads": 4, **kw})


def run_round(uri: str, world: int, *, round: int = 0, stores: dict[int, Store] | None = None,
              payloads: dict[int, torch.Tensor] | None = None, **kw: Any) -> dict[int, tuple[Any, torch.Tensor]]:
    """One all-reduce round with one thread per replica; ``{rank: (RoundResult or exception, tensor)}``."""
    out: dict[int, tuple[Any, torch.Tensor]] = {}

    def replica(rank: int) -> None:
        x = payloads[rank].clone() if payloads and rank in payloads else payload(rank, NUMEL)
        store = (stores or {}).get(rank) or Store(uri)
        ar = ObjectStoreAllReduce(store, rank, cfg(world, **kw))
        try:
            out[rank] = (ar.allreduce(round, x), x)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            out[rank] = (exc, x)
        finally:
            ar.close()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not any(t.is_alive() for t in threads), "a replica hung"
    return out


def mean_of(ranks: list[int]) -> torch.Tensor:
    return torch.stack([payload(r, NUMEL) for r in ranks]).mean(0)


def assert_committed(res: RoundResult | Exception, x: torch.Tensor, ranks: list[int], attempt: int) -> None:
    assert isinstance(res, RoundResult), res
    assert res.committed and res.participated, res
    assert res.attempt == attempt and res.participants == ranks, res
    torch.testing.assert_close(x, mean_of(ranks), atol=1e-6, rtol=0)


def outcome(uri: str, prefix: str = Q0) -> dict[str, Any]:
    return Store(uri).get_json(f"{prefix}/outcome.json")


def flip_byte(store: Store, key: str, offset: int = 3) -> None:
    path = store.path(key)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + offset)
        b = f.read(1)
        f.seek(HEADER_BYTES + offset)
        f.write(bytes([b[0] ^ 0x01]))


# --------------------------------------------------------------------------- records
@pytest.mark.parametrize("quorum,field", [
    ({"participants": [0, 7]}, "participants"),          # rank out of range
    ({"participants": [1, 0]}, "participants"),          # not sorted
    ({"participants": [0, 0, 1]}, "participants"),       # not unique
    ({"participants": [0, True]}, "participants"),       # bools are not ranks
    ({"participants": "all"}, "participants"),
    ({"participants": [0]}, "min_replicas"),             # fewer than min_replicas
    ({}, "participants"),
    ({"participants": [0, 1], "round": 3}, "round"),     # copied from another round
    ({"participants": [0, 1], "attempt": None}, "attempt"),  # a record must say where it belongs
    ({"participants": [0, 1], "excluded": [1]}, "excluded"),
])
def test_invalid_quorum_records_name_the_problem(quorum, field):
    with pytest.raises(BadObject) as err:
        Quorum.from_json({"round": 0, "attempt": 0, **quorum}, key="rounds/00000000/0/quorum.json", round=0,
                         attempt=0, replicas=3, min_replicas=2)
    assert field in str(err.value) and "quorum.json" in str(err.value)
    with pytest.raises(BadObject, match="JSON object"):
        Quorum.from_json([0, 1], key="rounds/00000000/0/quorum.json", round=0, attempt=0, replicas=3)


@pytest.mark.parametrize("record", [
    {"committed": "yes"}, {"committed": 1}, {"committed": True}, {"committed": False, "excluded": [9]},
    {"committed": False, "retry": "no"}, {"committed": True, "participants": [2, 1]}, None,
    {"committed": True, "participants": [0, 1], "attempt": None},
])
def test_invalid_outcome_records_are_rejected(record):
    with pytest.raises(BadObject):
        Outcome.from_json(record if record is None else {"round": 0, "attempt": 0, **record}, key="outcome.json",
                          round=0, attempt=0, replicas=3)


def test_config_rejects_bad_check_settings(store_uri):
    for bad in (1.0, 0.5, float("nan"), float("inf"), "10"):
        with pytest.raises(ValueError, match="sync.outlier_factor"):
            ObjectStoreAllReduce(Store(store_uri), 0, dataclasses.replace(allreduce_config(2), outlier_factor=bad))
    with pytest.raises(ValueError, match="sync.max_attempts"):
        ObjectStoreAllReduce(Store(store_uri), 0, dataclasses.replace(allreduce_config(2), max_attempts=0))


# --------------------------------------------------------------------------- stray and garbage records
def test_stray_join_objects_are_skipped_with_one_warning(any_store_uri, caplog):
    st = Store(any_store_uri)
    for name in ("README", "7.json", "01.json", "x/0.json", "-1.json"):
        st.put(f"{Q0}/join/{name}", b"not a join record")
    with caplog.at_level(logging.WARNING, logger="composer_cloud.sync.lockstep.rounds"):
        out = run_round(any_store_uri, 2, min_replicas=2)
    for rank in (0, 1):
        assert_committed(*out[rank], ranks=[0, 1], attempt=0)
    readme = [r for r in caplog.records if "join/README" in r.getMessage()]
    assert len(readme) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("garbage", [b"\x00garbage", b'{"participants": [0, 1, 9]}', b'{"participants": [0]}'])
def test_garbage_quorum_of_the_current_attempt_moves_everyone_to_the_next(any_store_uri, garbage):
    Store(any_store_uri).create(f"{Q0}/quorum.json", garbage)
    out = run_round(any_store_uri, 3)
    for rank in range(3):
        res, x = out[rank]
        assert_committed(res, x, ranks=[0, 1, 2], attempt=1)
    # Whoever came first met the garbage; later arrivals may go straight to attempt 1.
    assert max(res.attempts for res, _ in out.values()) == 2
    rec = outcome(any_store_uri)
    assert rec["committed"] is False and rec["check"] == "quorum" and "invalid quorum record" in rec["reason"]


def test_bit_flipped_old_outcome_does_not_break_round_discovery(store_uri):
    st = Store(store_uri)
    ar = ObjectStoreAllReduce(st, 0, allreduce_config(1))
    for r in range(4):
        assert ar.allreduce(r, torch.ones(8)).committed
    flip_byte(st, f"{Q0}/outcome.json")
    # The old round is unknown on its own, but later commits imply it committed.
    assert committed_attempt(st, 0) is None
    assert latest_committed_round(st, start=0) == 3
    # A corrupt quorum behind a committed outcome: same rule.
    flip_byte(st, "rounds/00000001/0/quorum.json")
    assert latest_committed_round(st, start=0) == 3
    # The newest round's outcome is unreadable: nothing later vouches for it.
    flip_byte(st, "rounds/00000003/0/outcome.json")
    assert latest_committed_round(st, start=0) == 2
    # Stray names under rounds/<r>/ are skipped too.
    st.put("rounds/00000002/README", b"x")
    st.put("rounds/00000002/\u00b2/outcome.json", b"x")
    assert latest_committed_round(st, start=0) == 2
    # ... and the run goes on: round 3 is retried as attempt 1, and commits.
    res = ar.allreduce(3, torch.ones(8))
    assert res.committed and res.attempt == 1
    assert latest_committed_round(st, start=0) == 3
    ar.close()


def test_run_status_survives_a_corrupt_old_outcome(store_uri):
    st = Store(store_uri)
    ar = ObjectStoreAllReduce(st, 0, allreduce_config(1))
    for r in range(2):
        ar.allreduce(r, torch.ones(4))
    ar.close()
    flip_byte(st, f"{Q0}/outcome.json")
    st.put(f"{Q0}/outcome.json.bak", b"junk")
    assert latest_committed_round(st) + 1 == 2  # what `status` counts


def test_forged_committed_outcomes_are_not_commits(any_store_uri):
    st = Store(any_store_uri)
    out = run_round(any_store_uri, 2, min_replicas=2)
    assert all(res.committed for res, _ in out.values())
    # No quorum record at all, participants that differ from the quorum, a record for another attempt.
    st.create_json("rounds/00000005/0/outcome.json", {"round": 5, "attempt": 0, "committed": True,
                                                      "participants": [0, 1]})
    st.create_json("rounds/00000001/0/quorum.json", {"round": 1, "attempt": 0, "participants": [0, 1]})
    st.create_json("rounds/00000001/0/outcome.json", {"round": 1, "attempt": 0, "committed": True,
                                                      "participants": [0]})
    st.create_json("rounds/00000002/0/outcome.json", {"round": 2, "committed": True, "participants": [0, 1],
                                                      "attempt": 4})
    assert latest_committed_round(st, start=0) == 0
    assert latest_committed_round(st, start=1) == 0
    assert committed_attempt(st, 5) is None
    # Replicas reaching round 1 treat the forged attempt as aborted and commit the next one.
    out = run_round(any_store_uri, 2, round=1, min_replicas=2)
    for rank in (0, 1):
        assert_committed(*out[rank], ranks=[0, 1], attempt=1)
    assert latest_committed_round(st, start=0) == 1


# --------------------------------------------------------------------------- payload checks
class ForgingStore(Store):
    """Replaces a reduced slot in the bucket after its reducer wrote it (an attacker, or a bad disk).

    ``with_digest``: also create a matching digest record first (a consistent forgery).
    """

    def __init__(self, uri: str, *, slot: int, attempts: tuple[int, ...] = (0,), with_digest: bool = False) -> None:
        super().__init__(uri)
        self.slot, self.attempts, self.with_digest = slot, attempts, with_digest

    def put(self, key, payload, **kw):
        n = super().put(key, payload, **kw)
        for a in self.attempts:
            if key == f"rounds/00000000/{a}/reduced/{self.slot}":
                numel = wire.decode("fp32", payload).numel()
                forged = wire.encode("fp32", torch.full((numel,), 1e3))
                if self.with_digest:
                    honest = [float(torch.linalg.vector_norm(payload_slot(r, self.slot), dtype=torch.float64))
                              for r in range(3)]
                    Store(self.uri).create_json(f"{key}.json", {
                        "round": 0, "attempt": a, "slot": self.slot, "numel": numel, "crc32": zlib.crc32(forged),
                        "input_norms": honest, "by": 1})
                Store(self.uri).put(key, forged)
        return n

    def get(self, key, **kw):
        # The forged slot's own reducer never reads it back: let the others look first, so that
        # the test exercises the readers' check rather than a race with the reducer's commit.
        if "/reduced/" in key and any(key.startswith(f"rounds/00000000/{a}/") for a in self.attempts):
            prefix = key.split("/reduced/")[0]
            deadline = time.monotonic() + 20
            while not os.path.exists(self.path(f"{prefix}/outcome.json")) and time.monotonic() < deadline:
                time.sleep(0.02)
        return super().get(key, **kw)


def payload_slot(rank: int, slot: int, world: int = 3) -> torch.Tensor:
    s, e = (slot * NUMEL) // world, ((slot + 1) * NUMEL) // world
    return payload(rank, NUMEL)[s:e]


@pytest.mark.parametrize("with_digest", [False, True])
def test_forged_reduced_slot_is_not_applied_and_the_retry_commits_the_mean(store_uri, with_digest):
    forger = ForgingStore(store_uri, slot=1, with_digest=with_digest)
    out = run_round(store_uri, 3, stores={1: forger})
    for rank in range(3):
        res, x = out[rank]
        assert_committed(res, x, ranks=[0, 1, 2], attempt=1)
        assert x.abs().max() < 100  # the 1e3 values never reached anyone
    rec = outcome(store_uri)
    assert rec["committed"] is False and rec["check"] == "reduced" and "reduced slot 1" in rec["reason"]
    assert rec["excluded"] == []  # the culprit is unknown: nobody is left out of the retry


class WaitForOutcomeStore(Store):
    """A reader that fetches reduced slot ``slot`` only once the attempt has an outcome (a slow reader)."""

    def __init__(self, uri: str, *, slot: int) -> None:
        super().__init__(uri)
        self.slot = slot

    def get(self, key, **kw):
        if key == f"{Q0}/reduced/{self.slot}":
            deadline = time.monotonic() + 20
            while not os.path.exists(self.path(f"{Q0}/outcome.json")) and time.monotonic() < deadline:
                time.sleep(0.02)
        return super().get(key, **kw)


def test_a_reader_never_applies_a_slot_that_failed_its_checks_even_after_a_commit(store_uri):
    # The forged slot's reducer does not read its own slot back, so it commits first; the
    # readers that then meet the forged bytes do not apply them (they heal at the next sync).
    class Forger(ForgingStore):
        def get(self, key, **kw):
            return Store.get(self, key, **kw)

    stores = {1: Forger(store_uri, slot=1), 0: WaitForOutcomeStore(store_uri, slot=1),
              2: WaitForOutcomeStore(store_uri, slot=1)}
    out = run_round(store_uri, 3, stores=stores)
    assert_committed(*out[1], ranks=[0, 1, 2], attempt=0)
    for rank in (0, 2):
        res, x = out[rank]
        assert isinstance(res, RoundResult) and not res.committed and res.participated, res
        assert "after the round committed" in res.reason and "reduced slot 1" in res.reason
        torch.testing.assert_close(x, payload(rank, NUMEL), atol=0, rtol=0)  # untouched
    assert outcome(store_uri)["committed"] is True


def test_persistent_forgery_gives_up_after_max_attempts_without_killing_anyone(store_uri):
    forger = ForgingStore(store_uri, slot=1, attempts=(0, 1, 2, 3))
    out = run_round(store_uri, 3, stores={1: forger}, max_attempts=2)
    for rank in range(3):
        res, x = out[rank]
        assert isinstance(res, RoundResult) and not res.committed and res.attempts == 2, res
        torch.testing.assert_close(x, payload(rank, NUMEL), atol=0, rtol=0)  # untouched
    # The next sync starts a fresh block of attempts (here the forger is gone from attempt 4 on).
    forger.attempts = ()
    out = run_round(store_uri, 3, stores={1: forger}, max_attempts=2)
    for rank in range(3):
        assert_committed(*out[rank], ranks=[0, 1, 2], attempt=2)


class NaNUploadStore(Store):
    """A replica whose uploads are damaged after its own checks: NaN in every grad slot it writes."""

    def put(self, key, payload, **kw):
        if "/grad/" in key:
            x = wire.decode("fp32", payload)
            x[: max(1, x.numel() // 3)] = float("nan")
            payload = wire.encode("fp32", x)
        return super().put(key, payload, **kw)


@pytest.mark.parametrize("where", ["payload", "upload"])
def test_nan_pseudo_gradient_aborts_the_attempt_naming_the_rank(any_store_uri, where):
    bad = payload(2, NUMEL)
    if where == "payload":
        bad[17] = float("nan")
    out = run_round(any_store_uri, 3, payloads={2: bad} if where == "payload" else None,
                    stores={2: NaNUploadStore(any_store_uri)} if where == "upload" else None)
    for rank in (0, 1):
        assert_committed(*out[rank], ranks=[0, 1], attempt=1)
    res2, x2 = out[2]
    assert isinstance(res2, RoundResult) and not res2.committed and 2 in res2.excluded, res2
    assert "replica 2" in res2.reason
    rec = outcome(any_store_uri)
    assert rec["committed"] is False and rec["check"] == "nonfinite" and rec["excluded"] == [2]
    assert "replica 2" in rec["reason"] and "non-finite" in rec["reason"]
    quorum = Store(any_store_uri).get_json("rounds/00000000/1/quorum.json")
    assert quorum["participants"] == [0, 1] and quorum["excluded"] == [2]


def test_nan_with_too_few_left_aborts_the_round_for_the_next_sync(store_uri):
    bad = payload(1, NUMEL)
    bad[0] = float("inf")
    out = run_round(store_uri, 2, payloads={1: bad}, min_replicas=2)
    for rank in (0, 1):
        res, x = out[rank]
        assert isinstance(res, RoundResult) and not res.committed and res.attempts == 1, res
    torch.testing.assert_close(out[0][1], payload(0, NUMEL), atol=0, rtol=0)
    assert "replica 1" in outcome(store_uri)["reason"]


@pytest.mark.parametrize("factor", [10.0, None])
def test_outlier_norm_is_excluded_unless_the_check_is_off(store_uri, factor):
    big = payload(1, NUMEL) * 1000
    out = run_round(store_uri, 4, payloads={1: big}, outlier_factor=factor)
    if factor is None:
        res, x = out[0]
        assert res.committed and res.attempt == 0
        expected = torch.stack([payload(0, NUMEL), big, payload(2, NUMEL), payload(3, NUMEL)]).mean(0)
        torch.testing.assert_close(x, expected, atol=1e-3, rtol=1e-6)
        return
    for rank in (0, 2, 3):
        assert_committed(*out[rank], ranks=[0, 2, 3], attempt=1)
    rec = outcome(store_uri)
    assert rec["check"] == "outlier" and rec["excluded"] == [1] and "replica 1" in rec["reason"]
    assert "outlier_factor=10.0" in rec["reason"]


class MalformedUploadStore(Store):
    """Uploads well-framed bytes that are not a payload of the codec."""

    def put(self, key, payload, **kw):
        if key.endswith("/grad/0/1"):
            payload = wire.encode("bf16", wire.decode("fp32", payload))  # wrong codec for an fp32 run
        return super().put(key, payload, **kw)


def test_malformed_payload_is_excluded(store_uri):
    out = run_round(store_uri, 3, stores={0: MalformedUploadStore(store_uri)})
    for rank in (1, 2):
        assert_committed(*out[rank], ranks=[1, 2], attempt=1)
    rec = outcome(store_uri)
    assert rec["check"] == "malformed" and rec["excluded"] == [0] and "replica 0, slot 1" in rec["reason"]


def test_bit_flipped_payload_is_retried_with_everyone(store_uri):
    class FlipOnce(Store):
        done = False

        def put(self, key, payload, **kw):
            if key != f"{Q0}/grad/2/0" or FlipOnce.done:
                return super().put(key, payload, **kw)
            FlipOnce.done = True  # the object appears already damaged: no reader can see it intact first
            data = bytearray(frame(payload))
            data[HEADER_BYTES + 200] ^= 0x01
            self.backend.put(key, bytes(data), durable=False)
            return len(data)

    out = run_round(store_uri, 3, stores={2: FlipOnce(store_uri)})
    for rank in range(3):
        assert_committed(*out[rank], ranks=[0, 1, 2], attempt=1)
    rec = outcome(store_uri)
    assert rec["check"] == "corrupt" and rec["excluded"] == []


# --------------------------------------------------------------------------- a whole run on a junk-filled bucket
def _junk_kw(q, index, uri, rank, world):
    diloco_worker(q, index, uri, rank, world, rounds=4, sync_every=3)


def test_diloco_run_survives_junk_records_and_matches_plain_torch(store_uri):
    st = Store(store_uri)
    st.create(f"{Q0}/quorum.json", b"\xff not json")                               # current round, garbage
    st.put("rounds/00000001/0/join/README", b"hello")                                  # stray join object
    st.create_json("rounds/00000002/0/quorum.json", {"round": 2, "attempt": 0,
                                                     "participants": [0, 1, 2, 3]})  # future round, out of range
    st.create_json("rounds/00000003/0/outcome.json", {"round": 3, "attempt": 0, "committed": True,
                                                      "participants": [0, 1, 2]})  # forged
    world, rounds = 3, 4
    outs = run_processes(_junk_kw, [(store_uri, r, world) for r in range(world)], timeout=240)
    ref = reference_diloco(world, rounds=rounds, sync_every=3)
    for o in outs:
        assert "error" not in o, o.get("error")
        assert o["step"] == rounds
        assert [h[1] for h in o["history"]] == [True] * rounds
    for sync in range(rounds):
        for p in range(6):
            a = outs[0]["snapshots"][sync][p]
            for o in outs[1:]:
                assert np.array_equal(a, o["snapshots"][sync][p])
            np.testing.assert_allclose(a, ref[sync][p], atol=1e-6, rtol=0)
    for r, attempt in ((0, 1), (1, 0), (2, 1), (3, 1)):
        assert committed_attempt(st, r) == attempt, r
    assert latest_committed_round(st, start=0) == rounds - 1


def test_stray_attempt_directories_are_not_joined_and_cleanup_skips_stray_names(store_uri):
    from composer_cloud.sync.lockstep.rounds import cleanup_rounds

    st = Store(store_uri)
    st.put("rounds/00000000/5/join/0.json", b"{}")        # a far-ahead attempt nobody opened
    st.put("rounds/00000000/README", b"x")
    st.put("rounds/\u00b2\u00b2/0/grad/0/0", b"x")          # isdigit() but not int()-able
    out = run_round(store_uri, 2, min_replicas=2)
    for rank in (0, 1):
        assert_committed(*out[rank], ranks=[0, 1], attempt=0)
    assert cleanup_rounds(st, before=1) == 1
    assert not st.list(f"{Q0}/grad") and st.exists(f"{Q0}/outcome.json")


def test_damaged_outcome_of_a_round_the_run_has_left_is_not_rejoined(store_uri):
    from composer_cloud.sync.lockstep.allreduce import BehindError

    st = Store(store_uri)
    ar = ObjectStoreAllReduce(st, 0, allreduce_config(1))
    ar.allreduce(0, torch.ones(4))
    flip_byte(st, f"{Q0}/outcome.json")
    # Nobody has moved on yet: the damaged attempt counts as aborted and round 0 is retried.
    assert ar.open_attempt(0) == 1
    # A name under round 1 is no evidence (issue 33: any object there made replicas "behind" with nothing
    # to heal, forever); a verified record of round 1, which only a job that finished round 0 writes, is.
    st.put("rounds/00000001/0/join/0.json", b"{}")
    assert ar.open_attempt(0) == 1
    st.create_json("rounds/00000001/0/quorum.json", {"round": 1, "attempt": 0, "participants": [0]})
    with pytest.raises(BehindError):
        ar.open_attempt(0)
    ar.close()
