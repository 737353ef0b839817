"""I/O benchmark: a large job through validate + shard and merge + write, without generation,
against reading the same file and writing an output of the same shape with polars (JSONL) or
pyarrow (Parquet) alone. Each step runs in its own process, so that its peak memory (ru_maxrss)
is its own; the checkpoints the merge reads are written in between, untimed. Every timed step runs
``--repeat`` times (3 by default), each in a new process: its median time counts, and its
highest peak.

    python -m bench.io_throughput --rows 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ANSWER = "A one-line summary of the item."
SAMPLE_ROWS = 100  # the output-length estimate's sample, reused by the shards
RETRIED_EVERY = 1000  # one row in this many fails first and succeeds on a rerun


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


def prepare(src: Path, work: Path, out: Path) -> dict[str, float]:
    """validate + shard."""
    from anex_pipeline.options import job_options
    from anex_pipeline.stages.submit import prepare_job

    started = time.perf_counter()
    job = prepare_job(src, str(out), job_options({"max_tokens": 16}), work)
    seconds = time.perf_counter() - started
    (work / "job_id").write_text(job.job_id)
    return {"seconds": seconds}


def fill(src: Path, work: Path, out: Path) -> dict[str, float]:
    """Writes each shard's checkpoint the way generation does: the reused sample rows first (in
    sample order), then the rest in row order, where one row in a thousand failed and was
    appended again, finished, by a rerun; in chunks of the job's ``checkpoint_rows``, as
    generation appends them."""
    from anex_pipeline.engine.completions import Generated, chat_completion
    from anex_pipeline.spec import RowError, RowOutcome
    from anex_pipeline.workdir.manifest import JobDir

    job = JobDir(work, (work / "job_id").read_text())
    manifest = job.manifest()
    generated = Generated(text=ANSWER, finish_reason="stop", prompt_tokens=21, completion_tokens=8)
    usage = {"prompt_tokens": 21, "completion_tokens": 8, "reasoning_tokens": 0, "cached_prompt_tokens": 0}
    sample = random.Random(0).sample(range(manifest.total_rows), min(SAMPLE_ROWS, manifest.total_rows))
    failed = RowError(message="synthetic failure", type="engine_error")
    chunk = manifest.job_options().checkpoint_rows

    def done(i: int, key: str) -> RowOutcome:
        body = chat_completion(f"{manifest.job_id}-{i}", manifest.model_name, generated)
        return RowOutcome(i, key, 200, body=body, usage=usage)

    for shard, rng in enumerate(manifest.shards):
        keys = {r.index: r.key for r in job.read_requests(shard) if r.index in sample}
        job.record_outcomes(shard, [done(i, keys[i]) for i in sample if rng.start <= i < rng.stop])
        batch: list[RowOutcome] = []
        retried: list[RowOutcome] = []
        for r in job.read_requests(shard):
            if r.index in keys:
                continue
            if r.index % RETRIED_EVERY == 1:
                batch.append(RowOutcome(r.index, r.key, 500, error=failed))
                retried.append(done(r.index, r.key))
            else:
                batch.append(done(r.index, r.key))
            if len(batch) == chunk:
                job.record_outcomes(shard, batch)
                batch = []
        job.record_outcomes(shard, batch)
        job.record_outcomes(shard, retried)
    return {}


def merge(src: Path, work: Path, out: Path) -> dict[str, float]:
    """merge + write, and the result published to the output path."""
    from anex_pipeline.stages.merge import merge_job
    from anex_pipeline.storage import publish
    from anex_pipeline.workdir.manifest import JobDir

    started = time.perf_counter()
    job = JobDir(work, (work / "job_id").read_text())
    merge_job(job)
    publish(job.result_path, str(out))
    return {"seconds": time.perf_counter() - started}


def copy(src: Path, out: Path) -> dict[str, float]:
    """For reference: the input read and written back unchanged, with polars or pyarrow."""
    started = time.perf_counter()
    if src.suffix == ".jsonl":
        import polars as pl

        pl.read_ndjson(src).write_ndjson(out)
    else:
        import pyarrow.parquet as pq

        pq.write_table(pq.read_table(src), out)
    return {"seconds": time.perf_counter() - started}


def baseline(src: Path, out: Path) -> dict[str, float]:
    """Reads the input with polars (JSONL) or pyarrow (Parquet) alone and writes an output of the
    same shape as ours: an OpenAI batch envelope per row holding a chat completion like the one
    the checkpoints hold, or the input's columns plus row_index, output and error_type."""
    started = time.perf_counter()
    if src.suffix == ".jsonl":
        import polars as pl

        requests = pl.read_ndjson(src)
        cid = pl.col("custom_id")
        message = pl.struct(role=pl.lit("assistant"), content=pl.lit(ANSWER))
        choice = pl.struct(
            index=pl.lit(0), message=message, logprobs=pl.lit(None, pl.Null), finish_reason=pl.lit("stop")
        )
        usage = pl.struct(
            prompt_tokens=pl.lit(21),
            completion_tokens=pl.lit(8),
            total_tokens=pl.lit(29),
            prompt_tokens_details=pl.struct(cached_tokens=pl.lit(0)),
            completion_tokens_details=pl.struct(reasoning_tokens=pl.lit(0)),
        )
        body = pl.struct(
            id=pl.concat_str(pl.lit("chatcmpl-"), cid),
            object=pl.lit("chat.completion"),
            created=pl.lit(int(time.time())),
            model=pl.lit("model"),
            choices=pl.concat_list(choice),
            usage=usage,
            system_fingerprint=pl.lit(None, pl.Null),
        )
        response = pl.struct(status_code=pl.lit(200), request_id=pl.concat_str(pl.lit("req_"), cid), body=body)
        requests.select(
            id=pl.concat_str(pl.lit("batch_req_"), cid), custom_id=cid, response=response, error=pl.lit(None, pl.Null)
        ).write_ndjson(out)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(src)
        rows = table.num_rows
        table = table.append_column("row_index", pa.array(range(rows), pa.int64()))
        table = table.append_column("output", pa.array([ANSWER] * rows, pa.string()))
        table = table.append_column("error_type", pa.nulls(rows, pa.string()))
        pq.write_table(table, out)
    return {"seconds": time.perf_counter() - started}


STEPS = {"prepare": prepare, "fill": fill, "merge": merge}
OURS = [
    "anex_pipeline.workdir.manifest",
    "anex_pipeline.stages.merge",
    "anex_pipeline.storage",
    "anex_pipeline.validate",
]
BASELINES = {"baseline": baseline, "copy": copy}
IMPORTS = {**{key: ["polars", "pyarrow.parquet"] for key in BASELINES}, **dict.fromkeys(STEPS, OURS)}


def child(step: str, src: str, folder: str) -> None:
    """Runs one step; reports its time, the process's peak memory, and the memory the process had
    before the step, with every module it uses imported."""
    import importlib

    for module in IMPORTS[step]:
        importlib.import_module(module)
    work = Path(folder)
    out = work / ("out" + Path(src).suffix)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figures = BASELINES[step](Path(src), out) if step in BASELINES else STEPS[step](Path(src), work / "work", out)
    peaks = (resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    figures["peak_rss_mb"] = max(peaks) / 1024  # the biggest process: the step's, or a worker's
    figures["imported_rss_mb"] = before
    print(json.dumps(figures))


def run_step(step: str, src: Path, folder: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.io_throughput", "--child", step, str(src), folder],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(src: Path, repeat: int) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float]]:
    """The baselines, then ours: validate + shard, the checkpoints (untimed), merge + write;
    each timed step ``repeat`` times, reporting the median time and the highest peak."""

    def repeated(step: str, folder: str | None = None) -> dict[str, float]:
        runs = []
        for _ in range(repeat):
            with tempfile.TemporaryDirectory(dir=src.parent) as fresh:
                runs.append(run_step(step, src, folder or fresh))
        return {
            "seconds": statistics.median(r["seconds"] for r in runs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "imported_rss_mb": max(r["imported_rss_mb"] for r in runs),
        }

    copied, base = repeated("copy"), repeated("baseline")
    prepared = repeated("prepare")
    with tempfile.TemporaryDirectory(dir=src.parent) as folder:
        run_step("prepare", src, folder)
        run_step("fill", src, folder)
        merged = repeated("merge", folder)  # the merge leaves the checkpoints as they are
    return copied, base, prepared, merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--format", choices=["jsonl", "parquet"], action="append", help="default: both")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each timed step; the median counts")
    parser.add_argument("--child", nargs=3, metavar=("STEP", "SRC", "FOLDER"), help=argparse.SUPPRESS)
    parser.add_argument("--inputs", nargs=2, metavar=("FOLDER", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.inputs:
        make_inputs(Path(args.inputs[0]), int(args.inputs[1]))
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("ANEX_BENCH_DIR")) as folder:
        # A child writes the inputs: Linux carries a process's peak memory over into the children
        # it starts, so this process must stay small for theirs to be their own.
        subprocess.run([sys.executable, "-m", "bench.io_throughput", "--inputs", folder, str(args.rows)], check=True)
        sources = {"jsonl": Path(folder) / "big.jsonl", "parquet": Path(folder) / "big.parquet"}
        for kind in args.format or sources:
            src = sources[kind]
            copied, base, prepared, merged = measure(src, args.repeat)
            ours = prepared["seconds"] + merged["seconds"]
            print(
                f"{kind} {args.rows:,} rows ({src.stat().st_size / 1e6:.0f} MB); peak memory (after imports):\n"
                f"  baseline {args.rows / base['seconds']:,.0f} rows/s ({base['seconds']:.2f} s), "
                f"peak {base['peak_rss_mb']:.0f} MB ({base['imported_rss_mb']:.0f} MB)\n"
                f"  ours     {args.rows / ours:,.0f} rows/s (validate+shard {prepared['seconds']:.2f} s, "
                f"peak {prepared['peak_rss_mb']:.0f} MB ({prepared['imported_rss_mb']:.0f} MB); "
                f"merge+write {merged['seconds']:.2f} s, peak {merged['peak_rss_mb']:.0f} MB "
                f"({merged['imported_rss_mb']:.0f} MB))\n"
                f"  ratio (ours / baseline rows/s) {base['seconds'] / ours:.2f}; for reference, the input "
                f"written back unchanged: {args.rows / copied['seconds']:,.0f} rows/s, "
                f"peak {copied['peak_rss_mb']:.0f} MB",
                flush=True,
            )


if __name__ == "__main__":
    main()
