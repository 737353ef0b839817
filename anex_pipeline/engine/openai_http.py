"""The engine that sends rows to an OpenAI-compatible server, such as ``vllm serve`` on GPU machines.

Each row becomes one HTTP request to ``/v1/chat/completions``, ``/v1/completions`` or
``/v1/embeddings``, carrying the row's body with the job's resolved values applied. Requests run
on a bounded thread pool; 408, 429, 5xx answers and lost connections are retried with
exponential backoff (a server's ``Retry-After`` wins). What the server answers is what the row
gets: a success body passes through untouched (embedding vectors are scaled to unit length), and
an error answer becomes the row's error with the server's status code.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import httpx

from anex_pipeline.engine.base import EngineRequest, StopCheck, collect
from anex_pipeline.engine.completions import unit_vector
from anex_pipeline.net.retry import retry_after_seconds
from anex_pipeline.request_fields import PROMPT_FIELDS
from anex_pipeline.spec import CONTEXT_LENGTH_EXCEEDED, RowError, RowOutcome

log = logging.getLogger(__name__)

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}
# An error type that is already an OpenAI-style failure class ("invalid_request_error"), as
# opposed to an exception name such as vLLM's "BadRequestError".
_OPENAI_ERROR_TYPE = re.compile(r"[a-z]+(_[a-z]+)*")
STOP_POLL_S = 0.2  # longest wait between two stop checks while requests are in flight


@dataclass(frozen=True)
class HttpSettings:
    """Where and how to reach the server; two equal settings share one client."""

    base_url: str  # e.g. http://gpu-1:8000 (a trailing /v1 is accepted)
    model_name: str  # the job's model
    model_named: bool = False  # the job named its model, so the server must serve exactly that one
    api_key: str | None = None
    max_concurrency: int = 32
    timeout_s: float = 600.0  # per request, generation included
    retries: int = 4  # further attempts after the first
    backoff_s: float = 1.0  # first wait; doubles on every retry
    max_wait_s: float = 60.0  # cap on one wait, Retry-After included


class ServerUnavailable(RuntimeError):
    """The server cannot be used for the job at all (unreachable, refuses us, lacks the model)."""


class OpenAIHttpEngine:
    """Runs rows on an OpenAI-compatible HTTP server."""

    def __init__(self, settings: HttpSettings):
        if settings.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {settings.max_concurrency}")
        self.settings = settings
        self.root = re.sub(r"/v1/?$", "", settings.base_url.rstrip("/"))
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.client = httpx.Client(
            base_url=self.root,
            headers=headers,
            timeout=httpx.Timeout(settings.timeout_s, connect=min(settings.timeout_s, 10.0)),
            limits=httpx.Limits(
                max_connections=settings.max_concurrency, max_keepalive_connections=settings.max_concurrency
            ),
        )
        try:
            self.model_name = self._served_model()
        except BaseException:
            self.client.close()
            raise

    def shutdown(self) -> None:
        self.client.close()

    def _served_model(self) -> str:
        """The model name to send: the job's own when the server serves it; for a job that left
        the model to its default, the server's only model."""
        try:
            response = self._send("GET", "/v1/models")
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"cannot reach the model server at {self.root}: {exc}") from None
        if response.status_code != 200:
            error = row_error(response)
            raise ServerUnavailable(
                f"the model server at {self.root} answered {response.status_code} to /v1/models: {error.message}"
            )
        try:
            served = [m["id"] for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ServerUnavailable(
                f"{self.root}/v1/models is not an OpenAI model list ({exc!r}); is base_url an OpenAI-compatible server?"
            ) from None
        wanted = self.settings.model_name
        if wanted in served:
            return wanted
        if len(served) == 1 and not self.settings.model_named:
            log.info("the job names no model; using %s, the one the server at %s serves", served[0], self.root)
            return served[0]
        raise ServerUnavailable(
            f"the model server at {self.root} serves {served or 'no models'}, not the job's model {wanted!r}; "
            "set the job's model to one of those, or start the server with --served-model-name"
        )

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        return collect(self.stream, requests)

    def stream(
        self, requests: Iterable[EngineRequest], group_rows: int, stop: StopCheck | None = None
    ) -> Iterator[list[RowOutcome]]:
        """Sends a row whenever a slot frees up, so ``max_concurrency`` requests stay in flight,
        and yields rows as they finish (``group_rows`` plays no part here). ``stop`` is called
        whenever requests finish, and at least every :data:`STOP_POLL_S` while none does. When it
        raises, or the generator is closed early, nothing more is sent and the answers of the
        requests still in flight are dropped without waiting for them."""
        source = iter(requests)
        room = self.settings.max_concurrency
        pool = ThreadPoolExecutor(max_workers=room)
        flying: set[Future[RowOutcome]] = set()
        try:
            while True:
                while len(flying) < room and (req := next(source, None)) is not None:
                    flying.add(pool.submit(self._run_one, req))
                if not flying:
                    break
                finished, flying = wait(flying, timeout=STOP_POLL_S, return_when=FIRST_COMPLETED)
                if finished:
                    yield [f.result() for f in finished]
                if stop is not None:
                    stop()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _run_one(self, req: EngineRequest) -> RowOutcome:
        body = request_body(req, self.model_name)
        try:
            response = self._send(
                "POST", ENDPOINT_PATHS[req.endpoint], json=body, headers={"X-Request-Id": req.request_id}
            )
        except httpx.TransportError as exc:
            message = (
                f"no answer from the model server at {self.root} after {self.settings.retries + 1} attempts: {exc!r}"
            )
            return RowOutcome(req.index, req.key, None, error=RowError(message=message, type="engine_error"))
        if not response.is_success:
            error = named_context_error(row_error(response), req.endpoint)
            return RowOutcome(req.index, req.key, response.status_code, error=error)
        try:
            payload = response.json()
            if req.endpoint == "embeddings":
                for item in payload["data"]:
                    item["embedding"] = unit_vector(item["embedding"])
            elif req.endpoint == "chat":
                _name_reasoning_as_specified(payload)
            usage = row_usage(payload.get("usage"), req.endpoint)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            message = f"the model server answered {response.status_code} with no usable {req.endpoint} body: {exc!r}"
            return RowOutcome(req.index, req.key, None, error=RowError(message=message, type="engine_error"))
        return RowOutcome(req.index, req.key, response.status_code, body=payload, usage=usage)

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request with retries; raises the last transport error when every attempt failed."""
        for attempt in range(self.settings.retries + 1):
            last = attempt == self.settings.retries
            try:
                response = self.client.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if last:
                    raise
                log.info("%s %s failed (%r); retrying", method, path, exc)
                time.sleep(self._wait(attempt, None))
                continue
            if last or not _retryable(response.status_code):
                return response
            log.info("%s %s answered %d; retrying", method, path, response.status_code)
            time.sleep(self._wait(attempt, response))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _wait(self, attempt: int, response: httpx.Response | None) -> float:
        asked = retry_after_seconds(response.headers.get("retry-after")) if response is not None else None
        if asked is None:
            asked = self.settings.backoff_s * 2**attempt * random.uniform(0.5, 1.0)
        return min(asked, self.settings.max_wait_s)


def request_body(req: EngineRequest, model: str) -> dict[str, Any]:
    """The row's body with the job's resolved values in force, as the server takes it."""
    body = {**req.body, "model": model}
    if req.endpoint == "embeddings":
        body["encoding_format"] = "float"  # vectors are normalised here, so they must arrive as numbers
        return body
    body.update(req.sampling)
    body.pop("max_completion_tokens", None)
    body.pop("max_tokens", None)
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    body.pop("response_format", None)
    if req.response_format is not None:
        body["response_format"] = req.response_format
    if req.endpoint == "chat" and req.chat_template_kwargs:
        body["chat_template_kwargs"] = req.chat_template_kwargs
    if req.reasoning_budget is not None:
        body["thinking_token_budget"] = req.reasoning_budget
    return body


def row_error(response: httpx.Response) -> RowError:
    """The row's error from the server's error answer: OpenAI's ``{"error": {...}}``, the older
    flat vLLM form, or any other body (then its text is the message)."""
    try:
        payload = response.json()
    except ValueError:
        payload = None
    info: dict[str, Any] = {}
    if isinstance(payload, dict):
        info = payload["error"] if isinstance(payload.get("error"), dict) else payload
    message = info.get("message") or info.get("detail")
    if not message:
        message = f"the model server answered {response.status_code}: {response.text.strip() or response.reason_phrase}"
    server_type = info.get("type")
    if isinstance(server_type, str) and _OPENAI_ERROR_TYPE.fullmatch(server_type):
        kind = server_type
    elif 400 <= response.status_code < 500 and response.status_code != 429:
        kind = "invalid_request_error"
    else:
        kind = "engine_error"
    param = info.get("param")
    return RowError(
        message=str(message),
        type=kind,
        code=info.get("code"),
        param=param if isinstance(param, str) else None,
    )


def named_context_error(error: RowError, endpoint: str) -> RowError:
    """The server's refusal of a row over the model's context, with OpenAI's code for it
    (vLLM's server gives the HTTP status as code, and names its own token count as param)."""
    if error.type != "invalid_request_error" or "maximum context length" not in error.message:
        return error
    param = PROMPT_FIELDS[endpoint] if error.param in (None, "input_tokens", "input_text") else error.param
    return RowError(message=error.message, type=error.type, code=CONTEXT_LENGTH_EXCEEDED, param=param)


def row_usage(usage: dict[str, Any] | None, endpoint: str) -> dict[str, int]:
    """The token counts the report adds up, from the server's ``usage`` object."""
    usage = usage or {}
    counts = {"prompt_tokens": int(usage.get("prompt_tokens") or 0)}
    if endpoint == "embeddings":
        return counts
    counts["completion_tokens"] = int(usage.get("completion_tokens") or 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    if reasoning is not None:
        counts["reasoning_tokens"] = int(reasoning)
    counts["cached_prompt_tokens"] = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return counts


def _retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _name_reasoning_as_specified(payload: dict[str, Any]) -> None:
    """vLLM's server calls the thinking trace ``message.reasoning``; results carry it as
    ``reasoning_content``, as the in-process engine writes it."""
    for choice in payload.get("choices") or []:
        message = choice.get("message") or {}
        if "reasoning" in message and "reasoning_content" not in message:
            message["reasoning_content"] = message.pop("reasoning")
