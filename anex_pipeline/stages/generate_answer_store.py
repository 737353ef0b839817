"""Answers of deterministic rows kept across the jobs of one work folder, so that a job rerun
with a few rows changed generates only those.

A row is looked up by the job's answer-book fingerprint (:func:`answer_book.fingerprint`:
endpoint, body, every sampling field, caps, format, template arguments, thinking settings) and
by what the engine is (:func:`engine_identity`: model, adapter and every engine setting that
shapes an answer, and vLLM's version), so an answer is served only to a row that asks exactly
the same of the same engine. Only successful answers of deterministic rows are kept (the
answer book decides which rows those are).

A job run by a shared service for one of its tenants looks up and keeps answers in that
tenant's scope only (:attr:`JobManifest.answer_scope`): one tenant never gets, nor can probe for,
an answer another tenant's job generated.

The store is one SQLite file of JSON answers beside the jobs (``<work root>/answer-store``, see
:mod:`anex_pipeline.workdir.answer_table`), bounded in size (the least recently stored answers
go first) and pruned with the jobs: each answer carries the id of the job that generated it, and
deleting or pruning that job removes its answers. The store only saves work: when it cannot be
read or written, or a stored answer cannot be read back, rows are generated as without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.spec import RowOutcome
from anex_pipeline.workdir import answer_table, layout
from anex_pipeline.workdir.answer_table import AnswerTable, UnsafeFolder
from anex_pipeline.workdir.manifest import JobDir, JobManifest

log = logging.getLogger(__name__)

SIZE_LIMIT_BYTES = 2 << 30  # answers beyond this go, least recently stored first
# Engine settings that size the engine but never change what it answers (how its core runs,
# core_in_process, is left out of every comparison of settings already).
SIZING = ("memory_share", "kv_cache_gib")


def engine_identity(config: EngineConfig, manifest: JobManifest) -> str:
    """What answers a job's rows, as far as the answers go: the engine kind and servers, the model
    (its folder and name) with its parsers, adapters and every engine setting but those that only
    size it, the files of the model's and adapters' local folders, vLLM's version, and the
    endpoint the rows were written for (a responses row runs as the chat row it means, and its
    answer is a Responses object)."""
    from anex_pipeline.engine.engine_args import vllm_version
    from anex_pipeline.engine.loader import vllm_settings
    from anex_pipeline.engine.modes import engine_kind

    engine = vllm_settings(config, manifest)
    settings = {
        f.name: getattr(engine, f.name) for f in dataclasses.fields(engine) if f.compare and f.name not in SIZING
    }
    folders = [settings["model"], *json.loads(settings.get("lora_modules") or "{}").values()]
    shape = {
        "kind": engine_kind(config),
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
    """The work folder's answers across jobs, for one engine identity and one scope (the tenant a
    shared service runs the job for; ``""``: everyone who uses the work folder)."""

    def __init__(
        self, work_root: Path, identity: str, job_id: str, size_limit: int = SIZE_LIMIT_BYTES, scope: str = ""
    ):
        self.identity, self.job_id, self.scope = identity, job_id, scope
        self._table = _open(work_root, size_limit)

    def _key(self, fingerprint: str) -> str:
        return hashlib.sha256(f"{self.identity}:{self.scope}:{fingerprint}".encode()).hexdigest()

    @property
    def dropped(self) -> int:
        """Stored answers found unreadable (and removed) by this job's look-ups."""
        return self._table.dropped if self._table is not None else 0

    def get(self, fingerprint: str) -> RowOutcome | None:
        """The answer an earlier job got for this fingerprint on this engine, if it is kept."""
        if self._table is None:
            return None
        try:
            return self._table.get(self._key(fingerprint))
        except (sqlite3.Error, OSError) as exc:
            log.warning("could not read the answer store: %s", exc)
            return None

    def add(self, answers: Iterable[tuple[str, RowOutcome]]) -> None:
        """Keeps the successful answers, marked as this job's."""
        if self._table is None:
            return
        try:
            self._table.put(((self._key(fingerprint), outcome) for fingerprint, outcome in answers), self.job_id)
        except (sqlite3.Error, OSError) as exc:
            log.warning("could not keep answers in the answer store %s: %s", self._table.path, exc)

    def close(self) -> None:
        if self._table is not None:
            self._table.close()


def open_store(job: JobDir, config: EngineConfig) -> AnswerStore | None:
    """The work folder's answer store for a job on the engine ``config`` describes, or None when
    the job keeps out of it (``answer_store`` or ``reuse_answers`` off)."""
    manifest = job.manifest()
    options = manifest.job_options()
    if not (options.answer_store and options.reuse_answers):
        return None
    return AnswerStore(job.root.parent, engine_identity(config, manifest), job.job_id, scope=manifest.answer_scope)


def drop_answers(work_root: Path, job_id: str) -> None:
    """Removes the answers a job generated (the job is being deleted or pruned)."""
    folder = Path(work_root).expanduser() / layout.ANSWER_STORE_DIR
    if not (folder / answer_table.FILE_NAME).is_file():
        return
    table = _open(work_root, SIZE_LIMIT_BYTES)
    if table is None:
        return
    try:
        table.drop_job(job_id)
    except (sqlite3.Error, OSError) as exc:
        log.warning("could not remove job %s's answers from the answer store: %s", job_id, exc)
    finally:
        table.close()


# What a store of an earlier version (diskcache's, with pickled answers) left in the folder: never read.
_LEGACY = ("cache.db", "cache.db-wal", "cache.db-shm")


def _open(work_root: Path, size_limit: int) -> AnswerTable | None:
    folder = Path(work_root).expanduser() / layout.ANSWER_STORE_DIR
    try:
        table = AnswerTable(folder, size_limit)
    except UnsafeFolder as exc:
        log.warning("the answer store is not used, since %s; rows are generated as without it", exc)
        return None
    except (sqlite3.Error, OSError) as exc:
        log.warning("the answer store %s cannot be opened; rows are generated as without it: %s", folder, exc)
        return None
    if (folder / _LEGACY[0]).exists():
        _remove_legacy(folder)
    return table


def _remove_legacy(folder: Path) -> None:
    """Removes an earlier version's store (its database and its folders of large answers)."""
    for name in _LEGACY:
        (folder / name).unlink(missing_ok=True)
    for sub in folder.iterdir():
        if sub.is_dir() and len(sub.name) == 2:  # diskcache's two-hex-digit folders
            shutil.rmtree(sub, ignore_errors=True)
