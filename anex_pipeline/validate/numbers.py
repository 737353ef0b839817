"""The number fields of a request body and of the job options: the range of each integer field,
finite floats, logit biases, and how deep a JSON value may nest."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from anex_pipeline.spec import INVALID_TYPE
from anex_pipeline.validate.problems import FieldProblem, kind_of

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the engine takes a seed as a signed 64-bit integer


INT32_MAX = 2**31 - 1


# The most alternatives a token's logprobs may list: OpenAI's limit for chat, and vLLM's default
# max_logprobs, above which the engine would refuse the row.
MAX_LOGPROBS = 20


# The most choices a row may ask for (``n``), and the most tokens its choices may ask for together
# (``n`` x its own max_tokens): a row is one request to the engine, whose batch it would fill.
MAX_CHOICES = 128


MAX_ROW_TOKENS = 2**20


# The most logprob entries a row may ask for: each generated token's own and its alternatives', over
# all its answers. The row's answer holds them all at once, so this bounds a row's memory.
MAX_ROW_LOGPROBS = 2**21


# The output tokens a job's rows may ask for together (see validate.answers.TokenBudget), unless
# the job's max_job_tokens says otherwise: about a day of generation on a large GPU cluster.
MAX_JOB_TOKENS = 2**34


# What a row with no cap of its own (and a job with none) counts for: the length estimate's
# sample cap, which is the most the estimate ever gives such a row.
UNCAPPED_ROW_TOKENS = 1024


# Integer request fields and job options with the values the engine can take: (lowest, highest).
INTEGER_RANGES = {
    "seed": (INT64_MIN, INT64_MAX),
    "max_tokens": (1, INT32_MAX),
    "max_completion_tokens": (1, INT32_MAX),
    "max_output_tokens": (1, INT32_MAX),
    "min_tokens": (0, INT32_MAX),
    "top_k": (-1, INT32_MAX),
    "reasoning_budget": (0, INT32_MAX),
    "truncate_prompt_tokens": (-1, INT32_MAX),  # -1: the model's context
    "prompt_logprobs": (0, MAX_LOGPROBS),
    "priority": (INT64_MIN, INT64_MAX),
    "dimensions": (1, INT32_MAX),
    "top_n": (0, INT32_MAX),  # rerank: 0 returns every document
    "n": (1, MAX_CHOICES),
    "top_logprobs": (0, MAX_LOGPROBS),
    "logprobs": (0, MAX_LOGPROBS),  # completions' count; chat's is true or false
}


LOGIT_BIAS_LIMIT = 100.0


# Number fields of a request body and of the job options (integers as above, biases, the rest floats).
NUMBER_FIELDS = frozenset(
    {
        *INTEGER_RANGES,
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
    }
)


def check_numbers(values: dict[str, Any], prefix: str = "") -> list[FieldProblem]:
    """The number fields the engine cannot take: an infinity or NaN (Python's json reads 1e999,
    NaN and Infinity), an integer out of its field's range, a logit_bias that does not map token
    ids to biases from -100 to 100. Fields are named ``prefix + key``."""
    problems: list[FieldProblem] = []
    for key, value in values.items():  # runs for every row: the usual case is kept short
        if key not in NUMBER_FIELDS:
            continue
        if type(value) is float:
            if not math.isfinite(value):
                problems.append(FieldProblem(prefix + key, _non_finite_message(value)))
        elif type(value) is int:
            low, high = INTEGER_RANGES.get(key, (value, value))
            if not low <= value <= high:
                message = f"is {value}, outside the range the engine takes ({low} to {high}); use a value within it"
                problems.append(FieldProblem(prefix + key, message))
        elif key == "logit_bias" and value is not None:
            problems += _check_logit_bias(value, prefix + key)
    return problems


def non_finite_problems(value: Any, where: str) -> Iterator[FieldProblem]:
    """A problem for each infinite or NaN number inside a JSON value (walked without recursion:
    an option's value may be nested as deep as the JSON reader allows)."""
    stack = [(where, value)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            yield FieldProblem(where, _non_finite_message(value))
        elif isinstance(value, dict):
            stack += [(f"{where}.{key}" if where else key, item) for key, item in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{where}[{n}]", item) for n, item in reversed(list(enumerate(value)))]


def deeper_than(value: Any, levels: int) -> bool:
    """True when a JSON value nests lists and objects more than ``levels`` deep (the value itself,
    if a list or an object, is the first level); walked without recursion."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > levels:
            return True
        stack += [(child, depth + 1) for child in children if isinstance(child, (dict, list))]
    return False


def _non_finite_message(value: float) -> str:
    return f"is not a finite number (it reads as {value!r}); write a finite number or remove it"


def _check_logit_bias(bias: Any, where: str) -> list[FieldProblem]:
    if not isinstance(bias, dict):
        message = f'must be an object of token ids and biases like {{"1234": -100}}, got {kind_of(bias)}'
        return [FieldProblem(where, message, INVALID_TYPE)]
    for token, value in bias.items():
        if not (token.isascii() and token.isdigit() and int(token) <= INT32_MAX):
            return [
                FieldProblem(
                    f"{where}.{token}", f'{json.dumps(token)} is not a token id; keys must be token ids like "1234"'
                )
            ]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return [
                FieldProblem(
                    f"{where}.{token}", f"must be a number from -100 to 100, got {kind_of(value)}", INVALID_TYPE
                )
            ]
        if not math.isfinite(value):
            return [FieldProblem(f"{where}.{token}", _non_finite_message(value))]
        if abs(value) > LOGIT_BIAS_LIMIT:
            return [FieldProblem(f"{where}.{token}", f"is {value}; a bias must be from -100 to 100")]
    return []
