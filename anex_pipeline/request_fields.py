"""The request body fields each endpoint accepts: one declaration that the submit check, the
request resolution (which fields go to the sampler) and the job's sampling defaults all read.

The fields mirror what vLLM's OpenAI-compatible chat, completions, embeddings, responses, score
and rerank requests take and what the engines here pass on (a responses row runs as the chat row it
means); a field outside this table is refused at submit, with the nearest known name. Kept as
plain data: importing vLLM's own request models takes seconds, and the check runs for every
row, so it is a dictionary look-up and a type test per field.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES = "chat", "completions", "embeddings", "responses"
SCORE, RERANK = "score", "rerank"
CLASSIFY = "classify"  # a sequence classifier's label and probabilities for each input
TRANSCRIPTIONS, TRANSLATIONS = "transcriptions", "translations"
AUDIO = frozenset({TRANSCRIPTIONS, TRANSLATIONS})  # a speech-to-text model's text of a sound
GENERATION = frozenset({CHAT, COMPLETIONS, RESPONSES})
CHAT_AND_COMPLETIONS = frozenset({CHAT, COMPLETIONS})  # fields a responses request names otherwise
SCORING = frozenset({SCORE, RERANK})  # a cross-encoder's scores of text pairs
# Endpoints a pooling model answers: nothing is generated, so no output length is estimated and no
# answer is checked against a format; their answers are deterministic.
POOLING = frozenset({EMBEDDINGS, *SCORING, CLASSIFY})
ALL = frozenset({*GENERATION, *POOLING, *AUDIO})
SAMPLED = frozenset({*GENERATION, *AUDIO})  # endpoints whose answers are sampled

NUMBER = (int, float)  # a JSON number (true and false are not numbers here)
OWN_CHECK = ()  # a field that validate.check_body checks by itself, more closely


@dataclass(frozen=True)
class BodyField:
    """A request body field: the JSON kinds its value may have (none listed: checked on its own),
    the endpoints that take it, whether it goes to the sampler as it is, and for a number the
    range it must lie in."""

    kinds: tuple[type, ...]
    endpoints: frozenset[str] = GENERATION
    sampling: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # the range excludes ``low`` itself

    def out_of_range(self, value: float) -> str | None:
        """What is wrong with a finite number for this field, or None."""
        below = self.low is not None and (value < self.low or (self.low_open and value == self.low))
        above = self.high is not None and value > self.high
        if not (below or above):
            return None
        low = "" if self.low is None else f"{'above' if self.low_open else 'at least'} {self.low:g}"
        high = "" if self.high is None else f"at most {self.high:g}"
        return f"is {value:g}; it must be {' and '.join(p for p in (low, high) if p)}"


BODY_FIELDS: dict[str, BodyField] = {
    # what the row asks
    "model": BodyField(OWN_CHECK, ALL),
    "messages": BodyField(OWN_CHECK, frozenset({CHAT, EMBEDDINGS})),  # embeddings: one conversation, as vLLM takes it
    "prompt": BodyField(OWN_CHECK, frozenset({COMPLETIONS, *AUDIO})),  # a sound's: text the model continues from
    "input": BodyField(OWN_CHECK, frozenset({EMBEDDINGS, RESPONSES, CLASSIFY})),
    "instructions": BodyField((str,), frozenset({RESPONSES})),
    # sampling, handed to the engine's sampler
    "temperature": BodyField(NUMBER, SAMPLED, sampling=True, low=0, high=2),
    "top_p": BodyField(NUMBER, SAMPLED, sampling=True, low=0, high=1, low_open=True),
    "top_k": BodyField((int,), SAMPLED, sampling=True),
    "min_p": BodyField(NUMBER, SAMPLED, sampling=True, low=0, high=1),
    "seed": BodyField((int,), SAMPLED, sampling=True),
    "stop": BodyField((str, list), sampling=True),
    "stop_token_ids": BodyField((list,), sampling=True),
    "presence_penalty": BodyField(NUMBER, SAMPLED, sampling=True, low=-2, high=2),
    "frequency_penalty": BodyField(NUMBER, SAMPLED, sampling=True, low=-2, high=2),
    "repetition_penalty": BodyField(NUMBER, SAMPLED, sampling=True, low=0, low_open=True),
    "min_tokens": BodyField((int,), sampling=True),
    "ignore_eos": BodyField((bool,), sampling=True),
    "include_stop_str_in_output": BodyField((bool,), sampling=True),
    "skip_special_tokens": BodyField((bool,), sampling=True),
    "logit_bias": BodyField((dict,), sampling=True),
    "bad_words": BodyField((list,), CHAT_AND_COMPLETIONS, sampling=True),  # vLLM's extras
    "allowed_token_ids": BodyField((list,), CHAT_AND_COMPLETIONS, sampling=True),
    "prompt_logprobs": BodyField((int,), CHAT_AND_COMPLETIONS, sampling=True),
    # vLLM's extras that act before sampling: the prompt's tokens, the template, the scheduler
    "truncate_prompt_tokens": BodyField((int,), CHAT_AND_COMPLETIONS),
    "priority": BodyField((int,), CHAT_AND_COMPLETIONS),
    "add_generation_prompt": BodyField((bool,), frozenset({CHAT, EMBEDDINGS})),
    "continue_final_message": BodyField((bool,), frozenset({CHAT, EMBEDDINGS})),
    "mm_processor_kwargs": BodyField((dict,), frozenset({CHAT})),
    # lengths, output shape and the envelope
    "max_tokens": BodyField((int,), CHAT_AND_COMPLETIONS),
    "max_completion_tokens": BodyField((int,), CHAT_AND_COMPLETIONS | AUDIO),
    "max_output_tokens": BodyField((int,), frozenset({RESPONSES})),
    "thinking_token_budget": BodyField((int,)),
    "response_format": BodyField(OWN_CHECK, CHAT_AND_COMPLETIONS | AUDIO),
    "text": BodyField(OWN_CHECK, frozenset({RESPONSES})),  # its format is chat's response_format
    "n": BodyField((int,), CHAT_AND_COMPLETIONS),
    "structured_outputs": BodyField((dict,), CHAT_AND_COMPLETIONS),  # vLLM's: choice, regex, grammar or json
    "stream": BodyField((bool,)),
    "stream_options": BodyField((dict,), CHAT_AND_COMPLETIONS),
    "logprobs": BodyField((bool, int), CHAT_AND_COMPLETIONS),
    "top_logprobs": BodyField((int,), frozenset({CHAT})),
    "user": BodyField((str,), ALL),
    "metadata": BodyField((dict,)),
    "store": BodyField((bool,)),
    "service_tier": BodyField((str,)),
    # chat only: tools, the template and reasoning
    "tools": BodyField((list,), frozenset({CHAT})),
    "tool_choice": BodyField((str, dict), frozenset({CHAT})),
    "parallel_tool_calls": BodyField((bool,), frozenset({CHAT})),
    "chat_template_kwargs": BodyField(OWN_CHECK, frozenset({CHAT, EMBEDDINGS})),
    "reasoning_effort": BodyField((str,), frozenset({CHAT})),
    "reasoning": BodyField(OWN_CHECK, frozenset({RESPONSES})),  # its effort maps onto thinking
    # embeddings only
    "encoding_format": BodyField((str,), frozenset({EMBEDDINGS})),
    "dimensions": BodyField((int,), frozenset({EMBEDDINGS})),
    # transcriptions and translations: the sound, its language and the language of the text
    "file_url": BodyField(OWN_CHECK, AUDIO),
    "language": BodyField((str,), AUDIO),
    "to_language": BodyField((str,), AUDIO),
    "timestamp_granularities[]": BodyField((list,), frozenset({TRANSCRIPTIONS})),
    # classify only: vLLM's switch for the classifier's activation (false: the raw logits)
    "use_activation": BodyField((bool,), frozenset({CLASSIFY})),
    # scoring: pairs of texts (score) or a query against documents (rerank)
    "text_1": BodyField(OWN_CHECK, frozenset({SCORE})),
    "text_2": BodyField(OWN_CHECK, frozenset({SCORE})),
    "queries": BodyField(OWN_CHECK, frozenset({SCORE})),  # vLLM's other spellings of the two sides
    "items": BodyField(OWN_CHECK, frozenset({SCORE})),
    "data_1": BodyField(OWN_CHECK, frozenset({SCORE})),
    "data_2": BodyField(OWN_CHECK, frozenset({SCORE})),
    "query": BodyField(OWN_CHECK, frozenset({RERANK})),
    "documents": BodyField(OWN_CHECK, frozenset({SCORE, RERANK})),
    "top_n": BodyField((int,), frozenset({RERANK})),
}

# The content part types of a chat message that hold text, as vLLM's chat code reads them (the
# Responses API's names and a refusal included); the media parts are the media stage's.
CHAT_TEXT_PARTS = ("text", "input_text", "output_text", "refusal")

# The field that holds each endpoint's prompt: what an error about the prompt names.
PROMPT_FIELDS = {
    CHAT: "messages",
    COMPLETIONS: "prompt",
    EMBEDDINGS: "input",
    RESPONSES: "input",
    SCORE: "text_2",
    RERANK: "documents",
    CLASSIFY: "input",
    TRANSCRIPTIONS: "file_url",
    TRANSLATIONS: "file_url",
}
# Chat request fields a responses request names otherwise (the names its errors and hints use).
RESPONSES_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
# A score row's two sides, as vLLM 0.32's score requests spell them (one pair per row).
SCORE_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


def score_sides(body: dict[str, object]) -> tuple[str, str]:
    """The names of a score row's two sides: the first of vLLM's spellings the row uses, else
    ``text_1``/``text_2`` (the names a row without either side is told of)."""
    for first, second in SCORE_SIDES:
        if first in body and second in body:
            return first, second
    for first, second in SCORE_SIDES:
        if first in body or second in body:
            return first, second
    return SCORE_SIDES[0]


# The most texts a score row's text_2 (or text_1) or a rerank row's documents may hold: each is
# one pair the cross-encoder reads, and a row's pairs go to the engine together.
MAX_SCORE_TEXTS = 1024
# The most characters one text of a score or rerank row may hold (a text past the model's context
# fails its row at the engine; this bounds the tokenising before that).
MAX_SCORE_TEXT_CHARS = 64 * 1024
# The fields by which a row caps its answer's length, the first one set winning.
CAP_FIELDS = ("max_completion_tokens", "max_tokens")

SAMPLING_FIELDS = frozenset(name for name, f in BODY_FIELDS.items() if f.sampling)
NON_SAMPLING_FIELDS = frozenset(BODY_FIELDS) - SAMPLING_FIELDS
_BY_ENDPOINT = {e: {n: f for n, f in BODY_FIELDS.items() if e in f.endpoints} for e in ALL}
_NAMES = {e: sorted(fields) for e, fields in _BY_ENDPOINT.items()}


def fields_of(endpoint: str) -> dict[str, BodyField]:
    """The body fields a request to the endpoint may carry."""
    return _BY_ENDPOINT[endpoint]


def unknown_field(name: str, endpoint: str) -> str:
    """The message for a body field the endpoint does not take, with the nearest known name."""
    close = difflib.get_close_matches(name, _NAMES[endpoint], n=1)
    if endpoint == RESPONSES and name in RESPONSES_NAMES:
        close = [RESPONSES_NAMES[name]]
    hint = f"did you mean '{close[0]}'?" if close else "remove it"
    elsewhere = [e for e in sorted(ALL) if name in _BY_ENDPOINT[e]]
    if elsewhere:
        return f"is not a field of {endpoint} requests (only of {' and '.join(elsewhere)} ones); {hint}"
    return f"unknown field; {hint}"
