"""Every name inside a job's work folder, in one place. The folder looks like this::

    <work root>/<job id>/
        job.json                  the manifest (what the job is, how its rows are sharded)
        input/                    an s3:// input, copied here by the Dagster submit step
        rows.staging              the accepted rows while the submit step reads the input
        shards/<NN>/requests.*    a shard's requests (the name is its format's shard_file)
        shards/<NN>/results.*     a shard's checkpoint of finished rows (its format's checkpoint_file)
        shards/<NN>/media.jsonl   the shard's rows whose media could not be fetched
        shards/<NN>/from_earlier_jobs.txt  the shard's rows answered from the answer store
        shards/<NN>/store_dropped.txt      unreadable stored answers the shard's look-ups removed
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

Beside the jobs' folders the work root holds folders of its own (``WORK_ROOT_FOLDERS``), which
are never a job's: no job may take their names, and ``delete`` and ``prune`` never touch them::

    <work root>/logs/             the engine's and libraries' messages of each command
    <work root>/inputs/           s3:// inputs that ``run`` downloaded
    <work root>/batch-api/        the Batch API's stored files and its batches' inputs and results
    <work root>/answer-store/     answers of deterministic rows kept across jobs
    <work root>/llm-steps/<job id>/  the rendered input and the result of an LLM step's job in a
                                  user's Dagster project, removed with the job
    <work root>/quotes/           the last quote of each job id, for its report
"""

from __future__ import annotations

MANIFEST = "job.json"
INPUT_DIR = "input"
STAGING = "rows.staging"
SHARDS_DIR = "shards"
MEDIA_FAILURES = "media.jsonl"
FROM_EARLIER_JOBS = "from_earlier_jobs.txt"  # a shard's rows answered from the answer store
STORE_DROPPED = "store_dropped.txt"  # unreadable answers the shard found in the answer store
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

LOGS_DIR = "logs"
INPUTS_DIR = "inputs"
BATCH_API_DIR = "batch-api"
ANSWER_STORE_DIR = "answer-store"
STEP_FILES_DIR = "llm-steps"
QUOTES_DIR = "quotes"
WORK_ROOT_FOLDERS = {
    LOGS_DIR: "the commands' log folder",
    INPUTS_DIR: "the folder of downloaded inputs",
    BATCH_API_DIR: "the Batch API's folder",
    ANSWER_STORE_DIR: "the answer store across jobs",
    STEP_FILES_DIR: "the LLM steps' inputs and results",
    QUOTES_DIR: "the folder of quotes",
}
