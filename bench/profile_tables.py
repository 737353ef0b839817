"""A cProfile of a job (``bench.overhead_command --profile``) as tables per row: where the
command's own time goes, for ``bench.overhead profile``.

- by area: every function's own time (``tottime``) goes to the area of its file (the answer
  store, the checkpoints, Dagster, ...); a built-in function (SQLite's ``execute``, ``fsync``, a
  file write) has no file, so its time goes to the areas of its callers, in the shares they
  called it for. The areas add up to the profile's total.
- primitives: SQLite calls, fsyncs, writes, JSON and Prometheus label look-ups, with their calls
  and time per row and who made them.
- the functions with the most own time, and the package's functions with the most cumulative
  time (which includes what they call, so those overlap).

Times are per row in microseconds, as measured under the profiler (which slows Python calls
down: compare the areas with each other, and the totals with an unprofiled run). A collection of
Python's cyclic garbage collector is counted to whatever function was running when it began.
"""

from __future__ import annotations

import pstats
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

Func = tuple[str, int, str]  # (file, line, name) as pstats keys them; file "~" for built-ins

# (area, substrings of a file path), first match wins
AREAS: list[tuple[str, tuple[str, ...]]] = [
    ("answer store (earlier jobs' answers)", ("stages/generate_answer_store.py", "workdir/answer_table.py")),
    ("answer book (identical rows of the job)", ("stages/generate_answer_book.py",)),
    ("checkpoint writes (work folder, shard owner)", ("workdir/manifest.py", "workdir/shard_owner.py")),
    ("formats: shard rows, checkpoints, results", ("anex_pipeline/formats/",)),
    ("resolve_request, engine streaming", ("anex_pipeline/engine/base.py",)),
    ("prefix order (prompt tokens ahead)", ("engine/prefix_order.py",)),
    ("our vLLM engine: prompts, stepping, outputs", ("anex_pipeline/engine/vllm/", "anex_pipeline/engine/sharing.py")),
    ("responses and completions", ("anex_pipeline/engine/completions.py", "anex_pipeline/responses.py")),
    ("metrics (our code)", ("anex_pipeline/metrics.py",)),
    ("progress display", ("anex_pipeline/console.py", "/tqdm/")),
    ("validation (submit)", ("anex_pipeline/validate/", "anex_pipeline/media/", "request_fields.py")),
    ("generate stage (other)", ("anex_pipeline/stages/generate.py",)),
    ("submit, shard, merge stages", ("anex_pipeline/stages/",)),
    ("fake engine (stands for the model)", ("anex_pipeline/testing.py",)),
    ("anex_pipeline (other)", ("anex_pipeline/",)),
    ("prometheus_client", ("/prometheus_client/",)),
    ("Dagster, SQLAlchemy, alembic", ("/dagster", "/sqlalchemy/", "/alembic/")),
    ("vLLM", ("/vllm/",)),
    ("tokenizer, transformers, torch", ("/transformers/", "/tokenizers/", "/torch/")),
    ("JSON (json, msgspec)", ("/json/", "msgspec")),
    ("threads and queues", ("threading.py", "queue.py", "concurrent/futures")),
    ("imports", ("<frozen importlib", "importlib/")),
]

# (name, substrings of a built-in's name)
PRIMITIVES: list[tuple[str, tuple[str, ...]]] = [
    ("SQLite execute/executemany", ("'execute' of 'sqlite3", "'executemany' of 'sqlite3")),
    ("SQLite commit", ("'commit' of 'sqlite3",)),
    ("SQLite connect/close", ("_sqlite3.connect", "'close' of 'sqlite3")),
    ("fsync", ("posix.fsync", "posix.fdatasync")),
    ("file writes", ("'write' of '_io.", "posix.write")),
    ("file opens", ("io.open", "posix.open")),
    ("msgspec encode", ("msgspec._core.json_encode", "'encode' of 'msgspec")),
    ("msgspec decode", ("msgspec._core.json_decode", "'decode' of 'msgspec")),
    ("json.dumps (stdlib)", ("json/__init__.py:dumps",)),
    ("json.loads (stdlib)", ("json/__init__.py:loads",)),
    ("prometheus labels()", ("prometheus_client/metrics.py:labels",)),
    ("tokenizer encode", ("'encode' of 'tokenizers", "'encode_batch' of 'tokenizers")),
]


def name_of(func: Func) -> str:
    file, line, name = func
    if file == "~":
        return name
    for marker in ("site-packages/", "/lib/python3.11/", "/anex_pipeline/"):
        if marker in file:
            file = ("anex_pipeline/" if marker == "/anex_pipeline/" else "") + file.split(marker, 1)[1]
            break
    return f"{file}:{line}({name})"


def area_of(func: Func) -> str | None:
    """The area of a function with a file; None for a built-in."""
    if func[0] == "~":
        return "JSON (json, msgspec)" if "msgspec" in func[2] or "_json" in func[2] else None
    path = func[0].replace("\\", "/")
    for area, parts in AREAS:
        if any(p in path for p in parts):
            return area
    return "other libraries"


def _primitive(func: Func) -> str | None:
    text = f"{func[0]}:{func[2]}" if func[0] != "~" else func[2]
    for name, parts in PRIMITIVES:
        if any(p in text for p in parts):
            return name
    return None


def _caller_areas(stats: dict, func: Func, seen: frozenset[Func] = frozenset()) -> dict[str, float]:
    """Shares (summing to 1) of ``func``'s calls by the area of its callers; built-in callers are
    followed up to their own callers."""
    callers = stats[func][4]
    total = sum(edge[2] for edge in callers.values()) or sum(1 for _ in callers) or 1
    shares: dict[str, float] = defaultdict(float)
    if not callers:
        shares["other libraries"] += 1.0
    for caller, edge in callers.items():
        weight = (edge[2] if sum(e[2] for e in callers.values()) else 1) / total
        area = area_of(caller)
        if area is None and caller not in seen and caller in stats:
            for sub, share in _caller_areas(stats, caller, seen | {func}).items():
                shares[sub] += weight * share
        else:
            shares[area or "other libraries"] += weight
    return shares


@dataclass
class Profile:
    """One profile, summed: seconds by area, primitives and function."""

    name: str
    rows: int
    total: float
    by_area: dict[str, float]
    primitive_calls: dict[str, int]
    primitive_time: dict[str, float]
    primitive_areas: dict[str, dict[str, float]]
    funcs: dict[Func, tuple[int, float, float]]  # calls, own seconds, cumulative seconds


def read(profile: Path, rows: int, name: str) -> Profile:
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    by_area: dict[str, float] = defaultdict(float)
    calls_of: dict[str, int] = defaultdict(int)
    time_of: dict[str, float] = defaultdict(float)
    areas_of: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for func, (_cc, calls, own, cum, _callers) in stats.items():
        area = area_of(func)
        if area is None:
            for sub, share in _caller_areas(stats, func).items():
                by_area[sub] += own * share
        else:
            by_area[area] += own
        kind = _primitive(func)
        if kind is not None:
            seconds = cum if func[0] != "~" else own
            time_of[kind] += seconds
            calls_of[kind] += calls
            for sub, share in _caller_areas(stats, func).items():
                areas_of[kind][sub] += share * seconds
    funcs = {func: (v[1], v[2], v[3]) for func, v in stats.items()}
    total = sum(v[2] for v in stats.values())
    return Profile(name, rows, total, dict(by_area), dict(calls_of), dict(time_of), dict(areas_of), funcs)


def difference(small: Profile, large: Profile) -> Profile:
    """What ``large`` did beyond ``small``, for its extra rows: the cost of one more row, with the
    job's fixed costs (imports, Dagster runs, engine start) left out."""

    def minus(a: dict, b: dict) -> dict:
        return {k: v - b.get(k, 0) for k, v in a.items()}

    areas = {k: minus(v, small.primitive_areas.get(k, {})) for k, v in large.primitive_areas.items()}
    funcs = {}
    for func, (calls, own, cum) in large.funcs.items():
        c0, o0, k0 = small.funcs.get(func, (0, 0.0, 0.0))
        funcs[func] = (calls - c0, own - o0, cum - k0)
    return Profile(
        f"{large.name} minus {small.name} (per extra row)",
        large.rows - small.rows,
        large.total - small.total,
        minus(large.by_area, small.by_area),
        minus(large.primitive_calls, small.primitive_calls),
        minus(large.primitive_time, small.primitive_time),
        areas,
        funcs,
    )


def render(p: Profile, top: int = 25) -> str:
    per_row = 1e6 / p.rows
    lines = [f"{p.name}: {p.rows:,} rows, {p.total:.2f} s of own time (profiled), {p.total * per_row:.1f} µs/row"]
    lines += ["", "Own time by area (built-ins counted to their callers' areas):", ""]
    lines += ["| area | µs/row | share |", "|---|---:|---:|"]
    for area, seconds in sorted(p.by_area.items(), key=lambda kv: -kv[1]):
        if abs(seconds * per_row) >= 0.5:
            lines.append(f"| {area} | {seconds * per_row:.1f} | {seconds / p.total:.1%} |")
    lines += ["", "Primitives (time includes what they call; the callers' areas after it):", ""]
    lines += ["| primitive | calls/row | µs/row | from |", "|---|---:|---:|---|"]
    for kind, seconds in sorted(p.primitive_time.items(), key=lambda kv: -kv[1]):
        areas = sorted(p.primitive_areas.get(kind, {}).items(), key=lambda kv: -kv[1])[:3]
        where = "; ".join(f"{a} {s * per_row:.1f}" for a, s in areas if s * per_row >= 0.05)
        lines.append(f"| {kind} | {p.primitive_calls[kind] / p.rows:.3f} | {seconds * per_row:.1f} | {where} |")
    lines += ["", f"Top {top} functions by own time:", ""]
    lines += _function_table(p, sorted(p.funcs, key=lambda f: -p.funcs[f][1])[:top])
    ours = [f for f in p.funcs if "/anex_pipeline/" in f[0]]
    lines += ["", f"Top {top} functions of the package by cumulative time (nested, so they overlap):", ""]
    lines += _function_table(p, sorted(ours, key=lambda f: -p.funcs[f][2])[:top])
    return "\n".join(lines)


def _function_table(p: Profile, funcs: Iterable[Func]) -> list[str]:
    per_row = 1e6 / p.rows
    out = ["| function | calls/row | own µs/row | cumulative µs/row |", "|---|---:|---:|---:|"]
    for func in funcs:
        calls, own, cum = p.funcs[func]
        out.append(f"| `{name_of(func)}` | {calls / p.rows:.3f} | {own * per_row:.1f} | {cum * per_row:.1f} |")
    return out
