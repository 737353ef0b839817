"""The S3 inbox sensor: each new object under a bucket/prefix becomes a job (see :mod:`inboxes`).

A module of its own because ``dagster_aws`` takes about a second to import (its package pulls in
Dagster's test utilities): the code location imports it, the command's own runs, which have no
sensors, do not."""

from __future__ import annotations

import dagster as dg
from dagster_aws.s3 import S3Resource
from dagster_aws.s3.sensor import get_objects

from anex_pipeline.options import MAX_OPTIONS_BYTES, SIDECAR_SUFFIX, check_options_size
from anex_pipeline.orchestration.inboxes import Arrival, S3InboxSettings, bucket_arrivals, take_new
from anex_pipeline.orchestration.names import SUBMIT_JOB
from anex_pipeline.orchestration.resources import StorageResource


def s3_resource(storage: StorageResource) -> S3Resource:
    """The sensor's S3 client settings: the storage's endpoint and region."""
    return S3Resource(endpoint_url=storage.s3_endpoint_url, region_name=storage.s3_region)


@dg.sensor(
    name="s3_inbox",
    job_name=SUBMIT_JOB,
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description=(
        "Each new object (JSONL or Parquet) under the configured bucket/prefix becomes a job, with options "
        "from a sidecar <key>.job.json; results go under the output prefix. Needs job_driver running."
    ),
)
def s3_inbox(
    context: dg.SensorEvaluationContext, s3: S3Resource, s3_inbox_settings: S3InboxSettings
) -> dg.SensorResult | dg.SkipReason:
    settings = s3_inbox_settings
    if not settings.bucket:
        return dg.SkipReason("no bucket is configured: set ANEX_S3_BUCKET (or the s3_inbox_settings resource)")
    client = s3.get_client()
    objects = get_objects(settings.bucket, settings.prefix, client=client)
    sizes = {obj["Key"]: obj["Size"] for obj in objects}

    def read_sidecar(arrival: Arrival) -> bytes | None:
        key = arrival.uri.removeprefix(f"s3://{settings.bucket}/") + SIDECAR_SUFFIX
        if key not in sizes:
            return None
        check_options_size(sizes[key], arrival.uri + SIDECAR_SUFFIX)  # before it is downloaded
        body = client.get_object(Bucket=settings.bucket, Key=key)["Body"]
        return body.read(MAX_OPTIONS_BYTES + 1)  # rewritten larger since the listing: refused when parsed

    where = f"s3://{settings.bucket}/{settings.prefix}"
    return take_new(context, bucket_arrivals(objects, settings), settings, read_sidecar, where)
