"""Runs batches as ordinary pipeline jobs, several at once, in background threads of the service.

``max_running`` threads check new batches (``JobRunner.submit``: a malformed file fails its
batch with the line-numbered problems at once, even while others are generating; batches sent
together are checked together, not one after another), and ``max_running`` threads run checked
batches through ``JobRunner.run`` on the instance (estimate, shards, merge as Dagster
runs), all on the one loaded engine, which batches their rows together and gives each API key an
even share of its room (:mod:`anex_pipeline.engine.sharing`): a small batch does not wait behind a
large one. Both kinds of thread take batches fairly between keys, and one key never holds them all
(:mod:`anex_pipeline.batch_api.fair_queue`). Batches that need another engine (another model, or
the same model as an embedding model) wait until the running ones are done, since one engine is
loaded at a time. A cancel asks the job to stop (:mod:`anex_pipeline.stopping`), which
generation notices at its next engine step: the rows in flight are aborted, the finished ones are
delivered, and every row that never ran is answered in the error file with ``batch_cancelled``
(``batch_expired`` when its completion window, or the job's time limit, ended first: the
batch's ``expires_at`` is the job's deadline, kept across restarts of the service). Closing the
service (or SIGINT/SIGTERM to it) stops the running job the same way but leaves the batch in
progress: the next start resumes it from its checkpoints.

Replicas of the service over one database and one work folder share the batches through leases in
the batch records (:mod:`anex_pipeline.batches.leases`): a thread works on a batch only once its
replica has taken the batch's lease, a keeper thread renews the leases held every third of their
time and looks for batches no live replica holds (a replica that died stops renewing), and a
replica that closes lets its batches go at once. A replica that finds it lost a lease (it could not
renew in time, and another took the batch over) stops the batch's job without finishing it.

At about 440 lines this module is over the project's usual size because :class:`BatchWorker` is one
state machine (checked, waiting for its model's turn, running, cancelled, expired, resumed after a
restart) whose steps share its queues, its turn condition and the store; split, each half would
need the other's state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anex_pipeline import settings
from anex_pipeline.batch_api.fair_queue import FairQueue
from anex_pipeline.batches.leases import LeaseLost
from anex_pipeline.batches.objects import BatchError, BatchRecord, now
from anex_pipeline.batches.store import Store
from anex_pipeline.engine.loader import engine_key
from anex_pipeline.engine.models import resolve_model
from anex_pipeline.engine.sharing import sharing_as
from anex_pipeline.errors import AnexError, JobStopped, RowErrorType
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobRejected, RequestCounts, RowError, Usage
from anex_pipeline.stages.generate import live_progress
from anex_pipeline.stages.merge_partial import with_unrun_lines
from anex_pipeline.stages.submit import default_report_path
from anex_pipeline.stopping import clear_stop, engine_loading, on_stop_signals, request_stop
from anex_pipeline.workdir.manifest import JobDir, JobManifest, read_report

log = logging.getLogger("anex_pipeline.batch_api")

MAX_ERRORS = 1000  # line-numbered problems kept on a failed batch
CLOSE_WAIT_S = 30.0  # how long closing waits for the running jobs to stop and merge
MAX_RUNNING = 4  # batches generating at once, by default
CANCELLED = "cancelled through the Batch API"
SERVICE_STOPPED = "the Batch API service stopped; the batch resumes when it starts again"
TAKEN_OVER = "another replica of the Batch API service took the batch over"
LOST = "the batch's work and its copy of the input were removed from the service before it finished; create it again"
# Error of a row that never ran, by the code OpenAI gives it.
UNRUN = {
    "batch_cancelled": "the request was not run: the batch was cancelled before it ran",
    "batch_expired": "the request was not run: the batch's completion window ended before it ran",
}


def default_replica() -> str:
    """This process's name as a lease holder: the same for every worker of the process, so that
    a service started again in one process goes on with the batches it held."""
    return f"{socket.gethostname()}:{os.getpid()}"


class BatchWorker:
    def __init__(self, runner: JobRunner, store: Store, max_running: int = MAX_RUNNING, replica: str | None = None):
        if max_running < 1:
            raise ValueError(f"batches in progress at once must be at least 1, got {max_running}")
        self.runner = runner
        self.store = store
        self.replica = replica or default_replica()  # the holder of this worker's leases
        self.lease_s = float(settings.BATCH_LEASE_S.get())
        self._pending: set[str] = set()  # batch ids in a queue here or being worked on here
        self._held: set[str] = set()  # batch ids whose lease this worker holds
        self._lost: set[str] = set()  # batch ids whose lease another replica took over
        self._checks = FairQueue(max_running)
        self._runs = FairQueue(max_running)
        self._closing = threading.Event()
        self._running: dict[str, JobDir] = {}  # batch id -> its job, while it generates
        self._engines: Counter[Hashable] = Counter()  # engine (see engine_key) -> batches running on it
        self._checking: dict[str, threading.Event] = {}  # batch id -> set to cut its check short
        self._turn = threading.Condition()  # guards the three
        self._checkers = [
            threading.Thread(target=self._loop, args=(self._checks, self._check), name=f"batch-check-{n}", daemon=True)
            for n in range(max_running + 1)  # one more for a key with nothing in progress
        ]
        self._runners = [
            threading.Thread(target=self._loop, args=(self._runs, self._run), name=f"batch-run-{n}", daemon=True)
            for n in range(max_running + 1)
        ]
        keeper = threading.Thread(target=self._keep_leases, name="batch-leases", daemon=True)
        self._threads = [*self._checkers, *self._runners, keeper]
        self._saved: dict[Path, _Saved] = {}  # checkpoint -> its rows, as of its size then

    def start(self) -> None:
        """Takes up the unfinished batches no other replica holds (those a previous start left
        among them), then waits for new ones. A stop signal to the service stops the running job
        at once, before the server winds down."""
        for record in self.store.unfinished():
            if (held := self.store.lease(record.id)) is None or held[0] == self.replica or held[1] <= time.time():
                self.enqueue(record)
        on_stop_signals(self._wind_down)
        for thread in self._threads:
            thread.start()

    def warm_up(self, model: str | None, parsers: dict[str, str]) -> None:
        """Starts loading the engine of ``model`` (None: the bundled chat model) with the service's
        ``parsers`` (job options) in the background, so that the service is ready (``GET /health``)
        before the first batch arrives. A load that fails is logged; the first batch that needs the
        engine tries again and fails with the reason."""
        reference, name = resolve_model(model, "chat")
        manifest = JobManifest(
            job_id="serve-warm-up",
            input="",
            input_sha256="",
            output="",
            report="",
            format="jsonl",
            endpoint="chat",
            model=reference,
            model_name=name,
            options={
                **({} if model is None else {"model": model}),
                **parsers,
                **({"lora_modules": adapters} if (adapters := self.runner.engine.lora_modules) else {}),
            },
            total_rows=0,
            shards=[],
            submitted_at=time.time(),
        )
        self.runner.engine.load_ahead(manifest, lambda _: None, "batch-engine-warm-up")

    def close(self) -> None:
        """Stops the running jobs (they resume on the next start) and waits for them, unless one
        is waiting for an engine load, which nothing can cut short."""
        self._wind_down()
        self._checks.close()
        self._runs.close()
        for thread in self._threads:
            if thread.is_alive() and engine_loading():
                log.warning("closing while the engine loads: not waiting for it")
                return
            thread.join(CLOSE_WAIT_S)
            if thread.is_alive():
                log.warning("closing without waiting any longer for %s", thread.name)
        with self._turn:  # checked batches still waiting in the run queue: held, but no thread works on them
            idle = [b for b in self._held if b not in self._running and b not in self._checking]
        for batch_id in idle:
            self._let_go(batch_id)

    def _wind_down(self) -> None:
        """Takes no new work and stops the running jobs; the next start resumes them."""
        self._closing.set()
        with self._turn:
            running = list(self._running.values())
            for cut in self._checking.values():
                cut.set()
            self._turn.notify_all()
        for job in running:
            request_stop(job, SERVICE_STOPPED)

    def enqueue(self, record: BatchRecord) -> None:
        """Queues the batch here, unless it is queued or worked on here already."""
        with self._turn:
            if record.id in self._pending:
                return
            self._pending.add(record.id)
        (self._checks if record.job_id is None else self._runs).put(record.owner, record.id)

    def cancel(self, record: BatchRecord) -> BatchRecord:
        """Marks the batch cancelling and asks its job (if it has one yet) to stop, or its check
        (if it is being checked) to end."""
        if record.finished or record.cancelling_at is not None:
            return record
        record = self.store.update_batch(record.id, cancelling_at=now(), once=True)  # another's cancel stays
        if record.finished:
            return record
        if record.job_id is not None:
            request_stop(self.runner.storage.job(record.job_id), CANCELLED)
        with self._turn:
            if (cut := self._checking.get(record.id)) is not None:
                cut.set()
        return record

    # -- what a batch shows while it runs --------------------------------------------------------
    def progress(self, record: BatchRecord) -> tuple[RequestCounts, Usage | None]:
        """Row counts and token usage of the batch's job: once finished, those of its report (the
        counts as its output and error files hold them); while it runs, the counts of the shard
        generating (live) and of the others' checkpoints, and the usage of every shard's checkpoint
        (written every ``checkpoint_rows`` rows)."""
        if record.job_id is None:
            return RequestCounts(), None
        with self._turn:  # a running job's folder keeps its parsed manifest between polls
            job = self._running.get(record.id) or self.runner.storage.job(record.job_id)
        report_file = job.report_path
        if not job.exists():  # removed by a prune: the published report (beside the result) stays
            report_file = Path(default_report_path(str(self.store.output_path(record.id))))
        if record.finished and (report := read_report(report_file)) is not None:
            counts = report.request_counts.model_copy()
            if _unrun_code(record) is not None:  # the rows that never ran are in the error file
                counts.failed = counts.total - counts.completed
            return counts, report.usage
        if not job.exists():  # removed before it finished: no row is left to count
            return RequestCounts(), None
        manifest = job.manifest()
        counts, usage = RequestCounts(total=manifest.total_rows), Usage()
        for shard in range(len(manifest.shards)):
            saved = self._checkpoint(job, shard)
            live = live_progress(job, shard)
            counts.completed += live.done - live.failed if live else saved.completed
            counts.failed += live.failed if live else saved.failed
            for name in Usage.model_fields:
                setattr(usage, name, getattr(usage, name) + getattr(saved.usage, name))
        return counts, usage

    def _checkpoint(self, job: JobDir, shard: int) -> _Saved:
        """A shard's finished rows and their tokens, re-read only when its checkpoint has grown
        since the last look."""
        path = job.checkpoint_path(shard)
        size = path.stat().st_size if path.exists() else 0
        cached = self._saved.get(path)
        if cached is None or cached.size != size:
            cached = self._saved[path] = _Saved(size)
            for o in job.outcomes(shard):
                if o.failed:
                    cached.failed += 1
                else:
                    cached.completed += 1
                for name in Usage.model_fields:
                    setattr(cached.usage, name, getattr(cached.usage, name) + getattr(o.usage, name))
        return cached

    def queued(self) -> tuple[dict[str, int], int]:
        """Unfinished batches by status, and how many of them wait to be checked or for their turn
        to generate (for the metrics)."""
        unfinished = self.store.unfinished()
        with self._turn:
            busy = set(self._running) | set(self._checking)
        by_status = Counter(r.status for r in unfinished)
        waiting = sum(r.id not in busy and r.status in ("validating", "in_progress") for r in unfinished)
        return dict(by_status), waiting

    # -- the threads -------------------------------------------------------------------------
    def _loop(self, jobs: FairQueue, work: Callable[[str], bool]) -> None:
        """Works on the batches of ``jobs`` whose lease this replica holds or takes; ``work`` tells
        whether it handed the batch on to another queue of this worker (it then stays held)."""
        while (taken := jobs.get()) is not None and not self._closing.is_set():
            owner, batch_id = taken
            handed_on = False
            try:
                if self._hold(batch_id):
                    handed_on = work(batch_id)
            except LeaseLost:
                log.warning("batch %s: %s", batch_id, TAKEN_OVER)
            except Exception as exc:  # a batch's failure must not end the worker
                log.exception("batch %s failed", batch_id)
                # The service's own faults name its files: the tenant gets the line, the log the rest.
                why = exc.message if isinstance(exc, AnexError) else "an error in the service (its log has the details)"
                self._fail(batch_id, f"the batch could not be run: {why}")
            finally:
                if not handed_on:
                    self._let_go(batch_id)
                jobs.done(owner)

    # -- leases: which replica works on a batch ---------------------------------------------------
    def _hold(self, batch_id: str) -> bool:
        """Takes (or renews) the batch's lease for this replica; False when another one holds it."""
        if not self.store.take_up(batch_id, self.replica, self.lease_s):
            return False
        with self._turn:
            self._held.add(batch_id)
            self._lost.discard(batch_id)
        return True

    def _let_go(self, batch_id: str) -> None:
        """This worker no longer works on the batch (finished, given up, or the service closing):
        its lease goes, so that any replica may take up what is left of it at once."""
        with self._turn:
            self._pending.discard(batch_id)
            held = batch_id in self._held
            self._held.discard(batch_id)
        if held:
            self.store.release(batch_id, self.replica)

    def _keep_leases(self) -> None:
        """Every third of a lease's time: renews the leases held (a lease found taken over stops
        its job here), and queues the unfinished batches that no live replica holds."""
        while not self._closing.wait(self.lease_s / 3):
            with self._turn:
                held = list(self._held)
            for batch_id in held:
                try:
                    renewed = self.store.renew(batch_id, self.replica, self.lease_s)
                except Exception:  # the database away for a moment: the next round tries again
                    log.exception("renewing the lease of batch %s failed", batch_id)
                    continue
                if not renewed:
                    self._taken_over(batch_id)
            try:
                for record in self.store.unclaimed_batches():
                    self.enqueue(record)
            except Exception:
                log.exception("looking for batches no replica holds failed")

    def _taken_over(self, batch_id: str) -> None:
        log.warning("batch %s: %s; its job here stops", batch_id, TAKEN_OVER)
        with self._turn:
            self._held.discard(batch_id)
            self._lost.add(batch_id)
            job = self._running.get(batch_id)
            if (cut := self._checking.get(batch_id)) is not None:
                cut.set()
        if job is not None:
            request_stop(job, TAKEN_OVER)

    def _check(self, batch_id: str) -> bool:
        cut = threading.Event()
        with self._turn:  # before the record is read: a cancel from now on reaches the check
            self._checking[batch_id] = cut
        try:
            return self._check_input(batch_id, cut)
        finally:
            with self._turn:
                del self._checking[batch_id]

    def _check_input(self, batch_id: str, cut: threading.Event) -> bool:
        """Checks the batch's input as a job; a cancel (or the service closing) ends the check
        between two chunks of rows: the batch is then cancelled (or checked again at the next
        start). True when the checked batch went on to the queue of batches to run."""
        record = self.store.batch(batch_id)
        if record is None or record.finished:
            return False
        if record.cancelling_at is not None:
            self.store.update_batch(batch_id, cancelled_at=now())
            return False

        def stop() -> None:
            if cut.is_set():
                raise JobStopped(
                    SERVICE_STOPPED if self._closing.is_set() else TAKEN_OVER if self._is_lost(batch_id) else CANCELLED
                )

        try:
            job = self.runner.submit(
                str(self.store.input_path(batch_id)),
                str(self.store.output_path(batch_id)),
                record.options,
                results_in=self.store.root,
                stop=stop,
                answer_scope=record.owner,  # a tenant's stored answers are its own
            )
        except JobStopped:
            if not self._closing.is_set() and not self._is_lost(batch_id):
                self.store.update_batch(batch_id, cancelled_at=now(), held_by=self.replica)
            return False
        except JobRejected as exc:
            errors = [
                BatchError(code=p.code, message=p.message, param=p.field, line=p.line)
                for p in exc.problems[:MAX_ERRORS]
            ]
            self.store.update_batch(batch_id, errors=errors, failed_at=now(), held_by=self.replica)
            return False
        record = self.store.update_batch(
            batch_id, job_id=job.job_id, model=job.manifest().model_name, in_progress_at=now(), held_by=self.replica
        )
        if record.cancelling_at is not None:  # cancelled while it was being checked
            request_stop(job, CANCELLED)
        self._runs.put(record.owner, batch_id)
        return True

    def _is_lost(self, batch_id: str) -> bool:
        with self._turn:
            return batch_id in self._lost

    def _run(self, batch_id: str) -> bool:
        record = self.store.batch(batch_id)
        if record is None or record.finished or record.job_id is None:
            return False
        job = self.runner.storage.job(record.job_id)
        if not job.exists():
            return self._check_again(record)
        engine = engine_key(self.runner.engine.plain(), job.manifest())
        if not self._take_turn(batch_id, job, engine):
            return False
        try:
            # A stop left by an earlier start must not stop this run, but a cancel from now on
            # must: so the stop is cleared before the record is read again, not by the runner.
            clear_stop(job)
            record = self.store.batch(batch_id) or record
            if self._closing.is_set() or self._is_lost(batch_id):
                return False
            if record.cancelling_at is None:
                with sharing_as(record.owner):  # the engine's room is shared out per API key
                    self.runner.run(job, clear_stop=False, until=_window_end(record))
                if self._closing.is_set() or self._is_lost(batch_id):
                    return False  # not finished: the next start, or the replica that took it over, goes on
        finally:
            with self._turn:
                del self._running[batch_id]
                self._engines[engine] -= 1
                self._engines += Counter()  # drops engines no batch runs on any more
                self._turn.notify_all()
        if record.cancelling_at is not None:  # cancelled before it ran: merge and publish what was finished
            self.runner.run(job, shards=[], clear_stop=False, until=_window_end(record))
        self._finalize(self.store.update_batch(batch_id, finalizing_at=now(), held_by=self.replica), job)
        return False

    def _check_again(self, record: BatchRecord) -> bool:
        """Takes up a batch whose job's folder was removed before it finished (while the service
        was down, say): from its own copy of its input it is checked and run again from the start
        (True: it went to the check queue); without that copy it fails."""
        if not self.store.input_path(record.id).exists():
            self._fail(record.id, LOST)
            return False
        log.warning("batch %s: its job %s is gone; checking and running it again", record.id, record.job_id)
        self.store.update_batch(record.id, job_id=None, in_progress_at=None, held_by=self.replica)
        self._checks.put(record.owner, record.id)
        return True

    def _take_turn(self, batch_id: str, job: JobDir, engine: Hashable) -> bool:
        """Waits until no batch runs on another engine (one is loaded at a time), then counts the
        batch as running on ``engine``; False when the service closes first."""
        with self._turn:
            self._turn.wait_for(lambda: self._closing.is_set() or set(self._engines) <= {engine})
            if self._closing.is_set():
                return False
            self._running[batch_id] = job
            self._engines[engine] += 1
            return True

    def _finalize(self, record: BatchRecord, job: JobDir) -> None:
        """Splits the result into the output and error files and sets the final status."""
        report = job.report()
        if record.cancelling_at is not None:
            ended, unrun = "cancelled_at", "batch_cancelled"
        elif report is not None and report.status == "completed":
            ended, unrun = "completed_at", None
        elif job.out_of_time() is not None:
            ended, unrun = "expired_at", "batch_expired"
        else:
            ended, unrun = "failed_at", None
        files = self._deliver(record, job, unrun) if report is not None else {}
        if ended == "failed_at":
            reason = report.failure_reason if report is not None else "the job ended without a report"
            files["errors"] = [BatchError(code="job_failed", message=reason or "the job failed")]
        self.store.update_batch(record.id, **{ended: now()}, **files, held_by=self.replica)

    def _deliver(self, record: BatchRecord, job: JobDir, unrun: str | None) -> dict[str, Any]:
        """Writes rows with a response to the output file and rows with an error to the error
        file; with ``unrun`` (an error code), every row that never ran is in the error file too.
        Files an earlier delivery of the batch stored before the service died are removed first."""
        for earlier in self.store.delivered_by(record):
            self.store.remove_file(earlier)
        out_path = self.store.scratch(f"{record.id}_output.jsonl")
        err_path = self.store.scratch(f"{record.id}_error.jsonl")
        rows = {"output_file_id": 0, "error_file_id": 0}
        with out_path.open("wb") as out, err_path.open("wb") as err:
            for line, failed in _result_lines(job, unrun):
                (err if failed else out).write(line)
                rows["error_file_id" if failed else "output_file_id"] += 1
        delivered: dict[str, Any] = {}
        for field, path in (("output_file_id", out_path), ("error_file_id", err_path)):
            if rows[field]:
                delivered[field] = self.store.add_file(
                    record.owner,
                    path.name,
                    "batch_output",
                    path,
                    expires_after_s=record.output_expires_after_s,
                    batch_id=record.id,
                ).id
            else:
                path.unlink()
        return delivered

    def results(self, record: BatchRecord) -> list[dict[str, Any]] | None:
        """Every delivered row of a finished batch, in input order (shown on batches created with
        their requests embedded in the body)."""
        if record.job_id is None or not record.finished:
            return None
        path = self.runner.storage.job(record.job_id).result_path
        if not path.exists():
            return []
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    def _fail(self, batch_id: str, message: str) -> None:
        record = self.store.batch(batch_id)
        if record is not None and not record.finished:
            self.store.update_batch(batch_id, errors=[BatchError(code="job_failed", message=message)], failed_at=now())


@dataclass
class _Saved:
    """What a shard's checkpoint held when it was this size."""

    size: int
    completed: int = 0
    failed: int = 0
    usage: Usage = dataclasses.field(default_factory=Usage)


def _window_end(record: BatchRecord) -> tuple[float, str] | None:
    """When the batch's completion window ends, and the reason its job stops then."""
    if record.expires_at is None:  # a batch stored before its window was kept
        return None
    return float(record.expires_at), f"the batch's completion window ended at its expires_at ({record.expires_at})"


def _unrun_code(record: BatchRecord) -> str | None:
    """The error code the rows of a finished batch that never ran were given, if any."""
    if record.cancelled_at is not None:
        return "batch_cancelled"
    return "batch_expired" if record.expired_at is not None else None


def _result_lines(job: JobDir, unrun: str | None) -> Iterator[tuple[bytes, bool]]:
    """The job's result lines, each with whether it is an error. With ``unrun``, a row that never
    ran gets an error line with that code, in its place in input order."""
    with job.result_path.open("rb") as src:
        if unrun is None:
            for line in src:
                yield line, json.loads(line)["error"] is not None
            return
        error = RowError(message=UNRUN[unrun], type=RowErrorType.BATCH, code=unrun).as_dict()
        # the rows the result has a line for, and every request, shard by shard
        shards = (({o.i for o in job.outcomes(n)}, job.read_requests(n)) for n in range(len(job.manifest().shards)))
        yield from with_unrun_lines(src, shards, error)
