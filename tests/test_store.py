"""The store's guarantees: atomic, verified, write-once, bounded waits."""

from __future__ import annotations

import threading
import time

import pytest

from composer_cloud.rendezvous.store import (
    ChecksumMismatch,
    ObjectNotFound,
    RetryPolicy,
    Store,
    StoreConfigError,
    StoreTimeout,
    frame,
    unframe,
)
from conftest import _CTX, run_processes


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


def test_no_pickle_in_the_sync_layer():
    import pathlib

    import composer_cloud.rendezvous as pkg

    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "torch.load" not in text, path
