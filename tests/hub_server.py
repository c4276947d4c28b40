"""A local stand-in for the Hugging Face Hub's upload endpoints: what ``HfApi.create_repo`` and ``upload_folder``
call, on loopback, files kept on disk (the real ``huggingface_hub`` client talks to it through ``endpoint=``).

Speaks: ``POST /api/repos/create``; ``POST /api/validate-yaml`` (a README's card metadata: accepted); ``POST /api/models/<ns>/<name>/preupload/<rev>`` (every file answered
``"regular"``, so the client inlines it in the commit: no LFS or Xet transfer to emulate); ``POST
/api/models/<ns>/<name>/commit/<rev>`` (NDJSON: a header, then base64 files), which writes the files under
``root/<ns>/<name>/``. Requests without ``Authorization: Bearer <token>`` get 401. Every request's headers are
recorded (``requests``) so a test can check what the client sent.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class HubServer:
    """``with HubServer(root, token="hf_x") as hub: HfApi(endpoint=hub.endpoint, token="hf_x")...``"""

    def __init__(self, root: Path, *, token: str) -> None:
        self.root, self.token = Path(root), token
        self.repos: dict[str, dict[str, Any]] = {}
        self.commits: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

            def _reply(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append(("POST", self.path, dict(self.headers)))
                if self.headers.get("Authorization") != f"Bearer {server.token}":
                    return self._reply(401, {"error": "Invalid credentials in Authorization header"})
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:3] == ["api", "repos", "create"]:
                    body = json.loads(raw)
                    repo = f"{body.get('organization') or 'tester'}/{body['name']}"
                    server.repos.setdefault(repo, {"private": body.get("private")})
                    return self._reply(200, {"url": f"{server.endpoint}/{repo}", "name": repo})
                if parts[:2] == ["api", "validate-yaml"]:  # a README.md's model card metadata
                    return self._reply(200, {"errors": [], "warnings": []})
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("preupload", "commit"):
                    repo = f"{parts[2]}/{parts[3]}"
                    if repo not in server.repos:
                        return self._reply(404, {"error": f"Repository {repo} not found"})
                    if parts[4] == "preupload":
                        files = json.loads(raw)["files"]
                        return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                            "shouldIgnore": False} for f in files]})
                    return self._commit(repo, raw)
                return self._reply(404, {"error": f"not served by the stand-in: {self.path}"})

            def _commit(self, repo: str, raw: bytes) -> None:
                lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
                header = next(x["value"] for x in lines if x["key"] == "header")
                written = []
                for x in lines:
                    if x["key"] == "file":
                        path = server.root / repo / x["value"]["path"]
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_bytes(base64.b64decode(x["value"]["content"]))
                        written.append(x["value"]["path"])
                oid = hashlib.sha1(raw).hexdigest()
                server.commits.append({"repo": repo, "summary": header.get("summary"), "files": written})
                return self._reply(200, {"success": True, "commitOid": oid,
                                         "commitUrl": f"{server.endpoint}/{repo}/commit/{oid}"})

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
