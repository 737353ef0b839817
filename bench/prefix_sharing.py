"""Unique rows that share long prefixes, against vLLM's own batch runner: dozens of documents of a
few hundred tokens, each asked a few questions, written question by question (every document's
first question, then every document's second, ...), so that the documents together do not fit in
the KV cache and file order evicts each document before its next question comes. Alternating
A B pairs, engine start included in both; the machinery is bench/vs_run_batch.py's.

    python -m bench.prefix_sharing --pairs 2                     # the figure: documents overflow 1 GiB of KV
    python -m bench.prefix_sharing --docs 4 --doc-tokens 200 --questions 2 --pairs 1   # a quick check

By default the number of documents is chosen from the model's KV bytes per token so that they
fill ``--overflow`` times the cache (``VLLM_CPU_KVCACHE_SPACE`` GiB, 1 unless set).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
from pathlib import Path

from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path
from bench.vs_run_batch import output_tokens, run_ours, run_peer

QUESTIONS = [
    "Summarise the document in one sentence.",
    "Which word appears first in the document?",
    "Is the document about a place, a person or a thing?",
    "Give the document a short title.",
    "Name one word the document repeats.",
    "How would you describe the document's tone?",
]
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "gu", "he", "ji", "fo", "wy"]


def kv_bytes_per_token(model: str, dtype_bytes: int = 4) -> int:
    """Keys and values of every layer for one token (the CPU build runs float32)."""
    config = json.loads(Path(model, "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes


def make_document(rng: random.Random, tokenizer, tokens: int) -> str:
    """Made-up words, about ``tokens`` tokens long; each document its own."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words.extend("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(20))
    return " ".join(words)


def make_input(path: Path, docs: int, doc_tokens: int, questions: int, max_tokens: int, model: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    documents = [make_document(rng, tokenizer, doc_tokens) for _ in range(docs)]
    with path.open("w") as f:
        for q in range(questions):
            for d, document in enumerate(documents):
                content = f"Document:\n{document}\n\nQuestion: {QUESTIONS[q % len(QUESTIONS)]}"
                body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
                row = {"custom_id": f"d{d}-q{q}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=None, help="documents (default: from --overflow)")
    parser.add_argument("--doc-tokens", type=int, default=500)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--overflow", type=float, default=1.5, help="documents' tokens over the KV cache's")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--no-prefix-order", action="store_true", help="ours in file order, to see what ordering adds")
    args = parser.parse_args()
    model = str(local_model_path(DEFAULT_CHAT_MODEL))
    cache_tokens = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30 // kv_bytes_per_token(model)
    docs = args.docs or math.ceil(args.overflow * cache_tokens / args.doc_tokens)
    rows = docs * args.questions
    print(
        f"{docs} documents of ~{args.doc_tokens} tokens x {args.questions} questions = {rows} rows; "
        f"documents {docs * args.doc_tokens:,} tokens, KV cache {cache_tokens:,} tokens",
        flush=True,
    )
    extra = ["--no-prefix-order"] if args.no_prefix_order else []
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        src = tmp / "in.jsonl"
        make_input(src, docs, args.doc_tokens, args.questions, args.max_tokens, model)
        for pair in range(args.pairs):
            peer_out, our_out = tmp / f"peer{pair}.jsonl", tmp / f"ours{pair}.jsonl"
            peer_s = run_peer(src, peer_out, model)
            our_s, report = run_ours(src, our_out, tmp / f"work{pair}", extra)
            ratios.append(our_s / peer_s)
            usage = report["usage"]
            cached, prompt = usage["cached_prompt_tokens"], usage["prompt_tokens"]
            print(
                f"pair {pair + 1}: run_batch {peer_s:.1f} s | anex-pipeline {our_s:.1f} s | time ratio "
                f"{our_s / peer_s:.2f}\n    ours: prompt tokens {prompt:,}, of which from vLLM's "
                f"prefix cache {cached:,} ({cached / max(1, prompt):.0%}); "
                f"output tokens ours {output_tokens(our_out):,}, run_batch {output_tokens(peer_out):,}",
                flush=True,
            )
    print(
        f"{rows} rows sharing document prefixes, median time ratio (ours / run_batch): {statistics.median(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
