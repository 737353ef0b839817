"""The YAML form of an LLM step: ``type: anex_pipeline.dagster.LlmBatchComponent`` in a defs.yaml,
and what ``dg scaffold defs`` writes for it."""

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import dagster as dg
from pydantic import BaseModel

from anex_pipeline.dagster.step import llm_batch_asset


class DailyPartitions(dg.Model):
    type: Literal["daily"] = "daily"
    start_date: str
    end_date: str | None = None
    timezone: str | None = None


class StaticPartitions(dg.Model):
    type: Literal["static"] = "static"
    partition_keys: list[str]


class DynamicPartitions(dg.Model):
    type: Literal["dynamic"] = "dynamic"
    name: str


def resolve_partitions(context: dg.ResolutionContext, model) -> dg.PartitionsDefinition | None:
    if model is None:
        return None
    if model.type == "daily":
        return dg.DailyPartitionsDefinition(
            start_date=model.start_date, end_date=model.end_date, timezone=model.timezone
        )
    if model.type == "static":
        return dg.StaticPartitionsDefinition(model.partition_keys)
    return dg.DynamicPartitionsDefinition(name=model.name)


class LlmBatchScaffoldParams(BaseModel):
    source: str | None = None


YAML_TEMPLATE = """\
type: {type_name}
attributes:
  asset: {asset}
  # The upstream asset; its IO manager loads its table (polars, pandas or pyarrow).
  source: {source}
  # Where the source is defined in this defs folder: the step then takes its partitions,
  # partition_expr and columns. Without it, name `partitions:` and `columns:` yourself.
  # source_defs: {source}.py
  # A str.format template: {{column}} takes each row's value; write {{{{ and }}}} for braces.
  prompt: |-
    Review: {{text}}
    Positive, negative or neutral? Answer in JSON.
  output_column: output
  options:
    max_tokens: 40
    temperature: 0
  # The project must provide the engine resource under the key anex_llm (see docs/dagster.md).
  # Fail the step's check when more than this share of rows failed or broke the format.
  max_failed_share: 0.0
"""

PYTHON_TEMPLATE = """\
from anex_pipeline.dagster import llm_batch_asset

{asset} = llm_batch_asset(
    name="{asset}",
    source="{source}",
    prompt="Review: {{text}}\\nPositive, negative or neutral? Answer in JSON.",
    options={{"max_tokens": 40, "temperature": 0}},
    output_column="output",
)
"""


class LlmBatchScaffolder(dg.Scaffolder[LlmBatchScaffoldParams]):
    @classmethod
    def get_scaffold_params(cls) -> type[LlmBatchScaffoldParams]:
        return LlmBatchScaffoldParams

    def scaffold(self, request: dg.ScaffoldRequest[LlmBatchScaffoldParams]) -> None:
        fields = {
            "type_name": request.type_name,
            "asset": request.target_path.name,
            "source": request.params.source or "my_table",
        }
        if request.scaffold_format == "python":
            (request.target_path / "component.py").write_text(PYTHON_TEMPLATE.format(**fields))
        else:
            (request.target_path / "defs.yaml").write_text(YAML_TEMPLATE.format(**fields))


def doc(text: str) -> dg.Resolver:
    return dg.Resolver.default(description=text)


@dg.scaffold_with(LlmBatchScaffolder)
@dataclass
class LlmBatchComponent(dg.Component, dg.Resolvable):
    """An LLM step: the source table in, the same table with an answer column out."""

    asset: Annotated[str, doc("Key of the asset this step makes.")]
    source: Annotated[str, doc("Key of the upstream asset; its IO manager loads the table.")]
    # passthrough: Dagster renders every other string attribute as a Jinja template ({{ ... }}),
    # which would eat a prompt's literal braces.
    prompt: Annotated[str | None, dg.Resolver.passthrough(description="Template; {column} takes each row's value.")] = (
        None
    )
    messages: Annotated[
        list[dict[str, str]] | None,
        dg.Resolver.passthrough(description="Instead of prompt: messages of role and a content template each."),
    ] = None
    document: Annotated[
        str | None, dg.Resolver.passthrough(description="Score steps: the template of the text scored against prompt.")
    ] = None
    documents_column: Annotated[str | None, doc("Rerank steps: the column of each row's list of texts.")] = None
    system_prompt: Annotated[str | None, dg.Resolver.passthrough(description="A system message for every row.")] = None
    # default_factory, not a default: a default would stand as the class attribute `model` and hide
    # Resolvable.model(), the classmethod Dagster builds the YAML schema with.
    model: Annotated[str | None, doc("The model (or a served model's name) the rows run on.")] = field(
        default_factory=lambda: None
    )
    adapter: Annotated[str | None, doc("The LoRA adapter the rows run on (see options.lora_modules).")] = None
    image_column: Annotated[str | None, doc("A column of image URLs or bytes, added to each row's message.")] = None
    options: Annotated[dict[str, Any], doc("Request options: max_tokens, temperature, response_format, ...")] = field(
        default_factory=dict
    )
    output_column: Annotated[str, doc("The answer column the step adds.")] = "output"
    columns: Annotated[list[str] | None, doc("The source's columns, checked when the definitions load.")] = None
    partitions: Annotated[
        dg.PartitionsDefinition | None,
        dg.Resolver(
            resolve_partitions,
            model_field_type=DailyPartitions | StaticPartitions | DynamicPartitions | None,
            description="The source's partitions (the step is partitioned the same way).",
        ),
    ] = None
    source_defs: Annotated[str | None, doc("Path in the defs folder whose definitions hold the source.")] = None
    max_failed_share: Annotated[float, doc("The check fails above this share of failed or badly formatted rows.")] = 0.0
    blocking: Annotated[bool, doc("A failed check stops the assets downstream.")] = False
    metadata: Annotated[
        dict[str, Any], doc("Metadata of the step's asset, e.g. partition_expr for a DB IO manager.")
    ] = field(default_factory=dict)
    group_name: str | None = None
    io_manager_key: str | None = None

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        source: Any = self.source
        if self.source_defs:
            source = context.build_defs(self.source_defs).get_assets_def(self.source)  # its partitions and columns
        step = llm_batch_asset(
            name=self.asset,
            source=source,
            prompt=self.prompt,
            messages=self.messages,
            document=self.document,
            documents_column=self.documents_column,
            options=self.options,
            system_prompt=self.system_prompt,
            model=self.model,
            adapter=self.adapter,
            image_column=self.image_column,
            output_column=self.output_column,
            partitions_def=self.partitions,
            columns=self.columns,
            max_failed_share=self.max_failed_share,
            blocking=self.blocking,
            metadata=self.metadata,
            group_name=self.group_name,
            io_manager_key=self.io_manager_key,
        )
        return dg.Definitions(assets=[step])
