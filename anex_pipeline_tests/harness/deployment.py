"""A code location on an instance driven tick by tick as the daemon would, and moto's S3 server (the
``s3_endpoint`` fixture)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from moto.server import ThreadedMotoServer

from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.inboxes import LocalInboxSettings
from anex_pipeline.orchestration.partitions import JOBS
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import QUIET_LOGGERS
from anex_pipeline.testing import fake_engine


@dataclass
class Deployment:
    """One code location on one instance, with the sensor cursors the daemon would keep."""

    defs: dg.Definitions
    instance: dg.DagsterInstance
    cursors: dict[str, str | None] = field(default_factory=dict)
    run_keys: list[str] = field(default_factory=list)

    def tick(self, sensor_name: str) -> Any:
        """Evaluates one tick and applies its partition requests and cursor, as the daemon does."""
        with (
            dg.build_sensor_context(
                instance=self.instance,
                instance_ref=self.instance.get_ref(),
                cursor=self.cursors.get(sensor_name),
                resources=dict(self.defs.resources),
                definitions=self.defs,
            ) as context,
            dg.partition_loading_context(dynamic_partitions_store=self.instance),
        ):
            data = self.defs.resolve_sensor_def(sensor_name).evaluate_tick(context)
        for request in data.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        if data.cursor is not None:
            self.cursors[sensor_name] = data.cursor
        self.run_keys.extend(r.run_key for r in data.run_requests or [])
        return data

    def execute(
        self, request: dg.RunRequest, job_name: str | None = None, *, must_succeed: bool = True
    ) -> dg.ExecuteInProcessResult:
        job = self.defs.resolve_job_def(job_name or request.job_name)
        result = job.execute_in_process(
            run_config={**request.run_config, "loggers": QUIET_LOGGERS},
            partition_key=request.partition_key,
            instance=self.instance,
            tags=request.tags,
            raise_on_error=False,
        )
        assert result.success or not must_succeed
        return result

    def drive(self, *, failing: frozenset[str] = frozenset()) -> list[list[str]]:
        """Ticks the driver and runs what it asks for until it asks for nothing; returns the steps.
        Runs of the partitions in ``failing`` must fail, every other run must succeed."""
        steps = []
        for _ in range(10):
            data = self.tick("job_driver")
            if not data.run_requests:
                assert len(set(self.run_keys)) == len(self.run_keys), "a step was requested twice"
                return steps
            steps.append([f"{r.job_name}:{r.partition_key}" for r in data.run_requests])
            for request in data.run_requests:
                result = self.execute(request, must_succeed=False)
                assert result.success == (str(request.partition_key) not in failing), request.partition_key
        raise AssertionError(f"the driver never settled: {steps}")

    def retry_tick(self) -> Any:
        """Evaluates one tick of the retry schedule."""
        schedule = self.defs.resolve_schedule_def("retry_failed_rows")
        with (
            dg.build_schedule_context(
                instance=self.instance,
                resources=dict(self.defs.resources),
                repository_def=self.defs.get_repository_def(),
            ) as context,
            dg.partition_loading_context(dynamic_partitions_store=self.instance),
        ):
            data = schedule.evaluate_tick(context)
        self.run_keys.extend(r.run_key for r in data.run_requests or [])
        return data

    def submit(self, job_id: str, config: dict[str, Any]) -> None:
        """What a UI user does: a new `jobs` partition, then submit_job with a launchpad config."""
        self.instance.add_dynamic_partitions(JOBS, [job_id])
        self.execute(
            dg.RunRequest(partition_key=job_id, run_config={"ops": {"validated_input": {"config": config}}}),
            "submit_job",
        )


def dummy_aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy AWS credentials and region for boto3, no proxy for loopback, and no endpoint, profile or
    session of the machine's own."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "test-key",
        "AWS_SECRET_ACCESS_KEY": "test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "NO_PROXY": "127.0.0.1,localhost",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """moto's S3 server on a free loopback port; boto3 reaches it over HTTP with dummy credentials."""
    dummy_aws_credentials(monkeypatch)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    yield endpoint
    # moto keeps buckets in process-wide state, whichever server serves them: empty it.
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
    server.stop()


def storage_for(tmp_path: Path, endpoint: str | None = None) -> StorageResource:
    return StorageResource(work_root=str(tmp_path / "work"), s3_endpoint_url=endpoint, s3_region="us-east-1")


def submitted(data: Any) -> list[dict[str, Any]]:
    """The launch config of each submit run a tick requested (its partition added in the same tick)."""
    added = [key for request in data.dynamic_partitions_requests or [] for key in request.partition_keys]
    assert added == [r.partition_key for r in data.run_requests]
    assert all(r.job_name == "submit_job" and r.run_key == r.partition_key for r in data.run_requests)
    return [r.run_config["ops"]["validated_input"]["config"] for r in data.run_requests]


def local_deployment(tmp_path: Path, instance: dg.DagsterInstance, **settings: Any) -> Deployment:
    inbox = LocalInboxSettings(**{"settle_seconds": 0.0, **settings})
    return Deployment(build_definitions(storage_for(tmp_path), fake_engine(), local_inbox=inbox), instance)
