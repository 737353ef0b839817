"""Every name inside a job's work folder, in one place. The folder looks like this::

    <work root>/<job id>/
        job.json                  the manifest (what the job is, how its rows are sharded)
        input/                    an s3:// input, copied here by the Dagster submit step
        rows.staging              the accepted rows while the submit step reads the input
        shards/<NN>/requests.*    a shard's requests (the name is its format's SHARD_FILE)
        shards/<NN>/results.*     a shard's checkpoint of finished rows (see CHECKPOINT_FILES)
        shards/<NN>/media.jsonl   the shard's rows whose media could not be fetched
        estimate.json             the output-length estimate
        estimate_sample.jsonl     the rows generated for the estimate
        answers/                  the answer book (one answer for identical deterministic rows)
        deadline.json             when the job's time limit runs out
        stop.json                 why the job was asked to stop
        timings.json              seconds per stage
        result.<format>           the merged result, before it is published
        report.json               the report, before it is published
        cli.lock                  held by an ``anex-pipeline`` process while it drives the job

Modules reach these paths through :class:`~anex_pipeline.workdir.manifest.JobDir`.
"""

from __future__ import annotations

MANIFEST = "job.json"
INPUT_DIR = "input"
STAGING = "rows.staging"
SHARDS_DIR = "shards"
CHECKPOINT_FILES = {"jsonl": "results.jsonl", "parquet": "results.arrow"}  # by the job's format
MEDIA_FAILURES = "media.jsonl"
ESTIMATE = "estimate.json"
ESTIMATE_SAMPLE = "estimate_sample.jsonl"
ANSWERS_DIR = "answers"
DEADLINE = "deadline.json"
STOP = "stop.json"
TIMINGS = "timings.json"
SERVED_BY = "served_by.json"  # rows each model server answered
ENGINE = "engine.json"  # the engine the job last ran on, for the report
RESULT_STEM = "result"
REPORT = "report.json"
LEASE = "cli.lock"
