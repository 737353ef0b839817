"""End-to-end benchmark against vLLM's own batch runner on the same input, model and engine
settings, alternating A B A B so that machine drift hits both sides alike. Engine start is part
of both wall times.

    python -m bench.vs_run_batch --rows 512 --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from anex_pipeline.models import DEFAULT_CHAT_MODEL, local_model_path

SYSTEMS = [
    "You are a concise assistant.",
    "You are a helpful support agent for an online bookshop. Answer in one or two sentences.",
    "You translate short phrases. Reply with the translation only.",
]
QUESTIONS = [
    "What is the capital of {c}?",
    "Give one tip for learning {c} quickly.",
    "Translate 'good morning' into the language of {c}.",
    "Write one sentence about the history of {c}.",
    "List three foods popular in {c}.",
]
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Peru", "Egypt", "Vietnam"]


def make_input(path: Path, rows: int, seed: int = 0) -> None:
    """Chat rows of mixed lengths with shared system prompts and some repeated prompts."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(rows):
            system = rng.choice(SYSTEMS)
            question = rng.choice(QUESTIONS).format(c=rng.choice(COUNTRIES))
            body = {
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "max_tokens": rng.choice([16, 32, 48, 64]),
                "temperature": 0,
            }
            f.write(json.dumps({"custom_id": f"b-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
            f.write("\n")


def output_tokens(path: Path) -> int:
    total = 0
    for line in path.read_text().splitlines():
        body = (json.loads(line).get("response") or {}).get("body") or {}
        total += (body.get("usage") or {}).get("completion_tokens", 0)
    return total


def run_peer(src: Path, out: Path, model: str) -> float:
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(out),
        "--model", model, "--served-model-name", DEFAULT_CHAT_MODEL, "--dtype", "float32", "--enforce-eager",
        "--gpu-memory-utilization", "0.3", "--max-model-len", "2048",
    ]  # fmt: skip
    return _timed(command)


def run_ours(src: Path, out: Path, work: Path) -> float:
    command = [
        str(Path(sys.executable).with_name("anex-pipeline")), "run", str(src), "-o", str(out),
        "--max-model-len", "2048", "--work-dir", str(work), "--quiet",
    ]  # fmt: skip
    return _timed(command)


def _timed(command: list[str]) -> float:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    model = local_model_path(DEFAULT_CHAT_MODEL)
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        src = tmp / "in.jsonl"
        make_input(src, args.rows)
        for pair in range(args.pairs):
            peer_out, our_out = tmp / f"peer{pair}.jsonl", tmp / f"ours{pair}.jsonl"
            peer_s = run_peer(src, peer_out, model)
            our_s = run_ours(src, our_out, tmp / f"work{pair}")  # a fresh work folder: no resumed rows
            peer_tok, our_tok = output_tokens(peer_out), output_tokens(our_out)
            ratios.append(our_s / peer_s)
            print(
                f"pair {pair + 1}: run_batch {peer_s:.1f} s ({peer_tok / peer_s:.1f} out tok/s) | "
                f"anex-pipeline {our_s:.1f} s ({our_tok / our_s:.1f} out tok/s) | time ratio {our_s / peer_s:.2f}",
                flush=True,
            )
    print(f"{args.rows} rows, median time ratio (ours / run_batch): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
