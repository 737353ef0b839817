"""The model server the Dagster step processes of one machine share, and its supervisor."""
