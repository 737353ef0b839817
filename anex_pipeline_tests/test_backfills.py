"""`dagster job backfill` on `shard_job`, the real command in its own process, against an instance on
disk: the backfill's runs land on the instance, and each shard redoes only its missing and failed
rows, as its materialization metadata and run log show. The project's workspace.yaml serves a
shard that needs no engine; the shards that generate go through the same code with the fake
engine (anex_pipeline_tests/harness/fake_location.py), since Dagster's run processes load the code
themselves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import dagster as dg
import pytest

from anex_pipeline.engine.base import EngineRequest, engine_failure
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.orchestration.assets import generations
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine, fake_engine
from anex_pipeline.workdir.manifest import unfinished_shards
from anex_pipeline_tests.harness.jobs import DAEMONLESS_INSTANCE_YAML, REPO, chat_row, write_jsonl


class FlakyEngine(FakeEngine):
    """Loses the rows whose id starts with "flaky" to an engine fault (status 500)."""

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        good = [r for r in requests if not r.key.startswith("flaky")]
        done = {o.index: o for o in super().run(good)}
        return [done.get(r.index) or engine_failure(r, "the engine restarted") for r in requests]


register_engine("flaky", lambda config, manifest: FlakyEngine(manifest.model_name))


@pytest.mark.subprocess
def test_dagster_job_backfill_redoes_only_missing_and_failed_rows(tmp_path: Path) -> None:
    home, work = tmp_path / "dagster_home", tmp_path / "work"
    home.mkdir()
    (home / "dagster.yaml").write_text(DAEMONLESS_INSTANCE_YAML)
    rows = [chat_row(f"r{i}", f"question {i}", max_tokens=9) for i in range(12)]
    rows[5], rows[6] = chat_row("flaky5", "question 5", max_tokens=9), chat_row("flaky6", "question 6", max_tokens=9)
    src = write_jsonl(tmp_path / "in.jsonl", rows)

    with dg.DagsterInstance.from_config(str(home)) as instance:
        # A job whose shard 1 (rows 4-7) has two failed rows and whose shard 2 (rows 8-11) lost its
        # last two rows (a process killed mid-shard).
        runner = JobRunner(instance, StorageResource(work_root=str(work)), fake_engine("flaky"))
        job = runner.submit(str(src), str(tmp_path / "out.jsonl"), {"shards": 3})
        runner.run(job)
        runner.close()
        checkpoint = job.checkpoint_path(2)
        checkpoint.write_text("".join(checkpoint.read_text().splitlines(keepends=True)[:2]))
        assert unfinished_shards(job) == [1, 2]

        def backfill(location: list[str], partitions: list[str]) -> dict[str, dict[str, object]]:
            """Runs the command; returns each partition's generations metadata."""
            command = [sys.executable, "-m", "dagster", "job", "backfill", *location, "-j", "shard_job"]
            command += ["--partitions", ",".join(partitions), "--noprompt"]
            env = {**os.environ, "DAGSTER_HOME": str(home), "ANEX_WORK_DIR": str(work)}
            done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stdout + done.stderr
            backfill_id = re.search(r"Launched backfill job `(\w+)`", done.stdout).group(1)  # type: ignore[union-attr]
            assert backfill_id in {b.backfill_id for b in instance.get_backfills()}
            runs = wait_for_runs(instance, backfill_id, len(partitions))
            assert sorted(r.tags["dagster/partition"] for r in runs) == partitions
            assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
            return {r.tags["dagster/partition"]: generations_metadata(instance, r) for r in runs}

        # The project's own code location: a shard with nothing to redo needs no engine.
        whole = f"{job.job_id}|00"
        metadata = backfill(["-w", str(REPO / "workspace.yaml")], [whole])[whole]
        assert metadata["kept_from_earlier_runs"] == 4 and metadata["generated"] == 0

        # The same code with the fake engine behind it: only the two missing and two failed rows run.
        partitions = [f"{job.job_id}|01", f"{job.job_id}|02"]
        redone = backfill(["-m", "anex_pipeline_tests.harness.fake_location", "-a", "defs"], partitions)
        for partition in partitions:
            metadata = redone[partition]
            assert metadata["kept_from_earlier_runs"] == 2 and metadata["generated"] == 2
            assert metadata["completed"] == 4 and metadata["failed"] == 0
            # Progress lines start once the engine is in hand, each with its rates: the two rows
            # kept from earlier runs are in the counts, never in a rate line of their own.
            assert metadata["log"] and metadata["log"][-1].startswith("4/4 rows done"), metadata["log"]
            assert all("rows/s" in line and not line.startswith("2/4") for line in metadata["log"]), metadata["log"]

    assert unfinished_shards(job) == []


def generations_metadata(instance: dg.DagsterInstance, run: dg.DagsterRun) -> dict[str, object]:
    """The run's `generations` materialization metadata, and its progress lines as "log"."""
    records = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records
    [generated] = [r.asset_materialization for r in records if r.asset_key == generations.key]
    assert generated and generated.partition == run.tags["dagster/partition"]
    log = [e.user_message for e in instance.all_logs(run.run_id) if " rows done" in e.user_message]
    return {**{k: v.value for k, v in generated.metadata.items()}, "log": log}


def wait_for_runs(instance: dg.DagsterInstance, backfill_id: str, count: int) -> Sequence[dg.DagsterRun]:
    """The backfill's runs, once all have ended (the command may return before they do)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
        if len(runs) == count and all(r.is_finished for r in runs):
            return runs
        time.sleep(1)
    raise AssertionError(f"backfill {backfill_id} did not finish within 300 s")
