"""The HTTP engine's continuation of a trace the thinking budget cut, on made-up token ids: where
the cut is found, what the rest is asked with, and how completions' logprobs join the first
answer's. The real server and model are in test_engine_thinking.py."""

from __future__ import annotations

from typing import Any

import pytest

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.config import EngineSettings
from anex_pipeline.engine.http.continuation import FORCED_LOGPROB, Cut, TraceContinuation, _Model
from anex_pipeline.engine.parsing import OutputParser, ParserNames
from anex_pipeline.engine.thinking import ThinkingIds

START, END, NOTICE = 1, 2, [7, 8]  # <think>, </think> and the notice's tokens


class Tokens:
    """A tokenizer whose token n reads "<n>"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


def continuation() -> TraceContinuation:
    made = TraceContinuation(EngineSettings(model="m", model_name="m", reasoning_parser="qwen3"), {})
    made._model = _Model(Tokens(), ThinkingIds([START], [END], [END], NOTICE), OutputParser(Tokens(), ParserNames()))
    return made


def request(endpoint: str = "chat", **fields: Any) -> EngineRequest:
    given = {"max_tokens": 12, "reasoning_budget": 3, "sampling": {"seed": 5, "min_tokens": 8, "prompt_logprobs": 1}}
    return EngineRequest(0, "r", "req-0", endpoint, {"messages": []}, **{**given, **fields})  # type: ignore[arg-type]


def chat_answer(output_ids: list[int]) -> dict[str, Any]:
    return {"prompt_token_ids": [9, START], "choices": [{"token_ids": output_ids, "message": {}}]}


def test_a_trace_that_reached_its_budget_is_cut_before_the_forced_end_tag() -> None:
    payload = chat_answer([30, 31, 32, END, 40])
    cut = continuation().cut(request(), payload)
    assert cut == Cut(prompt_ids=[9, START], head=[30, 31, 32, *NOTICE, END], cut=3, left=6)
    assert "prompt_token_ids" not in payload and "token_ids" not in payload["choices"][0]  # never delivered


@pytest.mark.parametrize(
    ("output_ids", "budget"),
    [([30, END, 40], 3), ([30, 31, 32, 33], 3)],  # ended within the budget; never ended
)
def test_a_trace_the_budget_did_not_end_is_left_as_the_server_answered(output_ids: list[int], budget: int) -> None:
    payload = chat_answer(output_ids)
    assert continuation().cut(request(reasoning_budget=budget), payload) is None
    assert "token_ids" not in payload["choices"][0]


def test_a_cap_inside_the_notice_leaves_nothing_for_a_rest() -> None:
    cut = continuation().cut(request(max_tokens=4), chat_answer([30, 31, 32, END]))
    assert cut is not None and (cut.head, cut.cut, cut.left) == ([30, 31, 32, NOTICE[0]], 3, 0)


def test_the_rest_is_asked_with_the_rows_sampling_after_the_head() -> None:
    c = continuation()
    req = request(logprobs=2, response_format={"type": "json_object"})
    cut = c.cut(req, chat_answer([30, 31, 32, END]))
    assert cut is not None
    body = {"model": "served", "response_format": {"type": "json_object"}, "return_token_ids": True}
    assert c.follow_body(req, body, cut) == {
        "model": "served",
        "prompt": [9, START, 30, 31, 32, *NOTICE, END],
        "max_tokens": 6,
        "min_tokens": 2,  # 8 less the head's 6
        "seed": 5,  # prompt_logprobs stays with the first answer
        "skip_special_tokens": False,
        "return_token_ids": True,
        "response_format": {"type": "json_object"},
        "logprobs": 2,
    }


def test_the_answer_joins_both_parts_and_their_logprobs() -> None:
    c = continuation()
    req = request("completions", logprobs=1)
    first = {
        "id": "cmpl-1",
        "created": 1,
        "model": "served",
        "usage": {"prompt_tokens_details": {"cached_tokens": 1}},
        "prompt_token_ids": None,
        "choices": [
            {
                "prompt_token_ids": [9, START],
                "token_ids": [30, 31, 32, END],
                "logprobs": {
                    "tokens": ["<30>", "<31>", "<32>", "<2>"],
                    "token_logprobs": [-1.0, -2.0, -3.0, None],
                    "top_logprobs": [{"<30>": -1.0}, {"<31>": -2.0}, {"<32>": -3.0}, None],
                    "text_offset": [0, 4, 8, 12],
                },
            }
        ],
    }
    cut = c.cut(req, first)
    assert cut is not None
    rest = {
        "choices": [
            {
                "text": "<50><51>",
                "token_ids": [50, 51],
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["<50>", "<51>"],
                    "token_logprobs": [-0.5, -0.25],
                    "top_logprobs": [{"<50>": -0.5, "<60>": -0.75}, {"<51>": -0.25}],
                    "text_offset": [0, 4],
                },
            }
        ]
    }
    body = c.joined(req, first, cut, rest)
    choice = body["choices"][0]
    assert (body["id"], choice["text"], choice["finish_reason"]) == (
        "cmpl-1",
        "<30><31><32><7><8><2><50><51>",
        "length",
    )
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["prompt_tokens"] == 2
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5  # the trace and the notice
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"] == [-1.0, -2.0, -3.0, None, None, None, -0.5, -0.25]
    assert logprobs["text_offset"] == [0, 4, 8, 12, 15, 18, 21, 25]  # each token after the ones before it
    assert logprobs["top_logprobs"][6] == {"<50>": -0.5, "<60>": -0.75}  # as the server gave them

    chat = request(logprobs=1)
    first_chat = {**chat_answer([30, 31, 32, END]), "id": "c", "created": 1, "model": "served"}
    entries = [{"token": f"<{t}>", "logprob": -1.0, "bytes": [], "top_logprobs": []} for t in (30, 31, 32, END)]
    first_chat["choices"][0]["logprobs"] = {"content": entries}
    cut = c.cut(chat, first_chat)
    assert cut is not None
    joined = c.joined(chat, first_chat, cut, rest)["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in joined] == [
        -1.0,
        -1.0,
        -1.0,
        FORCED_LOGPROB,
        FORCED_LOGPROB,
        FORCED_LOGPROB,
        -0.5,
        -0.25,
    ]
    assert [t["token"] for t in joined[6]["top_logprobs"]] == ["<50>"]  # completions give one more than asked
