"""`python -m anex_pipeline.cli`: the same as the `anex-pipeline` command."""

from anex_pipeline.cli import entry

entry()
