"""An OpenAI-compatible Batch API in front of the pipeline: ``anex-pipeline serve`` (see README)."""
