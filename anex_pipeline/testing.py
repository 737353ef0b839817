"""A deterministic stand-in engine for fast tests of the code around the real one.

It answers every chat row with a fixed transformation of the last user message, counts words as
tokens, honours max_tokens (finish_reason "length"), gives logprobs when asked (one per word),
answers constrained rows with JSON, and refuses prompts over its context the way the real engine
does. It refuses media that reach it as a URL instead of as data, which the media stage must
never let happen. The real vLLM engine is exercised by the tests marked ``engine``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from anex_pipeline.engine.base import Engine, EngineRequest, rejected
from anex_pipeline.engine.classify import classification_response
from anex_pipeline.engine.completions import Generated, body_for, embedding_response, one_prompt, unit_vector
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.engine.scoring import score_pairs, scoring_response
from anex_pipeline.orchestration.resources import EngineResource
from anex_pipeline.request_fields import PROMPT_FIELDS, SCORING
from anex_pipeline.spec import CONTEXT_LENGTH_EXCEEDED, RowOutcome
from anex_pipeline.validate.media_refs import media_references


class FakeEngine(Engine):
    def __init__(self, model_name: str = "fake-model", context_words: int = 200):
        self.model_name = model_name
        self.context_words = context_words
        self.calls: list[int] = []  # rows per run() call
        self.seen: list[str] = []  # keys in the order they were generated

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        self.calls.append(len(requests))
        return [self._one(r) for r in requests]

    def _one(self, req: EngineRequest) -> RowOutcome:
        self.seen.append(req.key)
        if req.endpoint == "embeddings":
            given = req.body.get("input") or json.dumps(req.body.get("messages"))
            inputs = [given] if isinstance(given, str) or type(given[0]) is int else given
            texts = [t if isinstance(t, str) else " ".join(map(str, t)) for t in inputs]
            vectors = [unit_vector([float(len(t)), float(sum(map(ord, t)) % 97), 1.0]) for t in texts]
            tokens = sum(len(t.split()) for t in texts)
            body = embedding_response(self.model_name, vectors, tokens, req.body.get("encoding_format"))
            return RowOutcome(req.index, req.key, 200, body=body, usage={"prompt_tokens": tokens})
        if req.endpoint in ("transcriptions", "translations"):  # the sound's size, in words
            url = req.body["file_url"]
            if not url.startswith("data:"):
                return rejected(req, f"the engine was handed a media URL instead of data: {url}", "file_url")
            text = f"a sound of {len(url.partition(',')[2])} base64 characters"
            usage_part = {"usage": {"type": "duration", "seconds": 1}} if req.endpoint == "transcriptions" else {}
            return RowOutcome(req.index, req.key, 200, body={"text": text, **usage_part}, usage={})
        if req.endpoint == "classify":  # two classes: the share of an input's letters that are vowels, and the rest
            given = req.body["input"]
            inputs = [given] if isinstance(given, str) or type(given[0]) is int else given
            texts = [t if isinstance(t, str) else " ".join(map(str, t)) for t in inputs]
            probs = [[share, 1.0 - share] for share in (sum(c in "aeiou" for c in t) / max(1, len(t)) for t in texts)]
            tokens = sum(len(t.split()) for t in texts)
            body = classification_response(req.request_id, self.model_name, {0: "vowels", 1: "other"}, probs, tokens)
            return RowOutcome(req.index, req.key, 200, body=body, usage={"prompt_tokens": tokens})
        if req.endpoint in SCORING:
            pairs = score_pairs(req.endpoint, req.body)
            scores = [_overlap(first, second) for first, second in pairs]
            tokens = sum(len(first.split()) + len(second.split()) for first, second in pairs)
            body = scoring_response(req.endpoint, req.request_id, self.model_name, req.body, scores, tokens)
            return RowOutcome(req.index, req.key, 200, body=body, usage={"prompt_tokens": tokens})
        if req.endpoint == "chat" and (urls := [r.url for r in media_references(req.body) if r.remote]):
            return rejected(req, f"the engine was handed a media URL instead of data: {urls[0]}", "messages")
        prompt = one_prompt(req.body["prompt"]) if req.endpoint == "completions" else json.dumps(req.body["messages"])
        prompt = " ".join(map(str, prompt)) if isinstance(prompt, list) else prompt
        words = prompt.split()
        if len(words) > self.context_words:
            problem = f"prompt of {len(words)} tokens exceeds the context"
            return rejected(req, problem, PROMPT_FIELDS[req.endpoint], CONTEXT_LENGTH_EXCEEDED)
        choice = (req.body.get("structured_outputs") or {}).get("choice")
        if choice:  # one of the choices, picked by the row's key, in tokens of 3 characters
            label = choice[sum(map(ord, req.key)) % len(choice)]
            tokens = [label[n : n + 3] for n in range(0, len(label), 3)]
        else:
            if req.response_format is not None:
                answer = json.dumps({"answer": req.key})
            else:
                answer = f"answer to {req.key}: " + " ".join(words[-3:])
            tokens = [w if n == 0 else f" {w}" for n, w in enumerate(answer.split(" "))]
        cap = req.max_tokens or 1000
        finish = "length" if len(tokens) > cap else "stop"
        g = Generated("".join(tokens[:cap]), finish, len(words), min(len(tokens), cap))
        if req.logprobs is not None:
            g.logprobs = _logprobs(req.endpoint, tokens[:cap], req.logprobs)
        body = body_for(req.endpoint, req.request_id, self.model_name, g)
        usage = {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens}
        return RowOutcome(req.index, req.key, 200, body=body, usage=usage)


def _logprobs(endpoint: str, tokens: list[str], k: int) -> dict[str, Any]:
    """Logprobs of the generated words in the endpoint's shape, as if greedy: each token is the
    best of its ``k`` alternatives (completions' list it, and only it, when ``k`` is 0)."""
    chosen = [-0.25 * (1 + n % 3) for n in range(len(tokens))]
    tops = [[(t, lp)] + [(f"{t}~{j}", lp - j) for j in range(1, k)] for t, lp in zip(tokens, chosen, strict=True)]
    if endpoint == "completions":
        offsets = [sum(map(len, tokens[:n])) for n in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": chosen,
            "top_logprobs": [dict(top) for top in tops],
            "text_offset": offsets,
        }
    return {
        "content": [
            {
                "token": t,
                "logprob": lp,
                "bytes": list(t.encode()),
                "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in top[:k]],
            }
            for t, lp, top in zip(tokens, chosen, tops, strict=True)
        ]
    }


def _overlap(first: str, second: str) -> float:
    """A pair's score: the share of their words the two texts have in common (0 to 1)."""
    a, b = set(first.lower().split()), set(second.lower().split())
    return len(a & b) / len(a | b)


_fake: dict[str, FakeEngine] = {}


def shared_fake_engine(model_name: str = "fake-model") -> FakeEngine:
    return _fake.setdefault(model_name, FakeEngine(model_name))


def fake_engine(kind: str = "fake", **settings: Any) -> EngineResource:
    """The engine resource with a stand-in behind it: ``kind`` names a factory given to
    :func:`~anex_pipeline.engine.register_engine` (``fake``: one fake engine per model and process,
    like the real one)."""
    return EngineResource(kind=kind, **settings)


register_engine("fake", lambda config, manifest: shared_fake_engine(manifest.model_name))
