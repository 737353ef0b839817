"""The ``fetched_media`` stage and what generation does with its work.

:func:`fetch_shard` downloads every http(s) URL of a shard into the media cache and records the rows
whose media could not be fetched. Generation then calls :func:`attach_media`, which fails those
rows with ``media_fetch_error`` before they reach the engine and swaps every other row's URLs
for ``data:`` URLs made from the cached bytes, so the engine never opens a connection. The stage
stops at the job's time limit."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from anex_pipeline.formats.jsonl_checkpoint import append_outcomes
from anex_pipeline.media.attach import media_failure
from anex_pipeline.media.fetcher import (
    FetchStats,
    MediaFetcher,
    MediaFetchError,
    MediaOutOfTime,
)
from anex_pipeline.media.guard import TOTAL_CONNECTIONS
from anex_pipeline.spec import InputRow, MediaOptions, RowOutcome
from anex_pipeline.validate.media_refs import MediaRef, media_references
from anex_pipeline.workdir.manifest import JobDir


def _first_failure(fetcher: MediaFetcher, row: InputRow, refs: Sequence[MediaRef]) -> RowOutcome | None:
    for ref in refs:
        try:
            if ref.remote:
                fetcher.checked(ref)
            else:
                fetcher.check_inline(ref)
        except MediaFetchError as exc:
            return media_failure(row, ref, exc)
    return None


def fetch_shard(job: JobDir, shard: int, options: MediaOptions, cache_dir: Path | None = None) -> dict[str, Any]:
    """Downloads the media of the shard's unfinished rows and records the rows whose media failed.

    Fetching stops when the job's time limit runs out; the media not fetched by then fail no row
    (generation then stops the job, as it does whenever the time is up). Returns the
    materialization metadata: URLs seen, fetched, served from cache, failed by code, the same
    three counts per host (``by_host``: downloaded, from_cache, failed), and bytes.
    """
    started = time.monotonic()
    finished = job.finished_rows(shard)
    rows: list[tuple[InputRow, list[MediaRef]]] = []
    total = inline = 0
    for row in job.read_requests(shard):
        total += 1
        refs = media_references(row.body) if row.index not in finished else []
        inline += sum(1 for ref in refs if not ref.remote)
        if refs:
            rows.append((row, refs))
    urls = list(dict.fromkeys(ref.url for _, refs in rows for ref in refs if ref.remote))
    failures: list[RowOutcome] = []
    codes: Counter[str] = Counter()
    by_host: dict[str, Counter[str]] = {}
    stats = FetchStats()
    media_bytes = out_of_time = 0
    if urls:
        left = job.time_left()
        stop_at = None if left is None else time.monotonic() + left
        # The stage only fills the cache; what the cache cannot store, generation fetches again.
        with (
            MediaFetcher(options, cache_dir, stop_at=stop_at, hold_uncached=False) as fetcher,
            ThreadPoolExecutor(TOTAL_CONNECTIONS) as pool,
        ):
            for url, future in [(url, pool.submit(fetcher.fetch, url)) for url in urls]:
                error = future.exception()
                host = by_host.setdefault(urlsplit(url).netloc, Counter(downloaded=0, from_cache=0, failed=0))
                if isinstance(error, MediaOutOfTime):
                    out_of_time += 1
                elif isinstance(error, MediaFetchError):
                    codes[str(error.status or "none")] += 1
                    host["failed"] += 1
                elif error is not None:
                    raise error
                else:
                    media_bytes += future.result().size
                    host["from_cache" if future.result().from_cache else "downloaded"] += 1
            if not out_of_time:
                failures = [f for row, refs in rows if (f := _first_failure(fetcher, row, refs))]
            stats = fetcher.stats
    path = job.media_failures_path(shard)
    path.unlink(missing_ok=True)
    append_outcomes(path, failures)
    return {
        "rows": total,
        "rows_with_media": len(rows),
        "inline_media": inline,
        "urls_seen": len(urls),
        "fetched": stats.fetched,
        "from_cache": stats.from_cache,
        "not_cached": stats.not_cached,
        "cache_problem": stats.cache_problem,
        "failed_urls": sum(codes.values()),
        "failed_by_code": dict(codes),
        "by_host": {host: dict(counts) for host, counts in sorted(by_host.items())},
        "not_fetched_time_limit": out_of_time,
        "rows_failed": len(failures),
        "bytes": media_bytes,
        "bytes_downloaded": stats.bytes_downloaded,
        "seconds": round(time.monotonic() - started, 3),
    }
