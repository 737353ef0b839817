"""Who drives a job: an ``anex-pipeline`` process holds the job's lease while it runs the job's
steps, and the Dagster driver leaves such a job alone."""

from __future__ import annotations

import fcntl
import logging
import time
from typing import IO

from anex_pipeline.workdir.manifest import JobDir

progress_log = logging.getLogger("anex_pipeline.progress")


def _lock(lease: IO[bytes], mode: int) -> bool:
    try:
        fcntl.flock(lease, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def take_lease(job: JobDir) -> IO[bytes]:
    """Marks the job as driven by this process until the returned file is closed.

    The mark is a kernel lock on ``<job>/cli.lock``: it goes away with the process however the
    process ends, so a crashed command never leaves the job blocked. A second process driving the
    same job waits here for the first.
    """
    job.root.mkdir(parents=True, exist_ok=True)
    lease = job.lease_path.open("ab")
    if not _lock(lease, fcntl.LOCK_EX):
        time.sleep(0.2)  # job_driver only looks at the lock for a moment
        if not _lock(lease, fcntl.LOCK_EX):
            progress_log.warning("job %s is being run by another process; waiting for it to end", job.job_id)
            fcntl.flock(lease, fcntl.LOCK_EX)
    return lease


def try_lease(job: JobDir) -> IO[bytes] | None:
    """The job's lease if no live process holds it (kept until the returned file is closed), else None."""
    job.root.mkdir(parents=True, exist_ok=True)
    lease = job.lease_path.open("ab")
    if _lock(lease, fcntl.LOCK_EX):
        return lease
    lease.close()
    return None


def driven_by_cli(job: JobDir) -> bool:
    """True while a live process holds the job's lease (a lease file left by a dead one is free)."""
    try:
        lease = job.lease_path.open("rb")
    except FileNotFoundError:
        return False
    with lease:
        return not _lock(lease, fcntl.LOCK_SH)  # closing the file lets go of the lock at once
