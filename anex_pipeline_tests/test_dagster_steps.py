"""LLM steps in a user's Dagster graph (anex_pipeline.dagster): a YAML step and a Python step over
a table, materialized on a Dagster instance; tables of each kind in and out; the column checks; a
step materialized again resumes its job; partitions. The fake engine here, the real one in the
tests marked engine (which share the session's engine: same settings, kept loaded)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.dagster import (
    FAILED_ROWS_CHECK,
    LlmBatchComponent,
    LlmEngineResource,
    StepDefinitionError,
    llm_batch_asset,
)
from anex_pipeline.dagster.step import ROW_COLUMNS
from anex_pipeline.engine import loader
from anex_pipeline.engine.models import DEFAULT_EMBEDDING_MODEL
from anex_pipeline.orchestration.job_admin import delete_job, list_jobs
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline_tests.harness import dagster_steps
from anex_pipeline_tests.harness.dagster_steps import judge_step, labels_step, review_texts, reviews_asset
from anex_pipeline_tests.harness.jobs import local_instance, real_engine_resource
from anex_pipeline_tests.harness.media import png_bytes
from anex_pipeline_tests.harness.tiny_models import write_config

DEFS = Path(dagster_steps.__file__)


def fake_llm(tmp_path: Path) -> LlmEngineResource:
    return LlmEngineResource(kind="fake", work_root=str(tmp_path / "work"), machine_server=False)


def materialize(assets: list[Any], llm: LlmEngineResource, instance: dg.DagsterInstance, **more: Any) -> Any:
    result = dg.materialize(assets, instance=instance, resources={"anex_llm": llm}, **more)
    assert result.success
    return result


def metadata(result: Any, node: str) -> dict[str, Any]:
    return {k: getattr(v, "value", v) for k, v in result.asset_materializations_for_node(node)[0].metadata.items()}


def test_two_steps_over_polars_keep_every_row_in_order(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    assets = [reviews_asset(6), *labels_step(), judge_step()]
    result = materialize(assets, fake_llm(tmp_path), instance)
    labels, checked = result.output_for_node("review_labels"), result.output_for_node("label_check")
    assert isinstance(labels, pl.DataFrame) and isinstance(checked, pl.DataFrame)
    assert checked["id"].to_list() == list(range(6)) and checked["text"].to_list() == review_texts(6)
    assert labels.columns == [
        "id",
        "text",
        "output",
        "error_type",
        "prompt_tokens",
        "completion_tokens",
        "finish_reason",
        "label",
    ]
    assert checked["verdict"].null_count() == 0 and checked["verdict_error_type"].null_count() == 6
    figures = metadata(result, "review_labels")
    assert figures["rows"] == 6 and figures["completed"] == 6 and figures["failed"] == 0
    assert figures["generated_now"] == 6 and figures["resumed"] is False
    graph = dg.Definitions(assets=assets, resources={"anex_llm": fake_llm(tmp_path)}).resolve_asset_graph()
    assert graph.get(dg.AssetKey("label_check")).parent_keys == {dg.AssetKey("review_labels")}
    assert graph.get(dg.AssetKey("review_labels")).parent_keys == {dg.AssetKey("reviews")}
    # The fake answers {"answer": <row>}, which the schema (label required) refuses: a format error
    # in every row, no label, and the step's check fails over its threshold of 0.
    assert figures["format_error_rows"] == 6 and labels["label"].null_count() == 6
    assert labels["error_type"].to_list() == ["format_error"] * 6
    checks = result.get_asset_check_evaluations()
    assert {(c.asset_key.to_user_string(), c.check_name, c.passed) for c in checks} == {
        ("review_labels", FAILED_ROWS_CHECK, False),
        ("label_check", FAILED_ROWS_CHECK, True),
    }


def test_a_second_materialization_resumes_and_generates_nothing(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    assets = [reviews_asset(5), *labels_step()]
    materialize(assets, fake_llm(tmp_path), instance)
    again = metadata(materialize(assets, fake_llm(tmp_path), instance), "review_labels")
    assert again["resumed"] is True and again["generated_now"] == 0 and again["kept_from_earlier_runs"] == 5


@pytest.mark.parametrize("kind", ["pandas", "pyarrow"])
def test_pandas_and_pyarrow_sources_give_the_same_kind(tmp_path: Path, instance: dg.DagsterInstance, kind: str) -> None:
    result = materialize([reviews_asset(4, kind), *labels_step()], fake_llm(tmp_path), instance)
    out = result.output_for_node("review_labels")
    if kind == "pandas":
        assert isinstance(out, pd.DataFrame) and list(out["id"]) == [0, 1, 2, 3]
        assert out["output"].notna().all()
    else:
        assert isinstance(out, pa.Table) and out.column("id").to_pylist() == [0, 1, 2, 3]
        assert out.column("output").null_count == 0


def test_a_missing_column_fails_at_definition_load_naming_asset_and_column() -> None:
    source = dg.AssetSpec(
        "reviews",
        metadata={
            "dagster/column_schema": dg.TableSchema(
                columns=[dg.TableColumn("id", "int"), dg.TableColumn("text", "string")]
            )
        },
    )
    with pytest.raises(ValueError, match="LLM step 'judge': the prompt names column 'body', which source 'reviews'"):
        llm_batch_asset(name="judge", source=source, prompt="{body}")
    component = LlmBatchComponent(asset="labels", source="reviews", prompt="{title}", columns=["id", "text"])
    with pytest.raises(ValueError, match="LLM step 'labels': the prompt names column 'title'"):
        dg.build_defs_for_component(component)


def test_a_source_known_by_key_is_checked_before_any_engine_loads(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    step = llm_batch_asset(name="late", source="reviews", prompt="{body}")
    result = dg.materialize(
        [reviews_asset(2), step], instance=instance, raise_on_error=False, resources={"anex_llm": fake_llm(tmp_path)}
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "LLM step 'late': the prompt names column 'body', which source 'reviews' does not have" in str(
        failure.step_failure_data.error.message
    )
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())


def test_a_daily_partitioned_source_gives_a_step_per_partition(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    days = dg.DailyPartitionsDefinition(start_date="2026-01-01", end_date="2026-01-03")

    @dg.asset(partitions_def=days)
    def reviews(context) -> pl.DataFrame:  # unannotated: this module defers annotations, Dagster reads them
        day = context.partition_key
        return pl.DataFrame({"day": [day, day], "text": [f"{day} good", f"{day} bad"]})

    step = llm_batch_asset(name="labels", source=reviews, prompt="{text}", options={"max_tokens": 20})
    assert step.partitions_def == days
    llm = fake_llm(tmp_path)
    outs = {}
    for day in ("2026-01-01", "2026-01-02"):
        outs[day] = materialize([reviews, step], llm, instance, partition_key=day).output_for_node("labels")
    for day, out in outs.items():
        assert out["day"].to_list() == [day, day] and out["output"].null_count() == 0
    # A step by key with no partitions of its own over this source would take every day at once: refused.
    by_key = llm_batch_asset(name="unpartitioned", source="reviews", prompt="{text}")
    refused = dg.materialize(
        [reviews, by_key], instance=instance, selection=[by_key], raise_on_error=False, resources={"anex_llm": llm}
    )
    failure = next(e for e in refused.all_events if e.event_type_value == "STEP_FAILURE")
    assert "LLM step 'unpartitioned' is not partitioned but its source 'reviews' is" in str(
        failure.step_failure_data.error.message
    )
    jobs = sorted(p.name for p in (tmp_path / "work").iterdir() if p.name.startswith("labels"))
    assert len(jobs) == 2 and "2026-01-01" in jobs[0] and "2026-01-02" in jobs[1]  # one job per partition


@pytest.mark.subprocess
def test_sigkill_during_generation_then_materialize_again_generates_no_checkpointed_row(tmp_path: Path) -> None:
    rows = 300
    env = {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path / "home"),
        "ANEX_TEST_ROWS": str(rows),
        "ANEX_TEST_CALLS_FILE": str(tmp_path / "calls.txt"),
        "ANEX_TEST_STEP_WORK": str(tmp_path / "work"),
        "ANEX_FAKE_ROW_DELAY_S": "0.02",
    }
    (tmp_path / "home").mkdir()
    command = [sys.executable, "-m", "dagster", "asset", "materialize", "--select", "*", "-f", str(DEFS)]
    victim = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    calls = tmp_path / "calls.txt"
    deadline = time.monotonic() + 180
    while (not calls.exists() or len(calls.read_text().splitlines()) < rows // 2) and time.monotonic() < deadline:
        assert victim.poll() is None, "the materialization ended before it was killed"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)  # the command and its step process
    victim.wait(timeout=30)
    before = len(calls.read_text().splitlines())
    assert rows // 2 <= before < rows

    again = subprocess.run(
        command, env={**env, "ANEX_FAKE_ROW_DELAY_S": "0"}, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    generated_again = len(calls.read_text().splitlines()) - before
    with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("review_labels"))
    figures = {k: getattr(v, "value", v) for k, v in event.asset_materialization.metadata.items()}
    assert figures["resumed"] is True and figures["kept_from_earlier_runs"] > 0
    # Only the rows not checkpointed before the kill were generated again.
    assert generated_again == figures["generated_now"] == rows - figures["kept_from_earlier_runs"]
    with (tmp_path / "home" / "storage" / "review_labels").open("rb") as stored:
        table = pickle.load(stored)
    assert table["id"].to_list() == list(range(rows)) and table["output"].null_count() == 0


@pytest.mark.engine
def test_three_steps_on_two_real_models_load_each_engine_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The YAML step labels with a JSON schema and the Python step judges the label, on the
    embedded chat model (the session's engine: the same settings as real_engine_resource, kept
    loaded); a third step embeds the judged texts with the embedded embedding model. Each model's
    engine is loaded once in the run, and each step's report is its own."""
    llm = LlmEngineResource(
        **{**real_engine_resource().model_dump(), "keep_loaded": True, "work_root": str(tmp_path / "work")}
    )
    engines: dict[str, set[int]] = {}
    vllm_factory = loader._factories["vllm"]

    def counted(config: Any, manifest: Any) -> Any:
        engine = vllm_factory(config, manifest)
        engines.setdefault(engine.model_name, set()).add(id(engine))
        return engine

    monkeypatch.setitem(loader._factories, "vllm", counted)
    embed = llm_batch_asset(
        name="verdict_vectors",
        source="label_check",
        prompt="{text} / {verdict}",
        output_column="vector",
        options={"endpoint": "embeddings", "model": DEFAULT_EMBEDDING_MODEL},
    )
    with local_instance() as instance:
        result = materialize([reviews_asset(4), *labels_step(), judge_step(), embed], llm, instance)
    assert len(engines) == 2 and all(len(objects) == 1 for objects in engines.values())
    vectors = result.output_for_node("verdict_vectors")
    assert vectors["vector"].null_count() == 0 and len(vectors["vector"][0]) == 384
    models = {node: metadata(result, node)["report"]["engine"]["model"] for node in ("label_check", "verdict_vectors")}
    assert models["label_check"] != models["verdict_vectors"]
    checked = result.output_for_node("label_check")
    assert checked["id"].to_list() == [0, 1, 2, 3] and checked["text"].to_list() == review_texts(4)
    assert set(checked["label"].to_list()) <= {"positive", "negative", "neutral"}
    assert checked["label"].null_count() == 0 and checked["error_type"].null_count() == 4
    assert checked["verdict"].null_count() == 0 and all(v.strip() for v in checked["verdict"].to_list())
    figures = metadata(result, "review_labels")
    assert figures["completed"] == 4 and figures["completion_tokens"] > 0 and figures["output_tokens_per_s"] > 0


@pytest.mark.subprocess
def test_a_backfill_of_two_daily_partitions_materializes_each_with_its_rows(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "run_coordinator: {module: dagster._core.run_coordinator, class: DefaultRunCoordinator}\n"
        "telemetry: {enabled: false}\n"
    )
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "ANEX_TEST_DAILY": "1",
        "ANEX_TEST_CALLS_FILE": str(tmp_path / "calls.txt"),
        "ANEX_TEST_STEP_WORK": str(tmp_path / "work"),
    }
    days = ["2026-01-01", "2026-01-02"]
    command = [
        sys.executable,
        "-m",
        "dagster",
        "job",
        "backfill",
        "-f",
        str(DEFS),
        "-j",
        "__ASSET_JOB",
        "--partitions",
        ",".join(days),
        "--noprompt",
    ]
    launched = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    with dg.DagsterInstance.from_config(str(home)) as instance:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # the backfill's runs go on in processes of their own
            runs = [r for r in instance.get_runs() if "dagster/backfill" in r.tags]
            if len(runs) == 2 and all(r.is_finished for r in runs):
                break
            time.sleep(0.5)
        assert sorted((r.tags["dagster/partition"], r.status.value) for r in runs) == [(day, "SUCCESS") for day in days]
    for day in days:
        with (home / "storage" / "review_labels" / day).open("rb") as stored:
            table = pickle.load(stored)
        assert table["day"].to_list() == [day, day] and table["output"].null_count() == 0


@pytest.mark.parametrize("endpoint", ["completions", "embeddings"])
def test_completions_and_embeddings_steps(tmp_path: Path, instance: dg.DagsterInstance, endpoint: str) -> None:
    step = llm_batch_asset(name="answers", source="reviews", prompt="Review: {text}", options={"endpoint": endpoint})
    out = materialize([reviews_asset(3), step], fake_llm(tmp_path), instance).output_for_node("answers")
    assert out["id"].to_list() == [0, 1, 2] and out["output"].null_count() == 0
    if endpoint == "embeddings":  # a vector column, and the prompt's tokens only
        assert isinstance(out.schema["output"], pl.List) and len(out["output"][0]) > 0
        assert "finish_reason" not in out.columns and out["prompt_tokens"].null_count() == 0
    else:
        assert out["output"].str.starts_with("answer to").all() and out["finish_reason"].null_count() == 0


def test_options_refused_at_submit_fail_the_step_in_one_line(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    step = llm_batch_asset(name="bad", source="reviews", prompt="{text}", options={"max_tokens": -3})
    result = dg.materialize(
        [reviews_asset(2), step], instance=instance, raise_on_error=False, resources={"anex_llm": fake_llm(tmp_path)}
    )
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    message = str(failure.step_failure_data.error.message)
    assert "LLM step 'bad'" in message and "max_tokens" in message


def step_failure(result: Any) -> str:
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    return str(failure.step_failure_data.error.message)


def job_input(llm: LlmEngineResource, result: Any, node: str) -> pa.Table:
    """The input file of the job a step ran: what its rows sent."""
    job = JobDir(llm.step_work_root(), metadata(result, node)["job_id"])
    return pq.read_table(job.step_files / "input.parquet")


def test_messages_system_prompt_and_an_image_column_reach_the_rows(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    pictures = [png_bytes(n) for n in range(3)]

    @dg.asset(name="reviews")
    def reviews() -> pa.Table:
        return pa.table({"text": review_texts(3), "tone": ["dry", "warm", "curt"], "picture": pictures})

    component = LlmBatchComponent.resolve_from_yaml(
        "asset: replies\nsource: reviews\nsystem_prompt: Answer in one line.\nimage_column: picture\n"
        "messages:\n  - {role: user, content: 'Review: {text}'}\n"
        "  - {role: assistant, content: 'Noted.'}\n  - {role: user, content: 'Reply in a {tone} tone.'}\n"
        "output_column: reply\n"
    )
    llm = fake_llm(tmp_path)
    step = next(iter(dg.build_defs_for_component(component).assets or []))
    assert step.specs_by_key[dg.AssetKey("replies")].metadata["anex/prompt"].startswith("user: Review: {text}")
    result = materialize([reviews, step], llm, instance)
    out = result.output_for_node("replies")
    assert out.column_names == ["text", "tone", "picture", "reply", *(f"reply_{c}" for c in ROW_COLUMNS)]
    assert out.column("reply_error_type").null_count == 3 and out.column("reply").null_count == 0
    sent = job_input(llm, result, "replies")
    assert sent.column("prompt").to_pylist()[1] == [
        {"role": "user", "content": f"Review: {review_texts(3)[1]}"},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Reply in a warm tone."},
    ]
    assert sent.column("image").to_pylist() == pictures
    job = JobDir(llm.step_work_root(), metadata(result, "replies")["job_id"])
    assert job.manifest().job_options().system_prompt == "Answer in one line."


def test_preprocess_and_postprocess_shape_each_row(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    def ask(row: dict[str, Any]) -> Any:
        return row["text"] if row["id"] % 2 else [{"role": "user", "content": f"Short: {row['text']}"}]

    def tidy(row: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        return {"words": len(answer["output"].split()), "row_id": row["id"]}

    step = llm_batch_asset(name="answers", source="reviews", preprocess=ask, postprocess=tidy)
    llm = fake_llm(tmp_path)
    result = materialize([reviews_asset(4), step], llm, instance)
    out = result.output_for_node("answers")
    assert out.columns[-2:] == ["words", "row_id"] and out["row_id"].to_list() == [0, 1, 2, 3]
    assert out["words"].to_list() == [len(t.split()) for t in out["output"].to_list()]
    sent = job_input(llm, result, "answers").column("prompt").to_pylist()
    assert sent[0] == [{"role": "user", "content": f"Short: {review_texts(4)[0]}"}]
    assert sent[1] == [{"role": "user", "content": review_texts(4)[1]}]  # a string is the user's message


def test_a_users_function_failing_fails_the_step_in_one_line_naming_the_row(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    def ask(row: dict[str, Any]) -> str:
        return row["text"] if row["id"] != 2 else ""

    step = llm_batch_asset(name="asks", source="reviews", preprocess=ask)
    result = dg.materialize(
        [reviews_asset(3), step], instance=instance, raise_on_error=False, resources={"anex_llm": fake_llm(tmp_path)}
    )
    assert "LLM step 'asks': preprocess gave row 2 str ''; it must give a non-empty prompt" in step_failure(result)

    def clash(row: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        return {"text": 1 / row["id"]}

    step = llm_batch_asset(name="after", source="reviews", prompt="{text}", postprocess=clash)
    result = dg.materialize(
        [reviews_asset(2), step], instance=instance, raise_on_error=False, resources={"anex_llm": fake_llm(tmp_path)}
    )
    assert "LLM step 'after': postprocess failed on row 0: ZeroDivisionError" in step_failure(result)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"prompt": "{text}", "messages": [{"role": "user", "content": "{text}"}]}, "exactly one of prompt, messages"),
        ({}, "give exactly one of prompt, messages and preprocess"),
        ({"messages": [{"role": "robot", "content": "{text}"}]}, r"messages\[0\] needs a role of system"),
        ({"messages": [{"role": "user", "content": "{title}"}]}, "a message names column 'title'"),
        ({"prompt": "{text}", "image_column": "photo"}, "image_column names column 'photo'"),
        ({"prompt": "{text}", "model": "a", "options": {"model": "b"}}, "model is given twice"),
    ],
)
def test_a_step_that_cannot_be_built_says_why_at_definition_load(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(StepDefinitionError, match=message):
        llm_batch_asset(name="s", source="reviews", columns=["id", "text"], **arguments)


def test_score_and_rerank_steps_give_scores_in_the_rows_order(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    @dg.asset(name="pairs")
    def pairs() -> pl.DataFrame:
        return pl.DataFrame(
            {
                "question": ["red apple pie", "blue sky today", "one two"],
                "answer": ["red apple pie", "green grass below", "one three"],
                "candidates": [["green grass", "red apple pie"], ["blue sky today"], ["x", "one two", "two"]],
            }
        )

    cross = write_config(tmp_path / "cross", architectures=["BertForSequenceClassification"], num_labels=1)
    score = LlmBatchComponent.resolve_from_yaml(
        f"asset: scored\nsource: pairs\nprompt: '{{question}}'\ndocument: '{{answer}}'\nmodel: {cross}\n"
        "output_column: score\noptions: {endpoint: score}\n"
    )
    rerank = llm_batch_asset(
        name="ranked",
        source="scored",
        prompt="{question}",
        documents_column="candidates",
        options={"endpoint": "rerank", "model": str(cross)},
    )
    result = materialize([pairs, *dg.build_defs_for_component(score).assets, rerank], fake_llm(tmp_path), instance)
    scored, ranked = result.output_for_node("scored"), result.output_for_node("ranked")
    assert (
        scored["score"].to_list() == [1.0, 0.0, pytest.approx(1 / 3)] and scored["score_error_type"].null_count() == 3
    )
    assert ranked["output"].to_list() == [[0.0, 1.0], [1.0], [0.0, 1.0, pytest.approx(0.5)]]
    assert ranked["score"].to_list() == scored["score"].to_list() and ranked["prompt_tokens"].null_count() == 0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"prompt": "{text}", "options": {"endpoint": "score"}}, "a score step pairs texts: give prompt"),
        (
            {"prompt": "{text}", "document": "{text}", "documents_column": "text", "options": {"endpoint": "rerank"}},
            "takes documents_column, not document",
        ),
        ({"prompt": "{text}", "documents_column": "docs", "options": {"endpoint": "rerank"}}, "documents_column names"),
        ({"prompt": "{text}", "document": "{text}"}, "document and documents_column are for score and rerank"),
    ],
)
def test_a_scoring_step_that_cannot_be_built_says_why(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(StepDefinitionError, match=message):
        llm_batch_asset(name="s", source="reviews", columns=["id", "text"], **arguments)


def test_deleting_a_steps_job_removes_its_rendered_input(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    llm = fake_llm(tmp_path)
    result = materialize(
        [reviews_asset(2), llm_batch_asset(name="answers", source="reviews", prompt="{text}")], llm, instance
    )
    job = JobDir(llm.step_work_root(), metadata(result, "answers")["job_id"])
    assert (job.step_files / "input.parquet").exists() and job.result_path.exists()
    assert [entry.job_id for entry in list_jobs(instance, llm.step_work_root())] == [job.job_id]
    delete_job(instance, job)
    assert not job.root.exists() and not job.step_files.exists()
