"""Where a job's rows are cut into shards: near even sizes, but not through a run of rows that
share a long prompt start (a document asked several questions in a row, a long instruction over
many items), so that two shards do not both compute the same prefix.

A shard is a contiguous range of rows (the checkpoints and the merge rely on it), so the plan can
only move cuts: each cut may move up to a quarter of a shard's size (at most 512 rows) to the
place where the rows on either side share the least. A file that interleaves its groups (each document's first
question, then each document's second) has no such place; its shards each compute every
document once, and the engine's row order (:mod:`anex_pipeline.engine.prefix_order`) keeps that to once.

How much two neighbouring rows share is measured on the request as stored, before any template:
the number of the lengths in :data:`LEVEL_CHARS` over which their starts are equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# The starts of the requests in each of the given (start, stop) row windows, in window order.
Heads = Callable[[list[tuple[int, int]]], list[Sequence[bytes | str]]]
LEVEL_CHARS = (512, 1024, 2048, 4096)  # about 128 to 1,024 tokens: one to eight cache blocks
SLACK = 0.25  # how far a cut may move, as a share of the even shard size,
REACH_ROWS = 512  # and in rows: a longer run computes its prefix once more for hundreds of rows


def sharing_level(previous: bytes | str, current: bytes | str) -> int:
    """How many of the :data:`LEVEL_CHARS` first characters (or bytes) the two requests share."""
    level = 0
    for n in LEVEL_CHARS:
        if len(previous) < n or len(current) < n or previous[:n] != current[:n]:
            break
        level += 1
    return level


def plan_bounds(total: int, count: int, heads: Heads) -> list[int]:
    """The ``count + 1`` row bounds of ``count`` shards of ``total`` rows (0 first, ``total`` last).

    Each cut starts at the even split and moves, within :data:`SLACK` of a shard's size, to the
    row that shares least (:func:`sharing_level`) with the row before it, the nearest such row on
    a tie. ``heads`` gives the starts of the requests around the cuts, all in one call.
    """
    reach = min(int(total / count * SLACK), REACH_ROWS)  # under half a shard: windows never overlap
    evens = [total * s // count for s in range(1, count)]
    windows = [(max(0, even - reach - 1), min(total, even + reach + 1)) for even in evens]
    bounds = [0]
    for even, (start, stop), rows in zip(evens, windows, heads(windows), strict=True):
        levels = {i: sharing_level(rows[i - start - 1], rows[i - start]) for i in range(max(1, start + 1), stop)}
        best = min(levels, key=lambda i: (levels[i], abs(i - even)), default=even)
        bounds.append(max(best, bounds[-1] + 1))
    bounds.append(total)
    return bounds
