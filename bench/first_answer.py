"""Time to the first answer and wall time of small jobs, side by side with vLLM's ``run_batch``
on the same input, model and engine settings (``--peer-env`` as in ``bench.vs_run_batch``),
alternating pairs, medians. Each of our runs is a new process (the page cache stays warm) and
writes each answer to its checkpoint as it finishes (``checkpoint_rows=1``), which is where
the first answer is seen; ``run_batch`` writes its whole file at the end.

    python -m bench.first_answer --rows 8 64 --pairs 3
    python -m bench.first_answer --rows 8 --pairs 3 --twice   # the second of two runs in a row

With ``--twice`` the first run of each pair has ``--keep-engine`` and the second, on other rows
of the same model and settings, finds the engine warm (a machine server folder of the
benchmark's own, stopped at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path
from anex_pipeline.engine.server.machine_server import stop_server
from bench.vs_run_batch import make_input, run_peer


def run_watching(
    src: Path, out: Path, work: Path, *more: str, env: dict[str, str] | None = None
) -> tuple[float, float]:
    """Our command's wall time and its time to the first answer checkpointed, in seconds."""
    command = [
        sys.executable, "-m", "anex_pipeline.cli", "run", str(src), "-o", str(out), "--max-model-len", "2048",
        "--work-dir", str(work), "--quiet", "--set", "checkpoint_rows=1", *more,
    ]  # fmt: skip
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
    started = time.perf_counter()
    process = subprocess.Popen(command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = None
    while process.poll() is None:
        if first is None and any(p.stat().st_size for p in work.glob("*/shards/*/results.*")):
            first = time.perf_counter() - started
        time.sleep(0.02)
    wall = time.perf_counter() - started
    report = json.loads(process.stdout.read() if process.stdout else "{}")
    if process.returncode != 0 or report.get("status") != "completed":
        raise SystemExit(f"our run failed: {process.returncode}, {report.get('failure_reason')}")
    return wall, first if first is not None else wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--twice", action="store_true", help="measure the second of two runs in a row")
    parser.add_argument("--peer-env", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    peer_env = dict(item.split("=", 1) for item in args.peer_env)
    model = local_model_path(DEFAULT_CHAT_MODEL)
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        servers = tmp / "machine-server"
        servers.mkdir(mode=0o700)
        ours_env = {"ANEX_MACHINE_SERVER_DIR": str(servers)}
        try:
            for rows in args.rows:
                peer_s, our_wall, our_first = [], [], []
                for pair in range(args.pairs):
                    src = tmp / f"in-{rows}-{pair}.jsonl"
                    make_input(src, rows, seed=pair, unique=True)
                    peer = run_peer(src, tmp / f"peer-{rows}-{pair}.jsonl", model, peer_env)
                    work = tmp / f"work-{rows}-{pair}"
                    if args.twice:
                        warm_src = tmp / f"warm-{rows}-{pair}.jsonl"
                        make_input(warm_src, rows, seed=1000 + pair, unique=True)
                        warm_out = tmp / f"warm-{rows}-{pair}.out.jsonl"
                        warm_work = tmp / f"warm-work-{rows}-{pair}"
                        run_watching(warm_src, warm_out, warm_work, "--keep-engine", env=ours_env)
                    wall, first = run_watching(src, tmp / f"ours-{rows}-{pair}.jsonl", work, env=ours_env)
                    if args.twice:
                        stop_server(servers)  # each pair's first run starts from a cold engine
                    peer_s.append(peer)
                    our_wall.append(wall)
                    our_first.append(first)
                    print(
                        f"{rows} rows, pair {pair + 1}: run_batch {peer:.1f} s | ours {wall:.1f} s, first answer "
                        f"after {first:.1f} s | wall ratio {wall / peer:.2f}",
                        flush=True,
                    )
                what = "second run" if args.twice else "cold process"
                print(
                    f"{rows} rows ({what}), medians of {args.pairs}: run_batch {statistics.median(peer_s):.1f} s, "
                    f"ours {statistics.median(our_wall):.1f} s, first answer {statistics.median(our_first):.1f} s, "
                    f"wall ratio {statistics.median(w / p for w, p in zip(our_wall, peer_s, strict=True)):.2f}",
                    flush=True,
                )
        finally:
            stop_server(servers)


if __name__ == "__main__":
    main()
