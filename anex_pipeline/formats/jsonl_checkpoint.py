"""A JSONL job's shard checkpoint: JSON lines of finished rows, appended durably and read back as
the latest outcome per row (a torn last line from a killed writer is skipped)."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar

import msgspec

from anex_pipeline.formats import (
    write_error,
)
from anex_pipeline.spec import RowOutcome

T = TypeVar("T")


READ_BLOCK = 1 << 18


MAX_OPEN_RUNS = 64  # runs of a checkpoint merged side by side; more are merged on disk first


PATCH_BYTES = 8 << 20  # small runs of a checkpoint held in memory while the merge streams the big ones


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
