"""A downstream asset of the user's own: how many reviews got each label, and how many the judge
agreed with."""

import dagster as dg
import polars as pl


@dg.asset(ins={"checked": dg.AssetIn("label_check")})
def label_summary(checked: pl.DataFrame) -> pl.DataFrame:
    agreed = checked["verdict"].str.to_lowercase().str.strip_chars().str.starts_with("yes")
    return (
        checked.with_columns(agreed=agreed)
        .group_by("label")
        .agg(reviews=pl.len(), judge_agreed=pl.col("agreed").sum())
        .sort("label")
    )
