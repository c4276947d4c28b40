"""Store URIs per store kind, pointing a test at one of the session's S3 servers, and a backend that counts
its calls."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest


def store_uri_for(kind: str, tmp_path: Path) -> str:
    """A fresh store for one test: ``file://<tmp>/store``, or a prefix of the ``cc-test`` bucket for S3 kinds.

    ``kind`` is ``file``, or ``s3``/``moto``/``seaweedfs`` (which server answers is set by the ``AWS_*``
    environment, see :func:`use_s3_server`).
    """
    if kind == "file":
        return f"file://{tmp_path}/store"
    if kind in ("s3", "moto", "seaweedfs"):
        return f"s3://cc-test/{tmp_path.name}"
    raise ValueError(f"unknown store kind {kind!r}")


def use_s3_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Point this test (and the processes it starts) at the session's ``kind`` server (``moto``/``seaweedfs``)."""
    server = request.getfixturevalue(f"s3_server_{kind}")
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)


class CountingBackend:
    """The store's backend, counting LISTs per folder and GETs per key (a HEAD counts as a GET)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lists: Counter[str] = Counter()
        self.gets: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def children(self, prefix: str) -> list[str]:
        self.lists[prefix] += 1
        return self.inner.children(prefix)

    def find(self, prefix: str) -> list[str]:
        self.lists[prefix] += 1
        return self.inner.find(prefix)

    def read(self, key: str, limit: int | None = None) -> bytes:
        self.gets[key] += 1
        return self.inner.read(key, limit)

    def exists(self, key: str) -> bool:
        self.gets[key] += 1
        return self.inner.exists(key)
