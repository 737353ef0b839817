"""The resources the steps need: the engine under its key (anex_llm), and an IO manager that keeps
every table in a local DuckDB file."""

import dagster as dg
from dagster_duckdb_polars import DuckDBPolarsIOManager

from anex_pipeline.dagster import ENGINE_RESOURCE_KEY, LlmEngineResource


@dg.definitions
def resources() -> dg.Definitions:
    return dg.Definitions(
        resources={
            # No field set: the embedded default model, as `anex-pipeline run` uses it.
            ENGINE_RESOURCE_KEY: LlmEngineResource(),
            "io_manager": DuckDBPolarsIOManager(database=dg.EnvVar("REVIEWS_DUCKDB").get_value("reviews.duckdb")),
        }
    )
