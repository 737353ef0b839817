"""anex-pipeline: offline batch LLM jobs on vLLM, orchestrated as Dagster assets."""
