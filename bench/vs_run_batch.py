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
from collections.abc import Sequence
from pathlib import Path

from anex_pipeline.engine.config import EngineSettings
from anex_pipeline.engine.engine_args import canonical, cli_flags, engine_kwargs, parse_engine_arg
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path
from anex_pipeline.engine.server.machine_server import cpu_build

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


def make_input(path: Path, rows: int, seed: int = 0, unique: bool = False) -> None:
    """Chat rows of mixed lengths with shared system prompts and some repeated prompts (with
    ``unique``, every question is made different so that no answer can be reused)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(rows):
            system = rng.choice(SYSTEMS)
            question = rng.choice(QUESTIONS).format(c=rng.choice(COUNTRIES))
            if unique:
                question += f" (question {i})"
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


def answers(path: Path) -> dict[str, str]:
    """Each row's answer text by custom_id."""
    found = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        choices = ((row.get("response") or {}).get("body") or {}).get("choices") or [{}]
        found[row["custom_id"]] = (choices[0].get("message") or {}).get("content")
    return found


def run_peer(
    src: Path, out: Path, model: str, env: dict[str, str] | None = None, engine_args: dict | None = None
) -> float:
    """run_batch's wall time, its engine built from the arguments the pipeline's engine gets."""
    settings = EngineSettings(
        model=str(model), model_name=DEFAULT_CHAT_MODEL, max_model_len=2048, engine_args=canonical(engine_args or {})
    )
    command = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(out)]
    command += [*cli_flags(engine_kwargs(settings, cpu_build())), "--served-model-name", DEFAULT_CHAT_MODEL]
    return _timed(command, env)[0]


def run_ours(
    src: Path, out: Path, work: Path, extra: Sequence[str] = (), env: dict[str, str] | None = None
) -> tuple[float, dict]:
    """Wall time and the job report (printed on stdout); ``extra``: more flags for the command,
    ``env``: more environment variables."""
    command = [
        sys.executable, "-m", "anex_pipeline.cli", "run", str(src), "-o", str(out),
        "--max-model-len", "2048", "--work-dir", str(work), "--quiet", *extra,
    ]  # fmt: skip
    seconds, stdout = _timed(command, env)
    return seconds, json.loads(stdout)


def _timed(command: list[str], more_env: dict[str, str] | None = None) -> tuple[float, str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(more_env or {})}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return time.perf_counter() - started, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--unique", action="store_true", help="no repeated prompts: measures without answer reuse")
    parser.add_argument(
        "--peer-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable for run_batch's environment (e.g. the pipeline's CPU core setting), repeatable",
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a vLLM engine argument for both sides (as `anex-pipeline run --engine-arg`), repeatable",
    )
    args = parser.parse_args()
    engine_args = dict(parse_engine_arg(item) for item in args.engine_arg)
    ours_extra = [flag for item in args.engine_arg for flag in ("--engine-arg", item)]
    model = local_model_path(DEFAULT_CHAT_MODEL)
    peer_env = dict(item.split("=", 1) for item in args.peer_env)
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        src = tmp / "in.jsonl"
        make_input(src, args.rows, unique=args.unique)
        for pair in range(args.pairs):
            peer_out, our_out = tmp / f"peer{pair}.jsonl", tmp / f"ours{pair}.jsonl"
            peer_s = run_peer(src, peer_out, model, peer_env, engine_args)
            # A fresh work folder: no resumed rows.
            our_s, report = run_ours(src, our_out, tmp / f"work{pair}", ours_extra)
            peer_tok, our_tok = output_tokens(peer_out), output_tokens(our_out)
            ratios.append(our_s / peer_s)
            theirs, mine = answers(peer_out), answers(our_out)
            differing = sum(mine.get(key) != text for key, text in theirs.items())
            timings, usage = report["timings"], report["usage"]
            cached = usage["cached_prompt_tokens"] / max(1, usage["prompt_tokens"])
            engine_s = timings.get("engine_load", 0.0) + timings.get("generate", 0.0) + timings.get("estimate", 0.0)
            print(
                f"pair {pair + 1}: run_batch {peer_s:.1f} s ({peer_tok / peer_s:.1f} out tok/s) | "
                f"anex-pipeline {our_s:.1f} s ({our_tok / our_s:.1f} out tok/s) | time ratio {our_s / peer_s:.2f}\n"
                f"    ours: engine load + generation {engine_s:.1f} s, everything else "
                f"{our_s - engine_s:.1f} s ({(our_s - engine_s) / our_s:.1%}); rows answered by an identical row "
                f"{report['reused_answer_rows']}; prompt tokens from vLLM's prefix cache {cached:.0%}; "
                f"answers unlike run_batch's {differing} of {len(theirs)}",
                flush=True,
            )
    kind = "unique" if args.unique else "with repeats"
    print(f"{args.rows} rows ({kind}), median time ratio (ours / run_batch): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
