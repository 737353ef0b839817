"""The shapes the Batch API stores and returns: File and Batch records, and OpenAI's error body.

A record holds what the service itself knows (owner, lifecycle timestamps, the job behind it);
what the job knows (row counts, usage, the model) is read from the job's work folder when a batch
is shown, and joined in by :meth:`BatchRecord.public`.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from anex_pipeline.errors import AnexError, RowErrorType
from anex_pipeline.spec import INVALID_VALUE, RequestCounts, Usage

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
MAX_EXPIRY_S = 30 * 24 * 3600  # the longest expiry OpenAI accepts
EVENT_TYPES = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "cancelled": "batch.cancelled",
    "expired": "batch.expired",
}


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def holder_name(role: str) -> str:
    """A name for one holder of leases or claims that no other process takes: the role, the host,
    the process id and a random part (a process id is reused)."""
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def now() -> int:
    return int(time.time())


def batch_event(batch_id: str, status: str) -> dict[str, Any]:
    """The event a batch that ended with ``status`` sends, with the fields of OpenAI's."""
    return {
        "id": new_id("evt_"),
        "object": "event",
        "type": EVENT_TYPES[status],
        "created_at": now(),
        "data": {"id": batch_id},
    }


class ApiError(AnexError):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``; a
    400 about a field has OpenAI's ``invalid_value`` code unless it is given a closer one."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = RowErrorType.INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        if code is None and status == 400 and param is not None:  # a field's value is what is wrong
            code = INVALID_VALUE
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}


def not_found(kind: str, object_id: str) -> ApiError:
    return ApiError(404, f"No {kind} found with id '{object_id}'.", param="id", code="not_found")


class ExpiresAfter(BaseModel):
    """When a file expires: ``seconds`` after its creation (OpenAI's only anchor)."""

    anchor: Literal["created_at"]
    seconds: int = Field(ge=1, le=MAX_EXPIRY_S)


class CreateBatch(BaseModel):
    """The body of ``POST /v1/batches``: OpenAI's fields, or the requests embedded in the body.

    Fields this service does not use (``provider``, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    endpoint: str
    completion_window: str = "24h"
    input_file_id: str | None = None
    requests: list[dict[str, Any]] | None = None  # [{"custom_id", "body"}]: the embedded variant
    metadata: dict[str, str] | None = None
    model: str | None = None
    anex_options: dict[str, Any] | None = None  # extension: job options
    output_expires_after: ExpiresAfter | None = None  # for the batch's output and error files


class FileRecord(BaseModel):
    id: str
    owner: str  # sha256 of the API key that uploaded it
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None
    batch_id: str | None = None  # the batch that delivered it (its output or error file)

    def expired(self, at: float) -> bool:
        return self.expires_at is not None and self.expires_at <= at

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": self.expires_at,
            "status_details": None,
        }


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchRecord(BaseModel):
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int | None = None  # the end of its completion window, which the worker keeps (None: no end kept)
    metadata: dict[str, str] | None = None
    model: str | None = None  # as asked for; the job's own model name once it is known
    options: dict[str, Any] = Field(default_factory=dict)  # the job options the batch runs with
    embedded: bool = False  # created with the requests in the body: the finished batch lists its results
    output_expires_after_s: int | None = None  # the output and error files expire this long after they are made
    job_id: str | None = None
    errors: list[BatchError] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    @property
    def status(self) -> BatchStatus:
        """The latest step of the lifecycle, from the timestamps the worker set."""
        for name in ("failed", "expired", "cancelled", "completed", "cancelling", "finalizing", "in_progress"):
            if getattr(self, f"{name}_at") is not None:
                return name  # type: ignore[return-value]
        return "validating"

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def public(self, counts: RequestCounts, tokens: Usage | None) -> dict[str, Any]:
        """The Batch object as OpenAI's API returns it (``openai.types.Batch``), with the job's
        token usage so far."""
        usage = None
        if tokens is not None:
            u = tokens
            usage = {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": {"object": "list", "data": [e.model_dump() for e in self.errors]} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
            "usage": usage,
            "metadata": self.metadata,
        }
