"""A stand-in for ``vllm serve`` behind the machine's model server, for fast tests of the
supervisor, the state and the signals: it answers ``/health``, ``/metrics`` (busy while the file
named by ``--busy-file`` exists) and ``/v1/models`` behind ``VLLM_API_KEY`` as vLLM does, and
starts a child of its own that, like vLLM's engine process, outlives it unless someone ends it.

    python fake_model_server.py --port PORT --busy-file PATH
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--busy-file", type=Path, required=True)
    args = parser.parse_args()
    token = os.environ.get("VLLM_API_KEY")
    # The engine process's stand-in: a grandchild of the supervisor, beyond its death signal.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.DEVNULL)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, b"")
            elif self.path == "/metrics":
                running = 1 if args.busy_file.exists() else 0
                self._answer(200, f'vllm:num_requests_running{{engine="0"}} {running}.0\n'.encode())
            elif self.path == "/v1/models":
                if token and self.headers.get("Authorization") != f"Bearer {token}":
                    self._answer(401, json.dumps({"error": "Unauthorized"}).encode())
                else:
                    self._answer(200, json.dumps({"object": "list", "data": [{"id": "fake"}]}).encode())
            else:
                self._answer(404, b"")

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
