"""The store's guarantees: atomic, verified, write-once, bounded waits."""

from __future__ import annotations

import threading
import time

import pytest

from composer_cloud import env
from composer_cloud.errors import (
    ChecksumMismatch,
    ObjectNotFound,
    RunKeyError,
    SignatureMismatch,
    StoreConfigError,
    StoreTimeout,
)
from composer_cloud.retry import Outage, RetryPolicy, is_transient
from composer_cloud.storage.backends import LocalBackend, is_precondition_failed
from composer_cloud.storage.framing import derive_signing_key, frame, run_key_bytes, unframe
from composer_cloud.storage.store import Store
from support.processes import run_processes


def test_put_get_roundtrip_and_counters(store_uri):
    st = Store(store_uri)
    payload = bytes(range(256)) * 10
    written = st.put("a/b/obj", payload)
    assert bytes(st.get("a/b/obj")) == payload
    assert st.bytes_written == written == len(payload) + 16
    assert st.bytes_read == written
    assert st.list("a") == ["a/b/obj"]
    assert st.list_dirs("a") == ["b"]
    st.delete("a", recursive=True)
    assert st.list("a") == []
    with pytest.raises(ObjectNotFound, match="a/b/obj"):
        st.get("a/b/obj")


def test_flipped_byte_raises_checksum_mismatch_naming_key(store_uri, tmp_path):
    st = Store(store_uri)
    st.put("rounds/1/grad/0/0", b"x" * 1000)
    path = tmp_path / "store" / "rounds/1/grad/0/0"
    raw = bytearray(path.read_bytes())
    raw[500] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatch) as err:
        st.get("rounds/1/grad/0/0")
    assert err.value.key == "rounds/1/grad/0/0"
    assert "rounds/1/grad/0/0" in str(err.value)


def test_truncated_and_foreign_objects_are_rejected():
    framed = frame(b"hello world")
    with pytest.raises(ChecksumMismatch, match="length"):
        unframe("k", framed[:-1])
    with pytest.raises(ChecksumMismatch, match="not a composer-cloud object"):
        unframe("k", b"PK\x03\x04" + framed[4:])
    assert bytes(unframe("k", framed)) == b"hello world"


def _racer(q, i, uri, barrier_path):
    st = Store(uri)
    # Spin until the start file exists, so that all writers race together.
    import os

    while not os.path.exists(barrier_path):
        time.sleep(0.001)
    won = st.create("rounds/0/0/quorum.json", f"writer-{i}".encode())
    q.put((i, won))


def test_ten_racing_writers_of_a_write_once_record(store_uri, tmp_path):
    barrier = str(tmp_path / "go")
    results = []
    holder = threading.Thread(target=lambda: results.extend(
        run_processes(_racer, [(store_uri, barrier)] * 10, timeout=60)))
    holder.start()
    time.sleep(1.5)
    open(barrier, "w").close()
    holder.join()
    assert sorted(results) == [False] * 9 + [True]
    winner = results.index(True)
    assert bytes(Store(store_uri).get("rounds/0/0/quorum.json")) == f"writer-{winner}".encode()


def test_create_does_not_overwrite(store_uri):
    st = Store(store_uri)
    assert st.create_json("commit.json", {"v": 1})
    assert not st.create_json("commit.json", {"v": 2})
    assert st.get_json("commit.json") == {"v": 1}


def test_wait_get_has_a_deadline(store_uri):
    st = Store(store_uri)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="never"):
        st.wait_get("never", deadline=time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 2.0

    threading.Timer(0.2, lambda: st.put("later", b"ok")).start()
    assert bytes(st.wait_get("later", deadline=time.monotonic() + 5)) == b"ok"


def test_transient_errors_are_retried_then_surface():
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionResetError("reset")
        return "ok"

    assert RetryPolicy(attempts=5, base_s=0.001).call("x", flaky) == "ok"
    assert calls["n"] == 3

    def always():
        raise OSError(16, "SlowDown")  # EBUSY, as s3fs maps S3 SlowDown / 503

    with pytest.raises(OSError):
        RetryPolicy(attempts=3, base_s=0.001).call("x", always)

    perm = {"n": 0}

    def denied():
        perm["n"] += 1
        raise PermissionError("denied")

    with pytest.raises(PermissionError):
        RetryPolicy(attempts=5, base_s=0.001).call("x", denied)
    assert perm["n"] == 1  # not retried


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", ""])
def test_bad_keys_rejected(store_uri, key):
    with pytest.raises(ValueError, match="invalid store key"):
        Store(store_uri).put(key, b"")


@pytest.mark.parametrize("uri", ["nope://bucket/x", "relative/path"])
def test_bad_uris_rejected(uri):
    with pytest.raises(StoreConfigError):
        Store(uri)


def test_no_pickle_in_the_storage_and_sync_layers():
    import pathlib

    import composer_cloud

    root = pathlib.Path(composer_cloud.__file__).parent
    paths = [*(root / "storage").rglob("*.py"), *(root / "sync").rglob("*.py")]
    assert len(paths) > 10
    for path in paths:
        text = path.read_text()
        assert "import pickle" not in text and "torch.load" not in text, path


# ---------------------------------------------------------------- retry classification and outage budget
def _client_error(status: int, code: str, condition: str | None = None):
    from botocore.exceptions import ClientError

    error = {"Code": code, "Message": "m"}
    if condition:
        error["Condition"] = condition
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def test_a_412_means_exists_whatever_the_body_says():
    from s3fs.errors import translate_boto_error


    # AWS and moto name the condition: s3fs gives FileExistsError. SeaweedFS does not: s3fs gives EINVAL.
    aws = translate_boto_error(_client_error(412, "PreconditionFailed", "If-None-Match"))
    seaweed = translate_boto_error(_client_error(412, "PreconditionFailed"))
    bare = translate_boto_error(_client_error(412, "412"))  # a 412 with no XML body at all
    assert isinstance(aws, FileExistsError)
    assert type(seaweed) is OSError and seaweed.errno == 22
    for exc in (aws, seaweed, bare):
        assert is_precondition_failed(exc) and not is_transient(exc)
    assert not is_precondition_failed(translate_boto_error(_client_error(400, "InvalidArgument")))


@pytest.mark.parametrize("status,code,transient", [
    (503, "SlowDown", True), (500, "InternalError", True), (502, "502", True), (429, "TooManyRequests", True),
    (409, "ConditionalRequestConflict", True), (403, "AccessDenied", False), (404, "NoSuchKey", False),
    (400, "InvalidArgument", False), (501, "NotImplemented", False), (412, "PreconditionFailed", False),
])
def test_s3_answers_are_classified_by_status_not_errno(status, code, transient):
    from s3fs.errors import translate_boto_error

    assert is_transient(translate_boto_error(_client_error(status, code))) is transient


def test_connection_errors_are_transient():
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(ConnectTimeoutError(endpoint_url="http://x"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert is_transient(ConnectionRefusedError()) and is_transient(TimeoutError())
    assert not is_transient(ValueError("bad")) and not is_transient(ObjectNotFound("k"))


def test_the_outage_budget_keeps_retrying_past_attempts_then_gives_up():
    calls = {"n": 0}

    def down():
        calls["n"] += 1
        raise ConnectionRefusedError("refused")

    with pytest.raises(ConnectionRefusedError):
        RetryPolicy(attempts=2, base_s=0.001, cap_s=0.01).call("x", down)
    assert calls["n"] == 2  # no budget: attempts bound the calls
    calls["n"] = 0
    with pytest.raises(ConnectionRefusedError):
        RetryPolicy(attempts=2, base_s=0.001, cap_s=0.01, budget_s=0.3).call("x", down)
    assert calls["n"] > 5  # kept going until the budget was spent

    state = {"n": 0}

    def back_after_10():
        state["n"] += 1
        if state["n"] <= 10:
            raise ConnectionResetError("reset")
        return "ok"

    assert RetryPolicy(attempts=2, base_s=0.001, cap_s=0.01, budget_s=30).call("x", back_after_10) == "ok"
    assert state["n"] == 11


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_bad_outage_budgets_are_rejected(store_uri, bad):
    with pytest.raises(ValueError, match="outage_s"):
        Store(store_uri, outage_s=bad)
    with pytest.raises(ValueError, match="budget_s"):
        RetryPolicy(budget_s=bad)


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(caplog):
    outage = Outage("store s3://b/p", budget_s=60)
    policy = RetryPolicy(attempts=2, base_s=0.001, cap_s=0.005, budget_s=60)
    left = {"n": 20}

    def flaky():
        if left["n"] > 0:
            left["n"] -= 1
            raise ConnectionRefusedError("refused")
        return 1

    with caplog.at_level("DEBUG", logger="composer_cloud.retry"):
        threads = [threading.Thread(target=policy.call, args=("get k", flaky), kwargs={"outage": outage})
                   for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings
    assert "retrying for up to 60s" in warnings[0] and "reachable again" in warnings[1]
    assert "(20 transient errors)" in warnings[1]
    assert outage.since is None


def test_a_create_whose_response_was_lost_still_knows_it_won(store_uri, monkeypatch):
    st = Store(store_uri, retry=RetryPolicy(base_s=0.001))
    real = LocalBackend._write
    lost = {"n": 1}

    def put_then_lose_the_answer(self, path, data, **kw):
        real(self, path, data, **kw)
        if lost["n"]:
            lost["n"] -= 1
            raise ConnectionResetError("the response was lost")

    monkeypatch.setattr(LocalBackend, "_write", put_then_lose_the_answer)
    assert st.create("quorum.json", b"mine")  # the retry finds our own bytes: we won
    lost["n"] = 1
    assert not st.create("quorum.json", b"someone else's")  # the retry finds other bytes: we lost
    assert bytes(st.get("quorum.json")) == b"mine"

    from botocore.exceptions import ReadTimeoutError  # not an OSError: the response timed out after the PUT

    def put_then_time_out(self, path, data, **kw):
        real(self, path, data, **kw)
        if lost["n"]:
            lost["n"] -= 1
            raise ReadTimeoutError(endpoint_url="http://store")

    monkeypatch.setattr(LocalBackend, "_write", put_then_time_out)
    lost["n"] = 1
    assert st.create("commit.json", b"mine")


# ---------------------------------------------------------------- signed objects
KEY = b"k" * 32


def test_signed_objects_round_trip_and_unsigned_or_moved_ones_are_rejected(store_uri, tmp_path):
    signed = Store(store_uri, signing_key=KEY)
    plain = Store(store_uri)
    signed.put_json("rounds/1/commit.json", {"ok": True})
    assert signed.get_json("rounds/1/commit.json") == {"ok": True}
    assert plain.get_json("rounds/1/commit.json") == {"ok": True}  # no key: crc only

    plain.put_json("rounds/2/commit.json", {"ok": True})  # a bucket writer without the key
    with pytest.raises(SignatureMismatch, match="rounds/2/commit.json.*unsigned"):
        signed.get("rounds/2/commit.json")

    root = tmp_path / "store"
    (root / "rounds/3").mkdir(parents=True)
    (root / "rounds/3/commit.json").write_bytes((root / "rounds/1/commit.json").read_bytes())  # replayed
    with pytest.raises(SignatureMismatch, match="rounds/3/commit.json.*HMAC"):
        signed.get("rounds/3/commit.json")
    with pytest.raises(SignatureMismatch):
        Store(store_uri, signing_key=b"x" * 32).get("rounds/1/commit.json")
    assert isinstance(SignatureMismatch("k", "r"), ChecksumMismatch)

    assert signed.create_json("rounds/4/quorum.json", {"r": [0, 1]})
    assert not signed.create_json("rounds/4/quorum.json", {"r": [0]})
    raw = bytearray((root / "rounds/4/quorum.json").read_bytes())
    raw[-2] ^= 0x01
    (root / "rounds/4/quorum.json").write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatch, match="rounds/4/quorum.json"):
        signed.get("rounds/4/quorum.json")


def test_the_hf_bootstrap_reads_both_frames_it_may_find(tmp_path):
    """The HF Jobs bootstrap unframes the staged wheel before composer-cloud is installed, with its own copy."""
    from composer_cloud.images import hf_bootstrap

    payload = b"PK\x03\x04 a wheel"
    for data in (frame(payload), frame(payload, key="executor/wheel/x.whl", signing_key=KEY)):
        assert hf_bootstrap._unframe("file:///wheel", data) == payload
    with pytest.raises(SystemExit):
        hf_bootstrap._unframe("file:///wheel", frame(payload)[:-1])


def test_the_run_key_comes_from_the_environment_and_is_never_echoed(store_uri):
    assert env.run_key({}) is None and env.run_key({"COMPOSER_CLOUD_RUN_KEY": ""}) is None
    assert run_key_bytes(env.run_key({"COMPOSER_CLOUD_RUN_KEY": "s3cr3t-" * 4})) == ("s3cr3t-" * 4).encode()
    with pytest.raises(RunKeyError, match="COMPOSER_CLOUD_RUN_KEY is too short") as err:
        run_key_bytes("hunter2")
    assert "hunter2" not in str(err.value)
    st = Store(store_uri, signing_key=b"hunter2-hunter2-hunter2")
    assert "hunter2" not in repr(st) and "signed=True" in repr(st)
    assert derive_signing_key(KEY, "run-a") != derive_signing_key(KEY, "run-b")
    assert len(derive_signing_key(KEY, "run-a")) == 32
