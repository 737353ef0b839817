"""The ``anex-pipeline`` command: run, validate, backfill and report.

Exit codes: 0 when the job completed (failed rows included), 1 when it failed or stopped early,
2 when it was rejected at submit (nothing ran, no result file).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_STOPPED, EXIT_REJECTED = 0, 1, 2

# Flags that map one-to-one onto job options: (flag, option name, type).
OPTION_FLAGS: list[tuple[str, str, Any]] = [
    ("--model", "model", str),
    ("--endpoint", "endpoint", str),
    ("--reasoning-budget", "reasoning_budget", int),
    ("--max-tokens", "max_tokens", int),
    ("--reasoning-parser", "reasoning_parser", str),
    ("--tool-parser", "tool_parser", str),
    ("--shards", "shards", int),
    ("--temperature", "temperature", float),
    ("--top-p", "top_p", float),
    ("--top-k", "top_k", int),
    ("--seed", "seed", int),
    ("--prompt-column", "prompt_column", str),
    ("--system-prompt", "system_prompt", str),
    ("--estimate-sample-size", "estimate_sample_size", int),
]
BOOL_FLAGS = [
    ("--reasoning", "reasoning"),
    ("--parse-thinking", "parse_thinking"),
    ("--parse-tool-calls", "parse_tool_calls"),
]


class UsageError(Exception):
    """A mistake in the command line or the options file."""


def _add_option_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job options (override the options file)")
    g.add_argument("--options", metavar="FILE", help="JSON file of job options; default: <input>.job.json if present")
    for flag, name, kind in OPTION_FLAGS:
        g.add_argument(flag, dest=name, type=kind, default=None, metavar=name.upper())
    for flag, name in BOOL_FLAGS:
        g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--response-format", metavar="JSON", help='e.g. \'{"type":"json_object"}\' or @schema.json')
    g.add_argument(
        "--media-allowed-host", action="append", default=None, metavar="HOST", help="allow media from HOST (repeatable)"
    )
    g.add_argument(
        "--set", action="append", default=[], metavar="KEY=JSON", help="any other option, e.g. --set prices='{...}'"
    )


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--memory-share", type=float, default=None, help="gpu_memory_utilization (CPU: share of RAM)")
    g.add_argument("--work-dir", default=None, help="where jobs keep shards and checkpoints")
    g.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help="send rows to this OpenAI-compatible server (e.g. `vllm serve`) instead of loading vLLM here",
    )
    g.add_argument("--api-key", default=None, help="bearer token for --base-url; default: $ANEX_API_KEY")
    g.add_argument("--max-concurrency", type=int, default=32, help="with --base-url: requests in flight at once")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anex-pipeline", description="Offline batch LLM jobs on vLLM and Dagster.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job end to end and print its report")
    run.add_argument("input", help="JSONL (OpenAI batch format) or Parquet file")
    run.add_argument("-o", "--output", required=True, help="result file, same format as the input")
    run.add_argument("--report", default=None, help="report path; default <output>.report.json")
    run.add_argument("--quiet", action="store_true", help="no progress lines")
    run.add_argument("--verbose", action="store_true", help="show the engine's own log lines")
    _add_option_flags(run)
    _engine_flags(run)

    val = sub.add_parser("validate", help="check an input file and its options without running it")
    val.add_argument("input")
    _add_option_flags(val)

    back = sub.add_parser("backfill", help="rerun chosen shards of a job, or every shard with failed or missing rows")
    back.add_argument("job_id", help="the job id printed by `run` (also the Dagster `jobs` partition)")
    chosen = back.add_mutually_exclusive_group()
    chosen.add_argument("--shards", help="comma-separated shard numbers, e.g. 0,3")
    chosen.add_argument("--failed", action="store_true", help="every shard with failed or missing rows (default)")
    back.add_argument("--quiet", action="store_true", help="no progress lines")
    back.add_argument("--verbose", action="store_true", help="show the engine's own log lines")
    _engine_flags(back)

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
    srv.add_argument("--quiet", action="store_true", help="no progress lines")
    srv.add_argument("--verbose", action="store_true", help="show the engine's own log lines")
    _engine_flags(srv)
    return parser


def collect_options(args: argparse.Namespace) -> dict[str, Any]:
    """Options file (explicit, or the input's sidecar) overlaid with the flags that were given."""
    raw: dict[str, Any] = {}
    path = args.options
    sidecar = Path(f"{args.input}.job.json")
    if path is None and sidecar.exists():
        path = str(sidecar)
    if path:
        try:
            loaded = json.loads(_read_regular_file(path, "options file"))
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"options file {path} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
            ) from None
        if not isinstance(loaded, dict):
            raise UsageError(f"options file {path} must hold a JSON object of option names and values")
        raw.update(loaded)
    for _, name, _ in OPTION_FLAGS:
        if getattr(args, name) is not None:
            raw[name] = getattr(args, name)
    for _, name in BOOL_FLAGS:
        if getattr(args, name) is not None:
            raw[name] = getattr(args, name)
    if args.response_format:
        raw["response_format"] = _json_arg("--response-format", args.response_format)
    if args.media_allowed_host:
        media = raw.get("media", {})  # anything but an object is left for the option check to reject
        raw["media"] = {**media, "allowed_hosts": args.media_allowed_host} if isinstance(media, dict) else media
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--set takes KEY=JSON, got {item!r}")
        raw[key] = _json_arg(f"--set {key}", value)
    return raw


def _read_regular_file(path: str, what: str) -> str:
    """The UTF-8 text of a regular file; a FIFO, device or folder is refused without waiting."""
    from anex_pipeline.storage import read_regular_file

    try:
        return read_regular_file(path).decode("utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} {path} is not UTF-8 text (byte {exc.start + 1}); save it as UTF-8") from None
    except ValueError as exc:
        raise UsageError(f"{what} {exc}; name a JSON file") from None


def _json_arg(flag: str, text: str) -> Any:
    if text.startswith("@"):
        text = _read_regular_file(text[1:], f"{flag} file")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        if flag.startswith("--set"):
            return text  # a bare string value
        raise UsageError(f"{flag} must be JSON (or @file.json): {text!r}") from None


def _instance() -> Any:
    import dagster as dg

    from anex_pipeline.models import cache_root

    home = Path(os.environ.get("DAGSTER_HOME") or cache_root() / "dagster_home")
    home.mkdir(parents=True, exist_ok=True)
    os.environ["DAGSTER_HOME"] = str(home)
    return dg.DagsterInstance.get()


class _CurrentStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at the time of the record (it may be swapped, as in tests)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def _progress_logging(quiet: bool) -> None:
    progress = logging.getLogger("anex_pipeline.progress")
    if not any(isinstance(h, _CurrentStderr) for h in progress.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("[anex] %(message)s"))
        progress.addHandler(handler)
    progress.setLevel(logging.WARNING if quiet else logging.INFO)
    progress.propagate = False


def _runner(args: argparse.Namespace) -> Any:
    from anex_pipeline.defs.resources import EngineResource, StorageResource, default_work_root
    from anex_pipeline.runner import JobRunner

    _progress_logging(args.quiet)
    # stdout carries the report alone: vLLM logs to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    storage = StorageResource(work_root=args.work_dir or default_work_root())
    engine = EngineResource(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        memory_share=args.memory_share,
        base_url=args.base_url,
        api_key=args.api_key or os.environ.get("ANEX_API_KEY"),
        max_concurrency=args.max_concurrency,
    )
    return JobRunner(_instance(), storage, engine)


def cmd_run(args: argparse.Namespace) -> int:
    raw = collect_options(args)
    runner = _runner(args)

    def run() -> Any:
        log = logging.getLogger("anex_pipeline.progress")
        log.info("checking %s", args.input)
        job = runner.submit(args.input, args.output, raw, args.report, options_file=args.options)
        manifest = job.manifest()
        log.info(
            "job %s: %d rows in %d shard(s), model %s",
            job.job_id,
            manifest.total_rows,
            len(manifest.shards),
            manifest.model_name,
        )
        return runner.run(job)

    return _report_of(runner, run)


def cmd_backfill(args: argparse.Namespace) -> int:
    runner = _runner(args)

    def backfill() -> Any:
        try:
            job = runner.storage.job(args.job_id)
        except ValueError as exc:  # not a name a job folder can have
            raise UsageError(str(exc)) from None
        if not job.exists():
            raise UsageError(f"no job {args.job_id} under {runner.storage.work_root}; `run` prints the job id")
        if args.shards:
            try:
                shards = sorted({int(s) for s in args.shards.split(",")})
            except ValueError:
                raise UsageError(f"--shards takes shard numbers like 0,3; got {args.shards!r}") from None
            count = len(job.manifest().shards)
            if any(s < 0 or s >= count for s in shards):
                raise UsageError(f"job {args.job_id} has shards 0 to {count - 1}")
        else:
            shards = runner.unfinished_shards(job)
        logging.getLogger("anex_pipeline.progress").info("rerunning shards %s", shards or "none (all finished)")
        return runner.run(job, shards=shards)

    return _report_of(runner, backfill)


def _report_of(runner: Any, work: Callable[[], Any]) -> int:
    """Runs a job action, always releasing the engine; prints the report and picks the exit code."""
    from anex_pipeline.runner import StepFailed

    try:
        report = work()
    except StepFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    except OSError as exc:  # the work folder cannot be written, e.g. its disk is full
        print(
            f"error: cannot write {exc.filename or 'the work folder'}: {exc.strerror or exc}; the rows finished so "
            "far are kept: make room (or fix the location) and run the same command again to resume",
            file=sys.stderr,
        )
        return EXIT_STOPPED
    finally:
        runner.close()
    return _finish(report)


def _finish(report: Any) -> int:
    print(report.model_dump_json(indent=2))
    if report.status == "completed":
        print(f"result: {report.output}", file=sys.stderr)
        return EXIT_OK
    print(f"job {report.status}: {report.failure_reason}", file=sys.stderr)
    return EXIT_STOPPED


def cmd_validate(args: argparse.Namespace) -> int:
    from anex_pipeline.jobs import check_input
    from anex_pipeline.spec import JobRejected, Problem
    from anex_pipeline.validate import parse_options

    options = parse_options(collect_options(args))
    kind, endpoint, rows = check_input(Path(args.input), options)
    count, problems, problem_count = 0, [], 0
    for item in rows:
        if isinstance(item, Problem):
            problem_count += 1
            if len(problems) < 1000:  # keep memory bounded on a file where every line is wrong
                problems.append(item)
        else:
            count += 1
    if problems:
        raise JobRejected(problems, total=problem_count)
    if count == 0:
        raise JobRejected([Problem(f"input file {args.input} has no rows")])
    print(f"ok: {count} rows, {kind}, {endpoint} endpoint")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from anex_pipeline.jobs import default_report_path

    path = args.path if args.path.endswith(".report.json") else default_report_path(args.path)
    try:
        print(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read report {path}: {exc.strerror}") from None
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from anex_pipeline.batch_api.app import create_app

    keys: list[str] | None = None
    if args.keys_file:
        try:
            lines = Path(args.keys_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise UsageError(f"cannot read keys file {args.keys_file}: {exc.strerror}") from None
        keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    elif os.environ.get("ANEX_BATCH_API_KEYS"):
        keys = [k.strip() for k in os.environ["ANEX_BATCH_API_KEYS"].split(",") if k.strip()]
    runner = _runner(args)
    try:
        app = create_app(runner, keys)
    except ValueError as exc:  # no API keys: nothing is loaded yet
        raise UsageError(str(exc)) from None
    try:
        uvicorn.run(app, host=args.host, port=args.port)
    finally:
        runner.close()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    from anex_pipeline.spec import JobRejected

    args = build_parser().parse_args(argv)
    handlers = {
        "run": cmd_run,
        "validate": cmd_validate,
        "backfill": cmd_backfill,
        "report": cmd_report,
        "serve": cmd_serve,
    }
    try:
        return handlers[args.command](args)
    except JobRejected as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_REJECTED
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REJECTED


def entry() -> None:
    """The ``anex-pipeline`` command: :func:`main`, then an exit that skips the interpreter's
    teardown. With torch and vLLM loaded, that teardown takes seconds after everything is
    written (2.7 s measured on the 2-core build machine); the exit handlers still run."""
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
