"""One model server per machine for the step processes: started once however many steps (or
racing processes) need it, replaced when it dies, ending by itself when idle; real ``vllm serve``
processes on loopback and real multi-process Dagster runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from anex_pipeline.engine import _loaded
from anex_pipeline.engine.machine_server import alive, read_state, server_for, starts, stop_server
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path
from anex_pipeline.engine.vllm_local import EngineSettings
from anex_pipeline.orchestration.partitions import JOBS
from anex_pipeline.runner import QUIET_LOGGERS
from anex_pipeline_tests.conftest import REPO, chat_row, read_jsonl, write_jsonl
from anex_pipeline_tests.test_sensors import Deployment

SETTINGS_CODE = (
    "from anex_pipeline.engine.vllm_local import EngineSettings\n"
    "from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path\n"
    "settings = EngineSettings(model=str(local_model_path(DEFAULT_CHAT_MODEL)), model_name=DEFAULT_CHAT_MODEL,"
    " max_model_len=2048)\n"
)


def tiny_settings() -> EngineSettings:
    return EngineSettings(
        model=str(local_model_path(DEFAULT_CHAT_MODEL)), model_name=DEFAULT_CHAT_MODEL, max_model_len=2048
    )


@pytest.fixture
def server_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "machine-server"
    monkeypatch.setenv("ANEX_MACHINE_SERVER_DIR", str(folder))
    yield folder
    stop_server(folder)


def wait_until(condition: object, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.engine
def test_racing_processes_start_one_server_a_killed_one_is_replaced_an_idle_one_ends(server_dir: Path) -> None:
    code = SETTINGS_CODE + (
        "import sys\nfrom pathlib import Path\nfrom anex_pipeline.engine.machine_server import server_for\n"
        "print(server_for(settings, idle_s=600, folder=Path(sys.argv[1])))\n"
    )
    racers = [
        subprocess.Popen([sys.executable, "-c", code, str(server_dir)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    urls = {racer.communicate(timeout=600)[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    assert len(urls) == 1 and starts(server_dir) == 1, "both processes use the one server the first started"

    first = read_state(server_dir)
    assert first is not None and first.url in urls
    os.killpg(first.pid, signal.SIGKILL)  # the supervisor and the server under it
    wait_until(lambda: not alive(first), "the killed server is gone")
    url = server_for(tiny_settings(), idle_s=3, folder=server_dir)
    second = read_state(server_dir)
    assert second is not None and second.pid != first.pid and url == second.url
    assert starts(server_dir) == 2, "the dead server was noticed and replaced"

    wait_until(lambda: not alive(second), "an idle server ends by itself", timeout_s=150)
    assert read_state(server_dir) is None, "and leaves no state behind"


def run_multiprocess(deployment: Deployment, request: dg.RunRequest) -> dg.DagsterRun:
    """Runs what the driver asked for as the daemon would: each step in a process of its own."""
    job = dg.build_reconstructable_job(
        "anex_pipeline_tests.shared_engine_location",
        "job_named",
        reconstructable_args=(request.job_name,),
        reconstructor_working_directory=str(REPO),
    )
    tags = {**request.tags, "dagster/partition": request.partition_key}
    run_config = {**request.run_config, "loggers": QUIET_LOGGERS}
    with dg.execute_job(job, deployment.instance, run_config=run_config, tags=tags) as result:
        assert result.success, [str(e.event_specific_data)[-2500:] for e in result.all_events if e.is_failure]
        return result.dagster_run


@pytest.mark.engine
def test_a_jobs_step_processes_share_one_loaded_engine(
    tmp_path: Path, server_dir: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("ANEX_EXECUTOR", "multiprocess")  # each step a process of its own
    from anex_pipeline_tests.shared_engine_location import defs

    deployment = Deployment(defs, instance)
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"Count to {i}.") for i in range(6)])
    out = tmp_path / "out.jsonl"
    # No max_tokens: the estimate step runs on the engine too, before the two shards.
    config = {"input": str(src), "output": str(out), "options": {"shards": 2}}
    instance.add_dynamic_partitions(JOBS, ["shared"])
    submit = dg.RunRequest(partition_key="shared", run_config={"ops": {"validated_input": {"config": config}}})
    run_multiprocess(deployment, submit.with_replaced_attrs(job_name="submit_job"))
    engine_steps = 0
    for _ in range(10):
        requests = deployment.tick("job_driver").run_requests or []
        if not requests:
            break
        for request in requests:
            run_multiprocess(deployment, request)
            engine_steps += request.job_name in ("estimate_job", "shard_job")
    assert engine_steps == 3, "the estimate and two shards ran, each in step processes of their own"
    assert starts(server_dir) == 1, "the model was loaded once for every step"
    assert not _loaded, "and never in this process"
    rows = read_jsonl(out)
    assert [r["custom_id"] for r in rows] == [f"r{i}" for i in range(6)]
    assert all(r["response"]["status_code"] == 200 for r in rows)
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] for r in rows)
