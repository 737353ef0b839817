"""The contract's data shapes: job options, submit-time problems, input rows, row outcomes and the job report.

Everything here is plain pydantic or dataclasses so that the CLI, the Dagster assets and the
tests share one definition of what a job is and what it produces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from anex_pipeline.errors import RejectedError
from anex_pipeline.request_fields import SAMPLING_FIELDS

Endpoint = Literal[
    "chat", "completions", "embeddings", "responses", "score", "rerank", "classify", "transcriptions", "translations"
]

ENDPOINT_BY_URL: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    "/v1/score": "score",
    "/v1/rerank": "rerank",
    "/v1/classify": "classify",
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
    # vLLM's own paths of the same endpoints, as its server and run_batch take them
    "/score": "score",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/classify": "classify",
}
# Each endpoint's OpenAI-style url: the first one listed above.
URL_BY_ENDPOINT: dict[Endpoint, str] = {}
for _url, _endpoint in ENDPOINT_BY_URL.items():
    URL_BY_ENDPOINT.setdefault(_endpoint, _url)

# The error code of a row whose prompt, or prompt and max_tokens together, do not fit the model's
# context, as OpenAI names it.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# OpenAI's codes for what is wrong with a request, which the Batch API gives each problem it lists.
INVALID_JSON = "invalid_json"
MISSING_PARAMETER = "missing_required_parameter"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"
UNKNOWN_PARAMETER = "unknown_parameter"
DUPLICATE_ID = "duplicate_custom_id"
MODEL_NOT_FOUND = "model_not_found"


class _Strict(BaseModel):
    """Unknown keys are refused, and every value must already be of its field's JSON kind, as in a
    row's body: no ``true`` as a number, no ``"5"`` as an integer, no ``1.0`` as a count."""

    model_config = ConfigDict(extra="forbid", strict=True)


class MediaOptions(_Strict):
    """Limits for downloading media that rows reference by URL."""

    allowed_hosts: list[str] = Field(default_factory=list)
    max_bytes: int = Field(default=20 * 1024 * 1024, gt=0)
    timeout_s: float = Field(default=30.0, gt=0)
    per_host_connections: int = Field(default=4, ge=1, le=64)
    max_retries: int = Field(default=4, ge=0, le=20)
    # the longest sound a row may carry, as vLLM decodes at most (VLLM_MAX_AUDIO_DECODE_DURATION_S)
    max_audio_seconds: float = Field(default=600.0, gt=0)


class Prices(_Strict):
    """Prices per 1,000 tokens, in whatever currency the user bills in."""

    input_per_1k: float = Field(ge=0)
    output_per_1k: float = Field(ge=0)
    cached_input_per_1k: float | None = Field(default=None, ge=0)

    def cost(self, prompt_tokens: float, completion_tokens: float, cached_prompt_tokens: float = 0) -> float:
        """What so many tokens cost; cached prompt tokens at their own price when one is set."""
        cached = cached_prompt_tokens if self.cached_input_per_1k is not None else 0
        total = (prompt_tokens - cached) / 1000 * self.input_per_1k
        total += cached / 1000 * (self.cached_input_per_1k or 0.0)
        total += completion_tokens / 1000 * self.output_per_1k
        return round(total, 6)


class JobOptions(_Strict):
    """Options that apply to a whole job. Unknown keys are rejected."""

    model: str | None = None
    endpoint: Endpoint | None = None
    # LoRA adapters by name (a local folder or a Hugging Face id): rows choose one by body.model
    lora_modules: dict[str, str] | None = None
    adapter: str | None = None  # the adapter of the rows that name no model (every Parquet row)
    response_format: dict[str, Any] | None = None
    reasoning: bool | None = None
    reasoning_budget: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    # the most output tokens the rows may ask for together (see validate.answers.TokenBudget);
    # None: the default budget, validate.numbers.MAX_JOB_TOKENS
    max_job_tokens: int | None = Field(default=None, ge=1)
    parse_thinking: bool | None = None
    parse_tool_calls: bool | None = None
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    shards: int | None = Field(default=None, ge=1)  # default: from the job's size (see stages.submit.shard_count)
    shard_rows: int | None = Field(default=None, ge=1)  # or: at most this many rows per shard
    media: MediaOptions = Field(default_factory=MediaOptions)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)
    stop: list[str] | str | None = None
    prompt_column: str | None = None
    image_column: str | None = None
    system_prompt: str | None = None
    # chat jobs: each row answers with one of these labels and its probability (engine/labels.py)
    labels: list[str] | None = None
    estimate_sample_size: int = Field(default=100, ge=4, le=4096)
    estimate_seed: int = 0
    checkpoint_rows: int = Field(default=256, ge=1, le=100_000)
    reuse_answers: bool = True  # identical deterministic rows are generated once
    answer_store: bool = True  # with reuse_answers: deterministic rows answered by earlier jobs are not generated
    row_metadata: bool = True  # Parquet results carry each row's token counts and finish reason
    # Parquet chat and completions jobs: a logprobs column, each generated token's logprob and its
    # top_logprobs best alternatives (0 to 20, the rows' own range; only with logprobs true)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    prefix_order: bool = True  # rows sharing a long prompt prefix go to the engine together
    time_limit_s: float | None = Field(default=None, gt=0)
    prices: Prices | None = None

    def sampling_defaults(self) -> dict[str, Any]:
        """Job-level sampling values that fill in under each row's own body values."""
        return {n: getattr(self, n) for n in SAMPLING_OPTIONS if getattr(self, n) is not None}


# The job options that are sampling fields of a request body too: the defaults of every row.
SAMPLING_OPTIONS = tuple(name for name in JobOptions.model_fields if name in SAMPLING_FIELDS)


@dataclass(frozen=True)
class Problem:
    """One reason a job was rejected at submit time."""

    message: str
    line: int | None = None  # 1-based line (JSONL) or row (Parquet); None for job-level problems
    field: str | None = None
    code: str = INVALID_VALUE  # OpenAI's name for the kind of problem (the Batch API shows it)

    def __str__(self) -> str:
        where = []
        if self.line is not None:
            where.append(f"line {self.line}")
        if self.field:
            where.append(f"field '{self.field}'")
        return f"{', '.join(where)}: {self.message}" if where else self.message


class JobRejected(RejectedError):
    """A job failed its submit-time checks; nothing was run and no result was written."""

    def __init__(self, problems: list[Problem], total: int | None = None):
        self.problems = problems
        self.total = total if total is not None else len(problems)
        super().__init__(self.render())

    def render(self, limit: int = 50) -> str:
        shown = self.problems[:limit]
        lines = [f"job rejected: {self.total} problem(s) found"]
        lines += [f"  {p}" for p in shown]
        if self.total > len(shown):
            lines.append(f"  ... and {self.total - len(shown)} more")
        return "\n".join(lines)


def error_kind(error_type: str, code: Any) -> str:
    """What a failed row is counted as (the report's error counts, Parquet's ``error_type``): the
    error's code when it names the reason (``context_length_exceeded``), else the error's type (a
    number as code, such as a media host's HTTP status, is no reason of its own)."""
    return code if isinstance(code, str) and code else error_type


@dataclass
class InputRow:
    """A request that passed its submit-time checks, normalised to an OpenAI request body."""

    index: int  # 0-based position in the input
    key: str  # the row identity: custom_id, the Parquet id column, or the row index
    body: dict[str, Any]
    # A /v1/responses row: its request as written, while ``body`` is the chat request it means.
    respond: dict[str, Any] | None = None


@dataclass
class RowError:
    """The error object of a failed row, as the OpenAI batch envelope carries it."""

    message: str
    type: str
    code: str | int | None = None
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "code": self.code, "param": self.param}


@dataclass
class RowOutcome:
    """What happened to one row: a completion body, or an error. Engine-agnostic."""

    index: int
    key: str
    status_code: int | None
    body: dict[str, Any] | None = None
    error: RowError | None = None
    # Parquet's error_type for a completion: "length" or "format_error"; None otherwise.
    completion_flag: str | None = None
    format_error: bool = False
    usage: dict[str, int] = field(default_factory=dict)
    reused: bool = False  # a copy of the answer of an identical deterministic row
    server: str | None = None  # the model server that answered (HTTP engine); not stored

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def error_type(self) -> str | None:
        return error_kind(self.error.type, self.error.code) if self.error is not None else self.completion_flag

    def to_record(self) -> dict[str, Any]:
        return {
            "i": self.index,
            "key": self.key,
            "status_code": self.status_code,
            "body": self.body,
            "error": self.error.as_dict() if self.error else None,
            "flag": self.completion_flag,
            "format_error": self.format_error,
            "usage": self.usage,
            "reused": self.reused,
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> RowOutcome:
        err = rec.get("error")
        return cls(
            index=rec["i"],
            key=rec["key"],
            status_code=rec.get("status_code"),
            body=rec.get("body"),
            error=RowError(**err) if err else None,
            completion_flag=rec.get("flag"),
            format_error=bool(rec.get("format_error")),
            usage=rec.get("usage") or {},
            reused=bool(rec.get("reused")),
        )


JobStatus = Literal["completed", "failed", "stopped_early"]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0
    format_error_rows: int = 0

    def nothing_delivered(self) -> bool:
        """True for a job with input rows none of which has a result (not even an error): its
        result file is empty and is not published in place of the result."""
        return self.total > 0 and self.completed + self.failed == 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_prompt_tokens: int = 0


class EstimateReport(BaseModel):
    max_tokens: int | None = None
    reasoning_budget: int | None = None
    sample_size: int = 0
    method: str = "set by user"


class Throughput(BaseModel):
    rows_per_s: float = 0.0
    output_tokens_per_s: float = 0.0


class Quote(BaseModel):
    """What a job is expected to take, worked out before it runs (``validate --quote``): exact
    counts where the input says them, expectations with a range where earlier jobs of the work
    folder do, ``None`` where nothing does."""

    rows: int
    model: str
    endpoint: Endpoint
    # Prompt tokens with the model's tokenizer and chat template, as the engine counts them; None
    # when the tokenizer is not on this machine. Media parts are not counted (their tokens are the
    # model processor's): ``rows_not_counted`` says how many rows were left out of the count.
    prompt_tokens: int | None = None
    rows_not_counted: int = 0
    # The sum of every row's cap (n x max_tokens, 1,024 for a row with no cap): no run goes above it.
    output_tokens_cap: int = 0
    output_tokens_expected: int | None = None
    output_tokens_range: tuple[int, int] | None = None
    output_basis: str = ""  # where the expected figure comes from
    sampled_rows: int = 0  # rows generated for this quote (validate --quote-sample), 0: none
    # Rows that need no generation: answered from the work folder's answer store, or copies of an
    # identical deterministic row of the job (reuse_answers).
    rows_from_answer_store: int = 0
    rows_reused_in_job: int = 0
    # Engine seconds to generate the rest, from the output tok/s earlier jobs measured here.
    engine_seconds: float | None = None
    engine_seconds_range: tuple[float, float] | None = None
    time_basis: str = ""
    cost: float | None = None  # at the job's prices: prompt tokens and expected output
    cost_range: tuple[float, float] | None = None
    cost_cap: float | None = None  # at the caps' sum
    max_job_tokens: int = 0  # the job's budget of output tokens (the caps' sum must fit)
    completion_window_s: int | None = None  # a batch's window, when quoted through the Batch API
    fits_window: bool | None = None  # whether the expected engine time (upper end) ends within it
    seconds: float = 0.0  # how long the quote took


class QuoteCheck(BaseModel):
    """A quote beside what the run that followed it did."""

    quoted: Quote
    prompt_tokens: int = 0
    output_tokens: int = 0
    engine_seconds: float = 0.0  # the estimate and generation stages' seconds
    cost: float | None = None


class JobReport(BaseModel):
    """The job report: what happened to the rows, why the job stopped, what it used and cost."""

    job_id: str
    status: JobStatus
    failure_reason: str | None = None
    input: str | None = None
    output: str | None = None
    model: str | None = None
    endpoint: Endpoint | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    error_counts: dict[str, int] = Field(default_factory=dict)
    usage: Usage = Field(default_factory=Usage)
    estimate: EstimateReport = Field(default_factory=EstimateReport)
    timings: dict[str, float] = Field(default_factory=dict)
    throughput: Throughput = Field(default_factory=Throughput)
    # Completion lengths of the rows that completed: p50, p90, p95, p99 and max output tokens.
    output_tokens: dict[str, int] = Field(default_factory=dict)
    # Rows answered with a copy of an identical deterministic row's answer (option reuse_answers).
    reused_answer_rows: int = 0
    # Rows answered with the answer an earlier job of the work folder generated (option answer_store).
    reused_from_earlier_jobs: int = 0
    # Answers of the answer store that could not be read back (damaged or not written by the
    # pipeline): each was removed, and its row generated as without the store.
    unreadable_stored_answers: int = 0
    # Rows whose answer is the one the length-estimation sample already generated.
    reused_sample_rows: int = 0
    # Rows per model they asked for (the base model and each adapter), when the job has adapters.
    rows_by_model: dict[str, int] = Field(default_factory=dict)
    # Generated rows each model server answered (the HTTP engine), or each host whose in-process engine did.
    served_by: dict[str, int] = Field(default_factory=dict)
    # The engine the rows ran on: kind, model, vLLM version, its engine arguments and context.
    engine: dict[str, Any] | None = None
    cost: float | None = None
    # The quote made of this job's input before it ran (validate --quote), beside what happened.
    quote: QuoteCheck | None = None
