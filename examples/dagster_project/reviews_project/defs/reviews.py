"""The upstream asset: product reviews from a local Parquet file, as a polars DataFrame."""

from pathlib import Path

import dagster as dg
import polars as pl

REVIEWS = Path(__file__).resolve().parents[2] / "reviews.parquet"


@dg.asset(
    metadata={  # the columns, declared: the LLM steps check their prompts against them at load
        "dagster/column_schema": dg.TableSchema(columns=[dg.TableColumn("id", "int"), dg.TableColumn("text", "string")])
    },
)
def reviews() -> pl.DataFrame:
    return pl.read_parquet(REVIEWS)
