"""The publish step: the merged result and its report, copied from the work folder to the
job's output and report locations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from anex_pipeline.spec import JobReport
from anex_pipeline.storage import publish
from anex_pipeline.workdir.manifest import JobDir


def publish_job(job: JobDir, s3_client: Callable[[], Any]) -> tuple[JobReport, str]:
    """Publishes the merged result and then the report; returns the report and where the result
    went. A job none of whose rows has a result keeps an earlier result where it is (the report
    tells why). ``s3_client`` makes an S3 client; it is called only when a location is on S3."""
    manifest = job.manifest()
    s3 = s3_client() if manifest.output.startswith("s3://") or manifest.report.startswith("s3://") else None
    report = job.report()
    if report is None:
        raise FileNotFoundError(f"{job.report_path}: the job has not been merged")
    if report.request_counts.nothing_delivered():  # the report tells why; an earlier result stays
        where = "not published: no row has a result"
    else:
        where = publish(job.result_path, manifest.output, s3)
    publish(job.report_path, manifest.report, s3)
    return report, where
