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


def test_a_sparse_gather_round_reads_each_object_once(s3_endpoint, tmp_path):
    """Per replica and round: the others' contributions and digests, the quorum and the outcome, one GET each."""
    from concurrent.futures import ThreadPoolExecutor

    from composer_cloud.sync import sparse
    from composer_cloud.sync.lockstep.gather import SparseGatherAllReduce
    from storeproxy import StoreProxy
    from workers import allreduce_config, payload

    world, rounds = 3, 2
    cfg = allreduce_config(world, min_replicas=world, codec="sparse", quorum_timeout_s=60, round_timeout_s=60)
    settings = sparse.SparseSettings(density=1 / 16, chunk=256)
    with StoreProxy(s3_endpoint) as proxy:
        uri = f"s3://cc-test/{tmp_path.name}"
        ars = [SparseGatherAllReduce(Store(uri, storage_options={"endpoint_url": proxy.endpoint}), r, cfg,
                                     settings=settings) for r in range(world)]
        proxy.requests.clear()
        with ThreadPoolExecutor(world) as pool:
            for round in range(rounds):
                flats = [payload(r + 10 * round, 3000) for r in range(world)]
                assert all(res.committed for res in pool.map(lambda i: ars[i].allreduce(round, flats[i]),
                                                              range(world)))
        reqs = list(proxy.requests)
        for ar in ars:
            ar.close()
    # 206: a record read with its kind's size limit is one ranged GET (storage/records/limits.py).
    gets = [r for r in reqs if r.method == "GET" and r.status in (200, 206) and "list-type" not in r.path]
    # The others' contributions and digests, the quorum and the outcome: one GET each. A refused create of the
    # quorum or outcome record is not settled by a read (the record is read next anyway).
    assert len(gets) == rounds * world * 2 * world, sorted(r.path for r in gets)  # 2W per replica per round
    assert not [r for r in reqs if r.method == "HEAD" and r.status == 200]
