"""The engine that sends rows to OpenAI-compatible servers, such as ``vllm serve`` on GPU machines.

Each row becomes one HTTP request to ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, or vLLM's ``/score`` and ``/rerank`` (its ``/v1/`` spellings of those two log a
warning per request), carrying the row's body with the job's resolved values applied. With
several servers (replicas of one model), rows are spread over them, ``max_concurrency`` in flight
per server (:mod:`anex_pipeline.engine.http.replicas`). A row is tried again, on another server
when it can, after a 408, 429 or 5xx answer or when its server gives no answer (which also takes
that server out until it answers a probe); waits follow the shared retry policy (a server's
``Retry-After`` wins). What the server answers is what the row gets: a success body passes
through untouched (embedding vectors are scaled to unit length; on the machine's shared server, a
trace the thinking budget cut is continued after the notice, :mod:`.continuation`), and an error
answer becomes the row's error with the server's status code.

At about 560 lines this module holds one idea, the stream that keeps every server's slots full
with its retries and the mapping between a row and its HTTP requests (its generation, and, for the
prefix order, its rendering by the server) and answer; the replicas' bookkeeping lives in
:mod:`.replicas`.
"""

from __future__ import annotations

import base64
import heapq
import itertools
import json
import logging
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any

import httpx

from anex_pipeline.engine.base import Engine, EngineRequest, StopCheck, collect
from anex_pipeline.engine.completions import encoded_vector, row_usage, unit_vector
from anex_pipeline.engine.config import HttpSettings
from anex_pipeline.engine.http.continuation import TraceContinuation
from anex_pipeline.engine.http.replicas import Server, ServerPool, ServersDown, server_root, server_urls
from anex_pipeline.engine.prefix_order import STOP_CHECK_ROWS, PrefixCache, shared_bytes
from anex_pipeline.errors import AnexError, RowErrorType
from anex_pipeline.net.retry import retryable_status
from anex_pipeline.request_fields import AUDIO, CLASSIFY, PROMPT_FIELDS, SCORING
from anex_pipeline.spec import CONTEXT_LENGTH_EXCEEDED, RowError, RowOutcome

log = logging.getLogger(__name__)

ENDPOINT_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "score": "/score",
    "rerank": "/rerank",
    "classify": "/classify",  # vLLM serves it at that path only
    "transcriptions": "/v1/audio/transcriptions",  # a form with the sound as a file
    "translations": "/v1/audio/translations",
}
# An error type that is already an OpenAI-style failure class ("invalid_request_error"), as
# opposed to an exception name such as vLLM's "BadRequestError".
_OPENAI_ERROR_TYPE = re.compile(r"[a-z]+(_[a-z]+)*")
STOP_POLL_S = 0.2  # longest wait between two stop checks while requests are in flight
PROBE_TIMEOUT_S = 5.0  # a server that was taken out must answer its model list within this


class ServerUnavailable(AnexError, RuntimeError):
    """The servers cannot be used for the job at all (unreachable, refuse us, lack the model)."""


class _Unusable(Exception):
    """One server cannot serve the job (a wrong model, not an OpenAI server): no retry mends it."""


@dataclass
class _Row:
    """A row on its way: the tries it has had, and the server of the last one."""

    req: EngineRequest
    tries: int = 0
    last_server: Server | None = None


@dataclass
class _Tried:
    """One try of a row on one server. ``retry`` says why another try may do better: "status"
    (a retryable answer) or "no answer" (the server is gone, too)."""

    outcome: RowOutcome
    retry: str | None = None
    retry_after: str | None = None
    reason: str = ""


class OpenAIHttpEngine(Engine):
    """Runs rows on one or several OpenAI-compatible HTTP servers serving the same model."""

    def __init__(self, settings: HttpSettings):
        if settings.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {settings.max_concurrency}")
        self.settings = settings
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        per_server = settings.max_concurrency
        servers = [
            Server(
                root=server_root(url),
                client=httpx.Client(
                    base_url=server_root(url),
                    headers=headers,
                    timeout=httpx.Timeout(settings.timeout_s, connect=min(settings.timeout_s, 10.0)),
                    limits=httpx.Limits(max_connections=per_server + 1, max_keepalive_connections=per_server + 1),
                ),
            )
            for url in server_urls(settings.base_url)
        ]
        self.root = ", ".join(s.root for s in servers)
        self.pool = ServerPool(servers, per_server, settings.policy)
        self.model_name = ""
        # The machine server's account of itself when the loader started the server behind this
        # engine (the report then shows it instead of the address).
        self.server_account: dict[str, Any] | None = None
        # Given by the loader for the machine's shared server of a model that thinks: continues a
        # trace the thinking budget cut, as the in-process engine does.
        self.continuation: TraceContinuation | None = None
        try:
            self._first_contact()
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        for server in self.pool.servers:
            server.client.close()

    def report_section(self) -> dict[str, Any]:
        if self.server_account is not None:
            return self.server_account
        return {"kind": "http", "model": self.model_name, "servers": self.root}

    def served_rows(self) -> dict[str, int]:
        """Rows each server answered over the engine's life."""
        return {s.root: s.served for s in self.pool.servers}

    # -- the model the servers serve -------------------------------------------------------------
    def _first_contact(self) -> None:
        """Finds the model to send (see :meth:`_model_of`) on the servers that answer, taking the
        others out; tries again with backoff while none answers."""
        policy = self.settings.policy
        for attempt in itertools.count():
            errors: dict[Server, str] = {}
            for server in self.pool.servers:
                try:
                    self._check(server, self.settings.timeout_s)
                except _Unusable as exc:
                    raise ServerUnavailable(str(exc)) from None
                except (httpx.TransportError, _Retryable) as exc:
                    errors[server] = str(exc) if isinstance(exc, _Retryable) else repr(exc)
            if len(errors) < len(self.pool.servers):
                for server, reason in errors.items():
                    self.pool.take_out(server, reason)
                return
            if not policy.may_retry(attempt + 1):
                names = "; ".join(f"{s.root}: {reason}" for s, reason in errors.items())
                raise ServerUnavailable(f"cannot reach the model server at {names}")
            log.info("no model server answers yet; trying again")
            time.sleep(policy.backoff(attempt))

    def _check(self, server: Server, timeout_s: float) -> None:
        """Asks the server for its models; the first server to answer sets the model name."""
        response = server.client.get("/v1/models", timeout=timeout_s)
        if response.status_code != 200:
            error = row_error(response)
            status = response.status_code
            problem = f"the model server at {server.root} answered {status} to /v1/models: {error.message}"
            raise (_Retryable if retryable_status(response.status_code) else _Unusable)(problem)
        try:
            served = [m["id"] for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise _Unusable(
                f"{server.root}/v1/models is not an OpenAI model list ({exc!r}); "
                "is base_url an OpenAI-compatible server?"
            ) from None
        missing = [name for name in self.settings.adapters if name not in served]
        if missing:
            raise _Unusable(
                f"the model server at {server.root} serves {served}, without the job's adapter(s) "
                f"{', '.join(missing)}; start it with --enable-lora --lora-modules NAME=PATH for each"
            )
        wanted = self.model_name or self.settings.model_name
        if wanted in served:
            self.model_name = wanted
            return
        if len(served) == 1 and not self.settings.model_named and not self.model_name:
            log.info("the job names no model; using %s, the one the server at %s serves", served[0], server.root)
            self.model_name = served[0]
            return
        raise _Unusable(
            f"the model server at {server.root} serves {served or 'no models'}, not the job's model {wanted!r}; "
            "set the job's model to one of those, or start the server with --served-model-name"
        )

    def _probe(self, server: Server) -> None:
        """Asks a server that was taken out whether it can have rows again, and records the answer."""
        error = None
        try:
            self._check(server, min(self.settings.timeout_s, PROBE_TIMEOUT_S))
        except httpx.TransportError as exc:
            error = repr(exc)
        except (_Retryable, _Unusable) as exc:
            error = str(exc)
        self.pool.probed(server, error)

    # -- rows ------------------------------------------------------------------------------------
    def prompt_tokens(self, request: EngineRequest) -> Sequence[int] | None:
        """The row's prompt as the server renders and tokenises it (vLLM's ``/tokenize``), for the
        prefix order. Asked only of an engine that was given a ``prefix_cache`` (the loader gives
        the machine's shared server one). None for the rows not asked about (see
        :func:`tokenize_body`) and when the server gives no tokens."""
        body = tokenize_body(request, self.model_name)
        if body is None:
            return None
        try:
            response = self.pool.servers[0].client.post("/tokenize", json=body, timeout=PROBE_TIMEOUT_S)
            tokens = response.json()["tokens"] if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return tokens if isinstance(tokens, list) else None

    def prompts_tokens(
        self, requests: Sequence[EngineRequest], stop: StopCheck | None = None
    ) -> list[Sequence[int] | None]:
        """The prompts' tokens from the server, ``max_concurrency`` asked at a time (a round trip
        takes 1-3 ms). None for all, with nothing asked, when the rows' texts show that they
        cannot share enough to be worth ordering (:func:`could_share_enough`)."""
        if self.prefix_cache is None or not could_share_enough(requests, self.prefix_cache):
            return [None] * len(requests)
        with ThreadPoolExecutor(self.settings.max_concurrency, thread_name_prefix="anex-tokenize") as pool:
            asked = [pool.submit(self.prompt_tokens, req) for req in requests]
            try:
                tokens = []
                for n, future in enumerate(asked):
                    if stop is not None and n % STOP_CHECK_ROWS == 0:
                        stop()
                    tokens.append(future.result())
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        return tokens

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        return collect(self.stream, requests)

    def stream(
        self, requests: Iterable[EngineRequest], group_rows: int, stop: StopCheck | None = None
    ) -> Iterator[list[RowOutcome]]:
        """Sends a row whenever a server has a free slot, so ``max_concurrency`` requests stay in
        flight on each server that is up, and yields rows as they finish (``group_rows`` plays no
        part here). ``stop`` is called whenever requests finish, and at least every
        :data:`STOP_POLL_S` while none does. When it raises, or the generator is closed early,
        nothing more is sent and the answers of the requests still in flight are dropped without
        waiting for them. Raises :class:`ServersDown` when every server is gone for good."""
        source = iter(requests)
        policy = self.settings.policy
        waiting: list[tuple[float, int, _Row]] = []  # (monotonic time it may go again, order, row)
        order = itertools.count()
        flying: dict[Future[Any], tuple[Server, _Row | None]] = {}  # a probe has no row
        executor = ThreadPoolExecutor(max_workers=self.pool.capacity + len(self.pool.servers))
        more = True  # the source may have more rows
        try:
            while True:
                for server in self.pool.probes_due():
                    flying[executor.submit(self._probe, server)] = (server, None)
                while self.pool.has_room():
                    row = _next_row(waiting, source)
                    if row is None:  # none due, and the source has no more
                        more = False
                        break
                    server = self.pool.reserve(avoid=row.last_server)  # a row tried again goes elsewhere if it can
                    if server is None:  # another stream on the engine took the slot
                        heapq.heappush(waiting, (time.monotonic(), next(order), row))
                        break
                    flying[executor.submit(self._try, server, row.req)] = (server, row)
                if not flying and not waiting and not more:
                    break
                if self.pool.dead():
                    raise ServersDown(self.pool.down_message())
                done = []
                if flying:
                    finished, _ = wait(flying, timeout=self._pause(waiting), return_when=FIRST_COMPLETED)
                else:  # every server is out, or the rows left wait for their retry: wait for the soonest
                    time.sleep(self._pause(waiting))
                    finished = set()
                for future in finished:
                    server, row = flying.pop(future)
                    if row is None:  # a probe (it recorded its result itself)
                        continue
                    tried: _Tried = future.result()
                    row.tries += 1
                    row.last_server = server
                    if tried.retry == "no answer":
                        self.pool.take_out(server, tried.reason)
                    if tried.retry is None or not policy.may_retry(row.tries):
                        done.append(self._final(row, tried))
                        continue
                    # A server that gave no answer is out: the row may go at once to another one.
                    pause = 0.0 if tried.retry == "no answer" else policy.wait(row.tries - 1, tried.retry_after)
                    log.info("row %s: %s; trying again", row.req.index, tried.reason)
                    heapq.heappush(waiting, (time.monotonic() + min(pause, policy.max_wait_s), next(order), row))
                if done:
                    yield done
                if stop is not None:
                    stop()
        finally:
            for future, (server, row) in flying.items():  # what never started gives its slot back
                if future.cancel() and row is not None:
                    self.pool.release(server, answered=False)
                elif future.cancelled():
                    self.pool.probe_dropped(server)
            executor.shutdown(wait=False)

    def _pause(self, waiting: list[tuple[float, int, _Row]]) -> float:
        """How long the dispatcher may wait for a request to finish before it has other work."""
        soonest = [STOP_POLL_S]
        if waiting and self.pool.has_room():
            soonest.append(max(0.0, waiting[0][0] - time.monotonic()))
        if (probe := self.pool.next_probe_in()) is not None:
            soonest.append(probe)
        return min(soonest)

    def _final(self, row: _Row, tried: _Tried) -> RowOutcome:
        if tried.retry == "no answer":
            message = (
                f"no answer from the model servers after {row.tries} attempts; the last, to "
                f"{tried.outcome.server}: {tried.reason}"
            )
            return replace(tried.outcome, error=RowError(message=message, type=RowErrorType.ENGINE))
        return tried.outcome

    def _try(self, server: Server, req: EngineRequest) -> _Tried:
        """One request for the row on one server, whose slot it gives back when done."""
        tried = None
        try:
            tried = self._request(server, req)
            return tried
        finally:
            self.pool.release(server, answered=tried is not None and tried.retry is None)

    def _request(self, server: Server, req: EngineRequest) -> _Tried:
        body = request_body(req, self.model_name)
        continuation = self.continuation if self.continuation is not None and self.continuation.applies(req) else None
        if continuation is not None:
            body["return_token_ids"] = True
        response = self._post(server, req, req.endpoint, body)
        if isinstance(response, _Tried):
            return response
        try:
            payload = response.json()
            if continuation is not None and (cut := continuation.cut(req, payload)) is not None:
                rest = None
                if cut.left is None or cut.left > 0:
                    answered = self._post(server, req, "completions", continuation.follow_body(req, body, cut), "-rest")
                    if isinstance(answered, _Tried):
                        return answered
                    rest = answered.json()
                payload = continuation.joined(req, payload, cut, rest)
            if req.endpoint == "embeddings":
                fmt = req.body.get("encoding_format")
                for item in payload["data"]:
                    item["embedding"] = encoded_vector(unit_vector(item["embedding"]), fmt)
            elif req.endpoint == "chat":
                _name_reasoning_as_specified(payload)
            usage = row_usage(payload.get("usage"), req.endpoint)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            message = f"the model server answered {response.status_code} with no usable {req.endpoint} body: {exc!r}"
            error = RowError(message=message, type=RowErrorType.ENGINE)
            return _Tried(RowOutcome(req.index, req.key, None, error=error, server=server.root))
        status = response.status_code
        return _Tried(RowOutcome(req.index, req.key, status, body=payload, usage=usage, server=server.root))

    def _post(
        self, server: Server, req: EngineRequest, endpoint: str, body: dict[str, Any], id_suffix: str = ""
    ) -> httpx.Response | _Tried:
        """One request for the row: the server's success answer, or the try's outcome otherwise."""
        try:
            path, headers = ENDPOINT_PATHS[endpoint], {"X-Request-Id": req.request_id + id_suffix}
            if endpoint in AUDIO:
                response = server.client.post(path, **speech_form(body), headers=headers)
            else:
                response = server.client.post(path, json=body, headers=headers)
        except httpx.TransportError as exc:
            lost = RowOutcome(req.index, req.key, None, server=server.root)
            return _Tried(lost, retry="no answer", reason=repr(exc))
        if response.is_success:
            return response
        status = response.status_code
        error = named_context_error(row_error(response), req.endpoint)
        outcome = RowOutcome(req.index, req.key, status, error=error, server=server.root)
        if retryable_status(response.status_code):
            reason = f"{server.root} answered {response.status_code}"
            return _Tried(outcome, retry="status", retry_after=response.headers.get("retry-after"), reason=reason)
        return _Tried(outcome)


class _Retryable(Exception):
    """A server answered its model list with an answer that may be different a moment later."""


def _next_row(waiting: list[tuple[float, int, _Row]], source: Iterator[EngineRequest]) -> _Row | None:
    """A row whose retry is due, else the next new row; None when neither is there now."""
    if waiting and waiting[0][0] <= time.monotonic():
        return heapq.heappop(waiting)[2]
    req = next(source, None)
    return None if req is None else _Row(req)


def speech_form(body: dict[str, Any]) -> dict[str, Any]:
    """A transcription or translation row as vLLM's server takes it: a form whose file is the sound
    (the media stage made file_url a data: URL) and whose other fields are the row's, lists as
    repeated fields and anything else as text."""
    header, _, payload = body["file_url"].partition(",")
    mime = header.removeprefix("data:").split(";")[0] or "application/octet-stream"

    def text(item: Any) -> str:
        return json.dumps(item) if isinstance(item, (bool, dict)) else str(item)

    fields = {
        name: [text(item) for item in value] if isinstance(value, list) else text(value)
        for name, value in body.items()
        if name != "file_url" and value is not None
    }
    return {"files": {"file": ("audio", base64.b64decode(payload), mime)}, "data": fields}


def request_body(req: EngineRequest, model: str) -> dict[str, Any]:
    """The row's body with the job's resolved values in force, as the server takes it (a row on
    a LoRA adapter names the adapter, which a server started with ``--lora-modules`` serves)."""
    body = {**req.body, "model": req.adapter or model}
    if req.endpoint == "embeddings":
        # Vectors are normalised here, so they must arrive as numbers; a base64 row gets its
        # encoding here too, from the unit vector.
        body["encoding_format"] = "float"
        return body
    if req.endpoint in SCORING or req.endpoint == CLASSIFY:  # nothing is sampled: the texts go as they are
        return body
    if req.endpoint in AUDIO:  # the row's fields as they are, the job's sampling defaults under them
        return {**req.sampling, **body}
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


TOKENIZE_CHAT_FIELDS = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
)


def tokenize_body(req: EngineRequest, model: str) -> dict[str, Any] | None:
    """What vLLM's ``/tokenize`` takes to render the row's prompt as its chat or completions request
    would be rendered; None for a row of another endpoint and for a chat row with media (rendering
    it would have the server fetch and process the media once more)."""
    body = request_body(req, model)
    if req.endpoint == "completions":
        return {"model": body["model"], "prompt": body["prompt"]} if isinstance(body.get("prompt"), str) else None
    if req.endpoint != "chat":
        return None
    for message in body.get("messages", []):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            return None
    return {"model": body["model"], **{k: body[k] for k in TOKENIZE_CHAT_FIELDS if k in body}}


RENDERING_SLACK_TOKENS = 1024  # what a chat template may add before and between the messages, at most


def could_share_enough(requests: Sequence[EngineRequest], cache: PrefixCache) -> bool:
    """Whether the rows' prompts could share enough to be worth ordering, told from their texts
    without the server: the bytes of every prefix two rows' messages (or prompts) share bound the
    tokens they share (a token is a byte or more), and the rows are worth ordering only when what
    they share fills more than half the cache. Rows with tools or a chat template of their own are
    not told apart this way (a template may render those first): then every row is asked."""
    texts = []
    for req in requests:
        body = tokenize_body(req, "")
        if body is None:
            continue
        if "tools" in body or "chat_template" in body:
            return True
        text = body.get("prompt", body.get("messages"))
        texts.append(text.encode() if isinstance(text, str) else json.dumps(text, ensure_ascii=False).encode())
    return shared_bytes(texts) + RENDERING_SLACK_TOKENS > cache.capacity_tokens // 2


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
        kind = RowErrorType.INVALID_REQUEST
    else:
        kind = RowErrorType.ENGINE
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
    if error.type != RowErrorType.INVALID_REQUEST or "maximum context length" not in error.message:
        return error
    param = PROMPT_FIELDS[endpoint] if error.param in (None, "input_tokens", "input_text") else error.param
    return RowError(message=error.message, type=error.type, code=CONTEXT_LENGTH_EXCEEDED, param=param)


def _name_reasoning_as_specified(payload: dict[str, Any]) -> None:
    """vLLM's server calls the thinking trace ``message.reasoning``; results carry it under that
    name and as ``reasoning_content`` too, as the in-process engine writes it."""
    for choice in payload.get("choices") or []:
        message = choice.get("message") or {}
        if "reasoning" in message and "reasoning_content" not in message:
            message["reasoning_content"] = message["reasoning"]
