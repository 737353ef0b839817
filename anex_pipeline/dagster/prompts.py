"""What an LLM step sends for each row of its source: a prompt template, a list of templated
messages, or the caller's own ``preprocess`` function; the columns each of them reads, checked
before any engine loads; and each row's rendered prompt, as the one column of the step's job."""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from anex_pipeline.errors import AnexError, ExitCode
from anex_pipeline.request_fields import SCORING

ROLES = ("system", "user", "assistant")
Preprocess = Callable[[dict[str, Any]], Any]


class StepDefinitionError(AnexError, ValueError):
    """A step that cannot be built: one line naming the asset and what to change."""

    exit_code = ExitCode.REJECTED


def template_columns(asset: str, template: str, where: str = "the prompt") -> list[str]:
    """The columns a str.format template names, in order ({{ and }} are literal braces)."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise StepDefinitionError(
            f"LLM step {asset!r}: {where} is not a template ({exc}); write {{{{ and }}}} for braces"
        ) from None
    for _, name, _, _ in parsed:
        if name is None:
            continue
        base = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not base or base.isdigit():
            raise StepDefinitionError(f"LLM step {asset!r}: field {{{name}}} of {where} must name a column")
        if base not in names:
            names.append(base)
    return names


@dataclass(frozen=True)
class StepPrompt:
    """How a step turns a source row into what its job sends: exactly one of ``prompt`` (a
    template), ``messages`` (role and templated content each) and ``preprocess`` (a function of
    the row, as a dict of its columns, giving a prompt string or a list of messages)."""

    asset: str
    prompt: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    preprocess: Preprocess | None = None
    # score and rerank rows pair texts: ``prompt`` is the query, ``document`` (score) the template
    # of the one text paired with it, ``documents_column`` (rerank) a column of a list of texts
    endpoint: str | None = None
    document: str | None = None
    documents_column: str | None = None

    @classmethod
    def of(
        cls,
        asset: str,
        prompt: str | None,
        messages: Sequence[Mapping[str, str]] | None,
        preprocess: Preprocess | None,
        endpoint: str | None = None,
        document: str | None = None,
        documents_column: str | None = None,
    ) -> StepPrompt:
        if endpoint in SCORING:
            return cls._scoring(asset, prompt, messages, preprocess, endpoint, document, documents_column)
        if document is not None or documents_column is not None:
            raise StepDefinitionError(
                f"LLM step {asset!r}: document and documents_column are for score and rerank steps; "
                "set options.endpoint to score or rerank, or remove them"
            )
        given = [
            name for name, value in (("prompt", prompt), ("messages", messages), ("preprocess", preprocess)) if value
        ]
        if len(given) != 1:
            raise StepDefinitionError(
                f"LLM step {asset!r}: give exactly one of prompt, messages and preprocess"
                + (f" (it has {' and '.join(given)})" if given else "")
            )
        if messages is not None:
            for n, message in enumerate(messages):
                if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
                    raise StepDefinitionError(
                        f"LLM step {asset!r}: messages[{n}] must have exactly a role and a content"
                    )
                if message["role"] not in ROLES or not isinstance(message["content"], str):
                    raise StepDefinitionError(
                        f"LLM step {asset!r}: messages[{n}] needs a role of {', '.join(ROLES)} and a text content"
                    )
            messages = tuple(dict(m) for m in messages)
        return cls(asset, prompt, messages, preprocess, endpoint)

    @classmethod
    def _scoring(
        cls,
        asset: str,
        prompt: str | None,
        messages: Any,
        preprocess: Any,
        endpoint: str,
        document: str | None,
        documents_column: str | None,
    ) -> StepPrompt:
        other = "document" if endpoint == "score" else "documents_column"
        if not prompt or messages or preprocess or (document if endpoint == "score" else documents_column) is None:
            raise StepDefinitionError(
                f"LLM step {asset!r}: a {endpoint} step pairs texts: give prompt (the query's template) and "
                f"{other}"
                + (
                    " (the template of the text scored against it)"
                    if endpoint == "score"
                    else " (a column holding each row's list of texts)"
                )
                + ", and no messages or preprocess"
            )
        if (document if endpoint == "rerank" else documents_column) is not None:
            raise StepDefinitionError(
                f"LLM step {asset!r}: a {endpoint} step takes {other}, not "
                + ("document" if endpoint == "rerank" else "documents_column")
            )
        return cls(asset, prompt, None, None, endpoint, document, documents_column)

    def columns(self) -> list[str] | None:
        """The source columns the templates read; None for a preprocess function (any of them)."""
        if self.document is not None:
            found = template_columns(self.asset, self.prompt or "")
            return found + [c for c in template_columns(self.asset, self.document, "document") if c not in found]
        if self.documents_column is not None:
            found = template_columns(self.asset, self.prompt or "")
            return found + ([] if self.documents_column in found else [self.documents_column])
        if self.prompt is not None:
            return template_columns(self.asset, self.prompt)
        if self.messages is not None:
            found: list[str] = []
            for n, message in enumerate(self.messages):
                for name in template_columns(self.asset, message["content"], f"messages[{n}]"):
                    if name not in found:
                        found.append(name)
            return found
        return None

    def describe(self) -> str:
        if self.document is not None:
            return f"score {self.prompt} against {self.document}"
        if self.documents_column is not None:
            return f"rerank {self.documents_column} for {self.prompt}"
        if self.prompt is not None:
            return self.prompt
        if self.messages is not None:
            return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages)
        return f"preprocess {getattr(self.preprocess, '__qualname__', self.preprocess)!r}"

    def render(self, table: pa.Table) -> pa.Array:
        """Each row's prompt (text) or messages (a list of role and content), in the table's order."""
        if self.preprocess is not None:
            return self._preprocessed(table)
        needed = self.columns() or []
        values = {c: table.column(c).to_pylist() for c in needed}
        rows = ({c: values[c][i] for c in needed} for i in range(table.num_rows))
        if self.prompt is not None:
            return pa.array([self.prompt.format(**row) for row in rows], pa.string())
        messages = self.messages or ()
        return pa.array([[{**m, "content": m["content"].format(**row)} for m in messages] for row in rows])

    def scoring_bodies(self, table: pa.Table) -> list[dict[str, Any]]:
        """Each row's score (``text_1``, ``text_2``) or rerank (``query``, ``documents``) request."""
        rows = table.select(self.columns() or []).to_pylist()
        query = self.prompt or ""
        if self.document is not None:
            return [{"text_1": query.format(**row), "text_2": self.document.format(**row)} for row in rows]
        column = self.documents_column or ""
        return [{"query": query.format(**row), "documents": row[column]} for row in rows]

    def _preprocessed(self, table: pa.Table) -> pa.Array:
        made: list[Any] = []
        for n, row in enumerate(table.to_pylist()):
            try:
                value = self.preprocess(row)  # type: ignore[misc]
            except Exception as exc:  # the user's function: its failure is one line naming the row
                raise StepDefinitionError(
                    f"LLM step {self.asset!r}: preprocess failed on row {n}: {type(exc).__name__}: {exc}"
                ) from None
            made.append(_as_messages(self.asset, n, value))
        if all(isinstance(v, str) for v in made):
            return pa.array(made, pa.string())
        return pa.array([[{"role": "user", "content": v}] if isinstance(v, str) else v for v in made])


def _as_messages(asset: str, row: int, value: Any) -> str | list[dict[str, str]]:
    """A preprocess function's value for one row: a prompt, or messages of role and text content."""
    if isinstance(value, Mapping) and set(value) <= {"prompt", "messages"} and len(value) == 1:
        value = next(iter(value.values()))  # the request body's own spelling: {"messages": [...]}
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise StepDefinitionError(
        f"LLM step {asset!r}: preprocess gave row {row} {type(value).__name__} {str(value)[:80]!r}; it must give "
        "a non-empty prompt string, or a list of messages with a role and a text content each "
        "(generation fields go in the step's options)"
    )


def _is_message(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and set(value) == {"role", "content"}
        and value["role"] in ROLES
        and isinstance(value["content"], str)
    )
