"""The order in which a shard's rows reach the engine: rows whose rendered prompts begin with the
same tokens (a system prompt, a document, a few-shot block) are sent next to each other, so the
engine's prefix cache computes the shared part once while those rows run.

vLLM keeps computed prompt blocks until it needs their room, and it schedules rows first come,
first served. When the shared prefixes of a shard fit in its KV cache together, any order finds
them cached; when they do not (dozens of long documents asked several questions each, question by
question), file order evicts each document before its next question comes. So the rows are
ordered only when the shared prefixes would fill more than half of the cache (the other half is
what the running rows themselves need).

The order is by tokens, so two conversations that differ only after a long common start group
together; only whole cache blocks count, as vLLM caches nothing smaller. Groups sharing the
longest prefix go first; rows that share no whole block with any other keep their file order,
after the groups. Results are keyed by row index, so the order never shows in the output.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

R = TypeVar("R")
WINDOW_ROWS = 8192  # rows read ahead and ordered together (a shard is usually one window)
STOP_CHECK_ROWS = 256  # rows tokenised between two stop checks


@dataclass(frozen=True)
class PrefixCache:
    """What an engine's prefix cache can hold: it keeps whole blocks of ``block_tokens``, and
    ``capacity_tokens`` in all."""

    block_tokens: int
    capacity_tokens: int


class PrefixEngine(Protocol):
    """An engine that can order rows by prefix: its cache, and the tokens of its rows' prompts
    (``stop`` checked while they are worked out)."""

    prefix_cache: PrefixCache | None

    def prompts_tokens(
        self, requests: Sequence[R], stop: Callable[[], None] | None
    ) -> Sequence[Sequence[int] | None]: ...


def shared_bytes(texts: Sequence[bytes]) -> int:
    """How many bytes of every distinct prefix that two texts or more share, in all: with each
    text standing for a prompt, no fewer than its tokens when a token is a byte or more."""
    lcp = [_shared_start(a, b) for a, b in itertools.pairwise(sorted(texts))]
    return sum(max(0, now - before) for before, now in zip([0, *lcp], lcp, strict=False))


def _shared_start(a: bytes, b: bytes) -> int:
    """The length of the start two texts share, by halving (each comparison runs in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def shared_blocks(a: Sequence[int], b: Sequence[int], block: int) -> int:
    """How many tokens the two prompts share at their start, in whole blocks."""
    n = 0
    limit = min(len(a), len(b))
    while n + block <= limit and a[n : n + block] == b[n : n + block]:
        n += block
    return n


def prefix_order(
    prompts: Sequence[Sequence[int] | None], cache: PrefixCache, adapters: Sequence[str | None] | None = None
) -> list[int] | None:
    """The positions of ``prompts`` in the order to run them, or None when file order is as good
    (no prefix worth keeping together, or all of them fit in the cache at once). A prompt that is
    None (it could not be rendered) goes last, where the engine refuses it as it would anyway.
    ``adapters``: each prompt's LoRA adapter (None: the base model); vLLM caches the blocks of
    each adapter apart, so prompts share a prefix only with prompts of the same adapter."""
    block = cache.block_tokens
    lanes = adapters or [None] * len(prompts)
    known = [i for i, p in enumerate(prompts) if p is not None]
    # Any fixed-width encoding sorts prompts that share a start next to each other.
    keys = {i: (lanes[i] is not None, lanes[i] or "", array("i", prompts[i]).tobytes()) for i in known}  # type: ignore[arg-type]
    ranked = sorted(known, key=keys.__getitem__)
    del keys
    lcp = [
        shared_blocks(prompts[a], prompts[b], block) if lanes[a] == lanes[b] else 0  # type: ignore[arg-type]
        for a, b in itertools.pairwise(ranked)
    ]
    # Tokens of every distinct block prefix that two rows or more share: what the cache must hold.
    shared = sum(max(0, now - before) for before, now in zip([0, *lcp], lcp, strict=False))
    if shared * 2 <= cache.capacity_tokens:
        return None
    groups: list[tuple[int, list[int]]] = []  # (tokens the group's rows all share, positions)
    alone: list[int] = []
    start = 0
    for k in range(len(ranked)):
        if k < len(lcp) and lcp[k] > 0:
            continue  # the group goes on with the next row
        run = ranked[start : k + 1]
        if len(run) > 1:
            groups.append((min(lcp[start:k]), run))
        else:
            alone.extend(run)
        start = k + 1
    groups.sort(key=lambda g: -g[0])  # stable: equal groups keep their sorted order
    missing = [i for i, p in enumerate(prompts) if p is None]
    return [i for _, run in groups for i in run] + sorted(alone) + missing


def ordered(
    requests: Iterable[R],
    engine: PrefixEngine,
    stop: Callable[[], None] | None = None,
    window: int = WINDOW_ROWS,
) -> Iterator[R]:
    """The requests in prefix order, ``window`` rows at a time (file order where ordering would not
    help); the engine must have a prefix cache. ``stop`` is checked while prompts are tokenised."""
    cache = engine.prefix_cache
    assert cache is not None
    source = iter(requests)
    while batch := list(itertools.islice(source, window)):
        prompts = engine.prompts_tokens(batch, stop)
        order = prefix_order(prompts, cache, [getattr(req, "adapter", None) for req in batch])
        del prompts
        yield from batch if order is None else (batch[i] for i in order)
