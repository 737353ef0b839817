"""The Batch API's records: the File and Batch objects and the store that keeps them in the Dagster
instance. The service, job admin (delete, prune) and the command line read them from here."""
