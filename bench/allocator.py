"""The same job with and without preloading tcmalloc and Intel's OpenMP runtime into vLLM's CPU
engine processes (``ANEX_CPU_PRELOAD``), each setting in turn per round so that machine drift
hits them alike; engine start included. The input is bench/vs_run_batch.py's, unique rows.

    python -m bench.allocator --rows 512 --rounds 2           # the figure
    python -m bench.allocator --rows 16 --rounds 1            # a quick check

tcmalloc comes from Debian's libtcmalloc-minimal4 (``./dev setup`` installs it); a setting whose library
is missing is reported and left out.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from anex_pipeline.engine.vllm.cpu_environment import LIBRARIES, PRELOAD_ENV
from bench.vs_run_batch import make_input, output_tokens, run_ours

SETTINGS = ["", "tcmalloc", "iomp", "tcmalloc,iomp"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = [s for s in SETTINGS if all(LIBRARIES[n]() for n in filter(None, s.split(",")))]
    for missing in sorted(set(SETTINGS) - set(settings)):
        print(f"{PRELOAD_ENV}={missing}: a library is not installed (./dev setup installs tcmalloc); left out")
    times: dict[str, list[float]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        src = tmp / "in.jsonl"
        make_input(src, args.rows, unique=True)
        for r in range(args.rounds):
            for n, setting in enumerate(settings):
                out = tmp / f"out{r}-{n}.jsonl"
                seconds, report = run_ours(src, out, tmp / f"work{r}-{n}", env={PRELOAD_ENV: setting})
                times[setting].append(seconds)
                generate = report["timings"].get("generate", 0.0)
                print(
                    f"round {r + 1}, {PRELOAD_ENV}={setting or '(none)'}: {seconds:.1f} s "
                    f"(generation {generate:.1f} s, {output_tokens(out) / seconds:.1f} out tok/s)",
                    flush=True,
                )
    base = statistics.median(times[""])
    for setting, values in times.items():
        median = statistics.median(values)
        print(f"{setting or '(none)':>14}: median {median:.1f} s, ratio to none {median / base:.2f}")


if __name__ == "__main__":
    main()
