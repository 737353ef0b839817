"""The ``anex-pipeline`` command: run, validate, backfill, report, serve, and list, delete and prune jobs.

Exit codes: 0 when the job completed with at least one row answered (other rows may have failed),
1 when it failed, stopped early or no row succeeded, 2 when it was rejected at submit (nothing
ran, no result file).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_STOPPED, EXIT_REJECTED = 0, 1, 2
LOW_SPACE_BYTES = 1 << 20  # a disk with less free space than this is taken as full

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


# What each job flag does, for --help: whether it is a cap or a default, and what happens when it is absent.
FLAG_HELP: dict[str, str] = {
    "model": "HF model id or local folder (default: the embedded SmolLM2-135M-Instruct; "
    "all-MiniLM-L6-v2 for embeddings)",
    "endpoint": "chat, completions or embeddings (default: from the rows' url, else chat)",
    "reasoning_budget": "thinking tokens a row may use before its trace is closed; 0 = no cap "
    "(default: estimated from a sample for reasoning models)",
    "max_tokens": "output-token cap for every row that sets none of its own (a row's own max_tokens wins); "
    "default: estimated from a generated sample, reported as estimate.max_tokens",
    "reasoning_parser": "name of vLLM's reasoning parser (default: chosen from the model)",
    "tool_parser": "name of vLLM's tool-call parser (default: chosen from the model)",
    "shards": "how many shards (Dagster partitions) the rows are split into (default: by size)",
    "temperature": "default for rows that set none (default: the model's)",
    "top_p": "default for rows that set none (default: the model's)",
    "top_k": "default for rows that set none (default: the model's)",
    "seed": "default for rows that set none; with it, sampled rows are reproducible",
    "prompt_column": "Parquet column holding the prompt (default: messages, prompt, input or text)",
    "system_prompt": "system message put before every Parquet row's prompt",
    "estimate_sample_size": "rows generated to estimate max_tokens (default: 100)",
}
BOOL_HELP: dict[str, str] = {
    "reasoning": "switch thinking on or off for models that have it (default: the model's own)",
    "parse_thinking": "put the thinking trace in message.reasoning_content (default: on where the model has a parser)",
    "parse_tool_calls": "put tool calls in message.tool_calls (default: on where the model has a parser)",
}


# The steps of a command write straight to its terminal. Dagster's default capture of step output
# copies it to the terminal through helper processes (tail and a Python watcher) in the terminal's
# process group: a Ctrl-C would kill them, printing a KeyboardInterrupt traceback and losing every
# line the step writes after it (the notice that the job is stopping included).
TERMINAL_OUTPUT = {
    "compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager", "class": "NoOpComputeLogManager"}
}


class UsageError(Exception):
    """A mistake in the command line or the options file."""


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
        "--set", action="append", default=[], metavar="KEY=JSON", help="any other option, e.g. --set prices='{...}'"
    )


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=4096, help="context length of the engine (default: 4096)")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anex-pipeline", description="Offline batch LLM jobs on vLLM and Dagster.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
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
        "--max-running-batches",
        type=int,
        default=4,
        metavar="N",
        help="batches generating at once, their rows batched together on the one engine (default: 4)",
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
    return parser


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


# The dagster.yaml written into a new Dagster home: SQLite storage in the home (Dagster's default).
NEW_HOME_SETTINGS = """\
# Written by anex-pipeline for a new Dagster home; storage defaults to SQLite in this folder.
telemetry:
  enabled: false
"""


def _instance() -> Any:
    """The Dagster instance of $DAGSTER_HOME (default: under the cache folder). Loading it creates
    its SQLite storage on first use; that happens under a lock on the home, because commands
    started together on a new home would otherwise create the same tables twice and can leave
    the storage unusable for good."""
    import fcntl
    import sqlite3

    import dagster as dg
    from dagster._core.instance.ref import InstanceRef
    from sqlalchemy.exc import DBAPIError

    from anex_pipeline.models import cache_root

    home = Path(os.environ.get("DAGSTER_HOME") or cache_root() / "dagster_home")
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        home.mkdir(parents=True, exist_ok=True)
        with (home / ".instance.lock").open("ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes
            settings = home / "dagster.yaml"
            if not settings.exists():  # without one Dagster prints a warning and a telemetry banner
                settings.write_text(NEW_HOME_SETTINGS, encoding="utf-8")
            return dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home), overrides=TERMINAL_OUTPUT))
    except (OSError, sqlite3.Error, DBAPIError) as exc:
        raise UsageError(
            f"{_storage_failure(exc)}; make room there (or make it writable), or set DAGSTER_HOME to another folder"
        ) from None


def _storage_failure(exc: Exception) -> str:
    """What went wrong writing the Dagster home (its SQLite storage, say), in a few words."""
    home = os.environ["DAGSTER_HOME"]
    cause = getattr(exc, "strerror", None) or getattr(exc, "orig", None) or exc
    try:
        full = "; no space left on its disk" if shutil.disk_usage(home).free < LOW_SPACE_BYTES else ""
    except OSError:  # the home itself could not be made
        full = ""
    return f"cannot write the Dagster run history in {home}: {cause}{full}"


def _progress_logging(quiet: bool) -> None:
    """Our lines on the terminal: progress as a bar (or plain lines when stderr is not a terminal),
    other messages prefixed with [anex]; ``quiet`` leaves only warnings and errors."""
    from anex_pipeline.console import PROGRESS_LOGGER, ProgressDisplay, ProgressHandler

    progress = logging.getLogger(PROGRESS_LOGGER)
    for handler in [h for h in progress.handlers if isinstance(h, ProgressHandler)]:
        progress.removeHandler(handler)
    progress.addHandler(ProgressHandler(None if quiet else ProgressDisplay(tty=sys.stderr.isatty())))
    progress.setLevel(logging.WARNING if quiet else logging.INFO)
    progress.propagate = False


def _runner(args: argparse.Namespace) -> Any:
    from anex_pipeline.console import PROGRESS_LOGGER, quiet_engine_output
    from anex_pipeline.defs.resources import EngineResource, StorageResource, default_work_root
    from anex_pipeline.runner import JobRunner

    _progress_logging(args.quiet)
    storage = StorageResource(work_root=args.work_dir or default_work_root())
    if args.verbose or not args.own_terminal:
        # stdout carries the report alone: vLLM logs to stdout unless told otherwise.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        log_path = Path(storage.work_root).expanduser() / "logs" / f"{args.command}-{stamp}-{os.getpid()}.log"
        quiet_engine_output(log_path)
        logging.getLogger(PROGRESS_LOGGER).info("engine and library messages go to %s (--verbose shows them)", log_path)
    engine = EngineResource(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        memory_share=args.memory_share,
        base_url=_base_url(args.base_url),
        api_key=args.api_key or os.environ.get("ANEX_API_KEY"),
        max_concurrency=args.max_concurrency,
    )
    return JobRunner(_instance(), storage, engine)


def _base_url(given: list[str] | None) -> str | None:
    """The servers of ``--base-url`` (repeated or comma-separated) as one comma-separated list."""
    from anex_pipeline.engine.replicas import server_urls

    try:
        return ",".join(server_urls(given)) or None
    except ValueError as exc:
        raise UsageError(f"--base-url: {exc}") from None


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


class _WithoutStorageNoise:
    """sys.stderr without the lines Dagster writes there itself when it cannot store an event
    (e.g. its SQLite storage is on a full disk): the error also reaches the command, which tells
    it in one line."""

    DAGSTER_STORE_FAILED = "Exception while writing logger call to event log"

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        return len(text) if text.startswith(self.DAGSTER_STORE_FAILED) else self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _report_of(runner: Any, work: Callable[[], Any]) -> int:
    """Runs a job action, always releasing the engine; prints the report and picks the exit code."""
    import sqlite3

    from sqlalchemy.exc import DBAPIError

    from anex_pipeline.console import close_progress
    from anex_pipeline.runner import StepFailed

    resume = (
        "the rows finished so far are kept: make room (or fix the location) and run the same command again to resume"
    )
    try:
        with contextlib.redirect_stderr(_WithoutStorageNoise(sys.stderr)):
            report = work()
    except StepFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    except OSError as exc:  # the work folder cannot be written, e.g. its disk is full
        print(
            f"error: cannot write {exc.filename or 'the work folder'}: {exc.strerror or exc}; {resume}", file=sys.stderr
        )
        return EXIT_STOPPED
    except (sqlite3.Error, DBAPIError) as exc:  # the instance's storage, e.g. SQLite on a full disk
        print(f"error: {_storage_failure(exc)}; {resume}", file=sys.stderr)
        return EXIT_STOPPED
    finally:
        close_progress()
        runner.close()
    return _finish(report)


def _finish(report: Any) -> int:
    print(report.model_dump_json(indent=2))
    counts = report.request_counts
    if report.status == "completed" and counts.total and not counts.completed:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(report.error_counts.items(), key=lambda kv: -kv[1]))
        print(f"job failed: no row succeeded ({kinds}); each row's error is in {report.output}", file=sys.stderr)
        return EXIT_STOPPED
    if report.status == "completed":
        print(f"result: {report.output}", file=sys.stderr)
        return EXIT_OK
    print(f"error: job {report.status}: {report.failure_reason}", file=sys.stderr)
    return EXIT_STOPPED


def cmd_validate(args: argparse.Namespace) -> int:
    from anex_pipeline.storage import is_s3
    from anex_pipeline.validate import parse_options

    options = parse_options(collect_options(args))
    if not is_s3(args.input):
        return _validate(args, options, Path(args.input))
    from anex_pipeline.defs.resources import StorageResource  # imports Dagster: only for an S3 input

    with tempfile.TemporaryDirectory(prefix="anex-validate-") as downloads:
        return _validate(args, options, StorageResource().local_input(args.input, Path(downloads)))


def _validate(args: argparse.Namespace, options: Any, path: Path) -> int:
    from anex_pipeline.jobs import check_input, model_problems
    from anex_pipeline.spec import JobRejected, Problem

    kind, endpoint, rows = check_input(path, options)
    # A job sent to a model server (ANEX_ENGINE_BASE_URL) runs the server's model: nothing to look for here.
    problems = [] if os.environ.get("ANEX_ENGINE_BASE_URL") else model_problems(options.model)
    count, problem_count = 0, len(problems)
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
    media = _media_policy(args)
    if args.max_running_batches < 1:
        raise UsageError(f"--max-running-batches must be at least 1, got {args.max_running_batches}")
    runner = _runner(args)
    try:
        app = create_app(runner, keys, media=media, max_running_batches=args.max_running_batches)
    except ValueError as exc:  # no API keys: nothing is loaded yet
        raise UsageError(str(exc)) from None
    try:
        uvicorn.run(app, host=args.host, port=args.port)
    finally:
        runner.close()
    return EXIT_OK


def _work_root(args: argparse.Namespace) -> Path:
    from anex_pipeline.defs.resources import default_work_root

    return Path(args.work_dir or default_work_root()).expanduser()


def cmd_list(args: argparse.Namespace) -> int:
    from anex_pipeline.retention import list_jobs, table

    at = time.time()
    entries = list_jobs(_instance(), _work_root(args))
    if args.json:
        print(json.dumps([e.as_json(at) for e in entries], indent=2))
    elif entries:
        print(table(entries, at))
    else:
        print(f"no jobs under {_work_root(args)}", file=sys.stderr)
    return EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    from anex_pipeline.defs.partitions import JOBS
    from anex_pipeline.jobs import JobDir
    from anex_pipeline.retention import JobRunning, delete_job

    try:
        job = JobDir(_work_root(args), args.job_id)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    instance = _instance()
    if not job.root.exists() and not instance.has_dynamic_partition(JOBS, job.job_id):
        raise UsageError(f"no job {args.job_id} under {job.root.parent}; `anex-pipeline list` shows the jobs")
    try:
        delete_job(instance, job)
    except JobRunning as exc:
        raise UsageError(str(exc)) from None
    print(f"deleted job {job.job_id}", file=sys.stderr)
    return EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    from anex_pipeline.retention import parse_age, prune

    try:
        older_than = parse_age(args.older_than)
    except ValueError as exc:
        raise UsageError(f"--older-than: {exc}") from None
    removed = prune(_instance(), _work_root(args), older_than, dry_run=args.dry_run)
    if args.json:
        print(json.dumps([r.as_json() for r in removed], indent=2))
    else:
        for r in removed:
            print(f"{'would remove' if args.dry_run else 'removed'} {r.kind} {r.id}: {r.reason}")
        if not removed:
            print("nothing to remove", file=sys.stderr)
    return EXIT_OK


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


def main(argv: list[str] | None = None, *, own_terminal: bool = False) -> int:
    """Runs one command. With ``own_terminal`` (the installed command) the engine's and libraries'
    messages go to a log file unless ``--verbose``; called from Python, stderr is left alone."""
    from anex_pipeline.spec import JobRejected

    args = build_parser().parse_args(argv)
    args.own_terminal = own_terminal
    handlers = {
        "run": cmd_run,
        "validate": cmd_validate,
        "backfill": cmd_backfill,
        "report": cmd_report,
        "serve": cmd_serve,
        "list": cmd_list,
        "delete": cmd_delete,
        "prune": cmd_prune,
    }
    try:
        return handlers[args.command](args)
    except JobRejected as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_REJECTED
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REJECTED
    except KeyboardInterrupt:  # Ctrl-C outside generation (which stops the job more gently)
        print("stopped: cancelled by the user; rerun the same command to resume", file=sys.stderr)
        return EXIT_STOPPED


def entry() -> None:
    """The ``anex-pipeline`` command: :func:`main`, then an exit that skips the interpreter's
    teardown. With torch and vLLM loaded, that teardown takes seconds after everything is
    written (2.7 s measured on the 2-core build machine); the exit handlers still run."""
    code = main(own_terminal=True)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
