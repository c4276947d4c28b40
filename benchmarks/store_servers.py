#!/usr/bin/env python
"""What the store costs on each real S3 server, and how it behaves when the server fails.

    python benchmarks/store_servers.py                      # moto and SeaweedFS on loopback
    python benchmarks/store_servers.py --servers seaweedfs --payload-mb 16 --json out.json

For each server (started on free loopback ports by ``tests/s3server.py``):

``startup_s``        start the server and create a bucket.
``probe_s``          one :func:`probe_store` (all properties, scratch cleanup).
``put_MBps``/``get_MBps``  ``Store.put``/``Store.get`` of ``--payload-mb`` (best of ``--repeats``).
``fail_fast_s``      a ``get`` through a proxy that refuses connections, ``outage_s=0``: how long a one-shot
                     command takes to give up (``StoreUnavailable``).
``fail_requests``    requests that reached a proxy answering ``503 SlowDown`` before the same ``get`` gave up
                     (one retry layer: equals ``RetryPolicy.attempts``).
``ride_out_s``       a ``get`` issued at the start of a ``--outage-s`` refused window with ``outage_s=600``:
                     time until it returned (>= the window; the excess is the backoff granularity).

Prints a table and writes the rows as JSON. No assertions: this measures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from s3server import s3_environ, s3_server  # noqa: E402
from storeproxy import StoreProxy  # noqa: E402

from composer_cloud.storage.conformance import probe_store  # noqa: E402
from composer_cloud.errors import StoreUnavailable  # noqa: E402
from composer_cloud.storage.store import Store  # noqa: E402
from composer_cloud.retry import RetryPolicy  # noqa: E402


def measure(kind: str, payload_mb: int, repeats: int, outage_s: float) -> dict:
    row: dict = {"server": kind}
    t0 = time.perf_counter()
    with s3_server(kind) as server, s3_environ(server):
        row["startup_s"] = time.perf_counter() - t0
        uri = f"s3://{server.bucket}/bench"
        t = time.perf_counter()
        report = probe_store(uri)
        row["probe_s"] = time.perf_counter() - t
        row["probe_failures"] = [c.name for c in report.failures()]
        st = Store(uri)
        payload = os.urandom(payload_mb * 2**20)
        puts, gets = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            st.put("obj", payload)
            puts.append(time.perf_counter() - t)
            t = time.perf_counter()
            st.get("obj")
            gets.append(time.perf_counter() - t)
        row["put_MBps"] = payload_mb / min(puts)
        row["get_MBps"] = payload_mb / min(gets)
        st.put("small", b"x")
        with StoreProxy(server.endpoint) as proxy:
            via = {"endpoint_url": proxy.endpoint}
            proxy.set_mode("refuse")
            t = time.perf_counter()
            try:
                Store(uri, storage_options=via).get("small")
            except StoreUnavailable:
                pass
            row["fail_fast_s"] = time.perf_counter() - t
            proxy.set_mode("error")
            try:
                Store(uri, storage_options=via).get("small")
            except StoreUnavailable:
                pass
            row["fail_requests"] = proxy.counts["error"]
            row["retry_attempts"] = RetryPolicy().attempts
            riding = Store(uri, storage_options=via, outage_s=600)
            proxy.set_mode("refuse", for_s=outage_s)
            t = time.perf_counter()
            riding.get("small")
            row["ride_out_s"] = time.perf_counter() - t
            row["outage_window_s"] = outage_s
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", nargs="+", default=["moto", "seaweedfs"])
    ap.add_argument("--payload-mb", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--outage-s", type=float, default=10.0)
    ap.add_argument("--json", default="store_servers.json")
    args = ap.parse_args()
    rows = [measure(kind, args.payload_mb, args.repeats, args.outage_s) for kind in args.servers]
    cols = ["server", "startup_s", "probe_s", "put_MBps", "get_MBps", "fail_fast_s", "fail_requests",
            "ride_out_s"]
    print(" | ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>13.2f}" if isinstance(r[c], float) else f"{r[c]!s:>13}" for c in cols))
    with open(args.json, "w") as f:
        json.dump({"payload_mb": args.payload_mb, "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
