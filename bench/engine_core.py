"""vLLM's engine core in its own processes (the calling process, EngineCore and its Worker, each
importing vLLM) against the core in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one
import, the model in the command's own process; the command's choice for jobs of up to
``SMALL_JOB_ROWS`` rows), for
engine start and generation, on the same job run by ``anex-pipeline run``. Alternating pairs,
medians; unique rows, so that no answer is reused.

    python -m bench.engine_core --rows 8 256 --pairs 3
    python -m bench.engine_core --importtime     # what the command imports before the engine

The command's report gives the engine's load time (``engine_load``) and the generation time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.vs_run_batch import make_input, output_tokens, run_ours

# The variable as the user would set it, which the command leaves alone: either way, whatever the size.
MODES = {"processes": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "in-process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


def one_run(src: Path, tmp: Path, mode: str, n: int) -> dict[str, float]:
    out = tmp / f"{mode}-{n}.jsonl"
    wall, report = run_ours(src, out, tmp / f"work-{mode}-{n}", env=MODES[mode])
    timings = report["timings"]
    generate = timings.get("generate", 0.0)
    return {
        "wall": wall,
        "engine_load": timings.get("engine_load", 0.0),
        "generate": generate,
        "tok_s": output_tokens(out) / generate if generate else 0.0,
    }


def compare(rows: int, pairs: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        src = tmp / "in.jsonl"
        make_input(src, rows, unique=True)
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for pair in range(pairs):
            order = list(MODES) if pair % 2 == 0 else list(reversed(MODES))  # who goes first alternates too
            for mode in order:
                figures = one_run(src, tmp, mode, pair)
                runs[mode].append(figures)
                print(
                    f"{rows} rows, pair {pair + 1}, {mode}: wall {figures['wall']:.1f} s, engine load "
                    f"{figures['engine_load']:.1f} s, generation {figures['generate']:.1f} s "
                    f"({figures['tok_s']:.1f} out tok/s)",
                    flush=True,
                )
        for mode, figures in runs.items():
            med = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
            print(
                f"{rows} rows, {mode}, median of {pairs}: wall {med['wall']:.1f} s, engine load "
                f"{med['engine_load']:.1f} s, generation {med['generate']:.1f} s ({med['tok_s']:.1f} out tok/s)",
                flush=True,
            )


def importtime(top: int = 15) -> None:
    """The modules the command imports before any engine, by cumulative import time."""
    code = "import anex_pipeline.cli.commands, anex_pipeline.runner"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True)
    entries = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        own, cumulative, name = line.removeprefix("import time:").split("|")  # microseconds
        entries.append((int(cumulative), int(own), name))
    total = max(c for c, _, _ in entries)
    print(f"importing the command and its runner: {total / 1e6:.2f} s")
    for cumulative, own, name in sorted(entries, reverse=True)[:top]:
        print(f"  {cumulative / 1e6:6.2f} s cumulative, {own / 1e6:5.2f} s own  {name.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 256, 2048])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--importtime", action="store_true", help="only list what the command imports, and how long")
    args = parser.parse_args()
    if args.importtime:
        importtime()
        return
    for rows in args.rows:
        compare(rows, args.pairs)


if __name__ == "__main__":
    main()
