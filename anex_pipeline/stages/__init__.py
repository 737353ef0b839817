"""The steps of a job, each a plain function the Dagster assets and the CLI call. In the order a
job runs them (the asset of each in brackets):

1. ``submit.py`` (``validated_input``): ``prepare_job`` checks every row, the model and the
   destinations, then writes the job's shards and manifest (cut by ``submit_shard_plan.py``).
2. ``fetch_media.py`` (``fetched_media``, per shard): ``fetch_shard`` downloads the media the
   rows reference by URL into the media cache.
3. ``estimate.py`` (``length_estimate``): ``estimate_lengths`` sets ``max_tokens`` from a
   generated sample when the job does not (the bound is ``estimate_length_bound.py``'s).
4. ``generate.py`` (``generations``, per shard): ``run_shard`` generates the shard's missing
   and failed rows into its checkpoint (identical deterministic rows once, ``generate_answer_book.py``;
   rows an earlier job answered from ``generate_answer_store.py``).
5. ``merge.py`` (``merged_result``): ``merge_job`` joins the checkpoints in input order and
   writes the report (``report.py``); ``merge_row_account.py`` checks every row is there once.
6. ``publish.py`` (``result_file``): ``publish_job`` copies the result and the report to the
   job's output locations.
"""
