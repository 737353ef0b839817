"""A job rerun with some rows changed, as a new job of the same work folder: the answer store
answers the unchanged rows, so only the changed ones are generated. Prints both wall times, the
rows the second run generated and the target (the first run's wall time x 0.1 plus the second
run's engine start).

    python -m bench.answer_store_rerun --rows 2048 --changed 64
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from bench.vs_run_batch import make_input, run_ours


def edit_rows(src: Path, dst: Path, changed: int, seed: int = 7) -> set[int]:
    """``dst``: ``src`` with the user question of ``changed`` rows (chosen with ``seed``) edited."""
    lines = src.read_text().splitlines()
    picked = set(random.Random(seed).sample(range(len(lines)), changed))
    with dst.open("w") as f:
        for i, line in enumerate(lines):
            row = json.loads(line)
            if i in picked:
                row["body"]["messages"][-1]["content"] += " Answer briefly."
            f.write(json.dumps(row) + "\n")
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--changed", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        first_in, second_in, work = tmp / "v1.jsonl", tmp / "v2.jsonl", tmp / "work"
        make_input(first_in, args.rows, unique=True)
        edit_rows(first_in, second_in, args.changed)
        first_s, _ = run_ours(first_in, tmp / "v1.out.jsonl", work)
        second_s, report = run_ours(second_in, tmp / "v2.out.jsonl", work)
        reused = report["reused_from_earlier_jobs"] + report["reused_answer_rows"] + report["reused_sample_rows"]
        generated = report["request_counts"]["total"] - reused
        start = report["timings"].get("engine_load", 0.0)
        target = 0.1 * first_s + start
        print(
            f"first run {first_s:.1f} s; rerun with {args.changed} of {args.rows} rows changed {second_s:.1f} s "
            f"(engine start {start:.1f} s), {generated} rows generated, {report['reused_from_earlier_jobs']} from "
            f"earlier jobs; target {target:.1f} s: {'met' if second_s <= target else 'missed'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
