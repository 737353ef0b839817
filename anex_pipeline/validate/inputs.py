"""What a row gives the model, endpoint by endpoint: chat messages, a responses request's input
items, completions prompts and embedding inputs in OpenAI's four shapes, and the texts of score
and rerank rows."""

from __future__ import annotations

import json
from typing import Any

from anex_pipeline.request_fields import (
    CHAT_TEXT_PARTS,
    MAX_SCORE_TEXT_CHARS,
    MAX_SCORE_TEXTS,
    SCORE_SIDES,
    score_sides,
)
from anex_pipeline.responses import EFFORTS, IMAGE_PART, ITEM_ROLES, TEXT_PARTS
from anex_pipeline.spec import INVALID_TYPE, MISSING_PARAMETER
from anex_pipeline.validate.answers import (
    check_text_format,
)
from anex_pipeline.validate.media_refs import MEDIA_PARTS, part_reference, reference_problem
from anex_pipeline.validate.numbers import INT32_MAX
from anex_pipeline.validate.problems import FieldProblem, kind_of, wrong_kind

ROLES = ("system", "developer", "user", "assistant", "tool")


MAX_PROMPTS = 2048  # OpenAI's limit of inputs in one embeddings request; completions prompts too


MAX_INPUT_TOKEN_IDS = 8192  # OpenAI's limit of tokens in one embedding input, here for token-id inputs


ENCODING_FORMATS = ("float", "base64")


# The content part types a chat message may hold: text, and media by URL or inline data.
CHAT_PARTS = (*CHAT_TEXT_PARTS, *MEDIA_PARTS)


def check_messages(messages: Any) -> list[FieldProblem]:
    if not isinstance(messages, list) or not messages:
        message = f"a chat row needs a non-empty list of messages, got {kind_of(messages)}"
        return [FieldProblem("body.messages", message, MISSING_PARAMETER if not messages else INVALID_TYPE)]
    for n, msg in enumerate(messages):
        where = f"body.messages[{n}]"
        if not isinstance(msg, dict):
            return [FieldProblem(where, f"must be an object with role and content, got {kind_of(msg)}", INVALID_TYPE)]
        if msg.get("role") not in ROLES:
            return [
                FieldProblem(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {json.dumps(msg.get('role'))}")
            ]
        content = msg.get("content")
        if content is None and msg.get("role") == "assistant" and msg.get("tool_calls"):
            continue
        if isinstance(content, str):
            continue
        if isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content):
            for p, part in enumerate(content):  # media URLs the media stage would never fetch
                if part["type"] not in CHAT_PARTS:
                    message = (
                        f"is {json.dumps(part['type'])}, a content part type chat rows do not take; use one of "
                        f'{", ".join(CHAT_PARTS)} (an image as {{"type": "image_url", "image_url": {{"url": ...}}}})'
                    )
                    return [FieldProblem(f"{where}.content[{p}].type", message)]
                url = part_reference(part)
                if url is not None and (why := reference_problem(url)) is not None:
                    return [FieldProblem(f"{where}.content[{p}].{part['type']}", why)]
            continue
        message = f"must be a string or a list of content parts, got {kind_of(content)}"
        return [wrong_kind(f"{where}.content", content, message)]
    return []


def check_continuation(body: dict[str, Any]) -> list[FieldProblem]:
    """A row that continues its last message: vLLM's template takes that message as the start of
    the answer, so it must be the assistant's, and the prompt then gets no new assistant turn."""
    if body.get("add_generation_prompt") is True:
        message = "cannot be true together with add_generation_prompt; set add_generation_prompt to false or remove it"
        return [FieldProblem("body.continue_final_message", message)]
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if isinstance(last, dict) and last.get("role") != "assistant":
        message = (
            "must be 'assistant' when continue_final_message is true (the answer continues that "
            "message); end the messages with the assistant's start, or remove continue_final_message"
        )
        return [FieldProblem(f"body.messages[{len(messages) - 1}].role", message)]
    return []


def check_responses_request(body: dict[str, Any]) -> list[FieldProblem]:
    """The parts of a /v1/responses request that have a shape of their own: input, text.format,
    reasoning.effort."""
    problems = _check_response_input(body.get("input"))
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        message = f'must be an object like {{"format": {{"type": "json_object"}}}}, got {kind_of(text)}'
        problems.append(FieldProblem("body.text", message, INVALID_TYPE))
    elif text is not None and text.get("format") is not None:
        problems += check_text_format(text["format"])
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        message = f'must be an object like {{"effort": "low"}}, got {kind_of(reasoning)}'
        problems.append(FieldProblem("body.reasoning", message, INVALID_TYPE))
    elif reasoning is not None and reasoning.get("effort") not in (None, *EFFORTS):
        message = f"must be one of {', '.join(EFFORTS)}; got {json.dumps(reasoning['effort'])}"
        problems.append(FieldProblem("body.reasoning.effort", message))
    return problems


def _check_response_input(value: Any) -> list[FieldProblem]:
    where = "body.input"
    if isinstance(value, str):
        return [] if value.strip() else [FieldProblem(where, "is empty; there is no prompt to send")]
    if not isinstance(value, list) or not value:
        message = f"a responses row needs a string input or a non-empty list of input items, got {kind_of(value)}"
        return [FieldProblem(where, message, MISSING_PARAMETER if value is None else INVALID_TYPE)]
    for n, item in enumerate(value):
        at = f"{where}[{n}]"
        if not isinstance(item, dict):
            return [
                FieldProblem(
                    at, f"must be an input item object with role and content, got {kind_of(item)}", INVALID_TYPE
                )
            ]
        if item.get("type", "message") != "message":
            message = f"is a {json.dumps(item['type'])} item; batch rows take message items only (role and content)"
            return [FieldProblem(f"{at}.type", message)]
        if item.get("role") not in ITEM_ROLES:
            return [
                FieldProblem(
                    f"{at}.role", f"must be one of {', '.join(ITEM_ROLES)}; got {json.dumps(item.get('role'))}"
                )
            ]
        content = item.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            message = f"must be a string or a list of content parts, got {kind_of(content)}"
            return [wrong_kind(f"{at}.content", content, message)]
        for p, part in enumerate(content):
            if (found := _check_input_part(part, f"{at}.content[{p}]")) is not None:
                return [found]
    return []


def _check_input_part(part: Any, where: str) -> FieldProblem | None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        text = part.get("text")
        return (
            None
            if isinstance(text, str)
            else wrong_kind(f"{where}.text", text, f"must be a string, got {kind_of(text)}")
        )
    if kind == IMAGE_PART:
        url = part.get("image_url")
        if isinstance(url, str):
            why = reference_problem(url)
            return None if why is None else FieldProblem(f"{where}.image_url", why)
        message = "must be the image's URL (https: or data:) as a string; images by file_id are not supported"
        return wrong_kind(f"{where}.image_url", url, message)
    wanted = ", ".join((*TEXT_PARTS, IMAGE_PART))
    return FieldProblem(f"{where}.type", f"must be one of {wanted}; got {json.dumps(kind)}")


def _text_only(messages: Any) -> list[FieldProblem]:
    """Messages to embed hold text alone: an embedding model reads no media."""
    for n, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for p, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") not in CHAT_TEXT_PARTS:
                where = f"body.messages[{n}].content[{p}].type"
                return [FieldProblem(where, f"is {json.dumps(part.get('type'))}; messages to embed hold text only")]
    return []


def check_embedding_request(
    body: dict[str, Any], model_names: frozenset[str], shortening: tuple[bool, list[int] | None] | None
) -> list[FieldProblem]:
    """An embeddings row's input (or, as vLLM's server takes it, one conversation as ``messages``,
    text only), encoding_format, and dimensions against what its model can do."""
    if "messages" in body:
        problems = []
        if "input" in body:
            problems.append(FieldProblem("body.input", "cannot go with messages: give the text as one or the other"))
        problems += check_messages(body["messages"])
        problems += _text_only(body["messages"])
        if body.get("continue_final_message") is True:
            problems += check_continuation(body)
    else:
        problems = check_prompt_shape(body.get("input"), "body.input", MAX_PROMPTS, "embed")
    fmt = body.get("encoding_format")
    if isinstance(fmt, str) and fmt not in ENCODING_FORMATS:
        message = f"must be one of {', '.join(ENCODING_FORMATS)}; got {json.dumps(fmt)}"
        problems.append(FieldProblem("body.encoding_format", message))
    dims = body.get("dimensions")
    if type(dims) is not int or shortening is None:
        return problems
    matryoshka, allowed = shortening
    model = sorted(model_names)[0]
    if not matryoshka:
        message = (
            f"model '{model}' cannot shorten its vectors (it is not a Matryoshka model: its config.json "
            "has no matryoshka_dimensions or is_matryoshka); remove dimensions or run the job on a model that can"
        )
        problems.append(FieldProblem("body.dimensions", message))
    elif allowed and dims not in allowed:
        message = f"is {dims}, but model '{model}' makes vectors of {', '.join(map(str, allowed))} dimensions only"
        problems.append(FieldProblem("body.dimensions", message))
    return problems


# The answer shapes of a transcription or translation row that vLLM's server gives (its srt, vtt
# and diarized_json are refused by the server, or need a model Whisper is not).
AUDIO_FORMATS = ("json", "text", "verbose_json")
TIMESTAMP_GRANULARITIES = ("segment", "word")


def check_audio_request(body: dict[str, Any]) -> list[FieldProblem]:
    """A transcription or translation row: its sound by ``file_url`` (an http(s) URL the media
    stage fetches, or a ``data:`` URL), and the shapes of its own fields."""
    problems = []
    url = body.get("file_url")
    if "file" in body:
        message = "is not taken in a batch: give the sound as file_url, an http(s) URL or a base64 data: URL"
        problems.append(FieldProblem("body.file", message))
    elif not isinstance(url, str) or not url:
        message = f"must be the sound's http(s) URL or a base64 data: URL, got {kind_of(url)}"
        problems.append(wrong_kind("body.file_url", url, message))
    elif (why := reference_problem(url)) is not None:
        problems.append(FieldProblem("body.file_url", why))
    fmt = body.get("response_format")
    if fmt is not None and fmt not in AUDIO_FORMATS:
        message = f"must be one of {', '.join(AUDIO_FORMATS)}; got {json.dumps(fmt)}"
        problems.append(FieldProblem("body.response_format", message))
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        problems.append(wrong_kind("body.prompt", prompt, f"must be a string, got {kind_of(prompt)}"))
    granularities = body.get("timestamp_granularities[]")
    if isinstance(granularities, list) and any(g not in TIMESTAMP_GRANULARITIES for g in granularities):
        message = f"must list some of {', '.join(TIMESTAMP_GRANULARITIES)}"
        problems.append(FieldProblem("body.timestamp_granularities[]", message))
    return problems


def check_score_request(body: dict[str, Any]) -> list[FieldProblem]:
    """A score row's two sides (``text_1`` and ``text_2``, or one of vLLM's other spellings),
    paired as vLLM pairs them: one to one, one to each of N, or N to N in order."""
    a, b = score_sides(body)
    others = sorted({name for pair in SCORE_SIDES for name in pair} & set(body) - {a, b})
    if others:
        message = f"is another spelling of a score row's sides than {a}/{b}; give the two sides in one spelling"
        return [FieldProblem(f"body.{others[0]}", message)]
    problems = _check_score_texts(body.get(a), f"body.{a}") + _check_score_texts(body.get(b), f"body.{b}")
    first, second = body.get(a), body.get(b)
    if not problems and isinstance(first, list) and len(first) > 1:
        count = len(second) if isinstance(second, list) else 1
        if count != len(first):
            message = (
                f"holds {len(first)} texts but body.{b} holds {count}; give one {a} for all of "
                f"{b}, or as many as {b} has, in order"
            )
            problems.append(FieldProblem(f"body.{a}", message))
    return problems


def check_rerank_request(body: dict[str, Any]) -> list[FieldProblem]:
    """A rerank row's one ``query`` and its ``documents`` (``top_n`` is a plain integer field)."""
    query = body.get("query")
    if isinstance(query, list):
        problems = [FieldProblem("body.query", "must be one string; score several queries in /v1/score rows")]
    else:
        problems = _check_score_texts(query, "body.query")
    return problems + _check_score_texts(body.get("documents"), "body.documents")


def _check_score_texts(value: Any, where: str) -> list[FieldProblem]:
    """A string or a list of strings to score, none empty, within the count and size bounds."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        return [wrong_kind(where, value, f"must be a string or a non-empty list of strings, got {kind_of(value)}")]
    if len(texts) > MAX_SCORE_TEXTS:
        return [FieldProblem(where, f"holds {len(texts)} texts; at most {MAX_SCORE_TEXTS} go in one row, split it")]
    for n, text in enumerate(texts):
        at = where if isinstance(value, str) else f"{where}[{n}]"
        if not isinstance(text, str):
            return [wrong_kind(at, text, f"must be a string, got {kind_of(text)}")]
        if not text:
            return [FieldProblem(at, "is an empty string; there is nothing to score")]
        if len(text) > MAX_SCORE_TEXT_CHARS:
            return [FieldProblem(at, f"is {len(text):,} characters; at most {MAX_SCORE_TEXT_CHARS:,} are taken")]
    return []


def check_prompt_shape(value: Any, where: str, most: int, task: str) -> list[FieldProblem]:
    """A prompt or embedding input in one of OpenAI's four shapes: a string, a list of strings,
    a list of token ids, or a list of token-id lists; at most ``most`` prompts, none empty, and
    each token-id prompt within OpenAI's token limit. ``task``: what is done with it ("embed")."""
    if isinstance(value, str):
        return [] if value else [FieldProblem(where, f"is an empty string; there is nothing to {task}")]
    shapes = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if not isinstance(value, list) or not value:
        return [wrong_kind(where, value, f"must be {shapes}, got {kind_of(value)}")]
    if all(type(v) is int for v in value):
        return _check_token_ids(value, where)
    if len(value) > most:
        return [FieldProblem(where, f"holds {len(value)} prompts; at most {most} go in one row, split it")]
    kind = type(value[0])
    for n, item in enumerate(value):
        at = f"{where}[{n}]"
        if type(item) is not kind:
            return [FieldProblem(at, f"is {kind_of(item)} but {where}[0] is {kind_of(value[0])}; use one shape")]
        if isinstance(item, str) and not item:
            return [FieldProblem(at, f"is an empty string; there is nothing to {task}")]
        if isinstance(item, list) and item and all(type(t) is int for t in item):
            if found := _check_token_ids(item, at):
                return found
        elif not isinstance(item, str):
            return [wrong_kind(at, item, f"must be a string or a non-empty list of token ids, got {kind_of(item)}")]
    return []


def _check_token_ids(ids: list[int], where: str) -> list[FieldProblem]:
    if len(ids) > MAX_INPUT_TOKEN_IDS:
        return [FieldProblem(where, f"holds {len(ids)} token ids; at most {MAX_INPUT_TOKEN_IDS} go in one prompt")]
    bad = next((n for n, t in enumerate(ids) if not 0 <= t <= INT32_MAX), None)
    if bad is not None:
        return [FieldProblem(f"{where}[{bad}]", f"is {ids[bad]}, which is not a token id (0 to {INT32_MAX})")]
    return []
