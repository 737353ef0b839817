"""The commands that look after what jobs leave behind rather than run one: ``list``, ``delete``
and ``prune`` the jobs of a work folder, and ``machine-server`` status or stop."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from anex_pipeline.cli.parser import UsageError
from anex_pipeline.errors import ExitCode
from anex_pipeline.instance import dagster_instance


def _work_root(args: argparse.Namespace) -> Path:
    from anex_pipeline.paths import default_work_root

    return Path(args.work_dir or default_work_root()).expanduser()


def _print_skipped(skipped: Any) -> None:
    print(skipped, file=sys.stderr)


def cmd_list(args: argparse.Namespace) -> int:
    from anex_pipeline.orchestration.job_admin import list_jobs, table

    at = time.time()
    entries = list_jobs(dagster_instance(), _work_root(args), on_skip=_print_skipped)
    if args.json:
        print(json.dumps([e.as_json(at) for e in entries], indent=2))
    elif entries:
        print(table(entries, at))
    else:
        print(f"no jobs under {_work_root(args)}", file=sys.stderr)
    return ExitCode.OK


def cmd_delete(args: argparse.Namespace) -> int:
    from anex_pipeline.orchestration.job_admin import delete_job
    from anex_pipeline.workdir.manifest import JobDir

    try:
        job = JobDir(_work_root(args), args.job_id)
    except ValueError as exc:
        raise UsageError(f"{exc}; `anex-pipeline list` shows the jobs") from None
    delete_job(dagster_instance(), job)  # refuses (exit 2) what is not a job, or is running
    print(f"deleted job {job.job_id}", file=sys.stderr)
    return ExitCode.OK


def cmd_prune(args: argparse.Namespace) -> int:
    from anex_pipeline.orchestration.job_admin import parse_age, prune

    try:
        older_than = parse_age(args.older_than)
    except ValueError as exc:
        raise UsageError(f"--older-than: {exc}") from None
    removed = prune(dagster_instance(), _work_root(args), older_than, dry_run=args.dry_run, on_skip=_print_skipped)
    if args.json:
        print(json.dumps([r.as_json() for r in removed], indent=2))
    else:
        for r in removed:
            print(f"{'would remove' if args.dry_run else 'removed'} {r.kind} {r.id}: {r.reason}")
        if not removed:
            print("nothing to remove", file=sys.stderr)
    return ExitCode.OK


def cmd_machine_server(args: argparse.Namespace) -> int:
    from anex_pipeline.engine.server.machine_server import alive, read_state, stop_server
    from anex_pipeline.paths import machine_server_dir

    folder = machine_server_dir()
    state = read_state(folder)
    running = state is not None and alive(state)
    if args.action == "stop" and state is not None:
        stop_server(folder)  # a dead supervisor's state goes too, with what its server left running
    if state is None or not running:
        print(f"no model server runs from {folder}", file=sys.stderr)
        return ExitCode.OK
    if args.action == "stop":
        print(f"stopped the model server for {state.model_name} at {state.url}", file=sys.stderr)
    else:
        print(f"{state.model_name} at {state.url} (supervisor pid {state.pid}, log {state.log})")
    return ExitCode.OK
