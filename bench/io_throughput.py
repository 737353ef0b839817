"""I/O benchmark: a large job through validate + shard + merge + write, without generation, against
reading and writing the same file with polars/pyarrow alone. Each side runs in its own process so
that its peak memory (ru_maxrss) is its own.

    python -m bench.io_throughput --rows 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_inputs(folder: Path, rows: int) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = folder / "big.jsonl"
    with jsonl.open("w") as f:
        for i in range(rows):
            body = {
                "messages": [{"role": "user", "content": f"Summarise item {i} in one line, please."}],
                "max_tokens": 16,
            }
            f.write(
                json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
            )
            f.write("\n")
    parquet = folder / "big.parquet"
    prompts = pa.array([f"Summarise item {i} in one line, please." for i in range(rows)])
    pq.write_table(pa.table({"prompt": prompts, "n": pa.array(range(rows))}), parquet)
    return jsonl, parquet


def ours(src: Path, work: Path, out: Path) -> dict[str, float]:
    """validate + shard, then (untimed) one synthetic outcome per row, then merge + publish."""
    from anex_pipeline.jobs import JobDir, append_outcomes, prepare_job
    from anex_pipeline.merge import merge_job, result_path
    from anex_pipeline.spec import RowOutcome
    from anex_pipeline.storage import publish
    from anex_pipeline.validate import parse_options

    started = time.perf_counter()
    job: JobDir = prepare_job(src, str(out), parse_options({"max_tokens": 16}), work)
    validated = time.perf_counter()
    manifest = job.manifest()
    for shard, rng in enumerate(manifest.shards):
        batch = []
        for row in job.read_requests(shard):
            body = {
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]
            }
            batch.append(RowOutcome(row.index, row.key, 200, body=body, usage={"completion_tokens": 1}))
            if len(batch) == 65536:
                append_outcomes(job.checkpoint_path(shard), batch)
                batch = []
        append_outcomes(job.checkpoint_path(shard), batch)
        del rng
    filled = time.perf_counter()
    merge_job(job)
    publish(result_path(job), str(out))
    done = time.perf_counter()
    return {
        "validate_shard_s": validated - started,
        "merge_write_s": done - filled,
        "pipeline_s": (validated - started) + (done - filled),
    }


def baseline(src: Path, out: Path) -> dict[str, float]:
    """Read the file and write it again with polars (JSONL) or pyarrow (Parquet) alone."""
    started = time.perf_counter()
    if src.suffix == ".jsonl":
        import polars as pl

        pl.read_ndjson(src).write_ndjson(out)
    else:
        import pyarrow.parquet as pq

        pq.write_table(pq.read_table(src), out)
    return {"pipeline_s": time.perf_counter() - started}


def child(side: str, src: str, folder: str) -> None:
    work = Path(folder)
    out = work / ("out" + Path(src).suffix)
    figures = ours(Path(src), work / "work", out) if side == "ours" else baseline(Path(src), out)
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(figures))


def measure(side: str, src: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=src.parent) as folder:
        done = subprocess.run(
            [sys.executable, "-m", "bench.io_throughput", "--child", side, str(src), folder],
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "SRC", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("ANEX_BENCH_DIR")) as folder:
        jsonl, parquet = make_inputs(Path(folder), args.rows)
        for src in (jsonl, parquet):
            size_mb = src.stat().st_size / 1e6
            base, mine = measure("baseline", src), measure("ours", src)
            print(
                f"{src.suffix[1:]:8} {args.rows:,} rows ({size_mb:.0f} MB): "
                f"baseline {args.rows / base['pipeline_s']:,.0f} rows/s, peak {base['peak_rss_mb']:.0f} MB | "
                f"ours {args.rows / mine['pipeline_s']:,.0f} rows/s (validate+shard {mine['validate_shard_s']:.1f} s, "
                f"merge+write {mine['merge_write_s']:.1f} s), peak {mine['peak_rss_mb']:.0f} MB | "
                f"ratio {base['pipeline_s'] / mine['pipeline_s']:.2f}"
            )


if __name__ == "__main__":
    main()
