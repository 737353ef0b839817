"""The submit step: checking a job's whole input, its model and its destinations before anything
loads, then writing the normalised requests as shard files plus the manifest.

``prepare_job`` streams the input and writes nothing unless every row passes; the CLI, the Batch
API and the Dagster asset all submit through it."""

from __future__ import annotations

import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from anex_pipeline.engine.adapters import adapter_problems, row_adapter
from anex_pipeline.engine.constraint_check import compile_problems, job_constraints
from anex_pipeline.engine.models import model_unavailable, resolve_model, spellings_of
from anex_pipeline.formats.base import Format
from anex_pipeline.formats.registry import FORMATS, misnamed, sniff
from anex_pipeline.options import sidecar_of
from anex_pipeline.spec import MODEL_NOT_FOUND, Endpoint, InputRow, JobOptions, JobRejected, Problem
from anex_pipeline.stages.submit_shard_plan import LEVEL_CHARS, Heads, plan_bounds
from anex_pipeline.storage import is_s3, output_problem
from anex_pipeline.validate import ModelNames
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.manifest import (
    JobDir,
    JobManifest,
    ShardRange,
    atomic_write_text,
    file_sha256,
    make_job_id,
)

# A shard is the unit of work one GPU takes at a time; by default a job gets as many shards as it
# needs for none to exceed either target (see docs/scale.md for why these sizes).
ROWS_PER_SHARD = 4096
TOKENS_PER_SHARD = 4_000_000  # estimated prompt + output tokens
BYTES_PER_TOKEN = 4  # a prompt's size in tokens, guessed from its bytes at submit
OUTPUT_TOKENS_GUESS = 256  # output tokens a row is expected to take when the job sets no max_tokens


MAX_REPORTED_PROBLEMS = 1000


class Problems:
    """The problems a check finds: all of them counted, the first :data:`MAX_REPORTED_PROBLEMS`
    kept, so that a file where every line is wrong keeps memory bounded."""

    def __init__(self, found: list[Problem] | None = None):
        self.kept: list[Problem] = []
        self.total = 0
        for problem in found or []:
            self.add(problem)

    def add(self, problem: Problem) -> None:
        self.total += 1
        if len(self.kept) < MAX_REPORTED_PROBLEMS:
            self.kept.append(problem)

    def __bool__(self) -> bool:
        return self.total > 0

    def rejection(self) -> JobRejected:
        """The job's refusal, naming the kept problems and counting all of them."""
        return JobRejected(self.kept, total=self.total)


def default_report_path(output: str) -> str:
    for suffix in (*(f.suffix for f in FORMATS.values()), ".json"):
        if output.endswith(suffix):
            return output[: -len(suffix)] + ".report.json"
    return output + ".report.json"


def shard_count(total: int, staged_bytes: int, options: JobOptions) -> int:
    """How many shards a job of ``total`` rows gets: ``shards`` when set, else enough for at most
    ``shard_rows`` rows each, else enough for neither ``ROWS_PER_SHARD`` rows nor
    ``TOKENS_PER_SHARD`` estimated tokens to be exceeded (the job's system prompt, kept once in
    its options, counts for every row); never more shards than rows."""
    if options.shards is not None:
        count = options.shards
    elif options.shard_rows is not None:
        count = math.ceil(total / options.shard_rows)
    else:
        prompt_bytes = staged_bytes + total * len((options.system_prompt or "").encode("utf-8", "surrogatepass"))
        tokens = prompt_bytes / BYTES_PER_TOKEN + total * (options.max_tokens or OUTPUT_TOKENS_GUESS)
        count = max(math.ceil(total / ROWS_PER_SHARD), math.ceil(tokens / TOKENS_PER_SHARD))
    return max(1, min(count, total))


def shard_ranges(total: int, count: int, heads: Heads | None = None) -> list[ShardRange]:
    """``count`` contiguous slices of ``total`` rows; with ``heads`` (the starts of staged
    requests) cut where neighbouring rows share the least prompt
    (:mod:`anex_pipeline.stages.submit_shard_plan`), else evenly (sizes differ by one at most)."""
    if heads is not None and count > 1:
        bounds = plan_bounds(total, count, heads)
    else:
        bounds = [total * s // count for s in range(count + 1)]
    return [ShardRange(start=bounds[s], stop=bounds[s + 1]) for s in range(count)]


def detect_format(path: Path) -> Format:
    if not path.exists():
        raise JobRejected([Problem(f"input file {path} does not exist")])
    if not path.is_file():
        raise JobRejected([Problem(f"input {path} is not a file")])
    try:
        kind = sniff(path)
    except OSError as exc:
        raise JobRejected([Problem(f"input file {path} cannot be read: {exc.strerror}")]) from None
    if kind is None:
        raise JobRejected([Problem(f"input file {path} is empty: there are no rows")])
    if why := misnamed(path, kind):
        raise JobRejected([Problem(why)])
    return kind


def read_input(path: Path, options: JobOptions, priority: bool | None = None) -> tuple[Format, Endpoint, Iterator[Any]]:
    """Opens an input for checking: its format, its endpoint, and its problems and chunks of
    accepted rows (in the format's own form), in input order, then the problems of regexes and
    grammars too many or too slow to compile. ``priority``: whether the job's engine schedules
    rows by priority (None: not known here)."""
    kind = detect_format(path)
    endpoint = kind.job_endpoint(path, options)
    model, model_name = resolve_model(options.model, endpoint)
    spellings = [*spellings_of(model_name), *([options.model] if options.model else [])]
    names = ModelNames(model_name, spellings, options.lora_modules or {})
    constraints = job_constraints()

    def items() -> Iterator[Any]:
        yield from kind.read_chunks(path, endpoint, names, options, priority, constraints)
        yield from compile_problems(constraints, model)

    return kind, endpoint, items()


def check_input(path: Path, options: JobOptions) -> tuple[Format, Endpoint, Iterator[InputRow | Problem]]:
    """Like :func:`read_input`, with the accepted rows one by one."""
    kind, endpoint, chunks = read_input(path, options)

    def rows() -> Iterator[InputRow | Problem]:
        for item in chunks:
            if isinstance(item, Problem):
                yield item
            else:
                yield from kind.chunk_rows(item, endpoint, options)

    return kind, endpoint, rows()


def accepted_rows(
    path: Path, options: JobOptions, local_model: bool = True
) -> tuple[Format, Endpoint, Iterator[InputRow]]:
    """A look at a job without preparing it (``validate``, a quote): its format, endpoint and
    accepted rows one by one. Once every row has been read, the rows raise the job's rejection if
    the input, a row, the model (``local_model``: one this machine loads) or an adapter has a
    problem, or there are no rows."""
    kind, endpoint, rows = check_input(path, options)
    problems = Problems(
        (model_problems(options.model) if local_model else []) + adapter_problems(options, endpoint, local_model)
    )

    def accepted() -> Iterator[InputRow]:
        count = 0
        for item in rows:
            if isinstance(item, Problem):
                problems.add(item)
            else:
                count += 1
                yield item
        if not problems and count == 0:
            problems.add(Problem(f"input file {path} has no rows"))
        if problems:
            raise problems.rejection()

    return kind, endpoint, accepted()


def model_problems(model: str | None) -> list[Problem]:
    """The job's model as a problem when this machine cannot load it (see :func:`model_unavailable`)."""
    why = model_unavailable(model)
    return [Problem(why, field="model", code=MODEL_NOT_FOUND)] if why else []


def check_destinations(
    input_path: Path,
    output: str,
    report: str,
    options_file: Path | None = None,
    *,
    work_root: Path | None = None,
    results_in: Path | None = None,
) -> None:
    """Refuses an output or report that is a file the job reads (the input, its sidecar
    ``<input>.job.json``, the options file) or each other, whatever the path's spelling (``..``,
    symlinks, hard links), one that exists but is not a regular file (a folder, a FIFO), and one
    inside ``work_root``, whose job folders ``delete`` and ``prune`` remove with all they hold
    (``results_in``: the one folder of the work root where the caller keeps results itself, the
    Batch API's)."""
    read = [("the input", input_path), ("the input's options sidecar", sidecar_of(input_path))]
    read += [("the options file", Path(options_file))] if options_file is not None else []
    problems = []
    written: list[tuple[str, Path]] = []
    in_work_root = False
    for flag, dest in (("output", output), ("report", report)):
        if is_s3(dest):
            continue
        target = Path(os.path.realpath(Path(dest).expanduser()))  # where it lands; folders on the way get made
        clash = next((what for what, path in read + written if _same_file(target, path)), None)
        if clash is not None:
            problems.append(
                Problem(f"{dest} is {clash}, which the job would write over; choose another path", field=flag)
            )
        elif target.exists() and not target.is_file():
            problems.append(
                Problem(f"{dest} exists and is not a regular file (a folder or FIFO); name a file", field=flag)
            )
        elif work_root is not None and _inside(target, work_root) and not (results_in and _inside(target, results_in)):
            if not in_work_root:  # a report beside such an output is inside too: one line says it
                problems.append(
                    Problem(
                        f"{dest} is inside the work folder {work_root}, whose job folders `anex-pipeline delete` "
                        "and `prune` remove; write the result outside it",
                        field=flag,
                    )
                )
            in_work_root = True
        written.append(("the output", target))
    if problems:
        raise JobRejected(problems)


def _inside(target: Path, folder: Path) -> bool:
    """Whether ``target`` (a resolved path) lies within ``folder``, by where the folder leads."""
    return target.is_relative_to(os.path.realpath(Path(folder).expanduser()))


def _same_file(a: Path, b: Path) -> bool:
    """True when two paths name one file: by where they lead (symlinks and ``..`` followed, even
    through folders not made yet, which writing the file would make) or, for files that exist,
    by inode (hard links)."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def prepare_job(
    input_path: Path,
    output: str,
    options: JobOptions,
    work_root: Path,
    *,
    report: str | None = None,
    job_id: str | None = None,
    local_model: bool = True,
    s3_client: Any = None,
    options_file: Path | None = None,
    stop: Callable[[], None] | None = None,
    results_in: Path | None = None,
    claim: Callable[[JobDir], object] | None = None,
    adapters: dict[str, str] | None = None,
    priority: bool | None = None,
    answer_scope: str = "",
) -> JobDir:
    """Checks the input, that the model can be loaded here (``local_model``; not for a job sent to
    a model server) and that the result and report locations can be written (``s3_client`` for
    s3:// ones), then writes the job's shards and manifest; raises JobRejected on problems.

    ``options_file``: the file the options were read from, if any, which the job must not write
    over. The output and report must lie outside ``work_root``, but for ``results_in`` (see
    :func:`check_destinations`). ``claim`` is called with the job as soon as its id is known,
    before its folder is looked at: the CLI takes the job's lease there, so that no ``prune`` or
    ``delete`` removes the folder of a job being resumed. ``stop`` is called before each chunk of
    rows is checked: what it raises ends the check, and the rows it had staged are removed.
    Idempotent: a job whose manifest already exists for the same input content is reused as it
    is, so reruns and resumes keep their checkpoints. ``adapters``: the engine's LoRA adapters
    (its ``lora_modules``), which join a generation job's own. ``priority``: whether the engine
    schedules rows by priority (see :meth:`~anex_pipeline.engine.config.EngineConfig.schedules_by_priority`).
    ``answer_scope``: whose stored answers the job may share (see :attr:`JobManifest.answer_scope`).
    """
    input_path = Path(input_path)
    kind, endpoint, chunks = read_input(input_path, options, priority)
    if adapters and endpoint != "embeddings":  # read again (nothing is read yet) knowing the adapters
        options = options.model_copy(update={"lora_modules": {**adapters, **(options.lora_modules or {})}})
        kind, endpoint, chunks = read_input(input_path, options, priority)
    report = report or default_report_path(output)
    check_destinations(input_path, output, report, options_file, work_root=work_root, results_in=results_in)
    problems = Problems(model_problems(options.model) if local_model else [])
    for problem in adapter_problems(options, endpoint, local_model):
        problems.add(problem)
    for dest in dict.fromkeys((output, report)):
        if why := output_problem(dest, s3_client):
            problems.add(Problem(why, field="output" if dest == output else "report"))
    sha = file_sha256(input_path)
    raw_options = options.model_dump(exclude_defaults=True)
    # The output is not part of the id: a job whose result could not be written resumes, with
    # every finished row, when it is run again towards a location that works.
    job_id = job_id or make_job_id(input_path, sha, raw_options)
    job = JobDir(work_root, job_id)
    new_folder = not os.path.lexists(job.root)  # a refused job then leaves no folder behind
    if claim is not None:
        claim(job)
    if job.exists() and job.manifest().input_sha256 == sha:
        if problems:
            raise problems.rejection()
        manifest = job.manifest()
        if (manifest.output, manifest.report) != (output, report):
            moved = manifest.model_copy(update={"output": output, "report": report})
            atomic_write_text(job.manifest_path, moved.model_dump_json(indent=2))
        return job
    job.root.mkdir(parents=True, exist_ok=True)
    staging = job.root / layout.STAGING
    total = 0
    out = kind.staging(staging)
    by_model: Counter[str] = Counter()
    model_path, model_name = resolve_model(options.model, endpoint)
    checked = False
    try:
        for item in chunks:
            if stop is not None:
                stop()
            if isinstance(item, Problem):
                problems.add(item)
                continue
            total += len(item)
            if not problems:
                out.add(item)
                if options.lora_modules:
                    by_model.update(_row_models(kind.chunk_rows(item, endpoint, options), options, model_name))
        checked = True
    finally:
        out.close()
        if not checked:  # cut short: nothing of this check is kept
            staging.unlink(missing_ok=True)
            if new_folder:
                shutil.rmtree(job.root, ignore_errors=True)
    if problems or total == 0:
        staging.unlink(missing_ok=True)
        if new_folder:  # nothing but the lease in it: no prune would ever remove it
            shutil.rmtree(job.root, ignore_errors=True)
        if not problems:
            problems.add(Problem(f"input file {input_path} has no rows"))
        raise problems.rejection()
    count = shard_count(total, staging.stat().st_size, options)
    ranges = shard_ranges(total, count, lambda windows: out.heads(windows, LEVEL_CHARS[-1]))
    _split(staging, job, ranges, kind)
    staging.unlink()
    manifest = JobManifest(
        job_id=job_id,
        input=str(input_path.resolve()),
        input_sha256=sha,
        output=output,
        report=report,
        format=kind.name,
        endpoint=endpoint,
        model=str(model_path),
        model_name=model_name,
        options=raw_options,
        total_rows=total,
        shards=ranges,
        submitted_at=time.time(),
        rows_by_model=dict(sorted(by_model.items())),
        answer_scope=answer_scope,
    )
    atomic_write_text(job.manifest_path, manifest.model_dump_json(indent=2))
    return job


def _row_models(rows: Iterator[InputRow], options: JobOptions, base: str) -> Iterator[str]:
    """The model each row asks for: its adapter's name, or the job's model."""
    for row in rows:
        yield row_adapter(row.body, options.lora_modules, options.adapter) or base


def _split(staging: Path, job: JobDir, ranges: list[ShardRange], kind: Format) -> None:
    targets = []
    for n, rng in enumerate(ranges):
        job.shard_dir(n).mkdir(parents=True, exist_ok=True)
        for each in FORMATS.values():  # the input changed: old results no longer apply
            (job.shard_dir(n) / each.checkpoint_file).unlink(missing_ok=True)
        targets.append((job.requests_path(n, kind.name), rng.size))
    kind.split_staging(staging, targets)
