"""Our own cost per row: the pipeline's work around the model, measured where the model costs next
to nothing. Four measurements, each a subcommand:

    python -m bench.overhead sides --rows 2048 --pairs 3       # ours, run_batch, LLM.chat: wall time
    python -m bench.overhead sides --rows 16384 --pairs 1
    python -m bench.overhead ceiling --rows 100000             # the fake engine: rows/s of a whole job
    python -m bench.overhead idle --rows 2048                  # the engine's idle time between steps
    python -m bench.overhead profile --fake-rows 10000 50000 --model-rows 2048 --out DIR

The model (``sides``, ``idle``, ``profile --model-rows``) is a random 2-layer Llama, 64 wide with
one head, on the embedded SmolLM2's tokenizer and chat template
(``tiny_models.build_near_free_chat_model``, built into the run's temporary folder, or reused from
``--model-dir``): rows are rendered and tokenised as for the real model and the answers run to
their ``max_tokens``, but a forward pass costs almost nothing, so what each side takes is mostly
its own work. The rows are ``bench.vs_run_batch``'s unique chat rows (``max_tokens`` 16 to 64,
temperature 0), so nothing is answered twice.

``sides`` runs the same file through three programs, each a process of its own, in turn, the
order rotating with each round ("pair" as in the other benchmarks): ``anex-pipeline run`` (a
fresh work folder each time, the machine's shared server off), vLLM's ``run_batch`` and a plain
``LLM.chat`` script (``bench.overhead_llm``). Each is timed from its start until its result file
was last written (the file's modification time) and until it exited. All three get the same
engine arguments (the pipeline's, plus ``--engine-arg``, by default ``max_num_seqs=256`` and
``max_num_batched_tokens=4096``: ``vllm.LLM``'s defaults, which the pipeline uses, made explicit
for ``run_batch``, whose server defaults are 128 and 2,048) and the environment the pipeline
gives its CPU engine's processes (``bench.overhead_engine``).

``ceiling`` runs a job on the fake engine that ships with the package: submit to merge, and the
generation stage alone (the report's ``timings``).

``idle`` times each engine step in the command's process (``bench.step_timing``, installed from
outside by ``bench.overhead_command``): the gaps between one step's end and the next one's start,
with vLLM's engine core in the command's process (there a gap is time the engine is idle) and in
its own processes (there the core keeps stepping while the command works: a gap is the command's
own time per step). The plain ``LLM.chat`` script is timed the same way, for vLLM's own loop.

``profile`` runs the fake engine's jobs and a near-free model's job under cProfile (every thread
of the command) and prints where the time goes per row (``bench.profile_tables``); with two
sizes, also the difference between them per extra row, which leaves the fixed costs out. The fake
engine's jobs are profiled on the wall clock (a wait for the disk is a cost there); the model's
on each thread's CPU time, so that the command's waits for vLLM's engine process are left out and
what remains is its own work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import profile_tables, step_timing
from bench.overhead_engine import build_near_free_model, llm_kwargs, parse_engine_arg, peer_environment
from bench.vs_run_batch import _timed, answers, make_input, output_tokens, run_ours, run_peer

DEFAULT_ENGINE_ARGS = ["max_num_seqs=256", "max_num_batched_tokens=4096"]
SIDES = ("ours", "run_batch", "LLM.chat")
MODES = {"in-process": "0", "processes": "1"}  # VLLM_ENABLE_V1_MULTIPROCESSING, as a user would set it


class Bench:
    """The run's folder, model and environments."""

    def __init__(self, folder: Path, model_dir: Path | None, engine_args: list[str]):
        self.folder = folder
        self.model_dir = model_dir
        self.engine_arg_items = engine_args
        self.engine_args = dict(parse_engine_arg(item) for item in engine_args)
        home = folder / "dagster-home"
        servers = folder / "machine-server"
        servers.mkdir(mode=0o700, exist_ok=True)
        # Our command: its own Dagster home, no shared model server (warm or started).
        self.ours_env = {"DAGSTER_HOME": str(home), "ANEX_MACHINE_SERVER": "0", "ANEX_MACHINE_SERVER_DIR": str(servers)}
        self.peer_env = peer_environment()
        self._runs = 0

    def model(self) -> Path:
        if self.model_dir is None:
            started = time.perf_counter()
            self.model_dir = build_near_free_model(self.folder / "near-free-model")
            print(f"near-free model built in {time.perf_counter() - started:.1f} s: {self.model_dir}", flush=True)
        return self.model_dir

    def prime_home(self) -> None:
        """Creates the Dagster home's storage once, so that no timed run pays for it."""
        command = [sys.executable, "-m", "anex_pipeline.cli", "list"]
        subprocess.run(command, env={**os.environ, **self.ours_env}, check=True, capture_output=True)

    def fresh(self, name: str) -> Path:
        self._runs += 1
        return self.folder / f"{self._runs:03d}-{name}"

    def ours_flags(self) -> list[str]:
        flags = ["--model", str(self.model())]
        return flags + [flag for item in self.engine_arg_items for flag in ("--engine-arg", item)]

    def llm_args_file(self) -> Path:
        path = self.folder / "llm-kwargs.json"
        path.write_text(json.dumps(llm_kwargs(str(self.model()), self.engine_args)))
        return path


@contextlib.contextmanager
def bench_folder(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("ANEX_BENCH_DIR")) as folder:
        yield Path(folder)


# --- sides -------------------------------------------------------------------------------------


def run_llm_chat(bench: Bench, src: Path, out: Path, steps: Path | None = None, env: dict | None = None) -> float:
    command = [sys.executable, "-m", "bench.overhead_llm", str(src), str(out), str(bench.llm_args_file())]
    if steps is not None:
        command += ["--steps", str(steps)]
    return _timed(command, {**bench.peer_env, **(env or {})})[0]


def one_side(bench: Bench, side: str, src: Path, rows: int) -> dict[str, Any]:
    """One side's run: ``result``, the seconds from its start until its result file was last
    written (the file's modification time), and ``exit``, until the process ended."""
    work = bench.fresh(side.replace(".", "-"))
    work.mkdir()
    out = work / "out.jsonl"
    figures: dict[str, Any] = {}
    started = time.time()
    if side == "ours":
        wall, report = run_ours(src, out, work / "work", bench.ours_flags(), env=bench.ours_env)
        if report["request_counts"]["completed"] != rows:
            raise SystemExit(f"our run did not complete every row: {report['request_counts']}")
        timings = report["timings"]
        figures["engine_load"] = timings.get("engine_load", 0.0)
        figures["generate"] = timings.get("generate", 0.0)
    elif side == "run_batch":
        wall = run_peer(src, out, str(bench.model()), bench.peer_env, bench.engine_args)
    else:
        wall = run_llm_chat(bench, src, out)
    result = out.stat().st_mtime - started
    figures.update(exit=wall, result=result, tokens=output_tokens(out), answers=answers(out))
    return figures


def sides(bench: Bench, rows: int, pairs: int) -> None:
    src = bench.folder / f"in-{rows}.jsonl"
    make_input(src, rows, unique=True)
    results: dict[str, list[float]] = {side: [] for side in SIDES}
    exits: dict[str, list[float]] = {side: [] for side in SIDES}
    for pair in range(pairs):
        order = SIDES[pair % 3 :] + SIDES[: pair % 3]
        runs = {side: one_side(bench, side, src, rows) for side in order}
        for side in SIDES:
            results[side].append(runs[side]["result"])
            exits[side].append(runs[side]["exit"])
        ours = runs["ours"]
        differing = {
            side: sum(ours["answers"].get(k) != v for k, v in runs[side]["answers"].items()) for side in SIDES[1:]
        }
        tokens = ", ".join(f"{side} {runs[side]['tokens']}" for side in SIDES)
        everything_else = ours["result"] - ours["engine_load"] - ours["generate"]
        print(
            f"{rows} rows, pair {pair + 1} (order {', '.join(order)}):\n"
            + "".join(
                f"    {side:9} result after {runs[side]['result']:7.1f} s ({rows / runs[side]['result']:6.1f} rows/s, "
                f"{runs[side]['tokens'] / runs[side]['result']:7.1f} out tok/s), "
                f"exit after {runs[side]['exit']:7.1f} s\n"
                for side in SIDES
            )
            + f"    ours: engine load {ours['engine_load']:.1f} s, generation {ours['generate']:.1f} s, everything "
            f"else {everything_else:.1f} s; output tokens {tokens}; "
            f"answers unlike ours: run_batch {differing['run_batch']}, LLM.chat {differing['LLM.chat']} of {rows}",
            flush=True,
        )
    med = {side: statistics.median(values) for side, values in results.items()}
    med_exit = {side: statistics.median(values) for side, values in exits.items()}
    print(
        f"{rows} rows, medians of {pairs}, to the result written: "
        + ", ".join(f"{side} {med[side]:.1f} s ({rows / med[side]:.1f} rows/s)" for side in SIDES)
        + f"; ours / run_batch {med['ours'] / med['run_batch']:.2f}"
        f", ours / LLM.chat {med['ours'] / med['LLM.chat']:.2f}"
        f"; ours minus LLM.chat per row {(med['ours'] - med['LLM.chat']) / rows * 1e3:.2f} ms\n"
        f"{rows} rows, medians of {pairs}, to the process's exit: "
        + ", ".join(f"{side} {med_exit[side]:.1f} s" for side in SIDES),
        flush=True,
    )


# --- the fake engine's ceiling -----------------------------------------------------------------


def run_command(
    bench: Bench,
    src: Path,
    name: str,
    *,
    fake: bool = False,
    steps: bool = False,
    profile: bool = False,
    profile_clock: str = "wall",
    more: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``anex-pipeline run`` through ``bench.overhead_command``: its wall time, report, the seconds
    of its main, and the files it was asked for."""
    work = bench.fresh(name)
    work.mkdir()
    files = {"record": work / "record.json", "steps": work / "steps.json", "profile": work / "profile.pstats"}
    command = [sys.executable, "-m", "bench.overhead_command", "--record", str(files["record"])]
    command += ["--fake"] * fake + ["--steps", str(files["steps"])] * steps
    command += ["--profile", str(files["profile"]), "--profile-clock", profile_clock] * profile
    command += ["--", "run", str(src), "-o", str(work / "out.jsonl"), "--work-dir", str(work / "work"), "--quiet"]
    if not fake:
        command += ["--max-model-len", "2048", *bench.ours_flags()]
    wall, stdout = _timed([*command, *(more or [])], {**bench.ours_env, **(env or {})})
    report = json.loads(stdout)
    if report["status"] != "completed":
        raise SystemExit(f"{name}: the job ended {report['status']}: {report.get('failure_reason')}")
    record = json.loads(files["record"].read_text())
    return {"wall": wall, "report": report, **record, **files}


def _gc(ran: dict[str, Any]) -> str:
    counts, seconds = ran["gc_collections"], ran["gc_seconds"]
    return "garbage collections " + ", ".join(
        f"gen {n}: {c} ({s:.2f} s)" for n, (c, s) in enumerate(zip(counts, seconds, strict=True))
    )


def ceiling(bench: Bench, rows: int) -> None:
    src = bench.folder / f"in-{rows}.jsonl"
    make_input(src, rows, unique=True)
    ran = run_command(bench, src, f"fake-{rows}", fake=True)
    timings = ran["report"]["timings"]
    generate = timings.get("generate", 0.0)
    print(
        f"fake engine, {rows:,} rows: the command's main (submit to merge and publish) {ran['main_s']:.1f} s, "
        f"{rows / ran['main_s']:,.0f} rows/s; generation stage {generate:.1f} s, {rows / generate:,.0f} rows/s; "
        f"process {ran['wall']:.1f} s; timings {json.dumps(timings)}; {_gc(ran)}",
        flush=True,
    )


# --- idle time between steps -------------------------------------------------------------------


def _gap_line(label: str, figures: dict[str, Any]) -> str:
    share = figures["gap_total_s"] / max(1e-9, figures["gap_total_s"] + figures["step_total_s"])
    return (
        f"    {label:22} {figures['steps']:6d} steps, step median {figures['step_median_s'] * 1e3:6.2f} ms, "
        f"gap median {figures['gap_median_s'] * 1e3:6.2f} ms, p90 {figures['gap_p90_s'] * 1e3:6.2f} ms, "
        f"p99 {figures['gap_p99_s'] * 1e3:6.2f} ms, max {figures['gap_max_s'] * 1e3:7.1f} ms; "
        f"steps {figures['step_total_s']:.1f} s, gaps {figures['gap_total_s']:.1f} s ({share:.0%} of stepping)"
    )


def idle(bench: Bench, rows: int) -> None:
    src = bench.folder / f"in-{rows}.jsonl"
    make_input(src, rows, unique=True)
    for mode, value in MODES.items():
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": value}
        ran = run_command(bench, src, f"idle-ours-{mode}", steps=True, env=env)
        ours = step_timing.gaps(ran["steps"])
        llm_steps = bench.fresh(f"idle-llm-{mode}")
        llm_steps.mkdir()
        llm_wall = run_llm_chat(bench, src, llm_steps / "out.jsonl", steps=llm_steps / "steps.json", env=env)
        theirs = step_timing.gaps(llm_steps / "steps.json")
        print(
            f"{rows} rows, engine core {mode}:\n"
            f"{_gap_line('ours', ours)} (wall {ran['wall']:.1f} s; {_gc(ran)})\n"
            f"{_gap_line('LLM.chat (vLLM loop)', theirs)} (wall {llm_wall:.1f} s)",
            flush=True,
        )


# --- profiles ----------------------------------------------------------------------------------


def profile(bench: Bench, fake_rows: list[int], model_rows: list[int], out: Path | None, top: int) -> None:
    written = []

    def show(name: str, text: str) -> None:
        print(text + "\n", flush=True)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name}.md").write_text(text + "\n")
            written.append(out / f"{name}.md")

    for kind, sizes in (("fake", fake_rows), ("model", model_rows)):
        read = []
        for rows in sizes:
            src = bench.folder / f"in-{rows}.jsonl"
            make_input(src, rows, unique=True)
            clock = "wall" if kind == "fake" else "cpu"
            ran = run_command(
                bench, src, f"profile-{kind}-{rows}", fake=kind == "fake", profile=True, profile_clock=clock
            )
            timings = ran["report"]["timings"]
            print(
                f"profiled {kind} run, {rows:,} rows: main {ran['main_s']:.1f} s, process {ran['wall']:.1f} s, "
                f"timings {json.dumps(timings)}; {_gc(ran)}",
                flush=True,
            )
            read.append(profile_tables.read(ran["profile"], rows, f"{kind} engine, {rows:,} rows, {clock} clock"))
            show(f"{kind}-{rows}", profile_tables.render(read[-1], top))
        if len(read) >= 2:
            extra = profile_tables.difference(read[0], read[-1])
            show(f"{kind}-per-extra-row", profile_tables.render(extra, top))
    if written:
        print("written: " + ", ".join(map(str, written)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="a near-free model built before (default: built anew)")
    parser.add_argument("--folder", type=Path, help="keep the runs' files here (default: a temporary folder)")
    parser.add_argument(
        "--engine-arg",
        action="append",
        metavar="KEY=VALUE",
        help=f"a vLLM engine argument for every side, repeatable (default: {' '.join(DEFAULT_ENGINE_ARGS)})",
    )
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("sides", help="ours, run_batch and LLM.chat on the same rows")
    p.add_argument("--rows", type=int, nargs="+", default=[2048])
    p.add_argument("--pairs", type=int, default=3)
    p = sub.add_parser("ceiling", help="the fake engine: rows/s of a whole job and of generation")
    p.add_argument("--rows", type=int, default=100_000)
    p = sub.add_parser("idle", help="the engine's idle time between steps")
    p.add_argument("--rows", type=int, default=2048)
    p = sub.add_parser("profile", help="where our time goes, per row")
    p.add_argument("--fake-rows", type=int, nargs="*", default=[10_000, 50_000])
    p.add_argument("--model-rows", type=int, nargs="*", default=[2048])
    p.add_argument("--out", type=Path, help="also write each table here as markdown")
    p.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with bench_folder(args.folder) as folder:
        bench = Bench(folder, args.model_dir, args.engine_arg or DEFAULT_ENGINE_ARGS)
        bench.prime_home()
        print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
        if args.what == "sides":
            for rows in args.rows:
                sides(bench, rows, args.pairs)
        elif args.what == "ceiling":
            ceiling(bench, args.rows)
        elif args.what == "idle":
            idle(bench, args.rows)
        else:
            profile(bench, args.fake_rows, args.model_rows, args.out, args.top)
        print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
