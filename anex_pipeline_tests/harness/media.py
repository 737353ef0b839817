"""Media for tests: real PNG and WAV bytes, a loopback media server, and chat rows that refer to them."""

from __future__ import annotations

import contextlib
import io
import struct
import threading
import time
import wave
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import dagster as dg

from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import MediaOptions


def png_bytes(seed: int, side: int = 8) -> bytes:
    """A real PNG: side x side pixels of one colour that depends on the seed."""
    pixel = bytes([seed % 256, seed * 7 % 256, seed * 13 % 256])
    raw = b"".join(b"\x00" + pixel * side for _ in range(side))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def wav_bytes() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"".join(struct.pack("<h", (i % 40 - 20) * 800) for i in range(800)))
    return out.getvalue()


def tone_wav(hz: int, rate: int = 16000, seconds: float = 0.5) -> bytes:
    """A real 16-bit mono WAV of a square wave at ``hz`` (rounded to whole samples per cycle)."""
    period = max(2, rate // hz)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(
            b"".join(struct.pack("<h", 8000 if i % period < period // 2 else -8000) for i in range(int(rate * seconds)))
        )
    return out.getvalue()


MP4 = struct.pack(">I", 24) + b"ftypisom" + struct.pack(">I", 512) + b"isomiso2"

WAV = wav_bytes()


def image_for(path: str) -> bytes:
    return png_bytes(zlib.crc32(path.encode()))


class MediaServer:
    """A threaded HTTP server on loopback serving test media; counts requests per path."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()  # body bytes written per path
        self.active = 0  # /slow/ requests in progress
        self.peak = 0  # the most /slow/ requests in progress at once
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer._handle(self)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def total_hits(self) -> int:
        return sum(self.hits.values())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(req.path)
        with self.lock:
            self.hits[parts.path] += 1
            count = self.hits[parts.path]
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client stopped reading
            self._route(req, parts.path, {k: v[0] for k, v in parse_qs(parts.query).items()}, count)

    def _send(
        self,
        req: BaseHTTPRequestHandler,
        status: int,
        body: bytes = b"",
        ctype: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        req.send_response(status)
        if ctype:
            req.send_header("Content-Type", ctype)
        for name, value in (headers or {}).items():
            req.send_header(name, value)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)
        with self.lock:
            self.sent[req.path.split("?")[0]] += len(body)

    def _stream(self, req: BaseHTTPRequestHandler, path: str, chunk: bytes, pause: float, limit: int) -> None:
        while self.sent[path] < limit:
            req.wfile.write(chunk)
            req.wfile.flush()
            with self.lock:
                self.sent[path] += len(chunk)
            time.sleep(pause)

    def _route(self, req: BaseHTTPRequestHandler, path: str, query: dict[str, str], count: int) -> None:
        if path.startswith("/img/"):
            self._send(req, 200, image_for(path), "image/png")
        elif path.startswith("/slow/"):  # counted as in progress until just before the answer is sent
            with self.lock:
                self.active += 1
                self.peak = max(self.peak, self.active)
            time.sleep(0.3)
            with self.lock:
                self.active -= 1
            self._send(req, 200, image_for(path), "image/png")
        elif path.startswith("/no-type/"):
            self._send(req, 200, image_for(path))
        elif path == "/sound.wav":
            self._send(req, 200, WAV, "audio/wav")
        elif path.startswith("/tone/"):  # /tone/<hz>.wav
            self._send(req, 200, tone_wav(int(path.removeprefix("/tone/").removesuffix(".wav"))), "audio/wav")
        elif path == "/clip.mp4":
            self._send(req, 200, MP4, "video/mp4")
        elif path == "/page.html":
            self._send(req, 200, b"<html>not an image</html>", "text/html; charset=utf-8")
        elif path.startswith("/limited/"):  # 429 for the first n requests, then the image
            if count <= int(query["n"]):
                self._send(req, 429, b"slow down", "text/plain", {"Retry-After": query["after"]})
            else:
                self._send(req, 200, image_for(path), "image/png")
        elif path == "/always-429.png":
            self._send(req, 429, b"slow down", "text/plain", {"Retry-After": "0"})
        elif path == "/unavailable-once.png":
            if count == 1:
                self._send(req, 503, b"busy", "text/plain")
            else:
                self._send(req, 200, image_for(path), "image/png")
        elif path == "/redirect":
            time.sleep(float(query.get("wait", 0)))
            self._send(req, 302, headers={"Location": query["to"]})
        elif path == "/trickle.png":  # 100 bytes every 0.2 s: each read is quick, the whole is slow
            req.send_response(200)
            req.send_header("Content-Type", "image/png")
            req.send_header("Content-Length", "100000")
            req.end_headers()
            self._stream(req, path, b"x" * 100, 0.2, 100_000)
        elif path == "/huge.png":  # no Content-Length, 256 MiB unless the client stops reading
            req.send_response(200)
            req.send_header("Content-Type", "image/png")
            req.end_headers()
            self._stream(req, path, b"x" * 65536, 0.0, 256 * 2**20)
        elif path == "/huge-declared.png":
            req.send_response(200)
            req.send_header("Content-Type", "image/png")
            req.send_header("Content-Length", str(10**9))
            req.end_headers()
            self._stream(req, path, b"x" * 65536, 0.0, 4 * 2**20)
        else:
            self._send(req, 404, b"no such media", "text/plain")


def allowing(server: MediaServer, **limits: Any) -> MediaOptions:
    return MediaOptions(allowed_hosts=[f"127.0.0.1:{server.port}"], **limits)


def media_row(cid: str, *parts: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "text", "text": f"What is in {cid}?"}, *parts]
    return {
        "custom_id": cid,
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": content}]},
    }


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def media_metadata(runner: JobRunner) -> dict[str, Any]:
    """The metadata of the latest fetched_media materialization on the runner's instance."""
    records = runner.instance.fetch_materializations(dg.AssetKey("fetched_media"), limit=1).records
    materialization = records[0].asset_materialization
    assert materialization is not None
    return {k: v.value for k, v in materialization.metadata.items()}
