"""The steps of a job, each a plain function the Dagster assets and the CLI call."""
