"""One LLM step as a Dagster asset: the source table in (polars, pandas or pyarrow, as the source's
IO manager loads it), the same table out with the answer columns added, every row once, in order."""

# No "from __future__ import annotations" here: Dagster reads the step's parameter annotations.

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import dagster as dg
import polars as pl
import pyarrow as pa

from anex_pipeline.dagster.prompts import Preprocess, StepDefinitionError, StepPrompt
from anex_pipeline.dagster.resource import ENGINE_RESOURCE_KEY, LlmEngineResource
from anex_pipeline.dagster.stages import IMAGE_COLUMN, PROMPT_COLUMN, StepRun, run_step_job
from anex_pipeline.errors import EngineLoadFailed, JobStopped
from anex_pipeline.orchestration.assets import report_metadata
from anex_pipeline.request_fields import SCORING
from anex_pipeline.spec import JobRejected

FAILED_ROWS_CHECK = "llm_failed_rows"
COLUMN_SCHEMA = "dagster/column_schema"
# The columns a step adds besides its output column, as a Parquet job's result has them. With an
# output column of its own name, a step prefixes them with it (``verdict_error_type``), so that a
# step over another step's table keeps both sets.
ROW_COLUMNS = ("error_type", "prompt_tokens", "completion_tokens", "finish_reason")
DEFAULT_OUTPUT = "output"


def row_column(output_column: str, name: str) -> str:
    return name if output_column == DEFAULT_OUTPUT else f"{output_column}_{name}"


SourceRef = str | dg.AssetKey | dg.AssetsDefinition | dg.AssetSpec
Postprocess = Callable[[dict[str, Any], dict[str, Any]], Mapping[str, Any]]


def schema_fields(options: Mapping[str, Any]) -> list[str]:
    """The top-level properties of a json_schema response format: one result column each."""
    fmt = options.get("response_format") or {}
    if fmt.get("type") != "json_schema":
        return []
    return list(((fmt.get("json_schema") or {}).get("schema") or {}).get("properties") or {})


def source_columns(source: Any) -> list[str] | None:
    """The columns an upstream asset declares (``dagster/column_schema``), if it declares them."""
    specs = [source] if isinstance(source, dg.AssetSpec) else list(getattr(source, "specs", []))
    for spec in specs:
        schema = spec.metadata.get(COLUMN_SCHEMA)
        if schema is not None:
            return [c.name for c in getattr(schema, "schema", schema).columns]
    return None


def check_columns(
    asset: str, source: str, needed: Mapping[str, str], added: Sequence[str], have: Sequence[str]
) -> None:
    """Every column the step reads (``needed``: column -> what names it) is in the source, and
    none the step adds is."""
    for column, named_by in needed.items():
        if column not in have:
            raise StepDefinitionError(
                f"LLM step {asset!r}: {named_by} names column {column!r}, which source {source!r} "
                f"does not have (its columns: {', '.join(have)})"
            )
    for column in added:
        if column in have:
            raise StepDefinitionError(
                f"LLM step {asset!r}: source {source!r} already has a column {column!r}, which the step adds; "
                "set output_column to another name or rename the source's column"
            )


def as_arrow(table: Any) -> pa.Table:
    if isinstance(table, pa.Table):
        return table
    if isinstance(table, pl.DataFrame):
        return table.to_arrow()
    if type(table).__module__.split(".")[0] == "pandas":
        return pa.Table.from_pandas(table, preserve_index=False)
    raise TypeError(f"an LLM step takes a pyarrow Table or a polars or pandas DataFrame, not {type(table).__name__}")


def with_columns(table: Any, added: pa.Table) -> Any:
    """The source table, of its own kind, with ``added``'s columns after its own."""
    if isinstance(table, pa.Table):
        for name in added.column_names:
            table = table.append_column(name, added.column(name))
        return table
    if isinstance(table, pl.DataFrame):
        return pl.concat([table, pl.from_arrow(added)], how="horizontal")
    out = table.copy()  # pandas
    for name in added.column_names:
        out[name] = added.column(name).to_pandas().to_numpy()
    return out


def answer_columns(run: StepRun, output_column: str, fields: Sequence[str]) -> pa.Table:
    """The columns a step adds, from its job's Parquet result (which keeps the input's order)."""
    result = run.result
    answer = "embedding" if "embedding" in result.column_names else "output"  # an embeddings job's vectors
    columns = {output_column: result.column(answer)}
    for name in ROW_COLUMNS:
        if name in result.column_names:  # an embedding has its prompt's tokens only
            columns[row_column(output_column, name)] = result.column(name)
    if fields:
        parsed = [
            _parsed(text, error)
            for text, error in zip(
                result.column("output").to_pylist(), result.column("error_type").to_pylist(), strict=True
            )
        ]
        for name in fields:
            values = [p.get(name) if p else None for p in parsed]
            try:
                columns[name] = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed kinds across rows: kept as JSON text
                columns[name] = pa.array([None if v is None else json.dumps(v) for v in values], pa.string())
    return pa.table(columns)


def _parsed(text: str | None, error: str | None) -> dict[str, Any] | None:
    if text is None or error is not None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _shard_table(run: StepRun) -> str:
    lines = ["| shard | rows | completed | failed | format errors | generated now |", "|---|---|---|---|---|---|"]
    for s in run.shards:
        lines.append(f"| {s.shard} | {s.rows} | {s.completed} | {s.failed} | {s.format_errors} | {s.generated} |")
    return "\n".join(lines)


def _metadata(run: StepRun, out: pa.Table) -> dict[str, Any]:
    """The figures a job's ``generations`` asset shows (from its report), and the step's own."""
    return {
        "dagster/row_count": run.report.request_counts.total,
        COLUMN_SCHEMA: dg.TableSchema(columns=[dg.TableColumn(f.name, str(f.type)) for f in out.schema]),
        **report_metadata(run.report, run.job.result_path),
        "generated_now": sum(s.generated for s in run.shards),
        "kept_from_earlier_runs": sum(s.kept_from_earlier_runs for s in run.shards),
        "resumed": run.resumed,
        "job_id": run.job.job_id,
        "work_folder": dg.MetadataValue.path(str(run.job.root)),
        "shards": dg.MetadataValue.md(_shard_table(run)),
    }


def _source_partitioned(context: dg.AssetExecutionContext) -> bool:
    try:
        return context.asset_partitions_def_for_input("table") is not None
    except dg.DagsterInvariantViolationError:  # Dagster's answer for a source with no partitions
        return False


def step_options(name: str, options: Mapping[str, Any] | None, **named: Any) -> dict[str, Any]:
    """The step's job options: ``options`` with the named ones given as arguments (system_prompt,
    model, adapter) added; the same option given both ways with two values is refused."""
    merged = dict(options or {})
    for option, value in named.items():
        if value is None:
            continue
        if merged.get(option, value) != value:
            raise StepDefinitionError(
                f"LLM step {name!r}: {option} is given twice, as {value!r} and in options as "
                f"{merged[option]!r}; keep one"
            )
        merged[option] = value
    return merged


def postprocessed(
    name: str, postprocess: Postprocess, source: pa.Table, answers: pa.Table, taken: Sequence[str]
) -> pa.Table:
    """The columns ``postprocess`` makes of each row and its answer columns, in row order."""
    made: list[Mapping[str, Any]] = []
    for n, (row, answer) in enumerate(zip(source.to_pylist(), answers.to_pylist(), strict=True)):
        try:
            value = postprocess(row, answer)
        except Exception as exc:  # the user's function: its failure is one line naming the row
            raise StepDefinitionError(
                f"LLM step {name!r}: postprocess failed on row {n}: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(value, Mapping):
            raise StepDefinitionError(
                f"LLM step {name!r}: postprocess gave row {n} a {type(value).__name__}; it must give a dict of "
                "column name to value"
            )
        made.append(value)
    names = list(dict.fromkeys(key for value in made for key in value))
    for column in names:
        if column in taken:
            raise StepDefinitionError(
                f"LLM step {name!r}: postprocess makes column {column!r}, which the table already has; "
                "give it another name"
            )
    try:
        return pa.table({column: [value.get(column) for value in made] for column in names})
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise StepDefinitionError(
            f"LLM step {name!r}: postprocess gave values of different kinds in one column ({exc})"
        ) from None


def llm_batch_asset(
    *,
    name: str,
    source: SourceRef,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    preprocess: Preprocess | None = None,
    postprocess: Postprocess | None = None,
    document: str | None = None,
    documents_column: str | None = None,
    options: Mapping[str, Any] | None = None,
    system_prompt: str | None = None,
    model: str | None = None,
    adapter: str | None = None,
    image_column: str | None = None,
    output_column: str = DEFAULT_OUTPUT,
    partitions_def: dg.PartitionsDefinition | None = None,
    columns: Sequence[str] | None = None,
    max_failed_share: float = 0.0,
    blocking: bool = False,
    key_prefix: Sequence[str] | None = None,
    group_name: str | None = None,
    io_manager_key: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dg.AssetsDefinition:
    """An LLM step as one asset: every row of ``source``'s table is sent, under ``options`` (job
    options and generation fields), as one of:

    - ``prompt``: a str.format template over the row's columns (``{text}``);
    - ``messages``: a list of ``{"role", "content"}`` whose contents are such templates;
    - ``preprocess``: a function of the row (a dict of its columns) giving a prompt string or a
      list of messages.

    ``system_prompt``, ``model`` and ``adapter`` are the job options of those names;
    ``image_column`` names a column of image URLs or bytes, added to each row's last message.
    ``postprocess(row, answer)``, given the row and a dict of the columns the step adds for it,
    returns a dict of more columns, added after them.

    With ``endpoint`` ``score`` in ``options``, ``prompt`` is the query's template and ``document``
    the template of the text scored against it: the output column holds the score. With
    ``rerank``, ``documents_column`` names a column holding each row's list of texts: the output
    column holds their relevance scores, in the documents' order.

    ``source`` given as the asset object itself gives the step its partitions, ``partition_expr``
    and (from ``dagster/column_schema``) its columns, which are then checked here, at definition
    load; a source given by key is checked when the step first runs, before any engine loads
    (``columns=`` declares them ahead). The step's check ``llm_failed_rows`` fails when more than
    ``max_failed_share`` of the rows failed or broke the answer format; ``blocking`` stops the
    assets downstream of it then."""
    options = step_options(name, options, system_prompt=system_prompt, model=model, adapter=adapter)
    asks = StepPrompt.of(name, prompt, messages, preprocess, options.get("endpoint"), document, documents_column)
    if image_column is not None:
        if asks.endpoint in SCORING:
            raise StepDefinitionError(f"LLM step {name!r}: a {asks.endpoint} step scores texts; remove image_column")
        options["image_column"] = IMAGE_COLUMN
    inherited: dict[str, Any] = {}
    have = list(columns) if columns is not None else None
    if isinstance(source, (dg.AssetsDefinition, dg.AssetSpec)):
        source_key = source.key
        if partitions_def is None:
            partitions_def = source.partitions_def
        if have is None:
            have = source_columns(source)
        specs = [source] if isinstance(source, dg.AssetSpec) else list(source.specs)
        if "partition_expr" in specs[0].metadata:  # DB IO managers read it; the step keeps the source's columns
            inherited["partition_expr"] = specs[0].metadata["partition_expr"]
    else:
        source_key = dg.AssetKey.from_user_string(source) if isinstance(source, str) else source
    source_name = source_key.to_user_string()
    named_by = "a message" if messages is not None else "the prompt" if document is None else "the prompt or document"
    needed = {column: named_by for column in asks.columns() or []}
    if image_column is not None:
        needed.setdefault(image_column, "image_column")
    if documents_column is not None:
        needed[documents_column] = "documents_column"
    fields = schema_fields(options)
    added = [output_column, *(row_column(output_column, c) for c in ROW_COLUMNS), *fields]
    if have is not None:
        check_columns(name, source_name, needed, added, have)
    key = dg.AssetKey([*(key_prefix or []), name])
    described = asks.describe()

    @dg.asset(
        key=key,
        ins={"table": dg.AssetIn(key=source_key)},
        partitions_def=partitions_def,
        group_name=group_name,
        io_manager_key=io_manager_key,
        kinds={"llm"},
        description=f"LLM step over {source_name}: {described[:200]}",
        check_specs=[
            dg.AssetCheckSpec(
                FAILED_ROWS_CHECK,
                asset=key,
                blocking=blocking,
                description=f"At most {max_failed_share:.0%} of the rows failed or broke the answer format.",
            )
        ],
        metadata={**inherited, **(metadata or {}), "anex/prompt": described, "anex/source": source_name},
    )
    def _step(context: dg.AssetExecutionContext, table, anex_llm: LlmEngineResource):
        if partitions_def is None and _source_partitioned(context):
            raise dg.Failure(  # Dagster would load every partition of the source into one job, silently
                description=f"LLM step {name!r} is not partitioned but its source {source_name!r} is: pass the "
                "source itself (Python), source_defs (YAML), or partitions like the source's",
                allow_retries=False,
            )
        if isinstance(table, pl.LazyFrame):  # dagster-deltalake-polars loads a LazyFrame by default
            table = table.collect()
        arrow = as_arrow(table)
        partition = context.partition_key if context.has_partition_key else None
        try:  # a source known only by key: checked now, before any engine loads
            check_columns(name, source_name, needed, added, arrow.column_names)
            if arrow.num_rows == 0:
                raise StepDefinitionError(
                    f"LLM step {name!r}: source {source_name!r} gave 0 rows"
                    + (f" for partition {partition}" if partition else "")
                )
            if asks.endpoint in SCORING:
                job_input: pa.Table | list[dict[str, Any]] = asks.scoring_bodies(arrow)
            else:
                columns = {PROMPT_COLUMN: asks.render(arrow)}
                if image_column is not None:
                    columns[IMAGE_COLUMN] = arrow.column(image_column)
                job_input = pa.table(columns)
        except StepDefinitionError as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        try:
            run = run_step_job(list(key.path), partition, job_input, options, anex_llm, anex_llm.step_work_root())
        except JobRejected as exc:  # the rows, options or model refused before any engine loads
            raise dg.Failure(description=f"LLM step {name!r}: {exc.render()}", allow_retries=False) from None
        except (JobStopped, EngineLoadFailed) as exc:  # materializing again resumes from the checkpoints
            raise dg.Failure(description=f"LLM step {name!r} stopped: {exc}", allow_retries=False) from None
        added_columns = answer_columns(run, output_column, fields)
        if postprocess is not None:
            try:
                more = postprocessed(name, postprocess, arrow, added_columns, [*arrow.column_names, *added])
            except StepDefinitionError as exc:
                raise dg.Failure(description=str(exc), allow_retries=False) from None
            for column in more.column_names:
                added_columns = added_columns.append_column(column, more.column(column))
        out = with_columns(table, added_columns)
        counts = run.report.request_counts
        bad = counts.failed + counts.format_error_rows
        share = bad / counts.total if counts.total else 0.0
        context.log.info(
            f"{counts.completed} of {counts.total} rows completed, {counts.failed} failed, "
            f"{counts.format_error_rows} format errors; job {run.job.job_id}"
        )
        return dg.MaterializeResult(
            value=out,
            metadata=_metadata(run, with_columns(arrow, added_columns)),
            check_results=[
                dg.AssetCheckResult(
                    check_name=FAILED_ROWS_CHECK,
                    passed=share <= max_failed_share,
                    severity=dg.AssetCheckSeverity.ERROR,
                    metadata={
                        "failed": counts.failed,
                        "format_error_rows": counts.format_error_rows,
                        "bad_share": share,
                        "max_failed_share": max_failed_share,
                    },
                )
            ],
        )

    assert ENGINE_RESOURCE_KEY == "anex_llm"  # the parameter name above is the resource key
    return _step
