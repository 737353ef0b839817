"""Sensors and the retry schedule, evaluated tick by tick on a test instance as the daemon would:
new files in a bucket (a real S3-compatible server on loopback) or a folder become jobs exactly
once, and the job driver carries each job from submit to the published result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
import pytest

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.options import MAX_OPTIONS_BYTES
from anex_pipeline.orchestration.definitions import build_definitions, defs
from anex_pipeline.orchestration.inboxes import MAX_SETTLE_WAIT_S, S3InboxSettings, folder_arrivals
from anex_pipeline.orchestration.names import CARRIED_RUN, LAUNCHED_BY_TAG, PARTITION_TAG
from anex_pipeline.orchestration.partitions import JOBS, job_shard_key
from anex_pipeline.orchestration.retries import RetrySettings
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine, fake_engine
from anex_pipeline_tests.harness.commands import FAKE_CLI
from anex_pipeline_tests.harness.deployment import Deployment, local_deployment, storage_for, submitted
from anex_pipeline_tests.harness.jobs import REPO, chat_row, local_instance, read_jsonl, write_jsonl

BUCKET = "batches"


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """A throwaway instance on disk: sensor and schedule contexts need an instance they can
    reopen by reference to add partitions in the same tick, which an in-memory one cannot give."""
    with local_instance(set_dagster_home=True) as inst:
        yield inst


@pytest.fixture
def bucket(tmp_path: Path, s3_endpoint: str, instance: dg.DagsterInstance) -> Callable[..., tuple[Deployment, Any]]:
    """A deployment watching BUCKET on the loopback server, and a boto3 client to fill it."""

    def make(**settings: Any) -> tuple[Deployment, Any]:
        storage = storage_for(tmp_path, s3_endpoint)
        client = storage.s3_client()
        client.create_bucket(Bucket=BUCKET)
        inbox = S3InboxSettings(**{"bucket": BUCKET, "prefix": "in/", "output_prefix": "out/", **settings})
        return Deployment(build_definitions(storage, fake_engine(), s3_inbox=inbox), instance), client

    return make


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_definitions_hold_the_sensors_and_schedule_switched_off() -> None:
    loaded = defs()
    assert {s.name: s.default_status for s in loaded.sensors or []} == {
        "job_driver": dg.DefaultSensorStatus.STOPPED,
        "s3_inbox": dg.DefaultSensorStatus.STOPPED,
        "local_inbox": dg.DefaultSensorStatus.STOPPED,
    }
    assert [(s.name, s.default_status) for s in loaded.schedules or []] == [
        ("retry_failed_rows", dg.DefaultScheduleStatus.STOPPED),
        ("prune_old_jobs", dg.DefaultScheduleStatus.STOPPED),
    ]


@pytest.mark.slow
def test_s3_object_becomes_one_job_and_an_overwrite_another(bucket: Callable[..., Any]) -> None:
    deployment, client = bucket(prefix="", output_prefix="out/")
    rows = [chat_row("a", "hello")]
    client.put_object(Bucket=BUCKET, Key="in/batch.jsonl", Body=jsonl_bytes(rows))
    client.put_object(Bucket=BUCKET, Key="in/notes.txt", Body=b"not an input")
    client.put_object(Bucket=BUCKET, Key="in/.partial.jsonl", Body=b"{}")
    client.put_object(Bucket=BUCKET, Key="out/earlier.results.jsonl", Body=jsonl_bytes(rows))

    first = deployment.tick("s3_inbox")
    assert submitted(first) == [
        {"input": f"s3://{BUCKET}/in/batch.jsonl", "output": f"s3://{BUCKET}/out/in/batch.results.jsonl", "options": {}}
    ]
    job_id = first.run_requests[0].partition_key
    assert deployment.instance.has_dynamic_partition(JOBS, job_id)

    again = deployment.tick("s3_inbox")
    assert not again.run_requests and not again.dynamic_partitions_requests and again.skip_message

    client.put_object(Bucket=BUCKET, Key="in/batch.jsonl", Body=jsonl_bytes([*rows, chat_row("b", "more")]))
    changed = deployment.tick("s3_inbox")
    assert [c["input"] for c in submitted(changed)] == [f"s3://{BUCKET}/in/batch.jsonl"]
    assert changed.run_requests[0].partition_key != job_id
    assert not deployment.tick("s3_inbox").run_requests


def test_sidecar_options_reach_the_run_config(bucket: Callable[..., Any]) -> None:
    deployment, client = bucket(options='{"temperature": 0, "max_tokens": 8}')
    body = jsonl_bytes([chat_row("a", "hello")])
    for name in ("a", "b", "c"):
        client.put_object(Bucket=BUCKET, Key=f"in/{name}.jsonl", Body=body)
    client.put_object(Bucket=BUCKET, Key="in/a.jsonl.job.json", Body=b'{"max_tokens": 16, "shards": 2}')
    client.put_object(Bucket=BUCKET, Key="in/c.jsonl.job.json", Body=b"{max_tokens: 16")

    options = {Path(c["input"]).name: c["options"] for c in submitted(deployment.tick("s3_inbox"))}
    assert options == {
        "a.jsonl": {"temperature": 0, "max_tokens": 16, "shards": 2},
        "b.jsonl": {"temperature": 0, "max_tokens": 8},
    }

    client.put_object(Bucket=BUCKET, Key="in/c.jsonl.job.json", Body=b'{"seed": 7}')
    fixed = submitted(deployment.tick("s3_inbox"))
    assert [(Path(c["input"]).name, c["options"]) for c in fixed] == [
        ("c.jsonl", {"temperature": 0, "max_tokens": 8, "seed": 7})
    ]


@pytest.mark.slow
def test_a_big_bucket_is_paged_across_ticks_without_loss_or_repeat(bucket: Callable[..., Any]) -> None:
    deployment, client = bucket(page_limit=3)
    keys = {f"in/part-{n:02d}.jsonl" for n in range(8)}
    for key in keys:
        client.put_object(Bucket=BUCKET, Key=key, Body=jsonl_bytes([chat_row(key, "hi")]))

    per_tick = []
    while (data := deployment.tick("s3_inbox")).run_requests:
        per_tick.append([c["input"].removeprefix(f"s3://{BUCKET}/") for c in submitted(data)])
        assert set(json.loads(deployment.cursors["s3_inbox"])) == {"since"}
    assert [len(t) for t in per_tick] == [3, 3, 2]
    taken = [key for tick in per_tick for key in tick]
    assert sorted(taken) == sorted(keys)
    assert len(deployment.instance.get_dynamic_partitions(JOBS)) == 8


@pytest.mark.slow
def test_s3_file_to_result_under_the_output_prefix(bucket: Callable[..., Any]) -> None:
    deployment, client = bucket()
    rows = [chat_row(f"q{i}", f"question {i}", max_tokens=12) for i in range(5)]
    client.put_object(Bucket=BUCKET, Key="in/batch.jsonl.job.json", Body=b'{"shards": 2}')
    client.put_object(Bucket=BUCKET, Key="in/batch.jsonl", Body=jsonl_bytes(rows))

    data = deployment.tick("s3_inbox")
    assert len(data.run_requests) == 1
    deployment.execute(data.run_requests[0])
    job_id = data.run_requests[0].partition_key
    steps = deployment.drive()
    assert steps == [  # every row sets max_tokens: the submit run recorded the estimate
        [f"shard_job:{job_shard_key(job_id, 0)}", f"shard_job:{job_shard_key(job_id, 1)}"],
        [f"finish_job:{job_id}"],
    ]

    def read(key: str) -> str:
        return client.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()

    lines = [json.loads(line) for line in read("out/batch.results.jsonl").splitlines()]
    assert [line["custom_id"] for line in lines] == [f"q{i}" for i in range(5)]
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in lines)
    assert lines[3]["response"]["body"]["choices"][0]["message"]["content"].startswith("answer to q3")
    report = json.loads(read("out/batch.results.report.json"))
    assert report["job_id"] == job_id and report["status"] == "completed"
    assert report["request_counts"]["total"] == 5 and report["request_counts"]["completed"] == 5


DEEP_SIDECAR = b'{"stop": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # about 10 KB


def refused_sidecars(capfd: pytest.CaptureFixture[str]) -> dict[str, str]:
    """The inputs the sensor's log said it did not submit for their sidecar, with the message."""
    lines = capfd.readouterr().err.splitlines()
    told = [line.split(" - ERROR - ", 1)[1] for line in lines if " - ERROR - " in line]
    return {Path(line.split(" ", 1)[0]).name: line for line in told if "is not submitted" in line}


def test_a_bad_s3_sidecar_holds_back_only_its_own_input(
    bucket: Callable[..., Any], capfd: pytest.CaptureFixture[str]
) -> None:
    deployment, client = bucket()
    body = jsonl_bytes([chat_row("a", "hello")])
    for name in ("deep", "good", "huge"):
        client.put_object(Bucket=BUCKET, Key=f"in/{name}.jsonl", Body=body)
    client.put_object(Bucket=BUCKET, Key="in/deep.jsonl.job.json", Body=DEEP_SIDECAR)
    client.put_object(Bucket=BUCKET, Key="in/huge.jsonl.job.json", Body=b" " * (MAX_OPTIONS_BYTES + 1))

    data = deployment.tick("s3_inbox")
    assert [Path(c["input"]).name for c in submitted(data)] == ["good.jsonl"]
    told = refused_sidecars(capfd)
    assert sorted(told) == ["deep.jsonl", "huge.jsonl"], told
    assert "nested more than 100 levels deep" in told["deep.jsonl"]
    assert f"holds {MAX_OPTIONS_BYTES + 1:,} bytes" in told["huge.jsonl"] and "at most 4 MiB" in told["huge.jsonl"]

    client.put_object(Bucket=BUCKET, Key="in/deep.jsonl.job.json", Body=b'{"seed": 7}')
    assert [(Path(c["input"]).name, c["options"]) for c in submitted(deployment.tick("s3_inbox"))] == [
        ("deep.jsonl", {"seed": 7})
    ]


def test_keys_that_would_share_a_result_key_are_refused_once_in_the_tick_log(
    bucket: Callable[..., Any], capfd: pytest.CaptureFixture[str]
) -> None:
    def told() -> list[str]:
        """The files the sensor's log said it does not take, since the last look."""
        lines = capfd.readouterr().err.splitlines()
        return sorted(line.split(" - WARNING - ", 1)[1].split(" ", 1)[0] for line in lines if "is not taken" in line)

    deployment, client = bucket()
    body = jsonl_bytes([chat_row("a", "hello")])
    for key in ("in/x.jsonl", "in/./x.jsonl", "in//x.jsonl", "in/team/../x.jsonl"):
        client.put_object(Bucket=BUCKET, Key=key, Body=body)

    first = deployment.tick("s3_inbox")
    assert submitted(first) == [
        {"input": f"s3://{BUCKET}/in/x.jsonl", "output": f"s3://{BUCKET}/out/x.results.jsonl", "options": {}}
    ]
    assert told() == sorted(f"s3://{BUCKET}/in/{name}" for name in ("/x.jsonl", "./x.jsonl", "team/../x.jsonl"))

    assert not deployment.tick("s3_inbox").run_requests
    assert told() == []  # told once, not on every tick

    client.put_object(Bucket=BUCKET, Key="in/./x.jsonl", Body=jsonl_bytes([chat_row("b", "changed")]))
    assert not deployment.tick("s3_inbox").run_requests
    assert told() == [f"s3://{BUCKET}/in/./x.jsonl"]  # a new version is told again


@pytest.mark.slow
def test_local_inbox_file_to_result_in_the_outbox(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    deployment = local_deployment(tmp_path, instance)  # inbox and outbox beside the work folder
    inbox = tmp_path / "inbox" / "team"
    inbox.mkdir(parents=True)
    shutil.copy(REPO / "examples" / "chat.parquet", inbox / "chat.parquet")
    (inbox / "chat.parquet.job.json").write_text('{"max_tokens": 6}')

    data = deployment.tick("local_inbox")
    assert submitted(data) == [
        {
            "input": str(inbox / "chat.parquet"),
            "output": str(tmp_path / "outbox" / "team" / "chat.results.parquet"),
            "options": {"max_tokens": 6},
        }
    ]
    deployment.execute(data.run_requests[0])
    # One shard: the submit run went on with the shard and the finish (max_tokens is set, so no
    # estimate run), each a run of its own; the driver has nothing left to start.
    carried = instance.get_runs(filters=dg.RunsFilter(tags={LAUNCHED_BY_TAG: CARRIED_RUN}))
    assert sorted(r.job_name for r in carried) == ["finish_job", "shard_job"]
    assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in carried)
    assert deployment.drive() == []
    assert not deployment.tick("local_inbox").run_requests

    table = pq.read_table(tmp_path / "outbox" / "team" / "chat.results.parquet").to_pylist()
    source = pq.read_table(REPO / "examples" / "chat.parquet").to_pylist()
    assert [r["id"] for r in table] == [r["id"] for r in source]
    assert all(r["output"] and r["error_type"] is None for r in table)
    report = json.loads((tmp_path / "outbox" / "team" / "chat.results.report.json").read_text())
    assert report["status"] == "completed" and report["request_counts"]["completed"] == len(source)


def test_a_bad_local_sidecar_holds_back_only_its_own_input(
    tmp_path: Path, instance: dg.DagsterInstance, capfd: pytest.CaptureFixture[str]
) -> None:
    deployment = local_deployment(tmp_path, instance)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for name in ("deep", "good", "huge", "mid"):
        write_jsonl(inbox / f"{name}.jsonl", [chat_row("a", "hello")])
    (inbox / "deep.jsonl.job.json").write_bytes(DEEP_SIDECAR)
    # 500 levels: json.loads reads it, but the daemon could not serialise the run request it makes
    (inbox / "mid.jsonl.job.json").write_bytes(b'{"stop": ' + b"[" * 500 + b"]" * 500 + b"}")
    with (inbox / "huge.jsonl.job.json").open("wb") as f:
        f.truncate(1 << 40)  # a sparse terabyte: refused by its size, never read

    data = deployment.tick("local_inbox")
    assert [Path(c["input"]).name for c in submitted(data)] == ["good.jsonl"]
    told = refused_sidecars(capfd)
    assert sorted(told) == ["deep.jsonl", "huge.jsonl", "mid.jsonl"], told
    assert "nested more than 100 levels deep" in told["deep.jsonl"] and "\n" not in told["deep.jsonl"]
    assert "option 'stop' is JSON nested more than 100 levels deep" in told["mid.jsonl"]
    assert f"holds {1 << 40:,} bytes" in told["huge.jsonl"]

    (inbox / "deep.jsonl.job.json").write_text('{"seed": 7}')
    assert [(Path(c["input"]).name, c["options"]) for c in submitted(deployment.tick("local_inbox"))] == [
        ("deep.jsonl", {"seed": 7})
    ]


def test_local_inbox_takes_each_file_once_and_a_changed_file_again(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    inbox, outbox = tmp_path / "drop", tmp_path / "drop" / "done"
    deployment = local_deployment(tmp_path, instance, folder=str(inbox), outbox=str(outbox))
    inbox.mkdir()
    src = write_jsonl(inbox / "in.jsonl", [chat_row("a", "hi")])
    outbox.mkdir()
    write_jsonl(outbox / "old.results.jsonl", [chat_row("a", "hi")])
    (inbox / "in.jsonl.job.json").write_text("{}")

    first = submitted(deployment.tick("local_inbox"))
    assert [c["input"] for c in first] == [str(src)]
    assert not deployment.tick("local_inbox").run_requests

    write_jsonl(src, [chat_row("a", "hi"), chat_row("b", "there")])
    second = deployment.tick("local_inbox")
    assert [c["input"] for c in submitted(second)] == [str(src)]
    assert len(deployment.instance.get_dynamic_partitions(JOBS)) == 2

    waiting = local_deployment(tmp_path, instance, folder=str(inbox), outbox=str(outbox), settle_seconds=3600)
    write_jsonl(inbox / "copying.jsonl", [chat_row("c", "still being written")])
    assert not waiting.tick("local_inbox").run_requests
    assert [c["input"] for c in submitted(deployment.tick("local_inbox"))] == [str(inbox / "copying.jsonl")]


def test_a_new_file_is_taken_in_the_tick_that_finds_it_once_it_has_settled(tmp_path: Path) -> None:
    """The tick waits out a new file's settle time rather than leaving it to the next tick, and
    takes it only if nothing was written to it meanwhile."""
    inbox, outbox = tmp_path / "inbox", tmp_path / "outbox"
    inbox.mkdir()
    done = write_jsonl(inbox / "done.jsonl", [chat_row("a", "hi")])
    copying = write_jsonl(inbox / "copying.jsonl", [chat_row("b", "hi")])
    waits: list[float] = []

    def wait(seconds: float) -> None:  # the copy goes on while the tick waits
        waits.append(seconds)
        time.sleep(seconds)
        with copying.open("a") as f:
            f.write(json.dumps(chat_row("c", "more")) + "\n")

    taken = [a.uri for a in folder_arrivals(inbox, outbox, 0.3, wait)]
    assert taken == [str(done)] and len(waits) == 1 and 0 < waits[0] <= 0.3
    assert [a.uri for a in folder_arrivals(inbox, outbox, MAX_SETTLE_WAIT_S + 1, wait)] == []
    assert len(waits) == 1, "a settle time longer than a tick may wait is left to later ticks"


@pytest.mark.slow
def test_driver_runs_a_job_launched_from_the_ui(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    deployment = Deployment(build_definitions(storage_for(tmp_path), fake_engine()), instance)
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"u{i}", f"question {i}", max_tokens=9) for i in range(12)])
    out = tmp_path / "out.jsonl"
    deployment.submit("ui-job", {"input": str(src), "output": str(out), "options": {"shards": 3}})

    # A run of the job already waiting to start (say, launched by hand): the driver waits for it.
    queued = instance.create_run_for_job(
        job_def=deployment.defs.resolve_job_def("estimate_job"),
        status=dg.DagsterRunStatus.NOT_STARTED,
        tags={"dagster/partition": "ui-job"},
    )
    assert not deployment.tick("job_driver").run_requests
    instance.delete_run(queued.run_id)

    steps = deployment.drive()
    assert steps == [
        [f"shard_job:{job_shard_key('ui-job', s)}" for s in range(3)],
        ["finish_job:ui-job"],
    ]
    assert sorted(r.dagster_run.job_name for r in instance.get_run_records()) == [
        "finish_job",
        *["shard_job"] * 3,
        "submit_job",
    ]  # the submit run recorded the estimate: every row sets max_tokens
    assert [line["custom_id"] for line in read_jsonl(out)] == [f"u{i}" for i in range(12)]

    # Materializing validated_input again (empty config: the same job) is a new submission.
    deployment.execute(dg.RunRequest(partition_key="ui-job"), "submit_job")
    again = deployment.tick("job_driver").run_requests
    assert [(r.job_name, r.partition_key) for r in again] == [
        ("shard_job", job_shard_key("ui-job", s)) for s in range(3)
    ]
    assert not set(r.run_key for r in again) & set(deployment.run_keys[: -len(again)])


@pytest.mark.slow
def test_retry_schedule_reruns_only_shards_with_failed_rows_up_to_its_limit(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    defs = build_definitions(storage_for(tmp_path), fake_engine(), retry=RetrySettings(max_attempts=2))
    deployment = Deployment(defs, instance)
    rows = [chat_row(f"r{i}", f"question {i}", max_tokens=9) for i in range(8)]
    rows[6] = chat_row("r6", "word " * 500, max_tokens=9)  # longer than the fake engine's context: a failed row
    deployment.submit(
        "flaky",
        {
            "input": str(write_jsonl(tmp_path / "in.jsonl", rows)),
            "output": str(tmp_path / "o.jsonl"),
            "options": {"shards": 2},
        },
    )
    deployment.submit(
        "clean",
        {
            "input": str(write_jsonl(tmp_path / "ok.jsonl", rows[:4])),
            "output": str(tmp_path / "ok-out.jsonl"),
            "options": {},
        },
    )
    deployment.drive()

    for _ in range(2):  # the row fails every time: two attempts, as configured
        data = deployment.retry_tick()
        assert [r.partition_key for r in data.run_requests] == [str(job_shard_key("flaky", 1))]
        rerun = deployment.execute(data.run_requests[0], "shard_job")
        metadata = rerun.asset_materializations_for_node("generations")[0].metadata
        assert metadata["generated"].value == 1 and metadata["kept_from_earlier_runs"].value == 3
        assert deployment.drive() == [["finish_job:flaky"]]  # the driver publishes the rerun's result
    assert not deployment.retry_tick().run_requests
    assert len(set(deployment.run_keys)) == len(deployment.run_keys)
    assert read_jsonl(tmp_path / "o.jsonl")[6]["error"]["type"] == "invalid_request_error"

    # A new submission of the job starts the count again.
    deployment.execute(dg.RunRequest(partition_key="flaky"), "submit_job")
    deployment.drive()
    assert [r.partition_key for r in deployment.retry_tick().run_requests] == [str(job_shard_key("flaky", 1))]


class BrokenEngine(FakeEngine):
    """The fake engine, raising (as a dead GPU would) on any batch with a row whose id starts "boom",
    while BROKEN["now"] is set."""

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        if BROKEN["now"] and any(r.key.startswith("boom") for r in requests):
            raise RuntimeError("the GPU fell off the bus")
        return super().run(requests)


BROKEN = {"now": True}


register_engine("broken", lambda config, manifest: BrokenEngine(manifest.model_name))


@pytest.mark.slow
def test_a_shard_that_fails_for_good_does_not_stall_its_job(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(BROKEN, "now", True)
    storage = storage_for(tmp_path)
    deployment = Deployment(build_definitions(storage, fake_engine("broken")), instance)
    rows = [chat_row(f"r{i}", f"question {i}", max_tokens=9) for i in range(6)]
    rows[5] = chat_row("boom5", "question 5", max_tokens=9)
    out = tmp_path / "out.jsonl"
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    deployment.submit("stuck", {"input": str(src), "output": str(out), "options": {"shards": 3}})

    last = str(job_shard_key("stuck", 2))
    steps = deployment.drive(failing=frozenset({last}))  # the step's own retries fail too
    assert steps == [
        [f"shard_job:{job_shard_key('stuck', s)}" for s in range(3)],
        ["finish_job:stuck"],
    ]
    finish = instance.get_runs(filters=dg.RunsFilter(job_name="finish_job"), limit=1)[0]
    assert finish.tags["anex/failed_shards"] == "2"
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert report["status"] == "stopped_early"
    assert report["failure_reason"] == "shard 2: RuntimeError: the GPU fell off the bus"
    assert report["request_counts"] == {**report["request_counts"], "total": 6, "completed": 4, "failed": 0}
    assert [r["custom_id"] for r in read_jsonl(out)] == [f"r{i}" for i in range(4)]
    # Published: the stop is kept in the report only, so that a later rerun of the shard can work.
    assert not storage.job("stuck").stop_path.exists()

    monkeypatch.setitem(BROKEN, "now", False)  # the fault is gone: the retry schedule repairs the job
    retry = deployment.retry_tick().run_requests
    assert [r.partition_key for r in retry] == [last]
    rerun = deployment.execute(retry[0], "shard_job")
    assert rerun.asset_materializations_for_node("generations")[0].metadata["generated"].value == 2
    assert deployment.drive() == [["finish_job:stuck"]]
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert report["status"] == "completed" and report["failure_reason"] is None
    assert [r["custom_id"] for r in read_jsonl(out)] == [r["custom_id"] for r in rows]


@pytest.mark.subprocess
def test_driver_leaves_a_job_to_the_cli_that_runs_it_and_takes_over_when_it_dies(tmp_path: Path) -> None:
    home, work = tmp_path / "dagster", tmp_path / "work"
    home.mkdir()
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"c{i}", f"question {i}", max_tokens=9) for i in range(8)])
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "ANEX_WORK_DIR": str(work), "DAGSTER_HOME": str(home), "ANEX_FAKE_ROW_DELAY_S": "10"}
    command = [
        *FAKE_CLI,
        "run",
        str(src),
        "-o",
        str(out),
        "--shards",
        "2",
    ]
    with local_instance(str(home), set_dagster_home=True) as instance:
        deployment = Deployment(build_definitions(storage_for(tmp_path), fake_engine()), instance)
        cli = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            shard_run = wait_for_run(instance, cli, "shard_job")  # the CLI is generating shard 0, slowly
            assert shard_run.tags[LAUNCHED_BY_TAG] == "cli"
            cli_runs = instance.get_runs(filters=dg.RunsFilter(tags={LAUNCHED_BY_TAG: "cli"}))
            assert {r.job_name for r in cli_runs} == {"submit_job", "shard_job"}  # rows set max_tokens: no estimate
            data = deployment.tick("job_driver")
            assert not data.run_requests and "run by anex-pipeline" in data.skip_message
        finally:
            cli.kill()  # the CLI dies mid-shard: its run stays "started", its lease goes with it
            cli.wait(timeout=30)
        assert instance.get_run_by_id(shard_run.run_id).status == dg.DagsterRunStatus.STARTED

        job_id = shard_run.tags[PARTITION_TAG].split("|")[0]
        assert deployment.drive() == [
            [f"shard_job:{job_shard_key(job_id, s)}" for s in range(2)],
            [f"finish_job:{job_id}"],
        ]
    assert [r["custom_id"] for r in read_jsonl(out)] == [f"c{i}" for i in range(8)]
    assert json.loads((tmp_path / "out.report.json").read_text())["status"] == "completed"


def wait_for_run(instance: dg.DagsterInstance, process: subprocess.Popen[bytes], job_name: str) -> dg.DagsterRun:
    """The first run of ``job_name`` that a process started, once it is running."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        runs = instance.get_runs(filters=dg.RunsFilter(job_name=job_name, statuses=[dg.DagsterRunStatus.STARTED]))
        if runs:
            return runs[-1]
        time.sleep(0.2)
    raise AssertionError(f"no {job_name} run started within 120 s")
