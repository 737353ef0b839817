"""The media stage against real HTTP servers on loopback: downloads once, cache, limits, retries,
per-row failures, and the address policy (nothing reaches a host it must not)."""

from __future__ import annotations

import base64
import contextlib
import copy
import errno
import itertools
import os
import pickle
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from anex_pipeline.media.attach import attach_media
from anex_pipeline.media.fetcher import MediaFetcher, MediaFetchError
from anex_pipeline.media.guard import address_problem, allowed_endpoints
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import InputRow, JobOptions, MediaOptions
from anex_pipeline.stages.fetch_media import fetch_shard
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.validate.media_refs import MediaRef, media_references
from anex_pipeline.workdir.outputs import recorded_failures
from anex_pipeline_tests.harness.jobs import read_jsonl, write_jsonl
from anex_pipeline_tests.harness.media import (
    MP4,
    WAV,
    MediaServer,
    allowing,
    image,
    image_for,
    media_row,
    png_bytes,
)


@pytest.fixture
def server() -> Iterator[MediaServer]:
    s = MediaServer()
    yield s
    s.close()


@pytest.fixture
def forbidden() -> Iterator[MediaServer]:
    """A second loopback server that no test may reach: its hit count proves it."""
    s = MediaServer()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def media_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "media-cache"
    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(folder))
    return folder


def image_ref(url: str) -> MediaRef:
    return MediaRef(0, 1, "image_url", url)


# -- references and the address policy ------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("127.0.0.1", "a loopback address"),
        ("127.9.9.9", "a loopback address"),
        ("::1", "a loopback address"),
        ("::ffff:127.0.0.1", "a loopback address"),
        ("10.1.2.3", "a private address"),
        ("172.16.5.4", "a private address"),
        ("192.168.0.10", "a private address"),
        ("fc00::5", "a private address"),
        ("169.254.169.254", "a cloud metadata address"),
        ("fd00:ec2::254", "a cloud metadata address"),
        ("100.100.100.200", "a cloud metadata address"),
        ("168.63.129.16", "a cloud metadata address"),
        ("169.254.10.1", "a link-local address"),
        ("fe80::1%eth0", "a link-local address"),
        ("64:ff9b::a9fe:a9fe", "a cloud metadata address"),
        ("64:ff9b::808:808", None),  # NAT64 of a public address
        ("64:ff9b:1::a9fe:a9fe", "a cloud metadata address"),
        ("64:ff9b:1::808:808", "a local-use NAT64 address"),
        ("::127.0.0.1", "a loopback address"),  # IPv4-compatible
        ("::169.254.169.254", "a cloud metadata address"),
        ("::ffff:10.0.0.1", "a private address"),
        ("2002:a9fe:a9fe::1", "a cloud metadata address"),  # 6to4
        ("2002:a00:1::1", "a private address"),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "a loopback address"),  # Teredo, client 127.0.0.1
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "a private address"),  # Teredo, client 192.0.2.45
        ("fec0::1", "a site-local address"),
        ("0.0.0.0", "the unspecified address, which reaches this machine"),
        ("::", "the unspecified address, which reaches this machine"),
        ("0.1.2.3", "a private address"),
        ("100.64.0.1", "not a public unicast address"),
        ("224.0.0.251", "not a public unicast address"),
        ("93.184.215.14", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_address_policy(address: str, problem: str | None) -> None:
    assert address_problem(address) == problem


def test_allowed_hosts_name_a_host_or_one_port() -> None:
    assert allowed_endpoints(["127.0.0.1", "Images.Example.com:8443", "[::1]:9000", "::1"]) == {
        ("127.0.0.1", None),
        ("images.example.com", 8443),
        ("::1", 9000),
        ("::1", None),
    }


def test_references_in_every_kind_of_part() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "plain text is no reference"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    image("https://a.example/x.png"),
                    {"type": "image_url", "image_url": "https://a.example/bare-string.png"},
                    {"type": "audio_url", "audio_url": {"url": "http://a.example/s.wav"}},
                    {"type": "video_url", "video_url": {"url": "http://a.example/v.mp4"}},
                    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                    {"type": "input_audio", "input_audio": {"data": "https://a.example/t.mp3", "format": "mp3"}},
                    image("data:image/png;base64,iVBORw0KGgo="),
                ],
            },
        ]
    }
    refs = media_references(body)
    assert [(r.param, r.kind, r.remote) for r in refs] == [
        ("messages[1].content[1]", "image", True),
        ("messages[1].content[2]", "image", True),
        ("messages[1].content[3]", "audio", True),
        ("messages[1].content[4]", "video", True),
        ("messages[1].content[6]", "audio", True),
        ("messages[1].content[7]", "image", False),
    ]


# -- downloads ------------------------------------------------------------------------------------


def test_media_reach_the_engine_as_data(server: MediaServer) -> None:
    inline_png = "data:image/png;base64," + base64.b64encode(png_bytes(1)).decode()
    bodies = [
        media_row("img", image(server.url("/img/cat.png")), image(inline_png))["body"],
        media_row("snd", {"type": "audio_url", "audio_url": {"url": server.url("/sound.wav")}})["body"],
        media_row("in-audio", {"type": "input_audio", "input_audio": {"data": server.url("/sound.wav")}})["body"],
        media_row("vid", {"type": "video_url", "video_url": {"url": server.url("/clip.mp4")}})["body"],
        media_row("guess", image(server.url("/no-type/dog.png")))["body"],
        {"messages": [{"role": "user", "content": "text only"}]},
    ]
    rows = [InputRow(i, f"k{i}", body) for i, body in enumerate(bodies)]
    originals = copy.deepcopy(bodies)

    ready, failed = attach_media(rows, allowing(server))

    assert failed == []
    assert [r.body for r in rows] == originals  # the stored rows are left as they were
    parts = [r.body["messages"][0]["content"] for r in ready[:5]]
    assert (
        parts[0][1]["image_url"]["url"]
        == "data:image/png;base64," + base64.b64encode(image_for("/img/cat.png")).decode()
    )
    assert parts[0][2]["image_url"]["url"] == inline_png
    assert parts[1][1]["audio_url"]["url"] == "data:audio/wav;base64," + base64.b64encode(WAV).decode()
    assert parts[2][1]["input_audio"] == {"data": base64.b64encode(WAV).decode(), "format": "wav"}
    assert parts[3][1]["video_url"]["url"] == "data:video/mp4;base64," + base64.b64encode(MP4).decode()
    assert parts[4][1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert ready[5].body is bodies[5]
    assert not any(r.remote for row in ready for r in media_references(row.body))
    assert server.hits["/sound.wav"] == 1  # two rows, one download


def test_concurrent_askers_share_one_download(server: MediaServer, media_cache: Path) -> None:
    urls = [server.url(f"/slow/{n}.png") for n in range(4)]
    with MediaFetcher(allowing(server)) as fetcher, ThreadPoolExecutor(40) as pool:
        sizes = list(pool.map(lambda n: fetcher.fetch(urls[n % 4]).size, range(40)))
    assert {server.hits[f"/slow/{n}.png"] for n in range(4)} == {1}
    assert fetcher.stats.fetched == 4 and sizes[0] == len(image_for("/slow/0.png"))

    with MediaFetcher(allowing(server), media_cache) as again:
        assert [again.fetch(u).mime for u in urls] == ["image/png"] * 4
    assert server.total_hits() == 4 and again.stats.from_cache == 4 and again.stats.fetched == 0

    # Two fetchers on one cache (as two processes would be) still download each URL once.
    more = [server.url(f"/slow/more-{n}.png") for n in range(3)]
    with MediaFetcher(allowing(server)) as a, MediaFetcher(allowing(server)) as b, ThreadPoolExecutor(12) as pool:
        list(pool.map(lambda n: (a if n % 2 else b).fetch(more[n % 3]), range(12)))
    assert [server.hits[f"/slow/more-{n}.png"] for n in range(3)] == [1, 1, 1]
    assert a.stats.fetched + b.stats.fetched == 3


def test_connections_per_host_are_bounded(server: MediaServer) -> None:
    urls = [server.url(f"/slow/bound-{n}.png") for n in range(6)]
    with MediaFetcher(allowing(server, per_host_connections=2)) as fetcher, ThreadPoolExecutor(6) as pool:
        list(pool.map(fetcher.fetch, urls))
    assert server.peak == 2


@pytest.mark.parametrize(
    ("path", "limits", "status", "says"),
    [
        ("/missing.png", {}, 404, "the server answered 404 Not Found"),
        ("/page.html", {}, None, "it is text/html; charset=utf-8, not an image, audio or video file"),
        ("/sound.wav", {}, None, "it is audio/wav, not the image its image_url part needs"),
        ("/trickle.png", {"timeout_s": 1.0}, None, "it did not arrive within media.timeout_s=1 s"),
        ("/huge.png", {"max_bytes": 200_000}, None, "it is larger than media.max_bytes=200000; stopped reading"),
        ("/huge-declared.png", {"max_bytes": 1000}, None, "it is 1000000000 bytes, more than media.max_bytes=1000"),
    ],
)
def test_a_failed_fetch_names_the_url_and_the_cause(
    server: MediaServer, path: str, limits: dict[str, Any], status: int | None, says: str
) -> None:
    url = server.url(path)
    started = time.monotonic()
    with MediaFetcher(allowing(server, **limits)) as fetcher, pytest.raises(MediaFetchError) as caught:
        fetcher.checked(image_ref(url))
    assert str(caught.value) == f"media {url} could not be fetched: {says}"
    assert caught.value.status == status
    assert time.monotonic() - started < 5
    assert server.hits[path] == 1
    assert server.sent[path] < 32 * 2**20  # big bodies were not read to the end (256 MiB, 1 GB declared)


def test_failures_without_an_http_status(server: MediaServer) -> None:
    closed = MediaServer()
    closed.close()  # nothing listens on its port any more
    options = MediaOptions(allowed_hosts=["127.0.0.1"])
    with MediaFetcher(options) as fetcher:
        with pytest.raises(MediaFetchError, match=r"the transfer failed: .*Connection refused") as refused:
            fetcher.fetch(closed.url("/img/a.png"))
        with pytest.raises(MediaFetchError, match=r"the host name nothing\.invalid does not resolve") as unknown:
            fetcher.fetch("http://nothing.invalid/a.png")
    assert refused.value.status is None and unknown.value.status is None


def test_rate_limits_are_retried_honouring_retry_after(server: MediaServer) -> None:
    with MediaFetcher(allowing(server, max_retries=2)) as fetcher:
        started = time.monotonic()
        assert fetcher.fetch(server.url("/limited/wait.png?n=1&after=1")).mime == "image/png"
        assert time.monotonic() - started >= 1.0  # it waited as the server asked
        assert fetcher.fetch(server.url("/unavailable-once.png")).mime == "image/png"  # 5xx: backoff
        with pytest.raises(MediaFetchError) as always:
            fetcher.fetch(server.url("/always-429.png"))
        started = time.monotonic()
        with pytest.raises(MediaFetchError) as too_long:
            fetcher.fetch(server.url("/limited/later.png?n=5&after=3600"))
        assert time.monotonic() - started < 2  # an hour's wait is refused, not slept
    assert server.hits["/limited/wait.png"] == 2 and server.hits["/unavailable-once.png"] == 2
    assert always.value.status == 429 and server.hits["/always-429.png"] == 3
    assert "answered 429 Too Many Requests to all 3 attempts (media.max_retries is 2)" in str(always.value)
    assert too_long.value.status == 429 and server.hits["/limited/later.png"] == 1
    assert "asked to retry after 3600 s, longer than the 60 s this stage waits" in str(too_long.value)


# -- where requests may not go --------------------------------------------------------------------

REFUSED_CASES: list[tuple[str, Callable[[MediaServer, MediaServer], str], str]] = [
    ("metadata", lambda s, f: "http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a cloud metadata"),
    ("metadata-v6", lambda s, f: "http://[fd00:ec2::254]/latest/meta-data/", "fd00:ec2::254 is a cloud metadata"),
    ("private", lambda s, f: "http://10.0.0.1/a.png", "10.0.0.1 is a private address"),
    ("loopback", lambda s, f: f.url("/img/a.png"), "127.0.0.1 is a loopback address"),
    ("loopback-v6", lambda s, f: f"http://[::1]:{f.port}/img/a.png", "::1 is a loopback address"),
    ("loopback-v4-compat", lambda s, f: f"http://[::127.0.0.1]:{f.port}/a.png", "::127.0.0.1 is a loopback address"),
    ("localhost", lambda s, f: f"http://localhost:{f.port}/img/a.png", "localhost resolves to 127.0.0.1, a loopback"),
    ("file", lambda s, f: "file:///etc/passwd", "only http and https URLs are fetched, not file: URLs"),
    ("ftp", lambda s, f: "ftp://files.example.com/a.png", "only http and https URLs are fetched, not ftp: URLs"),
    ("relative", lambda s, f: "pictures/a.png", "only http and https URLs are fetched, not a URL without a scheme"),
    (
        "redirect-to-metadata",
        lambda s, f: s.url("/redirect?to=http://169.254.169.254/latest/meta-data/"),
        "after a redirect to http://169.254.169.254/latest/meta-data/, 169.254.169.254 is a cloud metadata address",
    ),
    (
        "redirect-to-other-port",
        lambda s, f: s.url(f"/redirect?to=http://127.0.0.1:{f.port}/img/a.png"),
        "after a redirect to http://127.0.0.1:PORT/img/a.png, 127.0.0.1 is a loopback address",
    ),
    (
        "redirect-to-file",
        lambda s, f: s.url("/redirect?to=file:///etc/passwd"),
        "after a redirect to file:///etc/passwd, only http and https URLs are fetched, not file: URLs",
    ),
]


@pytest.mark.parametrize(("name", "make_url", "says"), REFUSED_CASES, ids=[c[0] for c in REFUSED_CASES])
def test_refused_destinations_get_no_request(
    server: MediaServer, forbidden: MediaServer, name: str, make_url: Callable[..., str], says: str
) -> None:
    url = make_url(server, forbidden)
    started = time.monotonic()
    with MediaFetcher(allowing(server)) as fetcher, pytest.raises(MediaFetchError) as caught:
        fetcher.fetch(url)
    message = str(caught.value)
    assert message.startswith(f"media {url} could not be fetched: ")
    assert says.replace("PORT", str(forbidden.port)) in message
    assert caught.value.status is None
    assert time.monotonic() - started < 2  # refused before any connection was tried
    assert forbidden.total_hits() == 0
    if name.startswith("redirect"):
        assert server.hits["/redirect"] == 1
    if name.startswith(("loopback", "metadata", "private", "localhost", "redirect-to-metadata")):
        assert "unless the job's media.allowed_hosts names them" in message


def test_loopback_needs_the_allow_list(server: MediaServer) -> None:
    with MediaFetcher(MediaOptions()) as fetcher, pytest.raises(MediaFetchError, match="is a loopback address"):
        fetcher.fetch(server.url("/img/a.png"))
    assert server.total_hits() == 0
    with MediaFetcher(MediaOptions(allowed_hosts=["127.0.0.1"])) as fetcher:  # a host without port: every port
        assert fetcher.fetch(server.url("/img/a.png")).mime == "image/png"
    assert server.total_hits() == 1


# -- the stage ------------------------------------------------------------------------------------


def test_fetch_shard_records_failed_rows_and_counts(tmp_path: Path, server: MediaServer) -> None:
    rows = [
        media_row("ok-1", image(server.url("/img/a.png"))),
        media_row("ok-2", image(server.url("/img/a.png")), image(server.url("/img/b.png"))),
        media_row("gone", image(server.url("/img/b.png")), image(server.url("/missing.png"))),
        media_row("inline", image("data:image/png;base64," + base64.b64encode(png_bytes(3)).decode())),
        media_row("meta", image("http://169.254.169.254/latest/meta-data/")),
        {"custom_id": "text", "body": {"messages": [{"role": "user", "content": "hi"}]}},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = JobOptions(media=allowing(server))
    job = prepare_job(src, str(tmp_path / "out.jsonl"), options, tmp_path / "work")

    stats = fetch_shard(job, 0, options.media)

    assert {k: v for k, v in stats.items() if k != "seconds"} == {
        "rows": 6,
        "rows_with_media": 5,
        "inline_media": 1,
        "urls_seen": 4,
        "fetched": 2,
        "from_cache": 0,
        "not_cached": 0,
        "cache_problem": "",
        "failed_urls": 2,
        "failed_by_code": {"404": 1, "none": 1},
        "by_host": {
            f"127.0.0.1:{server.port}": {"downloaded": 2, "from_cache": 0, "failed": 1},
            "169.254.169.254": {"downloaded": 0, "from_cache": 0, "failed": 1},
        },
        "not_fetched_time_limit": 0,
        "rows_failed": 2,
        "bytes": len(image_for("/img/a.png")) + len(image_for("/img/b.png")),
        "bytes_downloaded": len(image_for("/img/a.png")) + len(image_for("/img/b.png")),
    }
    failures = recorded_failures(job, 0)
    assert sorted(failures) == [2, 4]
    gone = failures[2]
    assert gone.status_code == 404 and gone.error is not None
    assert gone.error.as_dict() == {
        "message": f"media {server.url('/missing.png')} could not be fetched: the server answered 404 Not Found",
        "type": "media_fetch_error",
        "code": 404,
        "param": "messages[0].content[2]",
    }
    assert failures[4].status_code is None and failures[4].error is not None and failures[4].error.code is None

    again = fetch_shard(job, 0, options.media)
    assert (again["fetched"], again["from_cache"], again["failed_urls"]) == (0, 2, 2)
    assert again["by_host"][f"127.0.0.1:{server.port}"] == {"downloaded": 0, "from_cache": 2, "failed": 1}
    assert server.hits["/img/a.png"] == 1 and server.hits["/missing.png"] == 2  # failures are not cached


def _media_metadata(instance: dg.DagsterInstance, count: int) -> list[dict[str, Any]]:
    records = instance.fetch_materializations(dg.AssetKey("fetched_media"), limit=count).records
    out = []
    for record in records:
        materialization = record.asset_materialization
        assert materialization is not None
        out.append({k: v.value for k, v in materialization.metadata.items()})
    return out


def test_hundred_rows_ten_urls_download_ten_times_then_none(
    tmp_path: Path, fake_runner: JobRunner, instance: dg.DagsterInstance, server: MediaServer
) -> None:
    rows = [media_row(f"r-{i}", image(server.url(f"/img/{i % 10}.png"))) for i in range(100)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = {"shards": 2, "max_tokens": 16, "media": {"allowed_hosts": ["127.0.0.1"]}}

    first = fake_runner.run(fake_runner.submit(str(src), str(tmp_path / "first.jsonl"), options))
    # The fake engine refuses any media URL it is handed, so every completion got data.
    assert first.request_counts.completed == 100 and first.request_counts.failed == 0
    assert server.total_hits() == 10 and set(server.hits.values()) == {1}
    shard_1, shard_0 = _media_metadata(instance, 2)
    assert (shard_0["urls_seen"], shard_0["fetched"], shard_0["from_cache"]) == (10, 10, 0)
    assert (shard_1["urls_seen"], shard_1["fetched"], shard_1["from_cache"]) == (10, 0, 10)

    # The same file again is the same job, whose rows are all done: no shard runs, so no media stage
    # and no download, and the result is delivered to the new place.
    second = fake_runner.run(fake_runner.submit(str(src), str(tmp_path / "second.jsonl"), options))
    assert second.request_counts.completed == 100
    assert server.total_hits() == 10
    assert len(_media_metadata(instance, 10)) == 2


def test_rate_limited_rows_fail_alone_and_the_report_counts_them(
    tmp_path: Path, fake_runner: JobRunner, server: MediaServer
) -> None:
    kinds = ["limited", "missing", "metadata", "ok", "ok", "ok"]
    urls = {
        "limited": server.url("/always-429.png"),
        "missing": server.url("/missing.png"),
        "metadata": "http://169.254.169.254/latest/meta-data/",
    }
    rows = [
        media_row(f"r-{i}", image(urls.get(kinds[i % 6], server.url(f"/img/{i}.png"))))
        if i % 7
        else {"custom_id": f"r-{i}", "body": {"messages": [{"role": "user", "content": f"text {i}"}]}}
        for i in range(24)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    options = {"shards": 2, "max_tokens": 16, "media": {"allowed_hosts": ["127.0.0.1"], "max_retries": 1}}

    report = fake_runner.run(fake_runner.submit(str(src), str(out), options))

    lines = read_jsonl(out)
    failed = {line["custom_id"]: line for line in lines if line["error"]}
    expected = {f"r-{i}": kinds[i % 6] for i in range(24) if i % 7 and kinds[i % 6] != "ok"}
    assert set(failed) == set(expected)
    for cid, kind in expected.items():
        line = failed[cid]
        code = {"limited": 429, "missing": 404, "metadata": None}[kind]
        assert line["response"] == {"status_code": code, "request_id": f"req_{cid}", "body": None}
        assert line["error"]["type"] == "media_fetch_error" and line["error"]["code"] == code
        assert line["error"]["param"] == "messages[0].content[1]"
        assert line["error"]["message"].startswith(f"media {urls[kind]} could not be fetched: ")
    assert report.status == "completed"
    assert report.request_counts.model_dump() == {
        "total": 24,
        "completed": 24 - len(expected),
        "failed": len(expected),
        "format_error_rows": 0,
    }
    assert report.error_counts == {"media_fetch_error": len(expected)}
    assert server.hits["/always-429.png"] == 2 * 2  # max_retries + 1 attempts, once per shard


# -- hostile hosts, a cache that must not leak, a full disk ---------------------------------------


class TrickleServer:
    """A loopback TCP server that answers every connection with an HTTP response head (or, for TLS,
    a handshake record) sent one byte at a time, 0.2 s apart, and never finished: each read is
    quick, the whole never comes. It gives up on a connection after ``give_up_s``, so code without
    a deadline fails a test rather than hangs."""

    HTTP_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nX-Padding: "
    TLS_RECORD = b"\x16\x03\x03\x40\x00"  # a 16 KiB handshake record (a ServerHello's would be)

    def __init__(self, head: bytes = HTTP_HEAD, give_up_s: float = 8.0) -> None:
        self.head = head
        self.give_up_s = give_up_s
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.closed.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            ends = time.monotonic() + self.give_up_s
            for byte in itertools.chain(self.head, itertools.repeat(ord("a"))):
                if time.monotonic() > ends or self.closed.wait(0.2):
                    return
                conn.sendall(bytes([byte]))


@pytest.fixture
def trickle() -> Iterator[TrickleServer]:
    s = TrickleServer()
    yield s
    s.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["direct", "after-a-slow-redirect", "tls-handshake"])
def test_a_host_that_trickles_its_headers_fails_at_the_timeout(server: MediaServer, case: str) -> None:
    tls = case == "tls-handshake"
    with contextlib.closing(TrickleServer(TrickleServer.TLS_RECORD if tls else TrickleServer.HTTP_HEAD)) as trickle:
        target = trickle.url("/slow-head.png").replace("http:", "https:" if tls else "http:")
        url = server.url(f"/redirect?wait=1.5&to={target}") if case == "after-a-slow-redirect" else target
        options = MediaOptions(allowed_hosts=["127.0.0.1"], timeout_s=3.0, max_retries=0)
        started = time.monotonic()
        with MediaFetcher(options) as fetcher, pytest.raises(MediaFetchError) as caught:
            fetcher.fetch(url)
        took = time.monotonic() - started
    assert "it did not arrive within media.timeout_s=3 s" in str(caught.value)
    # One deadline for the whole request, the redirect's hop included. The bounds are what a
    # fault would cross, not a window around the expected time: a deadline started again at the
    # second hop cannot end the request before 1.5 + 3.0 s, and none ends it before 3.0 s.
    assert 2.9 < took < 4.5
    assert trickle.connections == 1


@pytest.mark.slow
def test_the_job_time_limit_holds_in_the_media_stage(
    tmp_path: Path, fake_runner: JobRunner, trickle: TrickleServer
) -> None:
    # Shard 0: text only, done in time. Shard 1: media on a host that never finishes answering.
    rows = [{"custom_id": f"t-{i}", "body": {"messages": [{"role": "user", "content": "hi"}]}} for i in range(20)]
    rows += [media_row(f"m-{i}", image(trickle.url(f"/{i}.png"))) for i in range(20)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    media = {"allowed_hosts": ["127.0.0.1"], "timeout_s": 60}
    options = {"shards": 2, "max_tokens": 16, "time_limit_s": 2.0, "media": media}
    job = fake_runner.submit(str(src), str(out), options)
    started = time.monotonic()
    report = fake_runner.run(job)
    assert time.monotonic() - started < 2.0 + 4  # the limit, plus the steps' own start-up
    assert report.status == "stopped_early"
    assert "time limit of 2 s" in (report.failure_reason or "")
    assert report.request_counts.failed == 0  # media not fetched in time are no media errors
    assert [line["custom_id"] for line in read_jsonl(out)] == [f"t-{i}" for i in range(20)]


def test_the_cache_answers_only_what_the_policy_allows(server: MediaServer, forbidden: MediaServer) -> None:
    direct = server.url("/img/a.png")
    redirected = server.url(f"/redirect?to={forbidden.url('/img/b.png')}")
    both = MediaOptions(allowed_hosts=[f"127.0.0.1:{server.port}", f"127.0.0.1:{forbidden.port}"])
    with MediaFetcher(both) as fetcher:
        assert fetcher.fetch(direct).mime == fetcher.fetch(redirected).mime == "image/png"
    assert server.total_hits() == 2 and forbidden.total_hits() == 1

    with MediaFetcher(MediaOptions()) as fetcher, pytest.raises(MediaFetchError, match=r"127\.0\.0\.1 is a loopback"):
        fetcher.fetch(direct)
    with MediaFetcher(allowing(server)) as fetcher:
        assert fetcher.fetch(direct).mime == "image/png"  # still allowed: from the cache
        with pytest.raises(MediaFetchError) as caught:
            fetcher.fetch(redirected)
    assert f"after a redirect to {forbidden.url('/img/b.png')}, 127.0.0.1 is a loopback address" in str(caught.value)
    assert server.total_hits() == 2 and forbidden.total_hits() == 1  # all of it from the cache or refused


@contextlib.contextmanager
def small_disk(where: Path, size: str = "1m") -> Iterator[Path]:
    """A real tmpfs of the given size mounted at ``where`` (needs root; skips the test otherwise)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill(disk: Path) -> None:
    """Writes a file until the disk has no room left."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.mark.subprocess
@pytest.mark.parametrize("cache", ["new", "existing"])
def test_a_full_cache_disk_fails_no_row(
    tmp_path: Path, fake_runner: JobRunner, server: MediaServer, monkeypatch: pytest.MonkeyPatch, cache: str
) -> None:
    rows = [media_row(f"m-{i}", image(server.url(f"/img/{i % 4}.png"))) for i in range(8)]
    rows += [{"custom_id": f"t-{i}", "body": {"messages": [{"role": "user", "content": "hi"}]}} for i in range(3)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    with small_disk(tmp_path / "disk") as disk:
        monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(disk / "media"))
        if cache == "existing":
            with MediaFetcher(allowing(server)) as fetcher:
                fetcher.fetch(server.url("/img/earlier.png"))
        fill(disk)
        options = {"max_tokens": 16, "media": {"allowed_hosts": ["127.0.0.1"]}}
        report = fake_runner.run(fake_runner.submit(str(src), str(out), options))
    # The fake engine refuses any media URL it is handed: every media row got its bytes as data.
    assert report.status == "completed"
    assert report.request_counts.completed == 11 and report.request_counts.failed == 0
    assert sorted(line["custom_id"] for line in read_jsonl(out)) == sorted(r["custom_id"] for r in rows)


@pytest.mark.subprocess
def test_media_the_cache_cannot_store_are_still_handed_over(tmp_path: Path, server: MediaServer) -> None:
    url = server.url("/img/kept.png")
    with small_disk(tmp_path / "disk") as disk, MediaFetcher(allowing(server), disk / "media") as fetcher:
        fill(disk)  # the cache opened fine; the disk filled up afterwards
        value = fetcher.inline_value(image_ref(url))
    assert value == "data:image/png;base64," + base64.b64encode(image_for("/img/kept.png")).decode()
    assert server.hits["/img/kept.png"] == 1


@pytest.mark.subprocess
def test_on_a_full_disk_only_media_too_large_for_memory_fail(tmp_path: Path, server: MediaServer) -> None:
    small, large = server.url("/img/small.png"), server.url("/huge.png")
    with small_disk(tmp_path / "disk") as disk:
        fill(disk)
        with MediaFetcher(allowing(server, max_bytes=64 * 2**20), disk / "media") as fetcher:
            assert fetcher.inline_value(image_ref(small)).startswith("data:image/png;base64,")
            with pytest.raises(MediaFetchError) as caught:
                fetcher.fetch(large)
    assert str(caught.value) == (
        f"media {large} could not be fetched: it is larger than 8 MiB and the media cache {disk / 'media'} has "
        "no room to hold it (No space left on device); free some space there or set ANEX_MEDIA_CACHE_DIR"
    )


GUARDED_TARGETS = [
    ("127.0.0.1:PORT", "127.0.0.1 is a loopback address"),
    ("2130706433:PORT", "2130706433 resolves to 127.0.0.1, a loopback address"),  # decimal
    ("017700000001:PORT", "017700000001 resolves to 127.0.0.1, a loopback address"),  # octal
    ("0x7f.0.0.1:PORT", "0x7f.0.0.1 resolves to 127.0.0.1, a loopback address"),  # hex
    ("0x7f000001:PORT", "0x7f000001 resolves to 127.0.0.1, a loopback address"),
    ("127.1:PORT", "127.1 resolves to 127.0.0.1, a loopback address"),
    ("[::ffff:127.0.0.1]:PORT", "::ffff:127.0.0.1 is a loopback address"),
    ("[::127.0.0.1]:PORT", "::127.0.0.1 is a loopback address"),
    ("[::1]:PORT", "::1 is a loopback address"),
    ("10.0.0.1", "10.0.0.1 is a private address"),
    ("169.254.10.1", "169.254.10.1 is a link-local address"),
    ("169.254.169.254", "169.254.169.254 is a cloud metadata address"),
    ("[::ffff:169.254.169.254]", "::ffff:169.254.169.254 is a cloud metadata address"),
]


@pytest.mark.parametrize("redirect", [False, True], ids=["direct", "redirect"])
@pytest.mark.parametrize(("target", "says"), GUARDED_TARGETS, ids=[t[0] for t in GUARDED_TARGETS])
def test_every_connection_passes_the_address_guard(
    server: MediaServer, forbidden: MediaServer, target: str, says: str, redirect: bool
) -> None:
    """Redirect hops are checked only where connections are opened: this fails if the client's
    connections stop going through the guard."""
    hop = f"http://{target.replace('PORT', str(forbidden.port))}/img/a.png"
    url = server.url(f"/redirect?to={hop}") if redirect else hop
    started = time.monotonic()
    with MediaFetcher(allowing(server, timeout_s=5.0)) as fetcher, pytest.raises(MediaFetchError) as caught:
        fetcher.fetch(url)
    via = f"after a redirect to {hop}, " if redirect else ""
    assert str(caught.value).startswith(f"media {url} could not be fetched: {via}{says}")
    assert time.monotonic() - started < 4.0, "refused before any connection, not after the request's deadline"
    assert forbidden.total_hits() == 0


def test_a_pickle_written_into_the_cache_is_never_loaded(
    server: MediaServer, media_cache: Path, tmp_path: Path
) -> None:
    """Whoever can write the cache's database could store a pickle under a URL; the cache never
    writes one, so one found there is refused and the media downloaded again."""
    url = server.url("/sound.wav")
    with MediaFetcher(allowing(server)) as fetcher:
        fetcher.fetch(url)
    ran = tmp_path / "code-ran"
    forged = pickle.dumps(Touches(ran))
    with sqlite3.connect(media_cache / "cache.db") as db:
        assert db.execute("UPDATE Cache SET mode = 4, value = ?, filename = NULL WHERE key = ?", (forged, url)).rowcount
    with MediaFetcher(allowing(server)) as again:
        assert again.fetch(url).size == len(WAV)
    assert not ran.exists() and server.hits["/sound.wav"] == 2  # diskcache takes the refusal as a miss


def test_a_media_cache_others_may_write_is_not_used(server: MediaServer, media_cache: Path) -> None:
    media_cache.mkdir(parents=True, exist_ok=True)
    media_cache.chmod(0o777)
    try:
        with MediaFetcher(allowing(server)) as fetcher:
            fetcher.fetch(server.url("/sound.wav"))
    finally:
        media_cache.chmod(0o700)
    assert fetcher.cache is None and "may be written by other users" in (fetcher.stats.cache_problem or "")
    assert not (media_cache / "cache.db").exists()


class Touches:
    """A pickle that runs ``touch`` when it is loaded."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.path}",))
