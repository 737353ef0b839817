"""The command line's flags and help, and the job options read from flags, the options file and the
input's sidecar.

At about 450 lines this module is over the project's usual size because the flags and the code that
reads them back into job options belong together: each job option's flag is declared once here and
read once here, so a new option is one change in one file."""

from __future__ import annotations

import argparse
import difflib
import json
from typing import Any, NoReturn

from anex_pipeline.errors import RejectedError

# Flags that map one-to-one onto job options: (flag, option name, type).
OPTION_FLAGS: list[tuple[str, str, Any]] = [
    ("--model", "model", str),
    ("--endpoint", "endpoint", str),
    ("--reasoning-budget", "reasoning_budget", int),
    ("--max-tokens", "max_tokens", int),
    ("--reasoning-parser", "reasoning_parser", str),
    ("--tool-parser", "tool_parser", str),
    ("--shards", "shards", int),
    ("--shard-rows", "shard_rows", int),
    ("--temperature", "temperature", float),
    ("--top-p", "top_p", float),
    ("--top-k", "top_k", int),
    ("--seed", "seed", int),
    ("--prompt-column", "prompt_column", str),
    ("--image-column", "image_column", str),
    ("--system-prompt", "system_prompt", str),
    ("--estimate-sample-size", "estimate_sample_size", int),
    ("--top-logprobs", "top_logprobs", int),
    ("--max-job-tokens", "max_job_tokens", int),
]


BOOL_FLAGS = [
    ("--reasoning", "reasoning"),
    ("--parse-thinking", "parse_thinking"),
    ("--parse-tool-calls", "parse_tool_calls"),
    ("--prefix-order", "prefix_order"),
    ("--answer-store", "answer_store"),
    ("--logprobs", "logprobs"),
]


# What each job flag does, for --help: whether it is a cap or a default, and what happens when it is absent.
FLAG_HELP: dict[str, str] = {
    "model": "HF model id or local folder (default: the embedded SmolLM2-135M-Instruct; "
    "all-MiniLM-L6-v2 for embeddings; score and rerank jobs name a cross-encoder)",
    "endpoint": "chat, completions, embeddings, responses, score, rerank, classify, transcriptions or "
    "translations (default: from the rows' url, else chat)",
    "reasoning_budget": "thinking tokens a row may use before its trace is closed; 0 = no cap "
    "(default: estimated from a sample for reasoning models)",
    "max_tokens": "output-token cap for every row that sets none of its own (a row's own max_tokens wins); "
    "default: estimated from a generated sample, reported as estimate.max_tokens",
    "reasoning_parser": "name of vLLM's reasoning parser (default: chosen from the model)",
    "tool_parser": "name of vLLM's tool-call parser (default: chosen from the model)",
    "shards": "how many shards (Dagster partitions) the rows are split into (default: by size)",
    "shard_rows": "at most this many rows per shard (instead of --shards; default: by rows and tokens)",
    "temperature": "default for rows that set none (default: the model's)",
    "top_p": "default for rows that set none (default: the model's)",
    "top_k": "default for rows that set none (default: the model's)",
    "seed": "default for rows that set none; with it, sampled rows are reproducible",
    "prompt_column": "Parquet column holding the prompt (default: messages, prompt, input or text)",
    "image_column": "Parquet column with an image for each row's prompt: a URL (http(s) or data:) "
    "or the image file's bytes (default: none)",
    "system_prompt": "system message for every chat row without one (instructions for responses rows)",
    "estimate_sample_size": "rows generated to estimate max_tokens (default: 100)",
    "top_logprobs": "Parquet jobs, with --logprobs: the best alternatives listed for each token, 0 to 20 "
    "(JSONL rows ask in their own body)",
    "max_job_tokens": "the most output tokens the rows may ask for together, each row n x its max_tokens "
    "(default: 2^34)",
}


BOOL_HELP: dict[str, str] = {
    "reasoning": "switch thinking on or off for models that have it (default: the model's own)",
    "parse_thinking": "put the thinking trace in message.reasoning_content (default: on where the model has a parser)",
    "parse_tool_calls": "put tool calls in message.tool_calls (default: on where the model has a parser)",
    "prefix_order": "send rows that share a long prompt prefix to the engine together (default: on; "
    "--no-prefix-order keeps file order)",
    "answer_store": "answer deterministic rows that an earlier job of the work folder answered on the same model "
    "and engine settings with that answer, not generated again (default: on)",
    "logprobs": "Parquet jobs: a logprobs column with each generated token's logprob (JSONL rows ask in their "
    "own body; default: off)",
}


# vLLM engine arguments common enough for a flag of their own, spelled as vLLM spells them:
# (engine argument, type, help). Each lands in the engine's engine_args like --engine-arg would.
ENGINE_ARG_FLAGS: list[tuple[str, Any, str]] = [
    ("tensor_parallel_size", int, "GPUs one engine splits each layer over (default: 1)"),
    ("pipeline_parallel_size", int, "GPUs one engine splits the layers over (default: 1)"),
    ("quantization", str, "weights' quantization method, e.g. fp8, awq (default: from the model's config)"),
    ("kv_cache_dtype", str, "KV cache dtype, e.g. fp8 (default: auto, the model's dtype)"),
    ("max_num_seqs", int, "rows the engine schedules at once (default: vLLM's)"),
    ("max_num_batched_tokens", int, "tokens the engine schedules in one step (default: vLLM's)"),
]
ENGINE_BOOL_FLAGS: list[tuple[str, str]] = [
    ("enable_prefix_caching", "keep computed prompt blocks for later rows (default: vLLM's, on)"),
    ("enable_chunked_prefill", "split long prompts over engine steps (default: vLLM's)"),
    ("trust_remote_code", "run the model repository's own code (default: off)"),
    ("enforce_eager", "no CUDA graphs (default: off on a GPU, on on the CPU build)"),
]


class UsageError(RejectedError):
    """A mistake in the command line or the options file."""


class _OneLineParser(argparse.ArgumentParser):
    """Reports a mistake on the command line in one line that names the command's help, instead
    of argparse's usage block, which hides the mistake under every option the command has."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; `{self.prog} --help` lists what it takes\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        """As argparse's, but an unknown flag is reported by the command it was given to, with the
        nearest flag that command has (a typo such as --temprature)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = self._commands().get(getattr(parsed, "command", None) or "", self)
            flags = [f for action in command._actions for f in action.option_strings if f.startswith("--")]
            unknown = next((e.split("=", 1)[0] for e in extra if e.startswith("--")), "")
            near = difflib.get_close_matches(unknown, flags, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return parsed

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def _add_option_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job options (override the options file)")
    g.add_argument("--options", metavar="FILE", help="JSON file of job options; default: <input>.job.json if present")
    for flag, name, kind in OPTION_FLAGS:
        g.add_argument(flag, dest=name, type=kind, default=None, metavar=name.upper(), help=FLAG_HELP[name])
    for flag, name in BOOL_FLAGS:
        g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=BOOL_HELP[name])
    g.add_argument("--response-format", metavar="JSON", help='e.g. \'{"type":"json_object"}\' or @schema.json')
    g.add_argument(
        "--media-allowed-host", action="append", default=None, metavar="HOST", help="allow media from HOST (repeatable)"
    )
    g.add_argument(
        "--lora-modules",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="a LoRA adapter of the job (local folder or HF id; repeatable): rows whose body.model is NAME run on it",
    )
    g.add_argument(
        "--set", action="append", default=[], metavar="KEY=JSON", help="any other option, e.g. --set prices='{...}'"
    )


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length of the engine (default: the model's own, capped by what the KV cache holds)",
    )
    g.add_argument("--dtype", default="auto", help="weights' dtype: auto, float32, bfloat16, ... (default: auto)")
    g.add_argument("--memory-share", type=float, default=None, help="gpu_memory_utilization (CPU: share of RAM)")
    g.add_argument("--work-dir", default=None, help="where jobs keep shards and checkpoints")
    g.add_argument(
        "--base-url",
        action="append",
        default=None,
        metavar="URL",
        help="send rows to this OpenAI-compatible server (e.g. `vllm serve`) instead of loading vLLM here; "
        "repeat it (or give a comma-separated list) for replicas of one model",
    )
    g.add_argument("--api-key", default=None, help="bearer token for --base-url; default: $ANEX_API_KEY")
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=32,
        help="with --base-url: requests in flight at once per server (default: 32)",
    )
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any vLLM engine argument by its EngineArgs name, VALUE as JSON or a string "
        '(e.g. --engine-arg speculative_config=\'{"method": "ngram"}\'); repeatable; default: $ANEX_ENGINE_ARGS',
    )
    for key, kind, text in ENGINE_ARG_FLAGS:
        flag, metavar = "--" + key.replace("_", "-"), "N" if kind is int else "NAME"
        g.add_argument(flag, dest=f"engine_{key}", type=kind, default=None, metavar=metavar, help=text)
    for key, text in ENGINE_BOOL_FLAGS:
        flag = "--" + key.replace("_", "-")
        g.add_argument(flag, dest=f"engine_{key}", action=argparse.BooleanOptionalAction, default=None, help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="anex-pipeline", description="Offline batch LLM jobs on vLLM and Dagster.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    run = sub.add_parser("run", help="run a job end to end and print a summary of its report")
    run.add_argument("input", help="JSONL (OpenAI batch format) or Parquet file")
    run.add_argument("-o", "--output", required=True, help="result file, same format as the input")
    run.add_argument("--report", default=None, help="report path; default <output>.report.json")
    run.add_argument("--quiet", action="store_true", help="no progress lines")
    run.add_argument("--verbose", action="store_true", help="show the engine's own log lines")
    run.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics of the job on http://127.0.0.1:PORT/metrics while it runs",
    )
    _json_flag(run)
    _add_option_flags(run)
    _engine_flags(run)
    run.add_argument(
        "--keep-engine",
        action="store_true",
        help="run on this machine's shared model server (started if none serves the job's model and engine "
        "settings) and leave it warm for its idle time, so the next run starts generating at once (runs without "
        "the flag use it too while it is up; ANEX_MACHINE_SERVER=0 keeps every run's model in its own process)",
    )

    val = sub.add_parser("validate", help="check an input file and its options without running it")
    val.add_argument("input")
    val.add_argument(
        "--quote",
        action="store_true",
        help="also say what the job would take: prompt tokens (the model's tokenizer), expected output tokens, "
        "engine time and cost, from what earlier jobs of the work folder measured; loads no engine",
    )
    val.add_argument(
        "--quote-sample",
        type=int,
        default=0,
        metavar="N",
        help="quote (as --quote) with the expected output and speed measured by generating N of the rows now, "
        "instead of from earlier jobs; loads the job's engine",
    )
    val.add_argument("--json", action="store_true", help="with --quote: print the quote as JSON")
    _add_option_flags(val)
    _work_dir_flag(val)

    back = sub.add_parser("backfill", help="rerun chosen shards of a job, or every shard with failed or missing rows")
    back.add_argument("job_id", help="the job id printed by `run` (also the Dagster `jobs` partition)")
    chosen = back.add_mutually_exclusive_group()
    chosen.add_argument("--shards", help="comma-separated shard numbers, e.g. 0,3")
    chosen.add_argument("--failed", action="store_true", help="every shard with failed or missing rows (default)")
    back.add_argument("--quiet", action="store_true", help="no progress lines")
    back.add_argument("--verbose", action="store_true", help="show the engine's own log lines")
    _json_flag(back)
    _engine_flags(back)

    res = sub.add_parser(
        "results", help="write the rows a job has finished so far (it may still be running), in input order"
    )
    res.add_argument("job_id", help="the job id printed by `run` (also the Dagster `jobs` partition)")
    res.add_argument(
        "-o", "--output", required=True, help="file to write, in the job's format (.jsonl or .parquet, as its input)"
    )
    res.add_argument(
        "--pending",
        action="store_true",
        help="also write the rows that have not run yet, marked: an error of type 'pending' (default: left out)",
    )
    _work_dir_flag(res)

    rep = sub.add_parser("report", help="print the report of a finished job")
    rep.add_argument("path", help="the result file or its .report.json")

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible Batch API; batches run as jobs here")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--keys-file",
        default=None,
        help="API keys, one per line (a key, or sha256:<hex> of one); default $ANEX_BATCH_API_KEYS "
        "(comma-separated), else the keys stored at the last start",
    )
    srv.add_argument(
        "--media",
        default=None,
        metavar="JSON",
        help="media policy of every batch, as the job option 'media' (JSON or @file.json); a batch may "
        "only name fewer hosts and lower limits",
    )
    srv.add_argument(
        "--media-allowed-host",
        action="append",
        default=None,
        metavar="HOST",
        help="let batches fetch media from HOST, e.g. an internal image store (repeatable)",
    )
    srv.add_argument(
        "--model",
        action="append",
        default=None,
        dest="models",
        metavar="NAME",
        help="a model batches may name (HF model id or local folder; repeatable); a batch that names none "
        "runs the first (default: only the embedded models, each the default of its endpoint)",
    )
    srv.add_argument(
        "--lora-modules",
        action="append",
        default=None,
        dest="engine_lora_modules",
        metavar="NAME=PATH",
        help="a LoRA adapter batches may name in body.model (local folder or HF id; repeatable); batches name "
        "adapters of this list only, never a path",
    )
    for flag, name in (("--reasoning-parser", "reasoning"), ("--tool-parser", "tool-call")):
        srv.add_argument(
            flag,
            default=None,
            metavar="NAME",
            help=f"vLLM's {name} parser of every batch (default: chosen from the model); batches cannot name "
            "another, since they share the engine",
        )
    srv.add_argument(
        "--max-running-batches",
        type=int,
        default=4,
        metavar="N",
        help="batches generating at once, their rows batched together on the one engine, and one more for an API "
        "key that has none in progress (default: 4)",
    )
    srv.add_argument(
        "--max-completion-window",
        type=window_seconds,
        default=None,
        metavar="DURATION",
        help="the longest any batch may run, e.g. 90s, 30m or 12h: a batch's completion_window (24h, or up "
        "to 168h) is cut to it, its expires_at shows the end, and a batch still running then ends expired "
        "(default: the batch's own window)",
    )
    srv.add_argument(
        "--max-job-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="the most output tokens one batch's rows may ask for together (each row n x its max_tokens); "
        "a batch above it is refused at creation, and a batch may set a lower max_job_tokens (default: the "
        "job budget of every run, 2^34)",
    )
    srv.add_argument(
        "--webhook-url",
        default=None,
        metavar="URL",
        help="POST a signed event there when a batch ends (batch.completed, .failed, .cancelled, .expired); "
        "default $ANEX_WEBHOOK_URL",
    )
    srv.add_argument(
        "--webhook-secret",
        default=None,
        metavar="SECRET",
        help="the events' signing secret, whsec_ followed by base64; default $ANEX_WEBHOOK_SECRET",
    )
    srv.add_argument(
        "--webhook-allowed-host",
        action="append",
        default=None,
        metavar="HOST",
        help="let webhooks reach HOST (or HOST:PORT) although it is a loopback, private or metadata address "
        "(repeatable)",
    )
    srv.add_argument("--quiet", action="store_true", help="no progress lines")
    srv.add_argument("--verbose", action="store_true", help="show the engine's own log lines")
    _engine_flags(srv)

    lst = sub.add_parser("list", help="list the jobs of the work folder, newest first")
    lst.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    _work_dir_flag(lst)

    dele = sub.add_parser("delete", help="remove a job's work folder and its Dagster history (not its result)")
    dele.add_argument("job_id", help="the job id shown by `list` or printed by `run`")
    _work_dir_flag(dele)

    prn = sub.add_parser(
        "prune", help="remove jobs not active for a while, and the Batch API's expired files (results stay)"
    )
    prn.add_argument("--older-than", required=True, metavar="AGE", help="e.g. 7d, 12h, 30m, 90s: last activity")
    prn.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    prn.add_argument("--json", action="store_true", help="print JSON for scripts")
    _work_dir_flag(prn)

    ms = sub.add_parser("machine-server", help="show or stop the model server this machine's Dagster steps share")
    ms.add_argument("action", choices=["status", "stop"], help="status: print it; stop: stop it now")
    return parser


WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600}


def window_seconds(text: str) -> int:
    """A duration such as ``90s``, ``30m`` or ``12h``, in whole seconds (at least 1)."""
    number, unit = text.strip()[:-1], text.strip()[-1:]
    if unit not in WINDOW_UNITS or not number.isascii() or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of s, m or h, such as 90s, 30m or 12h; got {text!r}")
    return int(number) * WINDOW_UNITS[unit]


def positive_int(text: str) -> int:
    """A whole number of at least 1."""
    if not text.strip().isascii() or not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1; got {text!r}")
    return int(text)


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        help="print the JSON report on standard output even at a terminal (it is printed whenever "
        "standard output is not one); the summary goes to standard error either way",
    )


def _work_dir_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work-dir", default=None, help="where jobs keep their work (default: $ANEX_WORK_DIR or the cache)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("anex-pipeline")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def collect_options(args: argparse.Namespace) -> dict[str, Any]:
    """Options file (explicit, or the input's sidecar) overlaid with the flags that were given."""
    from anex_pipeline.options import read_options_file, sidecar_of

    raw: dict[str, Any] = {}
    path = args.options
    sidecar = sidecar_of(args.input)
    if path is None and sidecar.exists():
        path = str(sidecar)
    if path:
        raw.update(read_options_file(path))
    for _, name, _ in OPTION_FLAGS:
        if getattr(args, name) is not None:
            raw[name] = getattr(args, name)
    for _, name in BOOL_FLAGS:
        if getattr(args, name) is not None:
            raw[name] = getattr(args, name)
    if args.response_format:
        raw["response_format"] = _json_arg("--response-format", args.response_format)
    if args.lora_modules:
        from anex_pipeline.engine.adapters import lora_modules_of

        modules = raw.get("lora_modules") or {}
        if isinstance(modules, dict):  # anything else is left for the option check to reject
            raw["lora_modules"] = {**modules, **lora_modules_of(args.lora_modules)}
    if args.media_allowed_host:
        media = raw.get("media", {})  # anything but an object is left for the option check to reject
        raw["media"] = {**media, "allowed_hosts": args.media_allowed_host} if isinstance(media, dict) else media
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--set takes KEY=JSON, got {item!r}")
        raw[key] = _json_arg(f"--set {key}", value)
    return raw


def _json_arg(flag: str, text: str) -> Any:
    from anex_pipeline.options import NESTED_TOO_DEEP, read_text_file

    if text.startswith("@"):
        text = read_text_file(text[1:], f"{flag} file")
    try:
        return json.loads(text)
    except RecursionError:  # the reader gives up at about 1,000 levels
        raise UsageError(f"{flag} {NESTED_TOO_DEEP}") from None
    except json.JSONDecodeError:
        if flag.startswith("--set"):
            return text  # a bare string value
        raise UsageError(f"{flag} must be JSON (or @file.json): {text!r}") from None


def _media_policy(args: argparse.Namespace) -> Any:
    """The operator's media policy for ``serve``: --media, with --media-allowed-host added."""
    from pydantic import ValidationError

    from anex_pipeline.spec import MediaOptions

    raw = _json_arg("--media", args.media) if args.media else {}
    if not isinstance(raw, dict):
        raise UsageError("--media must be a JSON object of media options, e.g. '{\"max_bytes\": 1000000}'")
    hosts = raw.get("allowed_hosts", [])
    if args.media_allowed_host and isinstance(hosts, list):
        raw["allowed_hosts"] = [*hosts, *args.media_allowed_host]
    try:
        return MediaOptions.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "media"
        raise UsageError(f"--media: {where}: {first['msg']}") from None


def engine_args_of(args: argparse.Namespace) -> dict[str, Any] | None:
    """The engine arguments of the command line (--engine-arg, then the flags named after
    engine arguments), or None when none was given (the settings' default then stands)."""
    from anex_pipeline.engine.engine_args import parse_engine_arg

    given = dict(parse_engine_arg(item) for item in args.engine_arg)
    for key in [k for k, _, _ in ENGINE_ARG_FLAGS] + [k for k, _ in ENGINE_BOOL_FLAGS]:
        if getattr(args, f"engine_{key}") is not None:
            given[key] = getattr(args, f"engine_{key}")
    return given or None
