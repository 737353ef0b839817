"""The Dagster layer: partitions, resources, assets, checks and jobs over the core functions."""
