"""What the commands that run jobs do (``run``, ``backfill``, ``validate``, ``results``, ``report``, ``serve``),
one function per command, and the runner they share; the commands that look after jobs are in
:mod:`anex_pipeline.cli.admin_commands`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anex_pipeline import settings
from anex_pipeline.cli.parser import UsageError, _media_policy, collect_options, engine_args_of
from anex_pipeline.errors import AnexError, ExitCode
from anex_pipeline.instance import dagster_instance, storage_failure

# Jobs of at most this many rows run vLLM's engine core in the command's process: one import of vLLM
# instead of three. On the 2-core machine it started 12 s sooner and generated as fast at 8 to 2,048
# rows on a quiet machine (docs/benchmarks.md); above a few hundred rows start time matters little.
# Only the installed command's run and backfill do it (main() called from Python, and serve, keep
# the processes): such a process builds one engine, and holds nothing else of a caller's.
SMALL_JOB_ROWS = 256
ONE_JOB_COMMANDS = ("run", "backfill")


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
    from anex_pipeline.engine.adapters import lora_modules_of
    from anex_pipeline.engine.config import EngineConfig
    from anex_pipeline.paths import default_work_root
    from anex_pipeline.runner import JobRunner
    from anex_pipeline.storage import StorageConfig
    from anex_pipeline.workdir import layout

    # Engine arguments are checked first, so that a misspelt one is refused before anything starts.
    given = engine_args_of(args)
    keep_engine = getattr(args, "keep_engine", False)
    if keep_engine and args.base_url:
        raise UsageError(
            "--keep-engine keeps this machine's shared model server warm; with --base-url the rows go to that "
            "server instead: drop one of the two"
        )
    if given and args.base_url:
        raise UsageError(
            f"engine arguments ({', '.join(sorted(given))}) are for the model this command loads; the server at "
            "--base-url was started with its own: give them to that server instead, or drop --base-url"
        )
    engine = EngineConfig(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        memory_share=args.memory_share,
        base_url=_base_url(args.base_url),
        api_key=args.api_key or settings.API_KEY.get() or None,
        max_concurrency=args.max_concurrency,
        lora_modules=lora_modules_of(getattr(args, "engine_lora_modules", None) or []),
        core_in_process_rows=SMALL_JOB_ROWS if args.own_terminal and args.command in ONE_JOB_COMMANDS else 0,
        # A warm shared server serves `run` and `backfill` (the Batch API keeps its engine in its process).
        warm_server=keep_engine or (args.command in ("run", "backfill") and settings.MACHINE_SERVER.get() != "0"),
        keep_warm=keep_engine,
        **({"engine_args": given} if given is not None else {}),
    )
    _progress_logging(args.quiet)
    storage = StorageConfig(work_root=args.work_dir or default_work_root())
    if args.verbose or not args.own_terminal:
        # stdout carries the report alone: vLLM logs to stdout unless told otherwise.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        log_path = Path(storage.work_root).expanduser() / layout.LOGS_DIR / f"{args.command}-{stamp}-{os.getpid()}.log"
        quiet_engine_output(log_path)
        logging.getLogger(PROGRESS_LOGGER).info("engine and library messages go to %s (--verbose shows them)", log_path)
    return JobRunner(dagster_instance(), storage, engine)


def _base_url(given: list[str] | None) -> str | None:
    """The servers of ``--base-url`` (repeated or comma-separated) as one comma-separated list."""
    from anex_pipeline.engine.http.replicas import server_urls

    try:
        return ",".join(server_urls(given)) or None
    except ValueError as exc:
        raise UsageError(f"--base-url: {exc}") from None


def cmd_run(args: argparse.Namespace) -> int:
    raw = collect_options(args)
    metrics_server = _metrics_server(args.metrics_port)
    try:
        return _run_job(args, raw)
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()


def _run_job(args: argparse.Namespace, raw: dict[str, Any]) -> int:
    from anex_pipeline.workdir.timing import read_timings

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
        return _Ran(job, read_timings(job), runner.run(job))

    return _report_of(runner, run, args.json, args.own_terminal)


def _metrics_server(port: int | None) -> Any:
    """The job's metrics on 127.0.0.1:port, or None without a port."""
    if port is None:
        return None
    if not 1 <= port <= 65535:
        raise UsageError(f"--metrics-port must be a port number from 1 to 65535, got {port}")
    from anex_pipeline.metrics import serve_metrics

    try:
        return serve_metrics(port)
    except OSError as exc:
        raise UsageError(f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror or exc})") from None


def cmd_backfill(args: argparse.Namespace) -> int:
    from anex_pipeline.workdir.timing import read_timings

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
        return _Ran(job, read_timings(job), runner.run(job, shards=shards))

    return _report_of(runner, backfill, args.json, args.own_terminal)


@dataclass
class _Ran:
    """What a run or backfill leaves for its last lines: the job, its stage timings before this
    command ran it, and its report."""

    job: Any
    timings_before: dict[str, float]
    report: Any


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


def _report_of(runner: Any, work: Callable[[], _Ran], as_json: bool, exiting: bool) -> int:
    """Runs a job action, always releasing the engine; prints the summary (and the JSON report
    when asked or when standard output is not a terminal) and picks the exit code. ``exiting``:
    the process ends right after (the installed command), so an engine that ends with it is let go
    without its shutdown."""
    import sqlite3

    from sqlalchemy.exc import DBAPIError

    from anex_pipeline.console import close_progress

    resume = (
        "the rows finished so far are kept: make room (or fix the location) and run the same command again to resume"
    )
    started = time.monotonic()
    try:
        with contextlib.redirect_stderr(_WithoutStorageNoise(sys.stderr)):
            ran = work()
    except AnexError as exc:  # a failed step: printed before the progress display closes
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # the work folder cannot be written, e.g. its disk is full
        print(
            f"error: cannot write {exc.filename or 'the work folder'}: {exc.strerror or exc}; {resume}", file=sys.stderr
        )
        return ExitCode.STOPPED
    except (sqlite3.Error, DBAPIError) as exc:  # the instance's storage, e.g. SQLite on a full disk
        print(f"error: {storage_failure(exc)}; {resume}", file=sys.stderr)
        return ExitCode.STOPPED
    finally:
        close_progress()
        runner.close(exiting)
    return _finish(ran, time.monotonic() - started, as_json or not sys.stdout.isatty())


def _finish(ran: _Ran, wall_s: float, as_json: bool) -> int:
    from anex_pipeline.console import summary_lines
    from anex_pipeline.formats.registry import FORMATS
    from anex_pipeline.workdir.timing import read_timings

    report, manifest = ran.report, ran.job.manifest()
    if as_json:
        print(report.model_dump_json(indent=2))
    spent = {stage: s - ran.timings_before.get(stage, 0.0) for stage, s in read_timings(ran.job).items()}
    for line in summary_lines(report, manifest.report, FORMATS[manifest.format].error_field, spent, wall_s):
        print(line, file=sys.stderr)
    counts = report.request_counts
    if report.status == "completed" and counts.total and not counts.completed:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(report.error_counts.items(), key=lambda kv: -kv[1]))
        print(f"job failed: no row succeeded ({kinds}); each row's error is in {report.output}", file=sys.stderr)
        return ExitCode.STOPPED
    if report.status == "completed":
        return ExitCode.OK
    print(f"error: job {report.status}: {report.failure_reason}", file=sys.stderr)
    return ExitCode.STOPPED


def cmd_validate(args: argparse.Namespace) -> int:
    from anex_pipeline.options import job_options
    from anex_pipeline.storage import is_s3

    options = job_options(collect_options(args))
    if not is_s3(args.input):
        return _validate(args, options, Path(args.input))
    from anex_pipeline.storage import StorageConfig

    with tempfile.TemporaryDirectory(prefix="anex-validate-") as downloads:
        return _validate(args, options, StorageConfig().local_input(args.input, Path(downloads)))


def _validate(args: argparse.Namespace, options: Any, path: Path) -> int:
    from anex_pipeline.stages.submit import accepted_rows

    # A job sent to a model server (ANEX_ENGINE_BASE_URL) runs the server's model: nothing to look for here.
    local = not settings.ENGINE_BASE_URL.get()
    if args.quote or args.quote_sample:
        return _quote(args, options, path, local)
    kind, endpoint, rows = accepted_rows(path, options, local_model=local)
    count = sum(1 for _ in rows)
    print(f"ok: {count} rows, {kind.name}, {endpoint} endpoint")
    return ExitCode.OK


def _quote(args: argparse.Namespace, options: Any, path: Path, local: bool) -> int:
    """``validate --quote``: the quote on one screen (or JSON), kept for the report of the job's run."""
    from anex_pipeline.console import quiet_engine_output
    from anex_pipeline.engine.config import EngineConfig
    from anex_pipeline.engine.loader import release_engines
    from anex_pipeline.paths import default_work_root
    from anex_pipeline.stages.quote import make_quote, quote_lines
    from anex_pipeline.storage import is_s3
    from anex_pipeline.workdir import layout
    from anex_pipeline.workdir.manifest import file_sha256, make_job_id
    from anex_pipeline.workdir.quotes import save_quote

    work_root = Path(args.work_dir or default_work_root()).expanduser()
    if args.quote_sample < 0:
        raise UsageError(f"--quote-sample takes a number of rows (0 or more), got {args.quote_sample}")
    engine = EngineConfig(base_url=settings.ENGINE_BASE_URL.get() or None)
    if args.quote_sample:  # the engine's messages: never on stdout (the quote), at a terminal to a log file
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        if sys.stderr.isatty():
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
            log_path = quiet_engine_output(work_root / layout.LOGS_DIR / f"quote-{stamp}-{os.getpid()}.log")
            print(f"generating {args.quote_sample} sample rows; engine messages go to {log_path}", file=sys.stderr)
    try:
        quote = make_quote(path, options, work_root, engine, local_model=local, sample=args.quote_sample)
    finally:
        if args.quote_sample:
            release_engines()
    if not is_s3(args.input):  # the id `run` gives the same input and options
        job_id = make_job_id(path, file_sha256(path), options.model_dump(exclude_defaults=True))
        with contextlib.suppress(OSError):
            save_quote(work_root, job_id, quote)
    if args.json:
        print(quote.model_dump_json(indent=2))
    else:
        print("\n".join(quote_lines(quote)))
    return ExitCode.OK


def cmd_results(args: argparse.Namespace) -> int:
    """The rows a job has finished so far, in input order, in the job's format; the job may be
    running (see :mod:`anex_pipeline.stages.merge_partial`)."""
    from anex_pipeline.formats.registry import FORMATS
    from anex_pipeline.paths import default_work_root
    from anex_pipeline.stages.merge_partial import write_finished_rows
    from anex_pipeline.stages.submit import check_destinations, default_report_path
    from anex_pipeline.storage import is_s3
    from anex_pipeline.workdir.manifest import JobDir

    work_root = Path(args.work_dir or default_work_root()).expanduser()
    try:
        job = JobDir(work_root, args.job_id)
    except ValueError as exc:  # not a name a job folder can have
        raise UsageError(f"no job {args.job_id[:80]!r}: {exc}") from None
    if not job.exists():
        raise UsageError(f"no job {args.job_id} under {work_root}; `anex-pipeline list` shows the jobs")
    manifest = job.manifest()
    kind = FORMATS[manifest.format]
    if is_s3(args.output):
        raise UsageError(f"-o {args.output}: results are written to a local file; copy it to S3 afterwards")
    if not args.output.endswith(kind.suffix):
        raise UsageError(f"job {args.job_id} is a {kind.title} job: name a {kind.suffix} file with -o")
    out = Path(args.output).expanduser()
    check_destinations(Path(manifest.input), str(out), default_report_path(str(out)), work_root=work_root)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        counts = write_finished_rows(job, out, pending=args.pending)
    except OSError as exc:
        raise UsageError(f"cannot write {exc.filename or out}: {exc.strerror or exc}") from None
    print(counts.line(out, args.pending), file=sys.stderr)
    return ExitCode.OK


def cmd_report(args: argparse.Namespace) -> int:
    from anex_pipeline.stages.submit import default_report_path

    path = args.path if args.path.endswith(".report.json") else default_report_path(args.path)
    try:
        print(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read report {path}: {exc.strerror}") from None
    return ExitCode.OK


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from anex_pipeline.batch_api.app import create_app
    from anex_pipeline.engine.models import model_unavailable

    keys: list[str] | None = None
    if args.keys_file:
        try:
            lines = Path(args.keys_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise UsageError(f"cannot read keys file {args.keys_file}: {exc.strerror}") from None
        keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    elif settings.BATCH_API_KEYS.get():
        keys = [k.strip() for k in settings.BATCH_API_KEYS.get().split(",") if k.strip()]
    media = _media_policy(args)
    if args.max_running_batches < 1:
        raise UsageError(f"--max-running-batches must be at least 1, got {args.max_running_batches}")
    models = args.models or []
    if not args.base_url:  # a model server's models are its own
        for name in models:
            if why := model_unavailable(name):
                raise UsageError(f"--model: {why}")
    webhook = _webhook(args)
    parsers = {"reasoning_parser": args.reasoning_parser, "tool_parser": args.tool_parser}
    if args.reasoning_parser or args.tool_parser:
        from anex_pipeline.engine.parsing import ParserChoiceError, check_parser_names  # imports vLLM

        try:
            check_parser_names(args.reasoning_parser, args.tool_parser)
        except ParserChoiceError as exc:
            raise UsageError(f"--reasoning-parser/--tool-parser: {exc}") from None
    runner = _runner(args)
    try:
        app = create_app(
            runner,
            keys,
            media=media,
            models=models,
            max_running_batches=args.max_running_batches,
            webhook=webhook,
            max_completion_window_s=args.max_completion_window,
            max_job_tokens=args.max_job_tokens,
            parsers=parsers,
            replica=f"{socket.gethostname()}:{args.port}",  # started again on its port, it goes on with its batches
        )
    except ValueError as exc:  # no API keys: nothing is loaded yet
        raise UsageError(str(exc)) from None
    with _ending_on_signals():
        try:
            uvicorn.run(app, host=args.host, port=args.port)
        finally:
            runner.close()
    return ExitCode.OK


def _webhook(args: argparse.Namespace) -> Any:
    """The webhook of ``serve`` (flags first, then the environment), checked; None without a URL."""
    from anex_pipeline.batch_api.webhooks import WebhookSettings

    url = args.webhook_url or settings.WEBHOOK_URL.get() or None
    secret = args.webhook_secret or settings.WEBHOOK_SECRET.get() or None
    if not url:
        if secret or args.webhook_allowed_host:
            raise UsageError("--webhook-secret and --webhook-allowed-host need --webhook-url (or ANEX_WEBHOOK_URL)")
        return None
    if not secret:
        raise UsageError("--webhook-url needs --webhook-secret (or ANEX_WEBHOOK_SECRET): whsec_ followed by base64")
    webhook = WebhookSettings(url, secret, tuple(args.webhook_allowed_host or ()))
    try:
        webhook.check()
    except ValueError as exc:
        raise UsageError(f"--webhook-url/--webhook-secret: {exc}") from None
    return webhook


class _Signalled(Exception):
    """The signal uvicorn passes on once it has wound the server down."""


@contextlib.contextmanager
def _ending_on_signals() -> Iterator[None]:
    """Lets ``serve`` end cleanly on SIGINT or SIGTERM. uvicorn takes both while it serves, winds
    down, then raises the signal again under the handlers it found: with these, that ends the
    command through its ``finally`` (the engine shut down, exit status 0) rather than killing it
    (status -15) or printing a job's "stopped" line."""

    def raise_signalled(signum: int, _: object) -> None:
        raise _Signalled(signum)

    previous = {sig: signal.signal(sig, raise_signalled) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except _Signalled as exc:
        print(f"serve: ended on {signal.Signals(exc.args[0]).name}", file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
