"""The store against real S3-protocol servers on loopback: moto_server and SeaweedFS."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from composer_cloud.sync.lockstep.allreduce import ObjectStoreAllReduce
from composer_cloud.errors import ChecksumMismatch, SignatureMismatch, StoreConfigError, StoreUnavailable
from composer_cloud.storage.store import Store
from composer_cloud.retry import RetryPolicy
from storeproxy import StoreProxy
from workers import allreduce_config


def test_s3_put_get_create_list(s3_store):
    st = Store(f"s3://{s3_store.bucket}/unit")
    st.put("a/b", b"payload")
    assert bytes(st.get("a/b")) == b"payload"
    assert st.create_json("a/once.json", {"v": 1})
    assert not st.create_json("a/once.json", {"v": 2})  # If-None-Match: * -> 412
    assert st.get_json("a/once.json") == {"v": 1}
    assert st.list("a") == ["a/b", "a/once.json"]
    assert st.list_dirs("") == ["a"]
    st.delete("a", recursive=True)
    assert st.list("a") == []


def test_s3_racing_writers_exactly_one_wins(s3_store):
    st = Store(f"s3://{s3_store.bucket}/race")
    results: list[bool] = []
    barrier = threading.Barrier(10)

    def go(i: int) -> None:
        barrier.wait()
        results.append(st.create("quorum.json", f"w{i}".encode()))

    # Daemon threads joined with a deadline: a server that stops answering fails this test instead of hanging the
    # worker (seen once: seaweedfs answered 500s, then held ten racing conditional PUTs open for minutes).
    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(10)]
    [t.start() for t in threads]
    deadline = time.monotonic() + 240
    [t.join(timeout=max(0.0, deadline - time.monotonic())) for t in threads]
    assert not any(t.is_alive() for t in threads), f"{s3_store.kind}: racing creates still unanswered after 240 s"
    assert sorted(results) == [False] * 9 + [True]


@pytest.mark.parametrize("serialised", [False, True], ids=["moto-as-shipped", "atomic_writes"])
def test_the_test_moto_server_decides_racing_creates_once(serialised, monkeypatch):
    """moto checks ``If-None-Match: *`` and stores the object in two steps; :func:`s3server.atomic_writes` makes
    the pair atomic, as on real S3. The gap is widened here (a slow key lookup) so that the race is certain."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError
    from moto.s3.models import S3Backend
    from werkzeug.serving import make_server

    from s3server import S3_ENV, moto_app

    lookup = S3Backend.get_object

    def slow_lookup(self, *args, **kwargs):
        found = lookup(self, *args, **kwargs)
        time.sleep(0.2)
        return found

    monkeypatch.setattr(S3Backend, "get_object", slow_lookup)
    server = make_server("127.0.0.1", 0, moto_app(serialised=serialised), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{server.port}", region_name="us-east-1",
                          aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                          config=Config(max_pool_connections=8, retries={"max_attempts": 1}))
        bucket = f"race-{serialised}".lower()  # moto's backends live on in this process: one bucket per case
        s3.create_bucket(Bucket=bucket)
        barrier = threading.Barrier(8)
        won: list[int] = []

        def create(i: int) -> None:
            barrier.wait()
            try:
                s3.put_object(Bucket=bucket, Key="quorum.json", Body=f"w{i}".encode(), IfNoneMatch="*")
                won.append(i)
            except ClientError as exc:
                assert exc.response["Error"]["Code"] == "PreconditionFailed"

        threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        stored = s3.get_object(Bucket=bucket, Key="quorum.json")["Body"].read()
    finally:
        server.shutdown()
    if serialised:
        assert len(won) == 1 and stored == f"w{won[0]}".encode()
    else:
        assert len(won) > 1, "moto now decides conditional creates atomically: atomic_writes may be dropped"


def test_s3_corrupt_object_is_detected(s3_store):
    import boto3

    st = Store(f"s3://{s3_store.bucket}/corrupt")
    st.put("x", b"0123456789" * 100)
    s3 = boto3.client("s3", endpoint_url=s3_store.endpoint, region_name="us-east-1")
    raw = bytearray(s3.get_object(Bucket=s3_store.bucket, Key="corrupt/x")["Body"].read())
    raw[100] ^= 0xFF
    s3.put_object(Bucket=s3_store.bucket, Key="corrupt/x", Body=bytes(raw))
    with pytest.raises(ChecksumMismatch, match="corrupt/x|x is corrupt"):
        st.get("x")


def test_s3_allreduce_single_process_rounds(s3_store):
    st = Store(f"s3://{s3_store.bucket}/ar")
    ar = ObjectStoreAllReduce(st, 0, allreduce_config(1, codec="bf16", quorum_timeout_s=5))
    x = torch.arange(100, dtype=torch.float32)
    res = ar.allreduce(0, x)
    assert res.committed and torch.allclose(x, torch.arange(100, dtype=torch.float32), rtol=2**-8)
    ar.close()


def test_missing_bucket_is_a_clear_error(s3_store):
    with pytest.raises(StoreConfigError, match="no-such-bucket"):
        Store("s3://no-such-bucket/runs").check_access()


def test_unreachable_endpoint_is_a_clear_error(s3_store, monkeypatch):
    # moto accepts any key unless auth is enforced; an endpoint that refuses connections stands in
    # for unreachable/invalid configuration and must name the store, not hang.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    with pytest.raises(StoreConfigError, match="cannot reach store s3://cc-test/runs at http://127.0.0.1:1"):
        Store("s3://cc-test/runs").check_access()


# ---------------------------------------------------------------- faults through a loopback proxy
def _via(proxy: StoreProxy, bucket: str, prefix: str, **kw) -> Store:
    return Store(f"s3://{bucket}/{prefix}", storage_options={"endpoint_url": proxy.endpoint}, **kw)


def test_a_store_rides_out_a_refused_connection_window(s3_store, caplog):
    with StoreProxy(s3_store.endpoint) as proxy:
        st = _via(proxy, s3_store.bucket, "outage", outage_s=120, retry=RetryPolicy(base_s=0.05, cap_s=0.5))
        st.put("before", b"1")
        proxy.set_mode("refuse", for_s=3)
        with caplog.at_level("WARNING", logger="composer_cloud.retry"):
            results: dict[str, object] = {}
            threads = [threading.Thread(target=lambda: results.__setitem__("get", bytes(st.get("before")))),
                       threading.Thread(target=lambda: results.__setitem__("create", st.create("rec", b"r"))),
                       threading.Thread(target=lambda: results.__setitem__("put", st.put("after", b"2")))]
            [t.start() for t in threads]
            [t.join(timeout=120) for t in threads]
        assert proxy.mode == "pass"
        assert results == {"get": b"1", "create": True, "put": 16 + 1}
        assert bytes(st.get("rec")) == b"r" and bytes(st.get("after")) == b"2"
    messages = [r.getMessage() for r in caplog.records if "s3://cc-test/outage" in r.getMessage()]
    assert len(messages) == 2, messages  # once when it started, once when it ended, for all three threads
    assert "retrying for up to 120s" in messages[0] and "reachable again" in messages[1]


def test_slowdown_answers_are_retried_by_one_layer_only(s3_store):
    with StoreProxy(s3_store.endpoint) as proxy:
        st = _via(proxy, s3_store.bucket, "slow", retry=RetryPolicy(attempts=4, base_s=0.01, cap_s=0.05))
        st.put("k", b"v")
        proxy.set_mode("error")
        with pytest.raises(StoreUnavailable, match="Service Unavailable|SlowDown|reduce your request rate"):
            st.get("k")
        # 4 attempts by our RetryPolicy; s3fs and botocore add none (they would multiply it).
        assert proxy.counts["error"] == 4
        proxy.set_mode("error", for_s=0.5)
        assert bytes(_via(proxy, s3_store.bucket, "slow", outage_s=60).get("k")) == b"v"


def test_an_outage_without_budget_fails_in_bounded_attempts_naming_the_store(s3_store):
    with StoreProxy(s3_store.endpoint) as proxy:
        proxy.set_mode("refuse")
        st = _via(proxy, s3_store.bucket, "down", retry=RetryPolicy(attempts=3, base_s=0.01, cap_s=0.05))
        with pytest.raises(StoreConfigError, match=f"cannot reach store s3://cc-test/down at {proxy.endpoint}"):
            st.check_access()
        with pytest.raises(StoreUnavailable, match="store s3://cc-test/down unavailable: get anything") as err:
            st.get("anything")
        assert type(err.value.__cause__).__name__ == "EndpointConnectionError"


def test_a_response_corrupted_in_transit_is_read_again_then_reported(s3_store):
    with StoreProxy(s3_store.endpoint) as proxy:
        st = _via(proxy, s3_store.bucket, "transit")
        st.put("obj", b"0123456789" * 100)
        proxy.set_mode("corrupt")
        with pytest.raises(ChecksumMismatch, match="obj"):
            st.get("obj")
        assert proxy.counts["corrupted"] == 2  # one re-read, then the error
        proxy.set_mode("pass")
        assert bytes(st.get("obj")) == b"0123456789" * 100


def test_signed_objects_on_s3(s3_store):
    key = b"r" * 32
    signed = Store(f"s3://{s3_store.bucket}/signed", signing_key=key)
    assert signed.create_json("q.json", {"ranks": [0, 1]})
    assert not signed.create_json("q.json", {"ranks": [0]})
    assert signed.get_json("q.json") == {"ranks": [0, 1]}
    Store(f"s3://{s3_store.bucket}/signed").put_json("forged.json", {"ranks": [7]})
    with pytest.raises(SignatureMismatch, match="forged.json"):
        signed.get_json("forged.json")


def test_a_replica_process_rides_out_an_outage_through_the_proxy(s3_store, tmp_path):
    """The proxy serves other processes (AWS_ENDPOINT_URL), as replicas reach it in end-to-end tests."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "reader.py"
    script.write_text(
        "import sys\n"
        "from composer_cloud.storage.store import Store\n"
        "from composer_cloud.retry import RetryPolicy\n"
        "st = Store(sys.argv[1], outage_s=60, retry=RetryPolicy(base_s=0.05, cap_s=0.5))\n"
        "open(sys.argv[2], 'w').close()\n"  # ready: the test starts the outage now
        "import time; time.sleep(1)\n"
        "print(st.get_json('spec.json')['v'], st.create_json('rec.json', {'by': 'child'}))\n")
    with StoreProxy(s3_store.endpoint) as proxy:
        uri = f"s3://{s3_store.bucket}/child"
        Store(uri).put_json("spec.json", {"v": 7})
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint}
        ready = tmp_path / "ready"
        child = subprocess.Popen([sys.executable, str(script), uri, str(ready)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            proxy.set_mode("refuse", for_s=4)
            out, err = child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
    assert child.returncode == 0, err
    assert out.split() == ["7", "True"]
    assert "reachable again" in err
    assert Store(uri).get_json("rec.json") == {"by": "child"}


def test_a_create_whose_response_was_lost_is_settled_by_the_stored_bytes(s3_store):
    """The PUT reached the store, its answer did not; the retry gets 412. The stored bytes decide."""
    with StoreProxy(s3_store.endpoint) as proxy:
        store = _via(proxy, s3_store.bucket, "lost-create", outage_s=10)
        proxy.set_mode("drop-create-response")
        proxy.drops_left = 1
        assert store.create("mine", b"payload of this writer")  # it was this writer's create
        assert proxy.counts["dropped-create-response"] == 1
        assert bytes(store.get("mine")) == b"payload of this writer"
        # Another writer's object: a lost answer to a refused create is still a loss.
        Store(f"s3://{s3_store.bucket}/lost-create").create("theirs", b"the other writer's payload")
        proxy.drops_left = 1
        assert not store.create("theirs", b"payload of this writer")
        assert proxy.counts["dropped-create-response"] == 2
        assert bytes(store.get("theirs")) == b"the other writer's payload"
        # Records (JSON) settle the same way: a launch's spec.json, a decoupled contribution's meta.
        proxy.drops_left = 1
        assert store.create_json("spec.json", {"run_id": "r"})
        assert proxy.counts["dropped-create-response"] == 3


def test_a_replica_that_starts_during_an_outage_rides_it_out_from_its_first_store_access(s3_store):
    """Replica.__init__ reads the run before it knows the spec's budget: that read rides out an outage too."""
    from composer_cloud.env import JobEnv
    from composer_cloud.hooks import NO_HOOKS
    from composer_cloud.replica.runtime import Replica
    from composer_cloud.spec import spec_from_dict

    uri = f"s3://{s3_store.bucket}/starting"
    Store(f"{uri}/r").put_json("spec.json", spec_from_dict({"run_id": "r", "store": uri, "replicas": 2,
                                                            "sync": {"store_outage_s": 120}}).to_json_dict())
    with StoreProxy(s3_store.endpoint) as proxy:
        proxy.set_mode("refuse", for_s=4)  # the store is down when the replica starts
        replica = Replica(f"{uri}/r", 1, job_env=JobEnv(store_options={"endpoint_url": proxy.endpoint}),
                          hooks=NO_HOOKS)
        assert proxy.mode == "pass"  # it waited the outage out instead of failing in a second
    assert replica.rank == 1 and replica.opened.store.outage_s == 120
