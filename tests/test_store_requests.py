"""Billed requests of the store's read and poll paths, counted by a loopback proxy in front of moto."""

from __future__ import annotations

from composer_cloud.storage.store import Store


def test_a_read_is_one_get_and_a_miss_one_get_404(s3_endpoint, tmp_path):
    from storeproxy import StoreProxy

    with StoreProxy(s3_endpoint) as proxy:
        store = Store(f"s3://cc-test/{tmp_path.name}", storage_options={"endpoint_url": proxy.endpoint})
        store.put("a/b", b"x" * 100)
        proxy.requests.clear()
        assert bytes(store.get("a/b")) == b"x" * 100
        assert store.try_get("a/missing") is None
        assert store.try_get_json("a/missing.json") is None
        assert store.exists("a/b") and not store.exists("a/missing.json")
        seen = [(r.method, r.status) for r in proxy.requests]
    # s3fs alone sends HEAD + GET for a read and HEAD 404 + LIST for a miss (docs/scale.md).
    assert seen == [("GET", 200), ("GET", 404), ("GET", 404), ("HEAD", 200), ("HEAD", 404)], seen
