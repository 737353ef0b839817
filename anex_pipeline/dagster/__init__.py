"""LLM steps in a user's own Dagster asset graph: a table in, the same table with answer columns out.

- ``LlmBatchComponent``: the YAML form (``type: anex_pipeline.dagster.LlmBatchComponent``).
- ``llm_batch_asset``: the Python form, one asset.
- ``LlmEngineResource``: the engine, which a project provides under ``ENGINE_RESOURCE_KEY``
  (``anex_llm``).

dg lists this module's components through the ``dagster_dg_cli.registry_modules`` entry point, so
it imports nothing heavy (no vLLM, no torch).
"""

from anex_pipeline.dagster.component import LlmBatchComponent
from anex_pipeline.dagster.prompts import StepDefinitionError
from anex_pipeline.dagster.resource import ENGINE_RESOURCE_KEY, LlmEngineResource
from anex_pipeline.dagster.step import FAILED_ROWS_CHECK, llm_batch_asset

__all__ = [
    "ENGINE_RESOURCE_KEY",
    "FAILED_ROWS_CHECK",
    "LlmBatchComponent",
    "LlmEngineResource",
    "StepDefinitionError",
    "llm_batch_asset",
]
