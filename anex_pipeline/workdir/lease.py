"""Who drives a job: an ``anex-pipeline`` process holds the job's lease while it runs the job's
steps, and the Dagster driver leaves such a job alone."""

from __future__ import annotations

import logging
import os
import time
from typing import IO

from anex_pipeline.workdir.locks import flock, try_flock
from anex_pipeline.workdir.manifest import JobDir

progress_log = logging.getLogger("anex_pipeline.progress")


def take_lease(job: JobDir) -> IO[bytes]:
    """Marks the job as driven by this process until the returned file is closed.

    The mark is a kernel lock on ``<job>/cli.lock``: it goes away with the process however the
    process ends, so a crashed command never leaves the job blocked. A second process driving the
    same job waits here for the first.
    """
    while True:
        lease = _open(job)
        if not try_flock(lease):
            time.sleep(0.2)  # job_driver only looks at the lock for a moment
            if not try_flock(lease):
                progress_log.warning("job %s is being run by another process; waiting for it to end", job.job_id)
                flock(lease)
        if _still_in_place(lease, job):
            return lease
        lease.close()  # the holder deleted the job meanwhile: lock the file of its new folder


def try_lease(job: JobDir) -> IO[bytes] | None:
    """The job's lease if no live process holds it (kept until the returned file is closed), else None."""
    lease = _open(job)
    if try_flock(lease) and _still_in_place(lease, job):
        return lease
    lease.close()
    return None


def _open(job: JobDir) -> IO[bytes]:
    job.root.mkdir(parents=True, exist_ok=True)
    return job.lease_path.open("ab")


def _still_in_place(lease: IO[bytes], job: JobDir) -> bool:
    """Whether the locked file is still the job's lease file: a process that deleted the job
    while this one waited for the lock removed the file this one holds, and a lock on it guards
    nothing."""
    try:
        found = os.stat(job.lease_path)
    except FileNotFoundError:
        return False
    held = os.fstat(lease.fileno())
    return (held.st_dev, held.st_ino) == (found.st_dev, found.st_ino)


def lease_held(job: JobDir) -> bool:
    """True while a live process holds the job's lease (a lease file left by a dead one is free)."""
    try:
        lease = job.lease_path.open("rb")
    except FileNotFoundError:
        return False
    with lease:
        return not try_flock(lease, shared=True)  # closing the file lets go of the lock at once
