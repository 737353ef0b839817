"""The HTTP routes of the OpenAI-compatible Batch API, as an ASGI app (Starlette).

The routes are the ones the ``openai`` SDK calls for batches: upload, list and delete files,
create a batch from one (or from requests embedded in the body), follow it, cancel it, download
its output and error files. Every error is answered in OpenAI's shape, so the SDK raises its usual exceptions.

At about 440 lines this module is over the project's usual size because it is the one table of the
service's routes and their checks of the caller (key, sizes, ownership); what a route does past
that lives in :mod:`.requests`, :mod:`.worker` and :mod:`anex_pipeline.batches`.
"""

from __future__ import annotations

import io
import json
import logging
import tempfile
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from anex_pipeline import metrics
from anex_pipeline.batch_api.requests import ServedModels, batch_options, completion_window_s, upload_expiry
from anex_pipeline.batch_api.webhooks import WebhookSender, WebhookSettings
from anex_pipeline.batch_api.worker import MAX_ERRORS, MAX_RUNNING, BatchWorker
from anex_pipeline.batches.objects import (
    ApiError,
    BatchError,
    BatchRecord,
    CreateBatch,
    FileRecord,
    new_id,
    not_found,
    now,
)
from anex_pipeline.batches.store import Store, key_hash
from anex_pipeline.errors import AnexError, ExitCode, RowErrorType
from anex_pipeline.options import job_options
from anex_pipeline.orchestration.job_admin import forget_file
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import (
    INVALID_JSON,
    MISSING_PARAMETER,
    JobRejected,
    MediaOptions,
    RequestCounts,
)
from anex_pipeline.stages.merge_partial import write_finished_rows
from anex_pipeline.stages.quote import make_quote
from anex_pipeline.validate.numbers import MAX_JOB_TOKENS
from anex_pipeline.validate.problems import pydantic_code

log = logging.getLogger("anex_pipeline.batch_api")

MAX_UPLOAD_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
MAX_BODY_BYTES = 50 * 1024 * 1024  # any other request, e.g. a batch with its requests embedded
MAX_FILES_PAGE = 10_000  # OpenAI's largest (and default) page of files
MAX_BATCHES_PAGE = 100  # OpenAI's largest page of batches
# A running batch's rows finished so far: a file id that a batch shows as partial_output_file_id
# while it runs, read with GET /v1/files/{id}/content (the SDK's files.content). Its lines are the
# output file's lines, successes and failures together, in input order; the final output and
# error files are OpenAI's, untouched.
PARTIAL = "file-partial-"


class BatchApi:
    """The routes' logic, on one store and one worker."""

    def __init__(
        self,
        store: Store,
        worker: BatchWorker,
        key_hashes: frozenset[str],
        media: MediaOptions,
        models: ServedModels,
        max_window_s: int | None = None,
        max_job_tokens: int | None = None,
    ):
        self.store = store
        self.worker = worker
        self.key_hashes = key_hashes
        self.media = media
        self.models = models
        self.max_window_s = max_window_s
        self.max_job_tokens = max_job_tokens or MAX_JOB_TOKENS

    def owner(self, request: Request) -> str:
        """The hash of the caller's API key, or a 401."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(
                401,
                "No API key was given: send it in the header 'Authorization: Bearer <key>' "
                "(the SDK does this with OpenAI(api_key=...)).",
                code="missing_api_key",
            )
        owner = key_hash(key.strip())
        if owner not in self.key_hashes:
            raise ApiError(401, "The API key is not valid for this service.", code="invalid_api_key")
        return owner

    # -- files -------------------------------------------------------------------------------------
    async def create_file(self, request: Request) -> Response:
        owner = self.owner(request)
        form = await request.form()
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise ApiError(
                400, f"purpose must be 'batch' (got {purpose!r}): files here are batch inputs.", param="purpose"
            )
        if not isinstance(upload, UploadFile):
            raise ApiError(
                400, "Send the file's bytes in the multipart field 'file'.", param="file", code=MISSING_PARAMETER
            )
        expiry = upload_expiry(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
        record = await run_in_threadpool(
            lambda: self.store.add_file(
                owner, upload.filename or "upload.jsonl", "batch", upload.file, expires_after_s=expiry
            )
        )
        return JSONResponse(record.public())

    async def list_files(self, request: Request) -> Response:
        owner = self.owner(request)
        query = request.query_params
        limit = page_limit(request, MAX_FILES_PAGE, MAX_FILES_PAGE)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}.", param="order")

        def page() -> dict[str, Any]:
            records, more = self.store.files(owner, query.get("purpose"), order == "desc", query.get("after"), limit)
            data = [r.public() for r in records]
            first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
            return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}

        return JSONResponse(await run_in_threadpool(page))

    async def delete_file(self, request: Request) -> Response:
        def delete() -> dict[str, Any]:
            # Refused while an unfinished batch uses the file; a batch made from it meanwhile waits.
            record = self.store.remove_unused_file(self.owner(request), request.path_params["file_id"])
            runner = self.worker.runner
            forget_file(runner.instance, self.store, Path(runner.storage.work_root).expanduser(), record)
            return {"id": record.id, "object": "file", "deleted": True}

        return JSONResponse(await run_in_threadpool(delete))

    async def retrieve_file(self, request: Request) -> Response:
        record = await run_in_threadpool(self._file, request)
        return JSONResponse(record.public())

    async def file_content(self, request: Request) -> Response:
        if (batch_id := partial_batch_id(request.path_params["file_id"])) is not None:
            return await run_in_threadpool(self._partial_content, request, batch_id)
        record = await run_in_threadpool(self._file, request)
        return FileResponse(self.store.content_path(record.id), media_type="application/octet-stream")

    def _partial_content(self, request: Request, batch_id: str) -> Response:
        """The rows the batch's job has finished so far, in input order, as batch output lines
        (successes and failures together); the header ``anex-partial`` says ``true`` until the batch
        has finished. Another key's batch, or a batch that has no job yet or no longer one, is a 404."""
        file_id = request.path_params["file_id"]
        record = self.store.batch(batch_id, self.owner(request))
        if record is None or record.job_id is None:
            raise not_found("file", file_id)
        job = self.worker.runner.storage.job(record.job_id)
        if not job.exists():
            raise not_found("file", file_id)
        path = self.store.scratch(f"{new_id('partial_')}.jsonl")
        try:
            write_finished_rows(job, path)
            body = path.read_bytes()
        finally:
            path.unlink(missing_ok=True)
        headers = {"anex-partial": "false" if record.finished else "true"}
        return Response(body, media_type="application/octet-stream", headers=headers)

    def _file(self, request: Request) -> Any:
        file_id = request.path_params["file_id"]
        record = self.store.file(self.owner(request), file_id)
        if record is None:
            raise not_found("file", file_id)
        return record

    # -- batches -----------------------------------------------------------------------------------
    async def create_batch(self, request: Request) -> Response:
        owner = self.owner(request)
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "The request body is not valid JSON.", code=INVALID_JSON) from None
        except RecursionError:
            raise ApiError(
                400, "The request body is JSON nested too deeply to read; flatten it.", code=INVALID_JSON
            ) from None
        try:
            body = CreateBatch.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise ApiError(400, f"'{param}': {first['msg']}", param=param, code=pydantic_code(first["type"])) from None
        idempotency_key = request.headers.get("idempotency-key")
        options, dry_run = batch_options(body, self.media, self.models, self.max_job_tokens)
        if dry_run:
            return JSONResponse(await run_in_threadpool(self._dry_run, owner, body, options))
        record = await run_in_threadpool(self._create_batch, owner, body, options, idempotency_key)
        return JSONResponse(await run_in_threadpool(self.show, record))

    def _dry_run(self, owner: str, body: CreateBatch, options: dict[str, Any]) -> dict[str, Any]:
        """A batch that is quoted, not run: the Batch object it would be, ``completed`` with its
        ``quote`` (see :mod:`anex_pipeline.stages.quote`), or ``failed`` with the problems its
        input has, as a batch is failed. Nothing is stored: the id cannot be retrieved."""
        window_s = completion_window_s(body.completion_window, self.max_window_s)
        record = BatchRecord(
            id=new_id("batch_dryrun_"),
            owner=owner,
            endpoint=body.endpoint,
            input_file_id=body.input_file_id or "",
            completion_window=body.completion_window,
            created_at=now(),
            metadata=body.metadata,
            model=options.get("model"),
        )
        runner = self.worker.runner
        scratch = self.store.scratch("dry-runs")
        scratch.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=scratch) as folder:
            if body.requests is not None:
                path = Path(folder) / "requests.jsonl"
                lines = [json.dumps({"method": "POST", "url": body.endpoint, **item}) + "\n" for item in body.requests]
                path.write_text("".join(lines), encoding="utf-8")
            else:
                stored = self.store.file(owner, body.input_file_id or "")
                if stored is None:
                    raise not_found("file", body.input_file_id or "")
                path = self.store.content_path(stored.id)
            try:
                quote = make_quote(
                    path,
                    job_options(options),
                    Path(runner.storage.work_root).expanduser(),
                    runner.engine.plain(),
                    local_model=not runner.engine.base_url,
                    completion_window_s=window_s,
                    answer_scope=owner,
                )
            except JobRejected as exc:
                errors = [BatchError(code=p.code, message=p.message, param=p.field, line=p.line) for p in exc.problems]
                failed = record.model_copy(update={"errors": errors[:MAX_ERRORS], "failed_at": now()})
                return {**failed.public(RequestCounts(), None), "dry_run": True}
        done = record.model_copy(update={"completed_at": now()})
        return {**done.public(RequestCounts(total=quote.rows), None), "dry_run": True, "quote": quote.model_dump()}

    def _create_batch(
        self, owner: str, body: CreateBatch, options: dict[str, Any], idempotency_key: str | None
    ) -> BatchRecord:
        if idempotency_key is not None and (earlier := self.store.batch_for_key(owner, idempotency_key)) is not None:
            return earlier
        window_s = completion_window_s(body.completion_window, self.max_window_s)
        batch_id = new_id("batch_")
        embedded = self._embedded_input(owner, batch_id, body) if body.requests is not None else None
        input_file_id = embedded.id if embedded is not None else body.input_file_id or ""
        record = BatchRecord(
            id=batch_id,
            owner=owner,
            endpoint=body.endpoint,
            input_file_id=input_file_id,
            completion_window=body.completion_window,
            created_at=(created := now()),
            expires_at=created + window_s,
            metadata=body.metadata,
            model=options.get("model"),
            options=options,
            embedded=body.requests is not None,
            output_expires_after_s=body.output_expires_after.seconds if body.output_expires_after else None,
        )
        try:  # the store checks the input file (404, 400) and the idempotency key
            stored = self.store.add_batch(record, idempotency_key)
        except BaseException:
            if embedded is not None:
                self.store.remove_file(embedded)
            raise
        if stored.id == batch_id:
            self.worker.enqueue(stored)
        elif embedded is not None:  # the batch made earlier with this idempotency key has its own input
            self.store.remove_file(embedded)
        return stored

    def _embedded_input(self, owner: str, batch_id: str, body: CreateBatch) -> FileRecord:
        """Writes embedded requests as a batch input file (requests[N] is line N+1 in its errors)."""
        if not body.requests:
            raise ApiError(400, "'requests' must hold at least one {custom_id, body} item.", param="requests")
        lines = [json.dumps({"method": "POST", "url": body.endpoint, **item}) + "\n" for item in body.requests]
        data = io.BytesIO("".join(lines).encode("utf-8"))
        return self.store.add_file(owner, f"{batch_id}_requests.jsonl", "batch", data)

    async def retrieve_batch(self, request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(lambda: self.show(self._batch(request), with_results=True)))

    async def cancel_batch(self, request: Request) -> Response:
        def cancel() -> dict[str, Any]:
            record = self._batch(request)
            if record.finished and record.cancelling_at is None:
                raise ApiError(
                    400, f"Batch {record.id} is already {record.status}; only a running batch can be cancelled."
                )
            return self.show(self.worker.cancel(record))

        return JSONResponse(await run_in_threadpool(cancel))

    async def list_batches(self, request: Request) -> Response:
        owner = self.owner(request)
        after = request.query_params.get("after")
        limit = page_limit(request, 20, MAX_BATCHES_PAGE)

        def page() -> dict[str, Any]:
            records, more = self.store.batches(owner, after, limit)
            data = [self.show(r) for r in records]
            first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
            return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}

        return JSONResponse(await run_in_threadpool(page))

    # -- what an operator watches ---------------------------------------------------------------
    async def models_list(self, request: Request) -> Response:
        self.owner(request)
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "anex-pipeline"} for name in self.models.listed()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, _: Request) -> Response:
        """200 once the engine is ready; 503 while it loads, before its first load, or when it is dead."""
        state = metrics.engine_state()
        return JSONResponse({"status": state}, status_code=200 if state == "ready" else 503)

    async def metrics_text(self, _: Request) -> Response:
        return Response(await run_in_threadpool(metrics.exposition), media_type=metrics.CONTENT_TYPE)

    def _batch(self, request: Request) -> BatchRecord:
        batch_id = request.path_params["batch_id"]
        record = self.store.batch(batch_id, self.owner(request))
        if record is None:
            raise not_found("batch", batch_id)
        return record

    def show(self, record: BatchRecord, *, with_results: bool = False) -> dict[str, Any]:
        """The Batch object; a retrieved batch that was created with embedded requests also lists
        its delivered rows once it is finished."""
        try:
            counts, usage = self.worker.progress(record)
        except Exception:  # one batch whose job cannot be read must not break a listing
            log.exception("batch %s: its job's progress cannot be read", record.id)
            counts, usage = RequestCounts(), None
        shown = record.public(counts, usage)
        if record.job_id is not None and not record.finished:  # the rows finished so far, as a file (see PARTIAL)
            shown["partial_output_file_id"] = PARTIAL + record.id
        if with_results and record.embedded and record.finished:
            shown["results"] = self.worker.results(record)
        return shown


def partial_batch_id(file_id: str) -> str | None:
    """The batch whose finished rows a file id names (``file-partial-<batch id>``), else None."""
    return file_id.removeprefix(PARTIAL) if file_id.startswith(PARTIAL) else None


def page_limit(request: Request, default: int, most: int) -> int:
    """The ``limit`` query parameter of a listing: ASCII digits from 1 to ``most`` (Python's ``int``
    would also take other scripts' digits, and ``str.isdigit`` superscripts it cannot convert)."""
    text = request.query_params.get("limit", str(default))
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= most:
        raise ApiError(400, f"limit must be a whole number from 1 to {most}, got {text!r}.", param="limit")
    return int(text)


class BodyLimit:
    """Refuses request bodies over a size (413): uploads to /v1/files, and everything else."""

    def __init__(self, app: ASGIApp, upload_bytes: int, body_bytes: int):
        self.app = app
        self.upload_bytes = upload_bytes
        self.body_bytes = body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_bytes if scope["path"].rstrip("/") == "/v1/files" else self.body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await error_response(too_large(limit))(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:  # a body sent in chunks without a declared length
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large(limit)
            return message

        await self.app(scope, counted, send)


def too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"The request body is larger than this service accepts ({limit:,} bytes).", code="request_too_large"
    )


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status)


async def _api_error(_: Request, exc: Exception) -> Response:
    """Every user-facing error a route raises: an :class:`ApiError` as it is; any other one as its
    one line, a 400 when it refuses the request, else a 500."""
    assert isinstance(exc, AnexError)
    if not isinstance(exc, ApiError):
        status = 400 if exc.exit_code == ExitCode.REJECTED else 500
        exc = ApiError(status, exc.message, type=RowErrorType.INVALID_REQUEST if status == 400 else "server_error")
    return error_response(exc)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(
        ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
    )


def create_app(
    runner: JobRunner,
    api_keys: Iterable[str] | None = None,
    *,
    max_upload_bytes: int = MAX_UPLOAD_BYTES,
    max_body_bytes: int = MAX_BODY_BYTES,
    media: MediaOptions | None = None,
    models: Sequence[str] = (),
    max_running_batches: int = MAX_RUNNING,
    webhook: WebhookSettings | None = None,
    warm_up: bool = True,
    max_completion_window_s: int | None = None,
    max_job_tokens: int | None = None,
    parsers: dict[str, str] | None = None,
    replica: str | None = None,
) -> Starlette:
    """The Batch API on a runner's instance and storage. ``api_keys`` (raw keys, or
    ``sha256:<hex>`` hashes) replace the stored keys; without them the stored keys stay valid.
    ``media`` is the operator's media policy (hosts and limits); callers may only narrow it.
    ``models`` are the models batches may name, the first one the default (see
    :class:`~anex_pipeline.batch_api.requests.ServedModels`).
    Up to ``max_running_batches`` batches generate at once, sharing the engine. With ``webhook``,
    every batch that ends sends its event there (see :mod:`~anex_pipeline.batch_api.webhooks`).
    With ``warm_up``, the engine of the default model starts loading as the service starts.
    ``max_completion_window_s`` cuts every batch's completion window to that many seconds: a
    batch still running at the end of its window ends ``expired``. ``max_job_tokens`` is the most
    output tokens one batch's rows may ask for together (None: the budget of every job,
    MAX_JOB_TOKENS); a batch may set a lower budget of its own. ``parsers``: the reasoning and
    tool-call parsers of every batch, by job option name (``reasoning_parser``, ``tool_parser``);
    unset, each is chosen from the model, and a batch may not name one. ``replica``: this
    service's name among replicas over one database (see :mod:`~anex_pipeline.batch_api.worker`);
    None: the host and process id."""
    store = Store(runner.instance, runner.storage.work_root)
    if api_keys is not None:
        store.set_keys(api_keys)
    key_hashes = store.key_hashes()
    if not key_hashes:
        raise ValueError(
            "no API keys: start the service with --keys-file or ANEX_BATCH_API_KEYS "
            "(none are stored from an earlier start)"
        )
    worker = BatchWorker(runner, store, max_running_batches, replica)
    served = ServedModels(models, adapters=list(runner.engine.lora_modules), parsers=parsers)
    api = BatchApi(store, worker, key_hashes, media or MediaOptions(), served, max_completion_window_s, max_job_tokens)
    store.keep_events = webhook is not None
    sender = WebhookSender(store, webhook) if webhook is not None else None

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        metrics.watch_batches(worker.queued)
        if sender is not None:
            sender.start()
        worker.start()
        if warm_up:
            worker.warm_up(served.names[0] if served.names else None, served.parsers)
        yield
        if sender is not None:  # its pending events wait, stored, for the next start
            await run_in_threadpool(sender.close)
        await run_in_threadpool(worker.close)
        metrics.watch_batches(None)

    routes = [
        Route("/v1/files", api.create_file, methods=["POST"]),
        Route("/v1/files", api.list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", api.retrieve_file, methods=["GET"]),
        Route("/v1/files/{file_id}", api.delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", api.file_content, methods=["GET"]),
        Route("/v1/batches", api.create_batch, methods=["POST"]),
        Route("/v1/batches", api.list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", api.retrieve_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", api.cancel_batch, methods=["POST"]),
        Route("/v1/models", api.models_list, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(BodyLimit, upload_bytes=max_upload_bytes, body_bytes=max_body_bytes)],
        exception_handlers={AnexError: _api_error, HTTPException: _http_error},
        lifespan=lifespan,
    )
