"""The store against real S3-protocol servers on loopback: moto_server and SeaweedFS."""

from __future__ import annotations

import threading

import pytest
import torch

from composer_cloud.rendezvous.allreduce import AllReduceConfig, ObjectStoreAllReduce
from composer_cloud.rendezvous.store import ChecksumMismatch, Store, StoreConfigError


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
        results.append(st.create(f"quorum.json", f"w{i}".encode()))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(10)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(results) == [False] * 9 + [True]


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
    ar = ObjectStoreAllReduce(st, 0, AllReduceConfig(replicas=1, codec="bf16", quorum_timeout_s=5))
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
