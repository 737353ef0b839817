"""Every environment variable the package reads, with its default and what it does.

Each is read when asked (:meth:`Setting.get`), never when a module is imported, so a process that
sets a variable after importing the package (a test, ``dagster dev`` loading the code location)
gets the value it set. The engine's own variables (``ANEX_ENGINE``, ``ANEX_ENGINE_ARGS``,
``ANEX_CPU_PRELOAD``, ``HF_HUB_OFFLINE`` and vLLM's)
are read in ``engine/``, which owns them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, the value taken when it is unset, and what it sets."""

    name: str
    default: str
    doc: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def get_int(self) -> int:
        return int(self.get())

    def is_set(self) -> bool:
        return self.name in os.environ


CACHE_DIR = Setting(
    "ANEX_CACHE_DIR", "", "The folder of the pipeline's own files (models, media, work); empty: ~/.cache/anex-pipeline."
)
MACHINE_SERVER_DIR = Setting(
    "ANEX_MACHINE_SERVER_DIR", "", "The shared model server's state folder; empty: machine-server in the cache folder."
)
DAGSTER_HOME = Setting("DAGSTER_HOME", "", "The Dagster instance's folder; empty: dagster_home under the cache folder.")
WORK_DIR = Setting("ANEX_WORK_DIR", "", "The work root of every job's folder; empty: work under the cache folder.")
MEDIA_CACHE_DIR = Setting("ANEX_MEDIA_CACHE_DIR", "", "Where downloaded media are kept; empty: media under the cache.")
EXECUTOR = Setting(
    "ANEX_EXECUTOR", "", "A Dagster run's steps: empty (in the run's process), multiprocess, k8s or ray."
)
MACHINE_SERVER = Setting(
    "ANEX_MACHINE_SERVER",
    "",
    "0 turns off the model server shared by a machine's step processes; empty: on, but k8s, ray.",
)
RAY_ADDRESS = Setting(
    "ANEX_RAY_ADDRESS", "", "The Ray dashboard (http://head:8265) that ANEX_EXECUTOR=ray sends steps to."
)
RAY_HEALTH_CHECK_S = Setting(
    "ANEX_RAY_HEALTH_CHECK_S", "5", "Seconds between two checks on a step's Ray job (ray executor)."
)
ENGINE_BASE_URL = Setting("ANEX_ENGINE_BASE_URL", "", "An OpenAI-compatible server to generate on instead of vLLM.")
API_KEY = Setting("ANEX_API_KEY", "", "The API key the HTTP engine sends to its server.")
CARRY_ON_SHARDS = Setting(
    "ANEX_CARRY_ON_SHARDS",
    "1",
    "A job of at most this many shards runs its later steps in its submit run's process; 0: job_driver starts each.",
)
DRIVER_INTERVAL_S = Setting("ANEX_DRIVER_INTERVAL_S", "5", "Seconds between two ticks of the job_driver sensor.")
RETRY_LIMIT = Setting("ANEX_RETRY_LIMIT", "3", "Reruns of one shard by the retry_failed_rows schedule, per submission.")
RETRY_CRON = Setting("ANEX_RETRY_CRON", "0 * * * *", "When the retry_failed_rows schedule runs.")
RETENTION_MAX_AGE = Setting("ANEX_RETENTION_MAX_AGE", "30d", "Jobs idle longer than this are pruned by the schedule.")
RETENTION_CRON = Setting("ANEX_RETENTION_CRON", "30 3 * * *", "When the prune_old_jobs schedule runs.")
INBOX_OPTIONS = Setting("ANEX_INBOX_OPTIONS", "{}", "Default job options (a JSON object) of the inbox sensors' jobs.")
S3_BUCKET = Setting("ANEX_S3_BUCKET", "", "The bucket the s3_inbox sensor watches.")
S3_PREFIX = Setting("ANEX_S3_PREFIX", "", "The key prefix of the s3_inbox sensor's inputs; empty: the whole bucket.")
S3_OUTPUT_PREFIX = Setting("ANEX_S3_OUTPUT_PREFIX", "results/", "Where the s3_inbox sensor's results go in the bucket.")
INBOX_DIR = Setting("ANEX_INBOX_DIR", "", "The local_inbox sensor's folder; empty: inbox beside the work root.")
OUTBOX_DIR = Setting("ANEX_OUTBOX_DIR", "", "The local_inbox sensor's results; empty: outbox beside the work root.")
BATCH_API_KEYS = Setting("ANEX_BATCH_API_KEYS", "", "The Batch API's keys, comma-separated, without --keys-file.")
BATCH_LEASE_S = Setting(
    "ANEX_BATCH_LEASE_S",
    "30",
    "Seconds a serve replica holds a batch without renewing; after that another replica takes it over.",
)
WEBHOOK_URL = Setting("ANEX_WEBHOOK_URL", "", "Where serve posts batch events, when it has no --webhook-url.")
WEBHOOK_SECRET = Setting("ANEX_WEBHOOK_SECRET", "", "The secret that signs them, when serve has no --webhook-secret.")


def pipeline_environment() -> dict[str, str]:
    """Every ``ANEX_*`` variable of this process: what a step started elsewhere (a Ray job) is
    given of its run's settings."""
    return {name: value for name, value in os.environ.items() if name.startswith("ANEX_")}
