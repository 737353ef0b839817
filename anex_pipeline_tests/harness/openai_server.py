"""A fake OpenAI-compatible server on loopback that records what it was sent, and engine requests for it."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from anex_pipeline.engine.base import EngineRequest

SERVED = "served-model"

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 2}}


class FakeServer:
    """An OpenAI-compatible server on loopback that records what it was sent."""

    def __init__(self, port: int = 0) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.attempts: Counter[str] = Counter()  # per row text
        self.received: dict[str, tuple[dict[str, str], dict[str, Any]]] = {}  # request id -> (headers, body)
        self.answered: dict[str, dict[str, Any]] = {}  # request id -> body sent back
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._reply(200, {"object": "list", "data": [{"id": SERVED, "object": "model"}]})

            counted = False  # whether this request is counted in server.in_flight

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    self.counted = True
                try:
                    self._answer(body)
                finally:
                    self._no_longer_in_flight()

            def _no_longer_in_flight(self) -> None:
                """Takes this request out of the count before its answer is sent: a client that has
                its answer may send the next request before this thread gets any further, and the
                two would then be counted in flight at once."""
                with server.lock:
                    if self.counted:
                        server.in_flight -= 1
                        self.counted = False

            def _answer(self, body: dict[str, Any]) -> None:
                text = body["messages"][-1]["content"] if "messages" in body else body.get("prompt", body.get("input"))
                rid = self.headers.get("X-Request-Id", "none")
                with server.lock:
                    server.attempts[text] += 1
                    attempt = server.attempts[text]
                    server.received[rid] = (dict(self.headers), body)
                if text == "bad":
                    error = {
                        "message": "temperature must be at least 0",
                        "type": "BadRequestError",
                        "param": "temperature",
                    }
                    return self._reply(400, {"error": {**error, "code": 400}})
                if text == "busy" and attempt == 1:
                    return self._reply(
                        429, {"error": {"message": "slow down", "type": "rate_limit"}}, {"Retry-After": "1"}
                    )
                if text == "down":
                    return self._reply(
                        503, {"error": {"message": "overloaded", "type": "ServiceUnavailable", "code": 503}}
                    )
                if text == "slow":
                    time.sleep(0.2)
                answer = self._completion(self.path, body, rid, text)
                server.answered[rid] = answer
                self._reply(200, answer)

            def _completion(self, path: str, body: dict[str, Any], rid: str, text: str) -> dict[str, Any]:
                head = {"created": 1700000000, "model": body["model"]}
                if path == "/v1/embeddings":
                    data = [{"index": 0, "object": "embedding", "embedding": [3.0, 4.0]}]
                    return {"id": f"embd-{rid}", "object": "list", **head, "data": data, "usage": USAGE}
                if path == "/v1/completions":
                    choice = {"index": 0, "text": f" {text}!", "logprobs": None, "finish_reason": "length"}
                    return {
                        "id": f"cmpl-{rid}",
                        "object": "text_completion",
                        **head,
                        "choices": [choice],
                        "usage": USAGE,
                    }
                message = {"role": "assistant", "content": f"echo: {text}", "reasoning_content": None, "tool_calls": []}
                choice = {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
                return {
                    "id": f"chatcmpl-{rid}",
                    "object": "chat.completion",
                    **head,
                    "choices": [choice],
                    "usage": USAGE,
                    "prompt_logprobs": None,
                }

            def _reply(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                self._no_longer_in_flight()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

        return Handler


def request(i: int, text: str, endpoint: str = "chat", **fields: Any) -> EngineRequest:
    body: dict[str, Any] = {
        "chat": {"messages": [{"role": "user", "content": text}]},
        "completions": {"prompt": text},
        "embeddings": {"input": text},
    }[endpoint]
    return EngineRequest(index=i, key=f"row-{i}", request_id=f"rid{i}", endpoint=endpoint, body=body, **fields)  # type: ignore[arg-type]
