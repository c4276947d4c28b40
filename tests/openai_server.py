"""A local OpenAI-compatible server for tests: tiny transformers models behind /v1/chat/completions and
/v1/completions on loopback, plus endpoints that misbehave (slow, garbage). No network.

    with OpenAIServer({"tiny": GreedyModel(model, tok), "slow": Slow(2.0), "junk": Garbage()}) as server:
        OpenAI(base_url=server.url, api_key="x").chat.completions.create(model="tiny", messages=[...])

``keys`` maps a model to the only API key it accepts (401 otherwise). ``served`` records, per model, the
usage of every answer it returned, so a test can recompute the cost its client reports.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch

Answer = tuple[str, int, int]  # text, prompt tokens, completion tokens


class GreedyModel:
    """Greedy decoding of a (tiny) causal LM; the prompt is the chat messages' contents joined by newlines."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        self._lock = threading.Lock()

    def __call__(self, prompt: str, max_tokens: int) -> Answer:
        ids = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with self._lock, torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
        new = out[0, ids.size(1):]
        return self.tokenizer.decode(new, skip_special_tokens=True), ids.size(1), new.numel()


class Slow:
    """Answers after ``delay_s`` seconds (longer than the client's timeout: a hung endpoint)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, prompt: str, max_tokens: int) -> Answer:
        time.sleep(self.delay_s)
        return "late", 1, 1


class Garbage:
    """HTTP 200 whose body is not JSON (a broken proxy, an HTML error page)."""


class OpenAIServer:
    def __init__(self, models: dict[str, Callable[[str, int], Answer] | Garbage],
                 keys: dict[str, str] | None = None) -> None:
        self.models, self.keys = models, dict(keys or {})
        self.served: dict[str, list[tuple[int, int]]] = {name: [] for name in models}
        self.authorizations: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                server.authorizations.append(self.headers.get("Authorization", ""))
                name = body.get("model")
                model = server.models.get(name)
                if model is None:
                    return self._json(404, {"error": {"message": f"model {name!r} not found"}})
                if name in server.keys and self.headers.get("Authorization") != f"Bearer {server.keys[name]}":
                    return self._json(401, {"error": {"message": "invalid api key"}})
                if isinstance(model, Garbage):
                    return self._raw(200, b"<html><body>upstream error</body></html>")
                chat = self.path.endswith("/chat/completions")
                prompt = "\n".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
                text, n_in, n_out = model(prompt, int(body.get("max_tokens") or 16))
                server.served[name].append((n_in, n_out))
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                          if chat else {"index": 0, "text": text, "finish_reason": "length"})
                self._json(200, {"id": "cmpl-test", "object": "chat.completion" if chat else "text_completion",
                                 "created": int(time.time()), "model": name, "choices": [choice],
                                 "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                           "total_tokens": n_in + n_out}})

            def _json(self, code: int, obj: Any) -> None:
                self._raw(code, json.dumps(obj).encode())

            def _raw(self, code: int, data: bytes) -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "OpenAIServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
