"""Batches that share the engine: three batches submitted together against one batch alone, on a
real ``anex-pipeline serve`` (in-process vLLM), alternating one / three so that machine drift hits
both alike; the medians and their ratio are printed (target: three together within 1.5x of one).
The engine is loaded by a warm-up batch first, so no round pays for it.

With ``--merged`` each pair also runs one batch holding the rows of all three: the engine's own
time for that many rows, which three batches together cannot beat (on a CPU the engine's
throughput grows much less than the number of rows it runs at once).

    python -m bench.batches_together --rows 20 --pairs 3
    python -m bench.batches_together --rows 20 --pairs 3 --merged
    python -m bench.batches_together --rows 2 --pairs 1      # a quick check that it works
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

from anex_pipeline.engine.orphans import signal_child_group
from bench.vs_run_batch import make_input

KEYS = ["sk-bench-alice-0123456789", "sk-bench-bob-0123456789", "sk-bench-carol-0123456789"]
DONE = {"completed", "failed", "cancelled", "expired"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(work: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DAGSTER_HOME": str(work / "home"), "ANEX_BATCH_API_KEYS": ",".join(KEYS)}
    (work / "home").mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "anex_pipeline.cli", "serve", "--port", str(port), "--quiet",
        "--max-model-len", "2048", "--work-dir", str(work / "work"),
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_up(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            sys.exit(f"serve exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/batches", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"serve did not answer in 120 s:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)


def run_round(url: str, inputs: list[Path]) -> float:
    """Seconds from submitting the batches (one per key) until the last one is done."""
    sdks = [OpenAI(base_url=url, api_key=key, max_retries=0) for key in KEYS[: len(inputs)]]
    uploaded = []
    for sdk, path in zip(sdks, inputs, strict=True):
        with path.open("rb") as f:
            uploaded.append(sdk.files.create(file=f, purpose="batch").id)
    started = time.monotonic()
    batches = [
        sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
        for sdk, file_id in zip(sdks, uploaded, strict=True)
    ]
    for sdk, batch_id in zip(sdks, batches, strict=True):
        while (batch := sdk.batches.retrieve(batch_id)).status not in DONE:
            time.sleep(0.05)
        if batch.status != "completed":
            sys.exit(f"batch {batch_id} ended {batch.status}: {batch.errors}")
    return time.monotonic() - started


def merge_inputs(inputs: list[Path], path: Path) -> None:
    """One input file with the rows of all ``inputs``, their custom ids kept apart."""
    with path.open("w", encoding="utf-8") as out:
        for n, src in enumerate(inputs):
            for line in src.read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                row["custom_id"] = f"{n}-{row['custom_id']}"
                out.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20, help="rows per batch")
    parser.add_argument("--pairs", type=int, default=3, help="rounds of one batch and of three")
    parser.add_argument("--merged", action="store_true", help="also time one batch with the rows of all three")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="anex-bench-") as tmp:
        work = Path(tmp)
        inputs = []
        for n in range(3):  # different rows per batch: no answer of one is reused by another
            inputs.append(work / f"in-{n}.jsonl")
            make_input(inputs[-1], args.rows, seed=n + 1, unique=True)
        merged = work / "in-merged.jsonl"
        merge_inputs(inputs, merged)
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        log = work / "serve.log"
        proc = start_serve(work, port, log)
        try:
            wait_up(proc, url, log)
            print(f"warm-up (engine load): {run_round(url, inputs[:1]):.1f} s", file=sys.stderr)
            one, three, all_in_one = [], [], []
            for pair in range(args.pairs):
                one.append(run_round(url, inputs[:1]))
                three.append(run_round(url, inputs))
                line = f"pair {pair + 1}: one {one[-1]:.2f} s, three together {three[-1]:.2f} s"
                if args.merged:
                    all_in_one.append(run_round(url, [merged]))
                    line += f", their rows in one batch {all_in_one[-1]:.2f} s"
                print(line, file=sys.stderr)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                signal_child_group(proc, signal.SIGKILL)
                proc.wait()
    m1, m3 = statistics.median(one), statistics.median(three)
    print(f"rows per batch {args.rows}; median one batch {m1:.2f} s; three together {m3:.2f} s; ratio {m3 / m1:.2f}")
    if all_in_one:
        mm = statistics.median(all_in_one)
        print(
            f"their {3 * args.rows} rows in one batch {mm:.2f} s ({mm / m1:.2f}x one batch); "
            f"three together {m3 / mm:.2f}x that"
        )


if __name__ == "__main__":
    main()
