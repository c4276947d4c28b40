"""A loopback HTTP proxy in front of an S3 server, for injecting store faults at run time.

Clients (this process, or replica subprocesses through ``AWS_ENDPOINT_URL``)
talk to :attr:`StoreProxy.endpoint`; the test switches :meth:`StoreProxy.set_mode`
while they run::

    with StoreProxy(upstream=server.endpoint) as proxy:
        env["AWS_ENDPOINT_URL"] = proxy.endpoint
        ...
        proxy.set_mode("refuse", for_s=90)   # a 90 s outage, then back to "pass"

Modes:

* ``pass``: forward everything unchanged.
* ``strip-if-none-match``: drop ``If-None-Match`` from requests: a store that
  ignores write-once (two creates both succeed).
* ``refuse``: close the listening socket and every open connection, so new
  connections are refused (``ECONNREFUSED``): an outage. Leaving the mode
  listens on the same port again.
* ``reset``: accept, then reset each connection before answering.
* ``delay``: wait ``delay_s`` before forwarding each request.
* ``error``: answer every request ``503 SlowDown`` without forwarding.
* ``corrupt``: flip one byte in the middle of every non-empty successful GET response body.
* ``serve-partial``: a PUT of at least :data:`PARTIAL_MIN_BYTES` is held for ``delay_s`` before it is
  forwarded, and a GET of that key meanwhile is answered ``200`` with the first half of the body being
  written (a store that serves objects while they are written).
* ``drop-create-response``: a conditional create (``If-None-Match``) is forwarded, then its connection
  is reset before the answer: the object was written, the client never hears so (a lost response).

Requests the proxy changes are signed again (SigV4) with ``credentials``
(the tests' dummy ones by default), so an upstream that checks signatures
sees the fault, not a bad signature. The proxy is threads of the test
process; it starts and stops no process.
"""

from __future__ import annotations

import http.client
import logging
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger(__name__)

MODES = ("pass", "strip-if-none-match", "refuse", "reset", "delay", "error", "corrupt", "serve-partial",
         "drop-create-response")
#: Smallest PUT body that ``serve-partial`` holds and serves half of.
PARTIAL_MIN_BYTES = 1 << 20
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
               "expect"}
_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], proxy: "StoreProxy") -> None:
        self.proxy = proxy
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        logger.debug("storeproxy: " + format, *args)

    def setup(self) -> None:
        super().setup()
        self.server.proxy._track(self.connection, add=True)
        self._upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.proxy._track(self.connection, add=False)
            if self._upstream is not None:
                self._upstream.close()

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _proxy(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        mode = proxy.mode
        proxy.counts[mode] += 1
        if mode == "reset" or mode == "refuse":
            # SO_LINGER 0: close() sends RST, the client sees "connection reset by peer".
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if mode == "error":
            self._answer(503, {"Content-Type": "application/xml"}, _SLOWDOWN)
            return
        if mode == "delay":
            time.sleep(proxy.delay_s)
        target = self.path.split("?", 1)[0]
        if mode == "serve-partial" and self.command == "GET" and (partial := proxy._writing.get(target)):
            proxy.counts["served-partial"] += 1
            self._answer(200, {"Content-Type": "application/octet-stream"}, partial)
            return
        if mode == "serve-partial" and self.command == "PUT" and len(body) >= PARTIAL_MIN_BYTES:
            proxy._writing[target] = body[: len(body) // 2]
            try:
                time.sleep(proxy.delay_s)
                self._forward(proxy, mode, body)
            finally:
                proxy._writing.pop(target, None)
            return
        self._forward(proxy, mode, body)

    def _forward(self, proxy: "StoreProxy", mode: str, body: bytes) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
            headers["Content-Length"] = str(len(body))
        if mode == "strip-if-none-match":
            stripped = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
            if len(stripped) != len(headers):
                proxy.counts["stripped"] += 1
                headers = proxy._resign(self.command, self.path, stripped, body)
        try:
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
            self._upstream.request(self.command, self.path, body=body, headers=headers)
            resp = self._upstream.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            if self._upstream is not None:
                self._upstream.close()
                self._upstream = None
            self._answer(502, {"Content-Type": "text/plain"}, f"storeproxy: upstream failed: {exc}".encode())
            return
        proxy._log(self.command, self.path, resp.status, len(body), len(data))
        if mode == "drop-create-response" and any(k.lower() == "if-none-match" for k in headers) \
                and proxy.drops_left > 0:
            proxy.drops_left -= 1
            proxy.counts["dropped-create-response"] += 1
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        out_headers = {k: v for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP}
        if mode == "corrupt" and self.command == "GET" and data and 200 <= resp.status < 300:
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0xFF
            data = bytes(flipped)
            proxy.counts["corrupted"] += 1
        if self.command != "HEAD":
            out_headers = {k: v for k, v in out_headers.items() if k.lower() != "content-length"}
            out_headers["Content-Length"] = str(len(data))
        self._answer(resp.status, out_headers, data if self.command != "HEAD" else b"", reason=resp.reason)

    def _answer(self, status: int, headers: dict[str, str], body: bytes, reason: str | None = None) -> None:
        self.send_response(status, reason)
        for k, v in headers.items():
            self.send_header(k, v)
        if "content-length" not in {k.lower() for k in headers}:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)


@dataclass(frozen=True)
class ProxiedRequest:
    """One request the proxy forwarded: method, path with query, upstream status, body bytes each way."""

    method: str
    path: str
    status: int
    bytes_up: int
    bytes_down: int


class StoreProxy:
    """A fault-injecting HTTP proxy on a loopback port in front of ``upstream`` (``http://host:port``).

    Thread-safe; :meth:`set_mode` takes effect for the next request (and, for
    ``refuse``, drops the open connections at once). ``counts`` counts
    requests per mode, plus ``stripped`` headers and ``corrupted`` bodies.
    """

    def __init__(self, upstream: str, *, port: int = 0, credentials: tuple[str, str] = ("test", "test"),
                 region: str = "us-east-1") -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"StoreProxy(upstream=...) must be http://host:port, got {upstream!r}")
        self.upstream_host, self.upstream_port = parsed.hostname, parsed.port
        self.credentials = credentials
        self.region = region
        self.mode = "pass"
        self.delay_s = 0.0
        self.counts: Counter[str] = Counter()
        #: ``drop-create-response``: how many create responses are still to be dropped.
        self.drops_left = 1
        self._writing: dict[str, bytes] = {}  # serve-partial: path -> half of the body being written
        #: Every request forwarded upstream, in order: what a store bills (benchmarks/scale.py counts them).
        self.requests: list[ProxiedRequest] = []
        self._port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None

    # ------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint(self) -> str:
        """The URL clients use instead of the upstream's (``AWS_ENDPOINT_URL``)."""
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> "StoreProxy":
        with self._lock:
            self._listen()
        return self

    def stop(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._unlisten()

    def __enter__(self) -> "StoreProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ faults
    def set_mode(self, mode: str, *, delay_s: float | None = None, for_s: float | None = None) -> None:
        """Switch to ``mode`` (see the module doc); with ``for_s``, switch back to ``pass`` after that many seconds."""
        if mode not in MODES:
            raise ValueError(f"unknown StoreProxy mode {mode!r}; one of {', '.join(MODES)}")
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if delay_s is not None:
                self.delay_s = delay_s
            previous, self.mode = self.mode, mode
            if mode == "refuse" and previous != "refuse":
                self._unlisten()
            elif mode != "refuse" and previous == "refuse":
                self._listen()
            logger.info("storeproxy %s: mode %s -> %s%s", self.endpoint, previous, mode,
                        f" for {for_s:.1f}s" if for_s else "")
            if for_s is not None:
                self._timer = threading.Timer(for_s, self.set_mode, args=("pass",))
                self._timer.daemon = True
                self._timer.start()

    # ------------------------------------------------------------ internals
    def _resign(self, method: str, path: str, headers: dict[str, str], body: bytes) -> dict[str, str]:
        """SigV4-sign a request the proxy changed, with ``credentials``, as a client of this endpoint would.

        A store that checks signatures (SeaweedFS may) would otherwise refuse
        it for the missing signed header instead of showing the fault.
        """
        if not any(k.lower() == "authorization" for k in headers):
            return headers
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        drop = {"authorization", "x-amz-date", "x-amz-security-token"}
        kept = {k: v for k, v in headers.items() if k.lower() not in drop}
        host = next((v for k, v in kept.items() if k.lower() == "host"), f"127.0.0.1:{self._port}")
        request = AWSRequest(method=method, url=f"http://{host}{path}", data=body, headers=kept)
        S3SigV4Auth(Credentials(*self.credentials), "s3", self.region).add_auth(request)
        return dict(request.headers.items())

    def _listen(self) -> None:
        if self._server is not None:
            return
        deadline = time.monotonic() + 10
        while True:  # the old socket may linger briefly after close
            try:
                self._server = _Server(("127.0.0.1", self._port), self)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"storeproxy-{self._port}", daemon=True)
        self._thread.start()

    def _unlisten(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        for conn in list(self._conns):
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _log(self, method: str, path: str, status: int, bytes_up: int, bytes_down: int) -> None:
        with self._lock:
            self.requests.append(ProxiedRequest(method, path, status, bytes_up, bytes_down))

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)
