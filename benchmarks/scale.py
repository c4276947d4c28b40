#!/usr/bin/env python
"""Requests, bytes, dollars and seconds of one sync round through an object store, as replicas grow.

    python benchmarks/scale.py                      # the model: table of W x model x codec x exchange
    python benchmarks/scale.py --validate           # check today's protocol against a real S3 server's counts
    python benchmarks/scale.py --json out.json

The model (``round_cost``) counts, per replica and per round: requests by billing class (PUT-class: PUT,
POST, COPY and LIST; GET-class: GET and HEAD), bytes up and down, then prices them on S3, R2 and GCS and
times them at 1/5/25 Gbit/s per replica. Exchanges:

``scatter`` (the dense codecs' lock-step all-reduce, ``sync/lockstep/allreduce.py``)
    W slot uploads, the reduction of one slot, the gather of W reduced slots. Per replica: W + 5
    PUT-class, 3W - 1 GETs and ``(3 - 1/W) P`` bytes. With the sparse codec only the first hop is sparse:
    a reduced slot holds the union of W supports (exact sum).
``gather`` (``sync.codec = "sparse"``, ``sync/lockstep/gather.py``)
    every replica uploads its one compressed contribution and the digest of its mean, and reads the
    W - 1 others' of each: 5 PUT-class (join, quorum, contribution, digest, outcome), 2W GETs (the others'
    contributions and digests, quorum, outcome), ``W * P`` bytes (every reader sums the same bytes in
    rank order).

Reads: since phase B of issue 22 a read is one GET and a poll miss one GET 404 (``storage/backends.py``
reads s3fs objects in one stream); ``head_before_get=True`` models s3fs's default (a HEAD before every GET,
a HEAD 404 and a LIST per miss), what was measured before. Poll misses depend on timing: they are
measured (``--validate``), not modelled.
``two_level`` (``sync.sparse.exchange = "two_level"``, ``sync/lockstep/grouped.py``)
    groups of ``g = ceil(sqrt(W))`` (``m = max(1, W // g)`` groups); a group's first member reads its
    members' contributions, re-encodes their sum with the sparse codec (same size ``P``, the residual fed
    back into error feedback) and publishes it and its digest; everyone reads the ``m`` sums and digests.
    Per replica: 4 + 2m/W PUT-class (join, quorum, contribution, outcome; sum and digest for aggregators),
    2 + 2m + (W - m)/W GETs, ``P (1 + m/W)`` up and ``P (m + (W - m)/W)`` down.
``two_level_exact`` (modelled only, to show why the built one re-sparsifies)
    as ``two_level`` but the group sum is sent exactly (union of g supports: gap-coded positions and fp32
    values, or dense fp32 if smaller).

The union density of k sparse contributions is modelled as independent supports, ``1 - (1 - d)^k``, an
upper bound (replicas' top-k overlap; docs/sparse.md has the measured ratio).

Per-prefix request-rate floors (S3: 3,500 PUT-class and 5,500 GET-class requests per second per prefix):
a round cannot finish faster than its requests on its busiest prefix allow. ``prefix_floor_s(1)`` puts
every request of a round on one prefix (the issue's measure); ``layout_floor_s`` takes the busiest prefix
of the keys as ``storage/layout.py`` spells them (``prefix_loads``).

Validation (``--validate``): a moto server behind a counting loopback proxy (``tests/storeproxy.py``);
W = 2, 4, 8 replica processes run lock-step all-reduce rounds of a tiny model's parameter count through
``s3://`` (``--validate-exchange scatter``: ``ObjectStoreAllReduce``, fp32; ``gather``:
``SparseGatherAllReduce``; ``two_level``: ``GroupedSparseAllReduce`` with ``--validate-group-size``; both
with the spec's default sparse settings); the proxy's log gives requests by class and bytes per replica
per round, compared with the model. Quorum creates are counted apart: a replica that finds the quorum
decided does not try to create it, so their number (1 to W a round) depends on timing; the model counts
one per replica (an upper bound) and the check compares every other PUT exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------- prices
#: List prices in USD, read 2026-11-24 from the vendors' pages (standard storage class, first tier):
#: S3 us-east-1 https://aws.amazon.com/s3/pricing/ (PUT, COPY, POST, LIST $0.005 / 1,000; GET, SELECT and
#:   all other requests $0.0004 / 1,000; DELETE free; data transfer out to the internet $0.09 / GB for the
#:   first 10 TB a month; transfer to EC2 in the same region free);
#: R2 https://developers.cloudflare.com/r2/pricing/ (Class A, incl. ListObjects, $4.50 / million; Class B,
#:   incl. HeadObject, $0.36 / million; egress free);
#: GCS us-east1 https://cloud.google.com/storage/pricing (Class A, incl. object listings, $0.005 / 1,000;
#:   Class B $0.0004 / 1,000; internet egress to the Americas/EMEA $0.12 / GB, 0-1 TB tier).
PRICES: dict[str, dict[str, float]] = {
    "s3": {"put": 0.005e-3, "get": 0.0004e-3, "egress_gb": 0.09},
    "r2": {"put": 4.50e-6, "get": 0.36e-6, "egress_gb": 0.0},
    "gcs": {"put": 0.005e-3, "get": 0.0004e-3, "egress_gb": 0.12},
}
#: S3's documented per-prefix request rates:
#: https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html
S3_PUT_PER_PREFIX_S, S3_GET_PER_PREFIX_S = 3500.0, 5500.0
MODELS = {"0.5B": 0.5e9, "1.5B": 1.5e9, "8B": 8.0e9}
BANDWIDTHS_GBIT = (1.0, 5.0, 25.0)


@dataclass(frozen=True)
class SparseShape:
    density: float = 1 / 64
    chunk: int = 4096
    value_bits: int = 2


def payload_bytes(codec: str, n: float, sparse: SparseShape = SparseShape()) -> float:
    """Encoded bytes of one replica's full pseudo-gradient of ``n`` parameters (headers ignored)."""
    if codec == "fp32":
        return 4 * n
    if codec == "bf16":
        return 2 * n
    if codec == "int8":
        return n + 4 * math.ceil(n / 512)
    if codec == "sparse":
        return sparse_bytes(n, sparse.density, sparse)
    raise ValueError(f"unknown codec {codec!r}")


def sparse_bytes(n: float, density: float, shape: SparseShape) -> float:
    """Bytes of a sparse payload at ``density``: Rice-coded gaps (~r + 2 bits), values, 2 B per level per chunk."""
    k = max(1.0, density * shape.chunk)
    r = max(0, int(math.log2(shape.chunk / k)))
    per_value_bits = r + 2 + shape.value_bits
    return n * density * per_value_bits / 8 + 2 * (n / shape.chunk) * 2 ** (shape.value_bits - 1)


def sum_bytes(n: float, density: float) -> float:
    """Exact partial sum of union density ``density``: gap-coded positions and fp32 values, or dense fp32."""
    r = max(0, int(math.log2(1 / density))) if density < 1 else 0
    return min(4 * n, n * density * (32 + r + 2) / 8)


@dataclass(frozen=True)
class RoundCost:
    """Per replica and per round (averaged over replicas where roles differ)."""

    exchange: str
    codec: str
    world: int
    params: float
    put: float  # PUT-class requests (PUT, POST, COPY, LIST)
    get: float  # GET-class requests (GET and HEAD)
    up: float  # bytes
    down: float
    round_puts: float  # PUT-class requests of the whole round (all replicas)
    round_gets: float
    layout_floor_s: float = 0.0  # the busiest prefix's floor with the keys as laid out (prefix_loads)

    def dollars(self, store: str, *, egress: bool) -> float:
        """The whole round's bill (all replicas)."""
        p = PRICES[store]
        egress_cost = p["egress_gb"] * self.down * self.world / 1e9 if egress else 0.0
        return self.round_puts * p["put"] + self.round_gets * p["get"] + egress_cost

    def seconds(self, gbit: float) -> float:
        """Transfer time of one replica at ``gbit`` Gbit/s (up and down share the link, as measured)."""
        return (self.up + self.down) * 8 / (gbit * 1e9)

    def prefix_floor_s(self, prefixes: int = 1) -> float:
        """Lower bound of a round's time from S3's per-prefix request rates (keys spread evenly)."""
        return (self.round_puts / S3_PUT_PER_PREFIX_S + self.round_gets / S3_GET_PER_PREFIX_S) / prefixes


def groups_of(world: int, group_size: int | None = None) -> int:
    """Groups of the two-level exchange (``grouped.groups_of``): ``max(1, W // g)``, ``g = ceil(sqrt(W))``."""
    return max(1, world // (group_size or math.ceil(math.sqrt(world))))


def prefix_loads(exchange: str, world: int, *, group_size: int | None = None) -> list[tuple[str, float, float]]:
    """``(prefix, PUT-class, GET-class)`` of a round's busiest prefix of each kind (the keys of layout.py).

    Every exchange: ``join/`` (W joins), the attempt's root (quorum and outcome: W creates and W reads
    each). ``scatter``: ``reduced/`` holds W slots and W digests, each read by W - 1 replicas.
    ``gather``: contributions over ``S = ceil(W / 32)`` prefixes, each read by W - 1 replicas;
    ``sparse/ack/``: W digests, each read by W - 1. ``two_level``: contributions over S prefixes, each
    read once (by its aggregator); one ``sparse/g<i>/`` per group: its sum and digest, read by all W.
    """
    w = world
    common = [("join/", w, 0.0), ("<attempt>/", 2 * w, 2 * w)]
    shards = math.ceil(w / 32)
    if exchange == "scatter":
        return common + [("reduced/", 2 * w, 2 * w * (w - 1)), ("grad/<rank>/", w, w - 1)]
    if exchange == "gather":
        return common + [("sparse/<s>/", math.ceil(w / shards), math.ceil(w / shards) * (w - 1)),
                         ("sparse/ack/", w, w * (w - 1))]
    if exchange in ("two_level", "two_level_exact"):
        return common + [("sparse/<s>/", math.ceil(w / shards), math.ceil(w / shards)), ("sparse/g<i>/", 2, 2 * w)]
    raise ValueError(f"unknown exchange {exchange!r}")


def layout_floor(exchange: str, world: int, *, group_size: int | None = None, heads: bool = False) -> float:
    """Seconds of the busiest prefix's requests at S3's per-prefix rates (``prefix_loads``)."""
    return max(put / S3_PUT_PER_PREFIX_S + get * (2 if heads else 1) / S3_GET_PER_PREFIX_S
               for _, put, get in prefix_loads(exchange, world, group_size=group_size))


def round_cost(exchange: str, codec: str, world: int, params: float, *, sparse: SparseShape = SparseShape(),
               head_before_get: bool | None = None, poll_lists: float = 0.0,
               group_size: int | None = None) -> RoundCost:
    """The request/byte model of one round (see the module docstring).

    ``head_before_get``: s3fs's default reads (a HEAD before every GET), as before issue 22's phase B;
    ``poll_lists`` adds LIST requests per replica (one listing per wait).
    """
    w = world
    p = payload_bytes(codec, params, sparse)
    heads = bool(head_before_get)
    if exchange == "scatter":
        # A sparse first hop still reduces to a slot of union density 1 - (1 - d)^W (sent losslessly).
        red = sum_bytes(params, 1 - (1 - sparse.density) ** w) if codec == "sparse" else p
        put, get, up, down = w + 5, 3 * w - 1, p + red / w, (p + red) * (w - 1) / w
    elif exchange == "gather":
        put, get, up, down = 5, 2 * w, p, p * (w - 1)
    elif exchange in ("two_level", "two_level_exact"):
        m = groups_of(w, group_size)
        if exchange == "two_level_exact":
            g = w / m
            s = sum_bytes(params, 1 - (1 - sparse.density) ** g) if codec == "sparse" else payload_bytes("fp32", params)
        else:
            s = p  # the group sum is re-encoded by the codec: one payload's size
        aggregators = m / w  # fraction of replicas that aggregate a group
        put = 4 + 2 * aggregators  # join, quorum, contribution, outcome; the sum and its digest
        get = 2 + 2 * m + (w - m) / w  # quorum, outcome, m sums and digests; aggregators read their members
        up = p + aggregators * s
        down = m * s + (w - m) / w * p
    else:
        raise ValueError(f"unknown exchange {exchange!r}")
    get_total = get * (2 if heads else 1)
    put += poll_lists
    return RoundCost(exchange, codec, w, params, put, get_total, up, down, put * w, get_total * w,
                     layout_floor(exchange, w, group_size=group_size, heads=heads))


# --------------------------------------------------------------------------- tables
def model_rows(worlds: list[int], sparse: SparseShape) -> list[dict[str, Any]]:
    rows = []
    plans = [("scatter", c) for c in ("fp32", "bf16", "int8", "sparse")] + \
            [(x, "sparse") for x in ("gather", "two_level_exact", "two_level")]
    for model, n in MODELS.items():
        for w in worlds:
            for exchange, codec in plans:
                c = round_cost(exchange, codec, w, n, sparse=sparse)
                rows.append({"model": model, **asdict(c),
                             **{f"usd_{s}": c.dollars(s, egress=True) for s in PRICES},
                             "usd_s3_no_egress": c.dollars("s3", egress=False),
                             **{f"t_{int(b)}gbit_s": c.seconds(b) for b in BANDWIDTHS_GBIT},
                             "prefix_floor_s": c.prefix_floor_s(1), "layout_floor_s": c.layout_floor_s})
    return rows


def crossovers(n: float, sparse: SparseShape) -> dict[str, Any]:
    """Smallest W (2..4096) where one exchange stops beating another (bytes per replica unless named)."""
    def first(pred) -> int | None:
        return next((w for w in range(2, 4097) if pred(w)), None)

    def cost(ex: str, codec: str, w: int) -> RoundCost:
        return round_cost(ex, codec, w, n, sparse=sparse)

    def total(ex: str, codec: str, w: int) -> float:
        c = cost(ex, codec, w)
        return c.up + c.down

    def flips(a: tuple[str, str], cmp: str, b: tuple[str, str], factor: float = 1.0) -> int | None:
        if cmp == ">":
            return first(lambda w: total(*a, w) > factor * total(*b, w))
        return first(lambda w: total(*a, w) < factor * total(*b, w))

    gather, two, exact = ("gather", "sparse"), ("two_level", "sparse"), ("two_level_exact", "sparse")
    return {
        "gather_sparse_worse_than_scatter_bf16": flips(gather, ">", ("scatter", "bf16")),
        "gather_sparse_worse_than_scatter_fp32": flips(gather, ">", ("scatter", "fp32")),
        "two_level_beats_gather": flips(two, "<", gather),
        "two_level_halves_gather": flips(two, "<", gather, 0.5),
        "two_level_cheaper_on_s3_with_egress": first(
            lambda w: cost(*two, w).dollars("s3", egress=True) < cost(*gather, w).dollars("s3", egress=True)),
        "two_level_worse_than_scatter_bf16": flips(two, ">", ("scatter", "bf16")),
        "two_level_exact_worse_than_scatter_bf16": flips(exact, ">", ("scatter", "bf16")),
        "two_level_exact_beats_gather": flips(exact, "<", gather),
        "gather_layout_floor_over_10s": first(lambda w: cost(*gather, w).layout_floor_s > 10),  # "auto" switches
        "two_level_layout_floor_over_10s": first(lambda w: cost(*two, w).layout_floor_s > 10),
    }


def prefixes_for(c: RoundCost, budget_s: float) -> int:
    """Prefixes the round's keys must spread over for the rate floor to stay under ``budget_s``."""
    return max(1, math.ceil(c.prefix_floor_s(1) / budget_s))


def targets(sparse: SparseShape) -> dict[str, float]:
    """Issue 22's targets: S3 $ (with egress) of the sparse exchange vs bf16 scatter at W = 64 and 1.5B
    (<= 1/20), and the largest prefix floor at W = 1024 with the keys as laid out (<= 10 s)."""
    n = MODELS["1.5B"]
    bf16 = round_cost("scatter", "bf16", 64, n).dollars("s3", egress=True)
    return {"w64_1.5B_two_level_over_bf16_scatter_s3_egress":
            round_cost("two_level", "sparse", 64, n, sparse=sparse).dollars("s3", egress=True) / bf16,
            "w64_1.5B_gather_over_bf16_scatter_s3_egress":
            round_cost("gather", "sparse", 64, n, sparse=sparse).dollars("s3", egress=True) / bf16,
            "w1024_two_level_layout_floor_s": round_cost("two_level", "sparse", 1024, n, sparse=sparse).layout_floor_s}


def print_model(rows: list[dict[str, Any]], models: list[str], worlds: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="one round, per replica (requests, bytes) and for the whole round ($, prefix floor)")
    for col in ("model", "W", "exchange", "codec", "PUT-cl", "GET-cl", "up", "down", "S3 $", "S3 $ no egr",
                "R2 $", "GCS $", "t@1G", "t@5G", "t@25G", "floor 1 prefix", "floor layout"):
        t.add_column(col, justify="left" if col in ("model", "exchange", "codec") else "right")
    for r in rows:
        if r["model"] in models and r["world"] in worlds:
            t.add_row(r["model"], str(r["world"]), r["exchange"], r["codec"], f"{r['put']:.0f}", f"{r['get']:.0f}",
                      _b(r["up"]), _b(r["down"]), f"{r['usd_s3']:.3g}", f"{r['usd_s3_no_egress']:.3g}",
                      f"{r['usd_r2']:.3g}", f"{r['usd_gcs']:.3g}", f"{r['t_1gbit_s']:.3g}", f"{r['t_5gbit_s']:.3g}",
                      f"{r['t_25gbit_s']:.3g}", f"{r['prefix_floor_s']:.3g}", f"{r['layout_floor_s']:.3g}")
    Console(width=200).print(t)


def _b(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return str(n)


def markdown(rows: list[dict[str, Any]], models: list[str], worlds: list[int]) -> str:
    """The docs/scale.md table: one line per (model, W, exchange, codec)."""
    out = ["| model | W | exchange | codec | PUT-class | GET-class | up | down | S3 $ | S3 $ in-region | R2 $ | "
           "GCS $ | t @ 1 / 5 / 25 Gbit/s | prefix floor: 1 prefix / as laid out |", "|" + "---|" * 14]
    for r in rows:
        if r["model"] in models and r["world"] in worlds:
            out.append(f"| {r['model']} | {r['world']} | {r['exchange']} | {r['codec']} | {r['put']:.0f} | "
                       f"{r['get']:.0f} | {_b(r['up'])} | {_b(r['down'])} | {r['usd_s3']:.3g} | "
                       f"{r['usd_s3_no_egress']:.3g} | {r['usd_r2']:.3g} | {r['usd_gcs']:.3g} | "
                       f"{r['t_1gbit_s']:.3g} / {r['t_5gbit_s']:.3g} / {r['t_25gbit_s']:.3g} s | "
                       f"{r['prefix_floor_s']:.3g} / {r['layout_floor_s']:.3g} s |")
    return "\n".join(out)


# --------------------------------------------------------------------------- validation
def classify(method: str, path: str) -> str:
    """Billing class of one S3 request: put, list, get, head or delete."""
    query = path.split("?", 1)[1] if "?" in path else ""
    if method in ("PUT", "POST"):
        return "put"
    if method == "DELETE":
        return "delete"
    if method == "HEAD":
        return "head"
    if method == "GET" and ("list-type=" in query or "prefix=" in query or "delimiter=" in query):
        return "list"
    return "get"


def _replica(endpoint: str, uri: str, rank: int, world: int, numel: int, rounds: int, exchange: str,
             q: Any, group_size: int | None = None) -> None:
    try:
        os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                           "AWS_DEFAULT_REGION": "us-east-1"})
        import torch

        from composer_cloud.retry import PollPolicy
        from composer_cloud.spec import spec_from_dict
        from composer_cloud.storage.store import Store
        from composer_cloud.sync.lockstep.allreduce import AllReduceConfig, ObjectStoreAllReduce
        from composer_cloud.sync.lockstep.grouped import sparse_allreduce
        from composer_cloud.sync.sparse import settings_of

        torch.set_num_threads(1)
        store = Store(uri, poll=PollPolicy(initial_s=0.02, max_s=0.2))
        spec = spec_from_dict({"replicas": world, "min_replicas": world,
                               "sync": {"codec": "fp32" if exchange == "scatter" else "sparse", "io_threads": 4,
                                        "quorum_timeout_s": 120, "round_timeout_s": 120}})
        config = AllReduceConfig.from_spec(spec)
        ar = ObjectStoreAllReduce(store, rank, config) if exchange == "scatter" else \
            sparse_allreduce(store, rank, config, settings=settings_of(spec), exchange=exchange, group_size=group_size)
        payload = 0
        for r in range(rounds):
            flat = torch.randn(numel, generator=torch.Generator().manual_seed(rank * 1000 + r))
            res = ar.allreduce(r, flat)
            if not res.committed:
                raise RuntimeError(f"round {r} not committed: {res.reason}")
            payload = res.payload_bytes
        ar.close()
        q.put((rank, {"payload": payload}))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": repr(exc)}))


def validate(worlds: list[int], numel: int, rounds: int, exchange: str = "scatter",
             group_size: int | None = None) -> list[dict[str, Any]]:
    import multiprocessing as mp

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from s3server import moto_s3_server
    from storeproxy import StoreProxy

    out = []
    ctx = mp.get_context("spawn")
    with moto_s3_server() as server, StoreProxy(upstream=server.endpoint) as proxy:
        for w in worlds:
            uri = f"s3://{server.bucket}/scale-{exchange}-w{w}-{int(time.time())}"
            proxy.requests.clear()
            q = ctx.Queue()
            procs = [ctx.Process(target=_replica, args=(proxy.endpoint, uri, r, w, numel, rounds, exchange, q,
                                                        group_size)) for r in range(w)]
            t0 = time.monotonic()
            for p in procs:
                p.start()
            reports = dict(q.get(timeout=600) for _ in procs)
            for p in procs:
                p.join(timeout=30)
            errors = {r: v["error"] for r, v in reports.items() if "error" in v}
            if errors:
                raise RuntimeError(f"W={w}: replicas failed: {errors}")
            reqs = list(proxy.requests)
            per = w * rounds
            counts: dict[str, float] = {}
            for cls in ("put", "list", "get", "head", "delete"):
                counts[cls] = sum(1 for x in reqs if classify(x.method, x.path) == cls) / per
            misses = {cls: sum(1 for x in reqs if classify(x.method, x.path) == cls and x.status == 404) / per
                      for cls in ("get", "head")}
            up = sum(x.bytes_up for x in reqs) / per
            down = sum(x.bytes_down for x in reqs if x.method == "GET" and classify(x.method, x.path) == "get") / per
            # Payload objects (slots, reduced slots, sparse contributions) vs records (JSON) and 404 bodies.
            is_payload = lambda x: x.status == 200 and not x.path.split("?")[0].endswith(".json")  # noqa: E731
            payload_up = sum(x.bytes_up for x in reqs if x.method == "PUT" and is_payload(x)) / per
            payload_down = sum(x.bytes_down for x in reqs if classify(x.method, x.path) == "get" and is_payload(x)) / per
            payload = reports[0]["payload"]
            # Requests only (bytes from the measured payload; a group sum is one payload's size too).
            model = round_cost(exchange, "fp32", w, numel, group_size=group_size)
            m = groups_of(w, group_size)
            # two_level: P + (m/W) P up, m P + (W - m)/W P down, per replica: (m + 2) P.
            model_bytes = {"scatter": 3 - 1 / w, "gather": w}.get(exchange, m + 2) * payload
            object_gets = counts["get"] - misses["get"]
            # Quorum creates depend on timing (1 to W a round): counted apart; every other PUT is modelled exactly.
            quorum_puts = sum(1 for x in reqs if x.method == "PUT" and x.path.split("?")[0].endswith("quorum.json"))
            puts_excl_quorum = counts["put"] - quorum_puts / per
            out.append({
                "exchange": exchange, "world": w, "rounds": rounds, "numel": numel, "payload_bytes": payload,
                "wall_s": time.monotonic() - t0, "requests": len(reqs), "measured": counts, "misses_404": misses,
                "model_put": model.put, "measured_put_excl_list": counts["put"],
                "model_get": model.get, "measured_get_200": object_gets,
                "measured_head_200": counts["head"] - misses["head"],
                "get_class_per_replica": counts["get"] + counts["head"],
                "model_bytes": model_bytes, "measured_bytes_up": up, "measured_bytes_down": down,
                "measured_payload_bytes": payload_up + payload_down,
                "measured_record_bytes": up + down - payload_up - payload_down,
                "bytes_ratio_measured_vs_model": (up + down) / model_bytes,
                "measured_quorum_creates_per_round": quorum_puts / rounds,
                "model_put_excl_quorum": model.put - 1, "measured_put_excl_quorum": puts_excl_quorum,
                "put_error_pct": 100 * (counts["put"] / model.put - 1),
                "put_excl_quorum_error_pct": 100 * (puts_excl_quorum / (model.put - 1) - 1),
                "get_error_pct": 100 * (object_gets / model.get - 1),
                "payload_bytes_error_pct": 100 * ((payload_up + payload_down) / model_bytes - 1),
                "bytes_error_pct": 100 * ((up + down) / model_bytes - 1),
            })
            print(json.dumps(out[-1], indent=None), flush=True)
    return out


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--density", type=float, default=1 / 64, help="sparse codec density (top-k / chunk)")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--value-bits", type=int, default=2)
    p.add_argument("--print-models", nargs="+", default=["1.5B"], choices=sorted(MODELS))
    p.add_argument("--markdown", action="store_true", help="print the table as markdown (docs/scale.md)")
    p.add_argument("--validate", action="store_true", help="measure today's protocol on a moto server")
    p.add_argument("--validate-worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--validate-numel", type=int, default=115_968, help="parameters (the tiny benchmark model's)")
    p.add_argument("--validate-rounds", type=int, default=3)
    p.add_argument("--validate-exchange", choices=["scatter", "gather", "two_level"], default="scatter",
                   help="scatter: fp32 ObjectStoreAllReduce; gather / two_level: the sparse codec's exchanges")
    p.add_argument("--validate-group-size", type=int, default=None, help="two_level: members per group")
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "out", "scale.json"))
    a = p.parse_args(argv)
    shape = SparseShape(density=a.density, chunk=a.chunk, value_bits=a.value_bits)
    doc: dict[str, Any] = {"prices": PRICES, "prices_read": "2026-11-24", "sparse": asdict(shape)}
    if a.validate:
        doc["validation"] = validate(a.validate_worlds, a.validate_numel, a.validate_rounds, a.validate_exchange,
                                     a.validate_group_size)
    rows = model_rows(a.worlds, shape)
    doc["rows"] = rows
    doc["crossovers"] = {m: crossovers(n, shape) for m, n in MODELS.items()}
    doc["targets"] = targets(shape)
    doc["prefixes_for_10s"] = {f"{m}/W={w}/{ex}": prefixes_for(round_cost(ex, "sparse", w, n, sparse=shape), 10.0)
                               for m, n in MODELS.items() for w in a.worlds
                               for ex in ("gather", "two_level_exact", "two_level")}
    if a.markdown:
        print(markdown(rows, a.print_models, a.worlds))
    else:
        print_model(rows, a.print_models, a.worlds)
    print(json.dumps({"crossovers (1.5B)": doc["crossovers"]["1.5B"], "targets": doc["targets"]}, indent=1))
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
