"""What a finished generation of the in-process engine becomes: the row's OpenAI response, one
choice per answer, its chat answers split into answer, reasoning and tool calls by
:mod:`anex_pipeline.engine.parsing`, with logprobs shaped by vLLM's own server code; and an
embedding row's response."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from anex_pipeline.engine.base import EngineRequest, engine_failure, rejected
from anex_pipeline.engine.completions import Generated, body_for, embedding_response, row_usage, unit_vector
from anex_pipeline.engine.parsing import OutputParser, count_thinking_tokens
from anex_pipeline.engine.thinking import ThinkingIds
from anex_pipeline.spec import RowOutcome


@dataclass
class Flight:
    """A row in the engine: its prompt, its sampling parameters and, once a cut trace is being
    continued, the head (trace, notice, end tag) the continuation follows."""

    req: EngineRequest
    prompt_ids: list[int]
    params: Any
    cached_tokens: int = 0
    head: list[int] | None = None
    head_text: str = ""
    head_logprobs: list[Any] | None = None  # the head's, when the row asked for logprobs
    prompt_logprobs: Any = None  # vLLM's, per prompt token, when the row asked for prompt_logprobs


@dataclass
class Answer:
    """One row's generated tokens, their text and why generation stopped."""

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[Any] | None = None  # per token: vLLM's alternatives by token id (None: forced)


@dataclass
class OutputShaper:
    """Makes the responses of one loaded model's rows."""

    tokenizer: Any
    model_name: str
    parser: OutputParser
    thinking: ThinkingIds | None

    def completion_outcome(self, flight: Flight, answers: list[Answer]) -> RowOutcome:
        """The row's response, one choice per answer (``n`` of them), in index order."""
        req = flight.req
        field = req.constraint_field
        if field and any(a.finish_reason == "error" for a in answers):
            # vLLM ends a row this way when its grammar does not compile, or when the grammar
            # allows no token at all (a schema that only refers to itself): the constraint is at fault.
            return rejected(
                req,
                f"the model cannot follow {field}: its schema or grammar does not compile, or allows no "
                "output (e.g. a $ref that only refers to itself); fix it",
                field,
            )
        abnormal = next((a.finish_reason for a in answers if a.finish_reason not in ("stop", "length")), None)
        if abnormal is not None:
            return engine_failure(req, f"generation ended abnormally ({abnormal})")
        choices = [self._generated(flight, answer) for answer in answers]
        body = body_for(req.endpoint, req.request_id, req.adapter or self.model_name, *choices)
        if flight.prompt_logprobs is not None:  # where vLLM's server puts them: the chat body, each text choice
            shaped = _prompt_logprobs(flight.prompt_logprobs)
            for holder in [body] if req.endpoint == "chat" else body["choices"]:
                holder["prompt_logprobs"] = shaped
        usage = row_usage(body["usage"], req.endpoint)
        return RowOutcome(index=req.index, key=req.key, status_code=200, body=body, usage=usage)

    def _generated(self, flight: Flight, answer: Answer) -> Generated:
        req = flight.req
        parsed = self.parser.row_answer(req, answer.text, answer.token_ids, flight.prompt_ids)
        t = self.thinking
        thinking = count_thinking_tokens(flight.prompt_ids, answer.token_ids, t.start, t.end) if t is not None else 0
        return Generated(
            text=parsed.content,
            finish_reason=answer.finish_reason,
            prompt_tokens=len(flight.prompt_ids),
            completion_tokens=len(answer.token_ids),
            cached_tokens=flight.cached_tokens,
            reasoning=parsed.reasoning,
            reasoning_tokens=thinking,
            tool_calls=parsed.tool_calls,
            logprobs=self._logprobs_object(req, answer),
            forced=parsed.forced,
        )

    def _logprobs_object(self, req: EngineRequest, answer: Answer) -> dict[str, Any] | None:
        """The answer's logprobs in its endpoint's shape, or None when the row asked for none.

        They cover every generated token, a thinking trace and tool-call text included, as
        vLLM's server gives them (a token the thinking budget forced has no logprob). vLLM's own
        server code shapes them, on instances without server state: these two methods read
        nothing of it but whether to show tokens as ids.
        """
        if req.logprobs is None or answer.logprobs is None:
            return None
        if req.endpoint == "chat":
            from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

            shaped = _stateless(OpenAIServingChat)._create_chat_logprobs(
                answer.token_ids, answer.logprobs, self.tokenizer, num_output_top_logprobs=req.logprobs
            )
        else:
            from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

            shaped = _stateless(OpenAIServingCompletion)._create_completion_logprobs(
                answer.token_ids, answer.logprobs, req.logprobs, self.tokenizer
            )
        return shaped.model_dump(mode="json")

    def embedding_outcome(self, req: EngineRequest, prompt_tokens: int, vectors: list[Any]) -> RowOutcome:
        values = [unit_vector(v) for v in vectors]
        body = embedding_response(self.model_name, values, prompt_tokens, req.body.get("encoding_format"))
        return RowOutcome(
            index=req.index, key=req.key, status_code=200, body=body, usage={"prompt_tokens": prompt_tokens}
        )


def _stateless(serving: type) -> Any:
    """An instance of one of vLLM's serving classes with none of a server's state, for its
    response-shaping methods; tokens are shown as text, as by default."""
    shaper = object.__new__(serving)
    shaper.return_tokens_as_token_ids = False
    return shaper


def _prompt_logprobs(per_token: Any) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt logprobs as its server writes them: per prompt token (the first has none),
    its alternatives by token id, each with its logprob (-9999 for minus infinity), rank and text."""
    from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs

    return [
        None
        if alternatives is None
        else {
            str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token, lp in alternatives.items()
        }
        for alternatives in clamp_prompt_logprobs(list(per_token))
    ]
