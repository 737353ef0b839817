"""The Dagster instance the command line, the Batch API service, the tests and the benches open:
the one of $DAGSTER_HOME, its storage created on first use under a lock on the home."""

from __future__ import annotations

import os
import shutil
from typing import Any

from anex_pipeline import settings
from anex_pipeline.errors import RejectedError
from anex_pipeline.workdir.locks import locked

LOW_SPACE_BYTES = 1 << 20  # a disk with less free space than this is taken as full


# The steps of a command write straight to its terminal. Dagster's default capture of step output
# copies it to the terminal through helper processes (tail and a Python watcher) in the terminal's
# process group: a Ctrl-C would kill them, printing a KeyboardInterrupt traceback and losing every
# line the step writes after it (the notice that the job is stopping included).
TERMINAL_OUTPUT = {
    "compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager", "class": "NoOpComputeLogManager"}
}


# The dagster.yaml written into a new Dagster home: SQLite storage in the home, with the run events
# in one database file. Dagster's default gives each run a database file of its own, created (a
# dozen tables) as the run starts, and writes every event of every run under one lock of the
# process: a Batch API service running several batches at once spent seconds a batch waiting there.
NEW_HOME_SETTINGS = """\
# Written by anex-pipeline for a new Dagster home: SQLite storage in this folder, every run's
# events in one file (event_log.db) rather than one file per run.
telemetry:
  enabled: false
event_log_storage:
  module: dagster._core.storage.event_log
  class: ConsolidatedSqliteEventLogStorage
  config:
    base_dir:
      env: DAGSTER_HOME
"""


def dagster_instance() -> Any:
    """The Dagster instance of $DAGSTER_HOME (default: under the cache folder). Loading it creates
    its SQLite storage on first use; that happens under a lock on the home, because commands
    started together on a new home would otherwise create the same tables twice and can leave
    the storage unusable for good."""
    import sqlite3

    import dagster as dg
    from dagster._core.instance.ref import InstanceRef
    from sqlalchemy.exc import DBAPIError

    from anex_pipeline.paths import dagster_home

    home = dagster_home()
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        home.mkdir(parents=True, exist_ok=True)
        with locked(home / ".instance.lock"):
            home_settings = home / "dagster.yaml"
            if not home_settings.exists():  # without one Dagster prints a warning and a telemetry banner
                home_settings.write_text(NEW_HOME_SETTINGS, encoding="utf-8")
            return dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home), overrides=TERMINAL_OUTPUT))
    except (OSError, sqlite3.Error, DBAPIError) as exc:
        raise RejectedError(
            f"{storage_failure(exc)}; make room there (or make it writable), or set DAGSTER_HOME to another folder"
        ) from None


def storage_failure(exc: Exception) -> str:
    """What went wrong writing the Dagster home (its SQLite storage, say), in a few words."""
    home = settings.DAGSTER_HOME.get()
    cause = getattr(exc, "strerror", None) or getattr(exc, "orig", None) or exc
    try:
        full = "; no space left on its disk" if shutil.disk_usage(home).free < LOW_SPACE_BYTES else ""
    except OSError:  # the home itself could not be made
        full = ""
    return f"cannot write the Dagster run history in {home}: {cause}{full}"
