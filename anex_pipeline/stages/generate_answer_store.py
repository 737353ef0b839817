"""Answers of deterministic rows kept across the jobs of one work folder, so that a job rerun
with a few rows changed generates only those.

A row is looked up by the job's answer-book fingerprint (:func:`answer_book.fingerprint`:
endpoint, body, every sampling field, caps, format, template arguments, thinking settings) and
by what the engine is (:func:`engine_identity`: model, adapter and every engine setting that
shapes an answer, and vLLM's version), so an answer is served only to a row that asks exactly
the same of the same engine. Only successful answers of deterministic rows are kept (the
answer book decides which rows those are).

The store is a diskcache folder beside the jobs (``<work root>/answer-store``), bounded in size
(the least recently stored answers go first) and pruned with the jobs: each answer carries the
id of the job that generated it, and deleting or pruning that job removes its answers. The
store only saves work: when it cannot be read or written, rows are generated as without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sqlite3
from collections.abc import Iterable
from pathlib import Path

import diskcache

from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.spec import RowOutcome
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.manifest import JobDir, JobManifest

log = logging.getLogger(__name__)

SIZE_LIMIT_BYTES = 2 << 30  # answers beyond this go, least recently stored first
# Engine settings that size the engine but never change what it answers.
SIZING = ("memory_share", "kv_cache_gib")


def engine_identity(config: EngineConfig, manifest: JobManifest) -> str:
    """What answers a job's rows, as far as the answers go: the engine kind and servers, the model
    (its folder and name) with its parsers, adapters and every engine setting but those that only
    size it, the files of the model's and adapters' local folders, vLLM's version, and the
    endpoint the rows were written for (a responses row runs as the chat row it means, and its
    answer is a Responses object)."""
    from anex_pipeline.engine.engine_args import vllm_version
    from anex_pipeline.engine.loader import vllm_settings

    settings = {k: v for k, v in dataclasses.asdict(vllm_settings(config, manifest)).items() if k not in SIZING}
    folders = [settings["model"], *json.loads(settings.get("lora_modules") or "{}").values()]
    shape = {
        "kind": config.kind,
        "servers": config.base_url,
        "settings": settings,
        "vllm": vllm_version(),
        "endpoint": manifest.endpoint,
        "files": [_files_of(str(folder)) for folder in folders],
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()


def _files_of(folder: str) -> list[tuple[str, int, int]]:
    """The files of a local model or adapter folder by name, size and modification time, so that
    weights written again under the same path are another identity (a hub id gives none)."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return []
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir() if f.is_file())


class AnswerStore:
    """The work folder's answers across jobs, for one engine identity."""

    def __init__(self, work_root: Path, identity: str, job_id: str, size_limit: int = SIZE_LIMIT_BYTES):
        self.identity, self.job_id = identity, job_id
        self._cache: diskcache.Cache | None = _open(work_root, size_limit)

    def _key(self, fingerprint: str) -> str:
        return hashlib.sha256(f"{self.identity}:{fingerprint}".encode()).hexdigest()

    def get(self, fingerprint: str) -> RowOutcome | None:
        """The answer an earlier job got for this fingerprint on this engine, if it is kept."""
        if self._cache is None:
            return None
        try:
            record = self._cache.get(self._key(fingerprint))
        except (sqlite3.Error, OSError, diskcache.Timeout) as exc:
            log.warning("could not read the answer store: %s", exc)
            return None
        return RowOutcome.from_record(record) if record is not None else None

    def add(self, answers: Iterable[tuple[str, RowOutcome]]) -> None:
        """Keeps the successful answers, marked as this job's."""
        if self._cache is None:
            return
        try:
            with self._cache.transact():
                for fingerprint, outcome in answers:
                    if outcome.ok:
                        self._cache.set(self._key(fingerprint), outcome.to_record(), tag=self.job_id)
            self._cache.cull()  # after the transaction: culling inside it removed every answer
        except (sqlite3.Error, OSError, diskcache.Timeout) as exc:
            log.warning("could not keep answers in the answer store %s: %s", self._cache.directory, exc)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()


def open_store(job: JobDir, config: EngineConfig) -> AnswerStore | None:
    """The work folder's answer store for a job on the engine ``config`` describes, or None when
    the job keeps out of it (``answer_store`` or ``reuse_answers`` off)."""
    manifest = job.manifest()
    options = manifest.job_options()
    if not (options.answer_store and options.reuse_answers):
        return None
    return AnswerStore(job.root.parent, engine_identity(config, manifest), job.job_id)


def note_served(job: JobDir, shard: int, rows: Iterable[int]) -> None:
    """Notes the rows of a shard that were answered from the store, for the report."""
    with (job.shard_dir(shard) / layout.FROM_EARLIER_JOBS).open("a", encoding="utf-8") as f:
        f.write("".join(f"{i}\n" for i in rows))


def served_rows(job: JobDir, shards: int) -> int:
    """The job's rows whose answer in the result came from the store: noted as served from it and
    still holding a copied answer (a row generated again later, after a failed write, does not count)."""
    count = 0
    for shard in range(shards):
        path = job.shard_dir(shard) / layout.FROM_EARLIER_JOBS
        if path.exists():
            noted = {int(line) for line in path.read_text(encoding="utf-8").split()}
            count += sum(1 for o in job.outcomes(shard) if o.i in noted and o.reused)
    return count


def drop_answers(work_root: Path, job_id: str) -> None:
    """Removes the answers a job generated (the job is being deleted or pruned)."""
    folder = Path(work_root).expanduser() / layout.ANSWER_STORE_DIR
    if not folder.is_dir():
        return
    cache = _open(work_root, SIZE_LIMIT_BYTES)
    if cache is None:
        return
    try:
        cache.evict(job_id)
    except (sqlite3.Error, OSError, diskcache.Timeout) as exc:
        log.warning("could not remove job %s's answers from the answer store: %s", job_id, exc)
    finally:
        cache.close()


def _open(work_root: Path, size_limit: int) -> diskcache.Cache | None:
    folder = Path(work_root).expanduser() / layout.ANSWER_STORE_DIR
    try:
        return diskcache.Cache(
            str(folder),
            size_limit=size_limit,
            eviction_policy="least-recently-stored",
            cull_limit=0,  # culled by add, once its answers are in
            tag_index=True,
        )
    except (sqlite3.Error, OSError, diskcache.Timeout) as exc:
        log.warning("the answer store %s cannot be opened; rows are generated as without it: %s", folder, exc)
        return None
