"""A small Dagster project of LLM steps, as a user would write it: a ``reviews`` table, a YAML step
that labels each review with a JSON schema, and a Python step that judges the label. Also loaded
by ``dagster asset materialize -f`` in tests that kill the step's process: it then registers an
engine kind that notes every row it generates in a file, slowly (``ANEX_TEST_CALLS_FILE``,
``ANEX_FAKE_ROW_DELAY_S``)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
import polars as pl
import pyarrow as pa

from anex_pipeline.dagster import LlmBatchComponent, LlmEngineResource, llm_batch_asset
from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine

LABELS_YAML = """\
asset: review_labels
source: reviews
prompt: "Review: {text}\\nPositive, negative or neutral? Answer in JSON like {\\"label\\": \\"positive\\"}."
options:
  max_tokens: 40
  checkpoint_rows: 16
  temperature: 0
  response_format:
    type: json_schema
    json_schema:
      name: label
      schema:
        type: object
        properties:
          label: {type: string, enum: [positive, negative, neutral]}
        required: [label]
"""
# The prompt above holds literal braces: a str.format template would need them doubled.
LABELS_YAML = LABELS_YAML.replace('like {\\"label\\": \\"positive\\"}', 'like {{\\"label\\": \\"positive\\"}}')


def review_texts(n: int) -> list[str]:
    kinds = ("I loved it, works great", "Broke after a day, awful", "It is a box. It holds things")
    return [f"{kinds[i % 3]} (#{i})" for i in range(n)]


def reviews_asset(n: int = 6, kind: str = "polars", **asset_args: Any) -> dg.AssetsDefinition:
    """The source: ``n`` reviews as a polars or pandas DataFrame or a pyarrow Table."""
    columns = {"id": list(range(n)), "text": review_texts(n)}

    @dg.asset(name="reviews", **asset_args)
    def reviews() -> Any:
        if kind == "pandas":
            return pd.DataFrame(columns)
        if kind == "pyarrow":
            return pa.table(columns)
        return pl.DataFrame(columns)

    return reviews


def labels_step() -> Sequence[dg.AssetsDefinition]:
    """The YAML step, loaded from its defs.yaml attributes."""
    component = LlmBatchComponent.resolve_from_yaml(LABELS_YAML)
    return list(dg.build_defs_for_component(component).assets or [])


def judge_step(**more: Any) -> dg.AssetsDefinition:
    """The Python step over the YAML step's table."""
    return llm_batch_asset(
        name="label_check",
        source="review_labels",
        prompt="Text: {text}\nSomeone labelled it {label}. Right? yes or no.",
        options={"max_tokens": 8, "temperature": 0},
        output_column="verdict",
        **more,
    )


class CountingFakeEngine(FakeEngine):
    """The fake engine, slowed down, writing each row it generates to a file (one line each)."""

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        time.sleep(float(os.environ.get("ANEX_FAKE_ROW_DELAY_S", "0")) * len(requests))
        with Path(os.environ["ANEX_TEST_CALLS_FILE"]).open("a") as calls:
            calls.writelines(f"{r.key}\n" for r in requests)
        return super().run(requests)


COUNTING_FAKE = "counting-fake"
register_engine(COUNTING_FAKE, lambda config, manifest: CountingFakeEngine(manifest.model_name))


def daily_reviews() -> dg.AssetsDefinition:
    """A daily-partitioned source: two reviews per day, each naming its day."""

    @dg.asset(
        name="reviews", partitions_def=dg.DailyPartitionsDefinition(start_date="2026-01-01", end_date="2026-01-03")
    )
    def reviews(context) -> pl.DataFrame:  # unannotated: this module defers annotations, Dagster reads them
        day = context.partition_key
        return pl.DataFrame({"day": [day, day], "text": [f"{day}: loved it", f"{day}: broke at once"]})

    return reviews


def _assets_of_the_test() -> list[dg.AssetsDefinition]:
    if os.environ.get("ANEX_TEST_DAILY"):
        source = daily_reviews()
        return [
            source,
            llm_batch_asset(name="review_labels", source=source, prompt="{text}", options={"max_tokens": 20}),
        ]
    return [reviews_asset(int(os.environ.get("ANEX_TEST_ROWS", "6"))), *labels_step()]


if "ANEX_TEST_CALLS_FILE" in os.environ:  # loaded by `dagster asset materialize -f` in a test
    defs = dg.Definitions(
        assets=_assets_of_the_test(),
        resources={
            "anex_llm": LlmEngineResource(
                kind=COUNTING_FAKE, work_root=os.environ["ANEX_TEST_STEP_WORK"], machine_server=False
            )
        },
    )
