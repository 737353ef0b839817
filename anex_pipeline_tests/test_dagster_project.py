"""The example Dagster project (examples/dagster_project): it loads as `dagster dev` loads it, runs
end to end on the fake engine with its DuckDB IO manager (a step's table stored, and read back by a
downstream asset), and `dg` scaffolds an LLM step into it that `dg check defs` passes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import duckdb
import pytest
from dagster_duckdb_polars import DuckDBPolarsIOManager

from anex_pipeline.dagster import LlmEngineResource
from anex_pipeline_tests.harness.jobs import REPO

PROJECT = REPO / "examples" / "dagster_project"
BIN = Path(sys.executable).parent


def project_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "project"
    shutil.copytree(PROJECT, copy, ignore=shutil.ignore_patterns("*.duckdb", "__pycache__"))
    return copy


def test_the_example_runs_end_to_end_through_duckdb(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(project_copy(tmp_path)))
    from reviews_project.definitions import defs  # importable only once the copy is on the path

    loaded = defs()
    graph = loaded.resolve_asset_graph()
    assert graph.get(dg.AssetKey("label_check")).parent_keys == {dg.AssetKey("review_labels")}
    assert graph.get(dg.AssetKey("review_labels")).parent_keys == {dg.AssetKey("reviews")}
    database = str(tmp_path / "reviews.duckdb")
    result = dg.materialize(
        [a for a in loaded.assets if isinstance(a, dg.AssetsDefinition)],
        instance=instance,
        resources={
            "anex_llm": LlmEngineResource(kind="fake", work_root=str(tmp_path / "work"), machine_server=False),
            "io_manager": DuckDBPolarsIOManager(database=database),
        },
    )
    assert result.success
    summary = result.output_for_node("label_summary")
    assert summary["reviews"].sum() == 6  # read back from DuckDB by the downstream asset
    with duckdb.connect(database, read_only=True) as connection:
        labels = connection.execute("select * from public.review_labels order by id").pl()
    assert labels["id"].to_list() == list(range(6)) and labels["output"].null_count() == 0


def dagster_cli(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(project), "DAGSTER_HOME": str(project / ".home")}
    (project / ".home").mkdir(exist_ok=True)
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]], cwd=project, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.subprocess
def test_the_example_loads_as_dagster_dev_loads_it(tmp_path: Path) -> None:
    done = dagster_cli(project_copy(tmp_path), "dagster", "definitions", "validate", "-w", "workspace.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "All code locations passed validation" in done.stderr + done.stdout


@pytest.mark.subprocess
def test_dg_lists_scaffolds_and_checks_the_component(tmp_path: Path) -> None:
    project = project_copy(tmp_path)
    listed = dagster_cli(project, "dg", "list", "components", "--json")
    assert listed.returncode == 0 and "anex_pipeline.dagster.LlmBatchComponent" in listed.stdout, listed.stderr[-2000:]
    done = dagster_cli(
        project,
        "dg",
        "scaffold",
        "defs",
        "anex_pipeline.dagster.LlmBatchComponent",
        "review_topics",
        "--source",
        "reviews",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    written = (project / "reviews_project" / "defs" / "review_topics" / "defs.yaml").read_text()
    assert "type: anex_pipeline.dagster.LlmBatchComponent" in written and "source: reviews" in written
    checked = dagster_cli(project, "dg", "check", "defs")
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "All definitions loaded successfully" in checked.stdout + checked.stderr
    # A prompt naming a column the source lacks fails the check, naming the step and the column.
    (project / "reviews_project" / "defs" / "review_topics" / "defs.yaml").write_text(
        written.replace("# source_defs: reviews.py", "source_defs: reviews.py").replace("{text}", "{body}")
    )
    broken = dagster_cli(project, "dg", "check", "defs")
    assert broken.returncode != 0
    assert (
        "LLM step 'review_topics': the prompt names column 'body', which source 'reviews'"
        in broken.stdout + broken.stderr
    )
