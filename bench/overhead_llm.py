"""The plainest way to run a batch file's chat rows on vLLM, for ``bench.overhead`` to compare
with: read the rows, build ``vllm.LLM`` from the given engine arguments, one ``LLM.chat`` over
every row (each with its own ``max_tokens`` and ``temperature``), write one result line per row in
the OpenAI batch output's shape (only the fields the benchmark reads), and end as any script does
(vLLM shuts its engine processes down at exit; ``bench.overhead`` reads when the result was
written from the file's modification time).

    python -m bench.overhead_llm IN.jsonl OUT.jsonl ENGINE_ARGS.json [--steps FILE]

``--steps``: every engine step's start and end (``bench.step_timing``): vLLM's own loop
(``LLM._run_engine``), for comparison with the pipeline's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("engine_args", type=Path, help="JSON object: the keyword arguments of vllm.LLM")
    parser.add_argument("--steps", type=Path)
    args = parser.parse_args()
    if args.steps:
        from bench import step_timing

        step_timing.install()
    rows = [json.loads(line) for line in args.src.read_text().splitlines() if line.strip()]
    from vllm import LLM, SamplingParams

    llm = LLM(**json.loads(args.engine_args.read_text()))
    conversations = [row["body"]["messages"] for row in rows]
    params = [
        SamplingParams(max_tokens=row["body"]["max_tokens"], temperature=row["body"].get("temperature", 1.0))
        for row in rows
    ]
    results = llm.chat(conversations, params, use_tqdm=False)
    with args.out.open("w") as f:
        for row, result in zip(rows, results, strict=True):
            answer = result.outputs[0]
            usage = {"prompt_tokens": len(result.prompt_token_ids), "completion_tokens": len(answer.token_ids)}
            choice = {"index": 0, "message": {"role": "assistant", "content": answer.text}}
            body = {"choices": [{**choice, "finish_reason": answer.finish_reason}], "usage": usage}
            f.write(json.dumps({"custom_id": row["custom_id"], "response": {"status_code": 200, "body": body}}))
            f.write("\n")
    if args.steps:
        step_timing.write(args.steps)


if __name__ == "__main__":  # vLLM's engine processes are spawned: they import this module again
    main()
