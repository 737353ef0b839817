"""A job's work folder: where each file lives, the manifest, the CLI lease."""
