"""Asset jobs, one per step of a batch job, so each can be launched (and rerun) on its own."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import dagster as dg

from anex_pipeline.orchestration.assets import (
    fetched_media,
    generations,
    length_estimate,
    merged_result,
    result_file,
    validated_input,
)
from anex_pipeline.orchestration.names import ESTIMATE_JOB, FINISH_JOB, SHARD_JOB, SUBMIT_JOB

if TYPE_CHECKING:
    from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition


def asset_jobs(submit_hooks: Collection[dg.HookDefinition] = ()) -> list[UnresolvedAssetJobDefinition]:
    """The submit, estimate, shard and finish jobs, in that order; ``submit_hooks`` run after a
    submit run succeeds (a small job's carry-on)."""
    submit_job = dg.define_asset_job(
        SUBMIT_JOB,
        selection=[validated_input],
        description="Step 1: check an input file and split it into shards (set input/output in the config). "
        "A one-shard job then runs its other steps in this run.",
        hooks=set(submit_hooks),
    )
    estimate_job = dg.define_asset_job(
        ESTIMATE_JOB,
        selection=[length_estimate],
        description="Step 2: estimate output lengths when the job leaves max_tokens unset.",
    )
    shard_job = dg.define_asset_job(
        SHARD_JOB,
        selection=[fetched_media, generations],
        description="Step 3, once per shard: fetch media and generate. Backfill failed shards with it.",
    )
    finish_job = dg.define_asset_job(
        FINISH_JOB,
        selection=dg.AssetSelection.assets(merged_result, result_file),
        description="Step 4: merge the shards in input order and publish the result file and report.",
    )
    return [submit_job, estimate_job, shard_job, finish_job]
