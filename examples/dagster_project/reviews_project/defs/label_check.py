"""A judge step over the labels: the Python form of an LLM step."""

from anex_pipeline.dagster import llm_batch_asset

label_check = llm_batch_asset(
    name="label_check",
    source="review_labels",
    prompt="Text: {text}\nSomeone labelled it {label}. Right? Answer yes or no.",
    options={"max_tokens": 8, "temperature": 0},
    output_column="verdict",
)
