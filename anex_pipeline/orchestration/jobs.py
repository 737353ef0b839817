"""Asset jobs, one per step of a batch job, so each can be launched (and rerun) on its own."""

from __future__ import annotations

import dagster as dg

from anex_pipeline.orchestration.assets import (
    fetched_media,
    generations,
    length_estimate,
    merged_result,
    result_file,
    validated_input,
)
from anex_pipeline.orchestration.carry_on import carry_on

submit_job = dg.define_asset_job(
    "submit_job",
    selection=[validated_input],
    description="Step 1: check an input file and split it into shards (set input/output in the config). "
    "A one-shard job then runs its other steps in this run.",
    hooks={carry_on},
)
estimate_job = dg.define_asset_job(
    "estimate_job",
    selection=[length_estimate],
    description="Step 2: estimate output lengths when the job leaves max_tokens unset.",
)
shard_job = dg.define_asset_job(
    "shard_job",
    selection=[fetched_media, generations],
    description="Step 3, once per shard: fetch media and generate. Backfill failed shards with it.",
)
finish_job = dg.define_asset_job(
    "finish_job",
    selection=dg.AssetSelection.assets(merged_result, result_file),
    description="Step 4: merge the shards in input order and publish the result file and report.",
)

all_jobs = [submit_job, estimate_job, shard_job, finish_job]
