"""A job's work folder: its manifest, its shards of requests and their checkpoints.

``prepare_job`` is the submit step: it checks the whole input (streaming), and only when nothing
is wrong writes the normalised requests as shard files plus a manifest. Everything later reads
the job through :class:`JobDir`.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import msgspec
import pyarrow as pa
from pydantic import BaseModel

from anex_pipeline.formats import (
    FileFormat,
    InputRow,
    StoredOutcome,
    arrow_checkpoint,
    decode_stored_outcome,
    jsonl,
    parquet,
    sniff_format,
    write_error,
)
from anex_pipeline.models import model_unavailable, resolve_model
from anex_pipeline.spec import Endpoint, JobOptions, JobRejected, Problem, RowOutcome
from anex_pipeline.storage import is_s3, output_problem

# A shard is the unit of work one GPU takes at a time; by default a job gets as many shards as it
# needs for none to exceed either target (see docs/scale.md for why these sizes).
ROWS_PER_SHARD = 4096
TOKENS_PER_SHARD = 4_000_000  # estimated prompt + output tokens
BYTES_PER_TOKEN = 4  # a prompt's size in tokens, guessed from its bytes at submit
OUTPUT_TOKENS_GUESS = 256  # output tokens a row is expected to take when the job sets no max_tokens
MAX_REPORTED_PROBLEMS = 1000
T = TypeVar("T")
JOB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
FORMATS = {"jsonl": jsonl, "parquet": parquet}
CHECKPOINT_FILES = {"jsonl": "results.jsonl", "parquet": "results.arrow"}  # a shard's finished rows
READ_BLOCK = 1 << 18
MAX_OPEN_RUNS = 64  # runs of a checkpoint merged side by side; more are merged on disk first
PATCH_BYTES = 8 << 20  # small runs of a checkpoint held in memory while the merge streams the big ones


class ShardRange(BaseModel):
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class JobManifest(BaseModel):
    """What a job is: where it reads and writes, its options, and how its rows are sharded."""

    job_id: str
    input: str
    input_sha256: str
    output: str
    report: str
    format: FileFormat
    endpoint: Endpoint
    model: str  # path or id the engine loads
    model_name: str  # the name written into responses
    options: dict[str, Any]
    total_rows: int
    shards: list[ShardRange]
    submitted_at: float

    def job_options(self) -> JobOptions:
        return JobOptions.model_validate(self.options)


def shard_key(n: int) -> str:
    return f"{n:02d}"


def default_report_path(output: str) -> str:
    for suffix in (".jsonl", ".parquet", ".json"):
        if output.endswith(suffix):
            return output[: -len(suffix)] + ".report.json"
    return output + ".report.json"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def make_job_id(input_path: Path, *identity: Any) -> str:
    """A stable id from the input's name and what identifies the job (for the CLI: the input's
    content and the options), so that running the same job again resumes it."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", input_path.name.split(".")[0]).strip("-")[:40] or "job"
    fingerprint = json.dumps(identity, sort_keys=True)
    return f"{stem}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:10]}"


def atomic_write_text(path: Path, text: str) -> None:
    """Writes a file so that readers see the old content or the new, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # e.g. the disk is full: leave no temp file behind, name the real file
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise write_error(exc, path) from None


class JobDir:
    """Paths and readers of one job's work folder."""

    def __init__(self, work_root: Path | str, job_id: str):
        if not JOB_ID.fullmatch(job_id):  # the id names a folder: it must stay one folder under work_root
            raise ValueError(
                f"job id {job_id[:80]!r} cannot name a job folder: use at most 200 letters, digits, '-', '_' "
                "and '.', not starting with '.'"
            )
        self.job_id = job_id
        self.root = Path(work_root) / job_id
        self._manifest: tuple[tuple[int, int, int], JobManifest] | None = None  # (file stamp, parsed)

    @property
    def manifest_path(self) -> Path:
        return self.root / "job.json"

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> JobManifest:
        """The job's manifest, parsed again only when its file has changed: a job's steps read
        it once per shard, and a job with thousands of shards has a manifest as long."""
        st = self.manifest_path.stat()
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if self._manifest is None or self._manifest[0] != stamp:
            self._manifest = (stamp, JobManifest.model_validate_json(self.manifest_path.read_text()))
        return self._manifest[1]

    def shard_dir(self, shard: int) -> Path:
        return self.root / "shards" / shard_key(shard)

    def requests_path(self, shard: int, kind: FileFormat) -> Path:
        return self.shard_dir(shard) / FORMATS[kind].SHARD_FILE

    def checkpoint_path(self, shard: int, manifest: JobManifest | None = None) -> Path:
        """The shard's finished rows: JSON lines for a JSONL job, Arrow columns for a Parquet one
        (``manifest``: the job's, when the caller has read it already)."""
        return self.shard_dir(shard) / CHECKPOINT_FILES[(manifest or self.manifest()).format]

    @property
    def estimate_path(self) -> Path:
        return self.root / "estimate.json"

    @property
    def sample_path(self) -> Path:
        return self.root / "estimate_sample.jsonl"

    @property
    def stop_path(self) -> Path:
        return self.root / "stop.json"

    def read_requests(self, shard: int) -> Iterator[InputRow]:
        manifest = self.manifest()
        path = self.requests_path(shard, manifest.format)
        yield from FORMATS[manifest.format].read_shard(path, manifest.endpoint, manifest.job_options())

    def record_outcomes(self, shard: int, outcomes: Iterable[RowOutcome]) -> None:
        """Appends finished rows to the shard's checkpoint, durably."""
        manifest = self.manifest()
        path = self.checkpoint_path(shard, manifest)
        if manifest.format == "parquet":
            arrow_checkpoint.append(path, outcomes, manifest.endpoint)
        else:
            append_outcomes(path, outcomes)

    def outcomes(self, shard: int) -> Iterator[StoredOutcome]:
        """The latest outcome of each row of the shard that has one, by row order. A JSONL job's
        bodies stay the stored JSON and its checkpoint is streamed, never read whole (see
        :func:`latest_records`); a Parquet job's answers stay in :meth:`answers`."""
        manifest = self.manifest()
        path = self.checkpoint_path(shard, manifest)
        if manifest.format == "parquet":
            return arrow_checkpoint.stored_outcomes(arrow_checkpoint.latest(path, manifest.endpoint))
        rng = manifest.shards[shard]
        return latest_records(path, rng.start, rng.stop, decode_stored_outcome)

    def answers(self, shard: int) -> Iterator[pa.Table]:
        """A Parquet job's shard checkpoint as columns: the latest row per index, by index."""
        manifest = self.manifest()
        return arrow_checkpoint.latest(self.checkpoint_path(shard, manifest), manifest.endpoint)

    def finished_rows(self, shard: int) -> set[int]:
        """The indices of the shard's rows whose latest outcome succeeded."""
        return {o.i for o in self.outcomes(shard) if not o.failed}

    @property
    def deadline_path(self) -> Path:
        return self.root / "deadline.json"

    def start_clock(self, time_limit_s: float | None) -> None:
        """Starts the job's time limit (if it has one) from now: each run of the job gets it whole."""
        self.deadline_path.unlink(missing_ok=True)
        if time_limit_s is not None:
            atomic_write_text(self.deadline_path, json.dumps({"at": time.time() + time_limit_s, "limit": time_limit_s}))

    def out_of_time(self) -> str | None:
        """Why the job must stop now because of its time limit, or None."""
        deadline = self._deadline()
        if deadline is None or time.time() < deadline["at"]:
            return None
        return f"the job's time limit of {deadline['limit']:g} s was reached"

    def time_left(self) -> float | None:
        """Seconds until the job's time limit runs out (0 or less once it has); None without a limit."""
        deadline = self._deadline()
        return None if deadline is None else deadline["at"] - time.time()

    def _deadline(self) -> dict[str, float] | None:
        if not self.deadline_path.exists():
            return None
        return json.loads(self.deadline_path.read_text())

    def record_stop(self, reason: str) -> None:
        atomic_write_text(self.stop_path, json.dumps({"reason": reason, "at": time.time()}))


def unfinished_shards(job: JobDir) -> list[int]:
    """Shards with rows that are missing from their checkpoint or failed."""
    return [shard for shard, rng in enumerate(job.manifest().shards) if len(job.finished_rows(shard)) < rng.size]


def read_outcomes(path: Path) -> dict[int, RowOutcome]:
    """The latest outcome per row index; a torn line (a killed writer) is skipped."""
    found: dict[int, RowOutcome] = {}
    if not path.exists():
        return found
    for _, line in _complete_lines(path):
        try:
            rec = msgspec.json.decode(line)
        except msgspec.DecodeError:
            continue
        found[rec["i"]] = RowOutcome.from_record(rec)
    return found


class _RowIndex(msgspec.Struct):
    i: int


_row_index = msgspec.json.Decoder(_RowIndex).decode


def latest_records(path: Path, start: int, stop: int, decode: Callable[[bytes], T]) -> Iterator[T]:
    """The last readable record written for each row index in ``[start, stop)``, decoded, by
    ascending index.

    A checkpoint is append-only: mostly ascending runs of rows, with reruns and reused samples
    appended out of order. The file is read twice: once for the byte ranges of its ascending
    runs, then the runs are merged by index; of the lines written for one index the latest
    readable one wins (an older one when the latest is torn). Memory does not grow with the
    file: the smallest runs, up to ``PATCH_BYTES`` in all, are held in memory; the others (at
    least the largest) are read side by side, at most ``MAX_OPEN_RUNS`` of them, a file with
    more having groups of them merged into temporary files first.
    """
    if not path.exists():
        return
    runs = _ascending_runs(path, start, stop)
    if not runs:  # an empty checkpoint (its first write failed and was cut back)
        return
    if len(runs) == 1:  # the common case: no index twice, nothing to merge
        yield from _decoded(_run_lines(path, *runs[0]), decode)
        return
    held: dict[int, list[tuple[int, bytes]]] = {}  # index -> (run number, line)
    room = PATCH_BYTES
    *smaller, largest = sorted(range(len(runs)), key=lambda n: runs[n][1] - runs[n][0])
    streamed = [largest]
    for n in smaller:
        begin, end = runs[n]
        if end - begin > room:
            streamed.append(n)
            continue
        room -= end - begin
        for line in _run_lines(path, begin, end):
            held.setdefault(_index_of(line), []).append((n, line))
    if len(streamed) == 1:  # one big run and a few stray lines (reused samples, reruns)
        yield from _patched_run(path, streamed[0], runs[streamed[0]], held, decode)
        return
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".merge-") as spill:
        sources = [_tagged_lines(path, n, *runs[n]) for n in sorted(streamed)]
        names = itertools.count()
        while len(sources) > MAX_OPEN_RUNS:
            merged = []
            for n in range(0, len(sources), MAX_OPEN_RUNS):
                out = Path(spill) / f"run-{next(names)}"
                with out.open("wb") as f:
                    for index, run, line in heapq.merge(*sources[n : n + MAX_OPEN_RUNS]):
                        f.write(b"%d %d %b\n" % (index, run, line))
                merged.append(_spilled_lines(out))
            sources = merged
        stream = sources[0] if len(sources) == 1 else heapq.merge(*sources)
        for candidates in _by_index(stream, held):
            yield from _latest_of(candidates, decode)


def _readable(line: bytes, decode: Callable[[bytes], T]) -> T | None:
    """The decoded line, or None for a torn one (a record of the wrong shape is an error)."""
    try:
        return decode(line)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError:
        return None


def _decoded(lines: Iterable[bytes], decode: Callable[[bytes], T]) -> Iterator[T]:
    for line in lines:
        if (record := _readable(line, decode)) is not None:
            yield record


def _latest_of(candidates: list[tuple[int, bytes]], decode: Callable[[bytes], T]) -> Iterator[T]:
    """The decoded line of the latest run among one index's (run, line) candidates that reads."""
    for _, line in sorted(candidates, reverse=True):
        if (record := _readable(line, decode)) is not None:
            yield record
            return


def _patched_run(
    path: Path,
    run: int,
    span: tuple[int, int],
    held: dict[int, list[tuple[int, bytes]]],
    decode: Callable[[bytes], T],
) -> Iterator[T]:
    """One ascending run merged with the lines held in memory: the run streams undecoded up to
    each held index, found by bisecting the run's bytes."""
    begin, end = span
    with path.open("rb") as f:
        for index in sorted(held):
            cut = _first_line_from(f, begin, end, index)
            yield from _decoded(_run_lines(path, begin, cut), decode)
            candidates = held[index]
            f.seek(cut)
            line = f.readline()
            begin = cut
            if cut < end and _index_of(line[:-1]) == index:
                candidates = [*candidates, (run, line[:-1])]
                begin += len(line)
            yield from _latest_of(candidates, decode)
    yield from _decoded(_run_lines(path, begin, end), decode)


def _first_line_from(f: BinaryIO, begin: int, end: int, index: int) -> int:
    """In an ascending run of whole lines at ``[begin, end)``, the offset of the first line whose
    index is ``index`` or more (``end`` when there is none)."""
    lo, hi = begin, end  # lines starting before lo are below index; the line at hi is not
    while lo < hi:
        start = (lo + hi) // 2
        if start > lo:
            f.seek(start - 1)
            f.readline()
            start = f.tell()
        if start >= hi:
            start = lo
        f.seek(start)
        line = f.readline()
        if _index_of(line[:-1]) >= index:
            hi = start
        else:
            lo = start + len(line)
    return lo


def _by_index(
    stream: Iterator[tuple[int, int, bytes]], held: dict[int, list[tuple[int, bytes]]]
) -> Iterator[list[tuple[int, bytes]]]:
    """The (run, line) candidates of each index, by ascending index, from an index-ordered stream
    of (index, run, line) and the runs held in memory."""
    extra = iter(sorted(held))
    following = next(extra, None)
    group: list[tuple[int, bytes]] = []
    current = -1
    for index, run, line in stream:
        if index != current:
            if group:
                yield group
            while following is not None and following <= index:
                if following < index:
                    yield held.pop(following)
                following = next(extra, None)
            group = held.pop(index, [])
            current = index
        group.append((run, line))
    if group:
        yield group
    while following is not None:
        yield held.pop(following)
        following = next(extra, None)


def _tagged_lines(path: Path, run: int, begin: int, end: int) -> Iterator[tuple[int, int, bytes]]:
    for line in _run_lines(path, begin, end, 1 << 16):
        yield _index_of(line), run, line


def _spilled_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    for line in _run_lines(path, 0, path.stat().st_size, 1 << 16):
        index, run, rest = line.split(b" ", 2)
        yield int(index), int(run), rest


def _index_of(line: bytes) -> int:
    """A checkpoint line's row index (records start with it); -1 for a line that is not one."""
    if line.startswith(b'{"i":'):
        end = line.find(b",", 5)
        if end > 5 and line[5:end].isdigit():
            return int(line[5:end])
    try:
        return _row_index(line).i
    except msgspec.DecodeError:
        return -1


def _complete_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Each newline-ended line (without the newline) and its offset; an unended tail is left out."""
    offset = 0
    rest = b""
    with path.open("rb") as f:
        while block := f.read(READ_BLOCK):
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            for line in lines:
                yield offset, line
                offset += len(line) + 1


def _ascending_runs(path: Path, start: int, stop: int) -> list[tuple[int, int]]:
    """Byte ranges of the file's maximal runs of lines with ascending row indices in range."""
    runs = []
    begin = None
    last = end = 0
    for offset, line in _complete_lines(path):
        index = _index_of(line)
        wanted = start <= index < stop
        if begin is not None and (not wanted or index <= last):
            runs.append((begin, offset))
            begin = None
        if wanted:
            begin = offset if begin is None else begin
            last, end = index, offset + len(line) + 1
    if begin is not None:
        runs.append((begin, end))
    return runs


def _run_lines(path: Path, begin: int, end: int, block: int = READ_BLOCK) -> Iterator[bytes]:
    """The lines (without newlines) of a byte range that holds whole lines."""
    rest = b""
    with path.open("rb") as f:
        f.seek(begin)
        left = end - begin
        while left:
            chunk = f.read(min(block, left))
            left -= len(chunk)
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            yield from lines


def append_outcomes(path: Path, outcomes: Iterable[RowOutcome]) -> None:
    """Appends finished rows to a checkpoint file and makes them durable before returning."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = memoryview(_torn_tail_break(path) + b"".join(msgspec.json.encode(o.to_record()) + b"\n" for o in outcomes))
    with path.open("ab", buffering=0) as f:
        start = os.fstat(f.fileno()).st_size
        try:
            while data:
                data = data[f.write(data) :]
            os.fsync(f.fileno())
        except OSError as exc:
            # Half a chunk must not stay: rows appended later would follow a torn line.
            f.truncate(start)
            raise write_error(exc, path) from None


def _torn_tail_break(path: Path) -> bytes:
    """A newline when the file ends inside a line (its writer was killed), so that the rows
    appended next start on a line of their own; else nothing."""
    with contextlib.suppress(FileNotFoundError), path.open("rb") as f:
        if f.seek(0, os.SEEK_END):
            f.seek(-1, os.SEEK_END)
            return b"" if f.read(1) == b"\n" else b"\n"
    return b""


def shard_count(total: int, staged_bytes: int, options: JobOptions) -> int:
    """How many shards a job of ``total`` rows gets: ``shards`` when set, else enough for at most
    ``shard_rows`` rows each, else enough for neither ``ROWS_PER_SHARD`` rows nor
    ``TOKENS_PER_SHARD`` estimated tokens to be exceeded; never more shards than rows."""
    if options.shards is not None:
        count = options.shards
    elif options.shard_rows is not None:
        count = math.ceil(total / options.shard_rows)
    else:
        tokens = staged_bytes / BYTES_PER_TOKEN + total * (options.max_tokens or OUTPUT_TOKENS_GUESS)
        count = max(math.ceil(total / ROWS_PER_SHARD), math.ceil(tokens / TOKENS_PER_SHARD))
    return max(1, min(count, total))


def shard_ranges(total: int, count: int) -> list[ShardRange]:
    """``count`` contiguous slices of ``total`` rows whose sizes differ by one at most."""
    bounds = [total * s // count for s in range(count + 1)]
    return [ShardRange(start=bounds[s], stop=bounds[s + 1]) for s in range(count)]


def detect_format(path: Path) -> FileFormat:
    if not path.exists():
        raise JobRejected([Problem(f"input file {path} does not exist")])
    if not path.is_file():
        raise JobRejected([Problem(f"input {path} is not a file")])
    try:
        kind = sniff_format(path)
    except OSError as exc:
        raise JobRejected([Problem(f"input file {path} cannot be read: {exc.strerror}")]) from None
    if kind is None:
        raise JobRejected([Problem(f"input file {path} is empty: there are no rows")])
    if path.suffix.lower() == ".parquet" and kind != "parquet":
        raise JobRejected(
            [Problem(f"{path.name} is named .parquet but is not a Parquet file (no PAR1 header); is it JSONL?")]
        )
    return kind


def read_input(path: Path, options: JobOptions) -> tuple[FileFormat, Endpoint, Iterator[Any]]:
    """Opens an input for checking: its format, its endpoint, and its problems and chunks of
    accepted rows (in the format module's own form), in input order."""
    kind = detect_format(path)
    module = FORMATS[kind]
    try:
        endpoint = module.job_endpoint(path, options)
    except parquet.ParquetInputError as exc:
        raise JobRejected(exc.problems) from None
    _, model_name = resolve_model(options.model, endpoint)
    names = frozenset({model_name, *(n for n in [options.model] if n)})
    return kind, endpoint, module.read_chunks(path, endpoint, names, options)


def check_input(path: Path, options: JobOptions) -> tuple[FileFormat, Endpoint, Iterator[InputRow | Problem]]:
    """Like :func:`read_input`, with the accepted rows one by one."""
    kind, endpoint, chunks = read_input(path, options)

    def rows() -> Iterator[InputRow | Problem]:
        for item in chunks:
            if isinstance(item, Problem):
                yield item
            elif kind == "jsonl":
                yield from jsonl.chunk_rows(item)
            else:
                yield from parquet.chunk_rows(item, endpoint, options)

    return kind, endpoint, rows()


def model_problems(model: str | None) -> list[Problem]:
    """The job's model as a problem when this machine cannot load it (see :func:`model_unavailable`)."""
    why = model_unavailable(model)
    return [Problem(why, field="model")] if why else []


def check_destinations(input_path: Path, output: str, report: str, options_file: Path | None = None) -> None:
    """Refuses an output or report that is a file the job reads (the input, its sidecar
    ``<input>.job.json``, the options file) or each other, whatever the path's spelling (``..``,
    symlinks, hard links), and one that exists but is not a regular file (a folder, a FIFO)."""
    read = [("the input", input_path), ("the input's options sidecar", Path(f"{input_path}.job.json"))]
    read += [("the options file", Path(options_file))] if options_file is not None else []
    problems = []
    written: list[tuple[str, Path]] = []
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
        written.append(("the output", target))
    if problems:
        raise JobRejected(problems)


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
) -> JobDir:
    """Checks the input, that the model can be loaded here (``local_model``; not for a job sent to
    a model server) and that the result and report locations can be written (``s3_client`` for
    s3:// ones), then writes the job's shards and manifest; raises JobRejected on problems.

    ``options_file``: the file the options were read from, if any, which the job must not write
    over. Idempotent: a job whose manifest already exists for the same input content is reused as
    it is, so reruns and resumes keep their checkpoints.
    """
    input_path = Path(input_path)
    kind, endpoint, chunks = read_input(input_path, options)
    report = report or default_report_path(output)
    check_destinations(input_path, output, report, options_file)
    found = model_problems(options.model) if local_model else []
    for dest in dict.fromkeys((output, report)):
        if why := output_problem(dest, s3_client):
            found.append(Problem(why, field="output" if dest == output else "report"))
    sha = file_sha256(input_path)
    raw_options = options.model_dump(exclude_defaults=True)
    # The output is not part of the id: a job whose result could not be written resumes, with
    # every finished row, when it is run again towards a location that works.
    job_id = job_id or make_job_id(input_path, sha, raw_options)
    job = JobDir(work_root, job_id)
    if job.exists() and job.manifest().input_sha256 == sha:
        if found:
            raise JobRejected(found)
        manifest = job.manifest()
        if (manifest.output, manifest.report) != (output, report):
            moved = manifest.model_copy(update={"output": output, "report": report})
            atomic_write_text(job.manifest_path, moved.model_dump_json(indent=2))
        return job
    job.root.mkdir(parents=True, exist_ok=True)
    module = FORMATS[kind]
    staging = job.root / "rows.staging"
    problems: list[Problem] = found
    problem_count = len(found)
    total = 0
    out = module.Staging(staging)
    try:
        for item in chunks:
            if isinstance(item, Problem):
                problem_count += 1
                if len(problems) < MAX_REPORTED_PROBLEMS:
                    problems.append(item)
                continue
            total += len(item)
            if problem_count == 0:
                out.add(item)
    finally:
        out.close()
    if problem_count:
        staging.unlink(missing_ok=True)
        raise JobRejected(problems, total=problem_count)
    if total == 0:
        staging.unlink(missing_ok=True)
        raise JobRejected([Problem(f"input file {input_path} has no rows")])
    ranges = shard_ranges(total, shard_count(total, staging.stat().st_size, options))
    _split(staging, job, ranges, kind)
    staging.unlink()
    model_path, model_name = resolve_model(options.model, endpoint)
    manifest = JobManifest(
        job_id=job_id,
        input=str(input_path.resolve()),
        input_sha256=sha,
        output=output,
        report=report,
        format=kind,
        endpoint=endpoint,
        model=str(model_path),
        model_name=model_name,
        options=raw_options,
        total_rows=total,
        shards=ranges,
        submitted_at=time.time(),
    )
    atomic_write_text(job.manifest_path, manifest.model_dump_json(indent=2))
    return job


def _split(staging: Path, job: JobDir, ranges: list[ShardRange], kind: FileFormat) -> None:
    targets = []
    for n, rng in enumerate(ranges):
        job.shard_dir(n).mkdir(parents=True, exist_ok=True)
        for name in CHECKPOINT_FILES.values():  # the input changed: old results no longer apply
            (job.shard_dir(n) / name).unlink(missing_ok=True)
        targets.append((job.requests_path(n, kind), rng.size))
    FORMATS[kind].split_staging(staging, targets)
