"""The same job through the command line and through the local inbox: ``anex-pipeline run`` (one
process, its own engine) against a file dropped into the inbox folder of a real ``dagster-daemon``
with the ``local_inbox`` and ``job_driver`` sensors on (the job's one shard carried through by its
submit run, the engine the machine's shared model server), from upload to result file. Rounds
alternate CLI / inbox; the medians and their ratio are printed (target: the inbox within 1.1x of
the CLI), and for each inbox round when each Dagster run was created, started and ended, counted
from the upload.

Every round's questions are its own, so no round reuses another's answers. The shared server
outlives a round (it ends after 10 minutes idle), so only the first inbox round
pays the model load, as on a machine whose daemon has run a job in the last 10 minutes;
``--cold`` stops it before every inbox round instead.

    python -m bench.sensor_vs_cli --rows 20 --pairs 2
    python -m bench.sensor_vs_cli --rows 2 --pairs 1      # a quick check that it works
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from anex_pipeline.engine.orphans import signal_child_group
from bench.vs_run_batch import make_input

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 32
ROUND_TIMEOUT_S = 1800.0


def bench_env(root: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DAGSTER_HOME": str(root / "home"),
        "ANEX_WORK_DIR": str(root / "work"),
        "ANEX_INBOX_DIR": str(root / "inbox"),
        "ANEX_OUTBOX_DIR": str(root / "outbox"),
        "ANEX_MACHINE_SERVER_DIR": str(root / "machine-server"),  # not the machine's usual one
    }


def dagster(env: dict[str, str], *args: str) -> None:
    command = [str(Path(sys.executable).with_name("dagster")), *args, "-w", str(REPO / "workspace.yaml")]
    subprocess.run(command, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def round_input(root: Path, rows: int, name: str) -> Path:
    """The benchmark's rows with the round's name in every question: no round can reuse another's
    answers (the pipeline keeps answers across jobs), so each generates all its rows."""
    src = root / f"{name}.input.jsonl"
    make_input(src, rows, unique=True)
    lines = []
    for line in src.read_text().splitlines():
        row = json.loads(line)
        row["body"]["messages"][-1]["content"] += f" [{name}]"
        lines.append(json.dumps(row))
    src.write_text("\n".join(lines) + "\n")
    return src


def cli_round(root: Path, src: Path, n: int, env: dict[str, str]) -> float:
    out = root / f"cli-{n}.results.jsonl"
    command = [
        str(Path(sys.executable).with_name("anex-pipeline")), "run", str(src), "-o", str(out), "--quiet",
        "--max-tokens", str(MAX_TOKENS), "--max-model-len", "2048",
    ]  # fmt: skip
    started = time.monotonic()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def inbox_round(root: Path, src: Path, n: int, daemon: subprocess.Popen[bytes]) -> tuple[float, float]:
    """Drops the file into the inbox (written aside, then renamed in); returns the wall time to its
    result file and the time.time() of the upload."""
    inbox, name = root / "inbox", f"job-{n}.jsonl"
    staged = root / name  # outside the inbox, on the same file system
    staged.write_bytes(src.read_bytes())
    (inbox / f"{name}.job.json").write_text(json.dumps({"max_tokens": MAX_TOKENS}))
    uploaded, started = time.time(), time.monotonic()
    staged.rename(inbox / name)
    result = root / "outbox" / f"job-{n}.results.jsonl"
    while not result.exists():
        if daemon.poll() is not None:
            sys.exit(f"dagster-daemon exited with {daemon.returncode}; see {root / 'daemon.log'}")
        if time.monotonic() - started > ROUND_TIMEOUT_S:
            sys.exit(f"no result for {name} in {ROUND_TIMEOUT_S:.0f} s; see {root / 'daemon.log'}")
        time.sleep(0.2)
    return time.monotonic() - started, uploaded


def timeline(uploaded: float) -> list[str]:
    """Each Dagster run since the upload: job, partition, and created/started/ended in seconds."""
    import dagster as dg

    lines = []
    with dg.DagsterInstance.get() as instance:
        for record in reversed(instance.get_run_records()):
            if record.create_timestamp.timestamp() < uploaded:
                continue
            run = record.dagster_run
            marks = [record.create_timestamp.timestamp(), record.start_time, record.end_time]
            at = " ".join(f"{m - uploaded:6.1f}" if m else "     -" for m in marks)
            lines.append(f"  {run.job_name:<11} {run.tags.get('dagster/partition', ''):<14} {at}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="stop the shared model server before each inbox round")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sensor-vs-cli-"))
    env = bench_env(root)
    os.environ.update(env)  # for reading the runs back and stopping the shared server
    (root / "home").mkdir()
    (root / "inbox").mkdir()
    shutil.copy(REPO / "dagster.yaml", root / "home" / "dagster.yaml")
    dagster(env, "sensor", "start", "local_inbox")
    dagster(env, "sensor", "start", "job_driver")
    from anex_pipeline.engine.server.machine_server import stop_server

    with (root / "daemon.log").open("wb") as log:
        daemon = subprocess.Popen(
            [str(Path(sys.executable).with_name("dagster-daemon")), "run", "-w", str(REPO / "workspace.yaml")],
            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    cli, inbox = [], []
    try:
        for n in range(args.pairs):
            cli.append(cli_round(root, round_input(root, args.rows, f"cli-{n}"), n, env))
            if args.cold:
                stop_server()
            seconds, uploaded = inbox_round(root, round_input(root, args.rows, f"inbox-{n}"), n, daemon)
            inbox.append(seconds)
            print(f"pair {n}: cli {cli[-1]:.1f} s, inbox {inbox[-1]:.1f} s; runs (created, started, ended):")
            print("\n".join(timeline(uploaded)), flush=True)
    finally:
        signal_child_group(daemon, signal.SIGTERM)
        daemon.wait(timeout=60)
        stop_server()
    cli_s, inbox_s = statistics.median(cli), statistics.median(inbox)
    print(f"{args.rows} rows: cli median {cli_s:.1f} s, inbox median {inbox_s:.1f} s, ratio {inbox_s / cli_s:.2f}x")
    print(f"work files in {root}")


if __name__ == "__main__":
    main()
