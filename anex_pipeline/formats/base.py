"""What every file format of a job provides, and what its merge is handed.

A format reads its input in chunks, in input order (a :class:`~anex_pipeline.spec.Problem` for a
row that failed its checks, or a run of consecutive accepted rows in the form its shards store
them), stages them until the job knows its shards, cuts the staging into shard files and reads
them back as :class:`~anex_pipeline.spec.InputRow`; it keeps each shard's finished rows in a
checkpoint of its own form, and merges the checkpoints into the result file. The registry
(:mod:`~anex_pipeline.formats.registry`) holds one instance of each, by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import pyarrow as pa

from anex_pipeline.formats import StoredOutcome
from anex_pipeline.spec import Endpoint, InputRow, JobOptions, RowOutcome
from anex_pipeline.validate.answers import Constraints


class RowCounter(Protocol):
    """What a merge shows each row of the result to: the report's tally of rows and tokens."""

    def add(self, o: StoredOutcome) -> StoredOutcome: ...

    def add_answers(self, table: pa.Table) -> pa.Table: ...

    def absorb(self, other: Any) -> None: ...


@dataclass(frozen=True)
class ShardCheckpoint:
    """A shard's checkpoint and the rows ``[start, stop)`` the shard holds."""

    path: Path
    start: int
    stop: int


@dataclass(frozen=True)
class MergeInput:
    """What a merge reads: the job's input file, its endpoint and options, and every shard's
    checkpoint in shard order."""

    input: Path
    endpoint: Endpoint
    options: JobOptions
    shards: list[ShardCheckpoint]


class Staging(Protocol):
    """Every accepted row of an input in one file, until the job knows how to cut it into shards."""

    def add(self, chunk: Any) -> None: ...

    def close(self) -> None: ...

    def heads(self, windows: list[tuple[int, int]], size: int) -> list[list[Any]]: ...


class Format(ABC):
    """One file format: a job's input and result are files of it."""

    name: ClassVar[str]  # the manifest's name of the format; the result's suffix after a dot
    title: ClassVar[str]  # the format's name in messages
    magic: ClassVar[bytes | None] = None  # the first bytes of its files; None: any file no other format claims
    shard_file: ClassVar[str]  # a shard's requests, in the shard's folder
    checkpoint_file: ClassVar[str]  # a shard's finished rows, in the shard's folder
    error_field: ClassVar[str]  # the field of the result that is set on a failed row

    @property
    def suffix(self) -> str:
        return f".{self.name}"

    @abstractmethod
    def job_endpoint(self, path: Path, options: JobOptions) -> Endpoint:
        """The endpoint of the job's rows; raises JobRejected for a file that cannot say."""

    @abstractmethod
    def read_chunks(
        self,
        path: Path,
        endpoint: Endpoint,
        model_names: frozenset[str],
        options: JobOptions,
        priority: bool | None = None,
        constraints: Constraints | None = None,
    ) -> Iterator[Any]:
        """Checks every row in input order; yields each bad row's problems and, for runs of good
        ones, a chunk in the form the shards store (``len(chunk)`` is its number of rows).
        ``priority``: whether the job's engine schedules rows by priority (None: not known).
        ``constraints`` gets the regexes and grammars the accepted rows ask to be held to."""

    @abstractmethod
    def chunk_rows(self, chunk: Any, endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
        """The rows of one chunk of :meth:`read_chunks`, with their request bodies."""

    @abstractmethod
    def staging(self, path: Path) -> Staging:
        """A new staging file at ``path``, for the chunks of :meth:`read_chunks`."""

    @abstractmethod
    def split_staging(self, staging: Path, shards: list[tuple[Path, int]]) -> None:
        """Cuts the staged rows into shard files holding the given numbers of rows, in order."""

    @abstractmethod
    def read_shard(self, path: Path, endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
        """A shard's rows with their request bodies (a /v1/responses row comes as the chat row
        it means)."""

    @abstractmethod
    def append_checkpoint(self, path: Path, outcomes: Iterable[RowOutcome], endpoint: Endpoint) -> None:
        """Appends finished rows to a shard's checkpoint, durably."""

    @abstractmethod
    def checkpoint_outcomes(self, path: Path, start: int, stop: int, endpoint: Endpoint) -> Iterator[StoredOutcome]:
        """The latest outcome of each row ``[start, stop)`` of a shard's checkpoint, by row order."""

    @abstractmethod
    def merge(self, job: MergeInput, out: Path, counter: RowCounter) -> None:
        """Writes the result of every row that has an outcome, in input order, to ``out`` (a path
        the caller renames into place), showing each row to ``counter`` on the way."""

    @abstractmethod
    def result_keys(self, path: Path) -> Iterator[str]:
        """The row identities of a result file, in file order."""
