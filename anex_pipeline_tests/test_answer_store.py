"""Answers kept across the jobs of a work folder: a job rerun with a few rows changed generates
only those, counted as ``reused_from_earlier_jobs``; nothing is served across models, engine
settings or sampling, nor to a row that differs in any field of its request; the store is
pruned with the jobs and turned off by ``answer_store: false``."""

from __future__ import annotations

import json
import logging
import os
import pickle
import sqlite3
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from anex_pipeline.engine.base import resolve_request
from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.orchestration.job_admin import delete_job
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.request_fields import CHAT, COMPLETIONS, EMBEDDINGS, fields_of
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import InputRow, JobOptions, RowOutcome
from anex_pipeline.stages.generate_answer_book import fingerprint
from anex_pipeline.stages.generate_answer_store import AnswerStore, engine_identity
from anex_pipeline.testing import fake_engine, shared_fake_engine
from anex_pipeline.validate import check_body
from anex_pipeline.workdir.manifest import JobManifest
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, write_jsonl

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def rows(n: int, changed: frozenset[int] = frozenset(), **body: Any) -> list[dict[str, Any]]:
    return [
        chat_row(f"r{i}", f"question {i}" + (" (edited)" if i in changed else ""), max_tokens=12, temperature=0, **body)
        for i in range(n)
    ]


def run(runner: JobRunner, src: Path, out: Path, options: dict[str, Any] | None = None) -> Any:
    return runner.run(runner.submit(str(src), str(out), {"shards": 2, **(options or {})}))


def generated_during(action: Any) -> list[str]:
    engine = shared_fake_engine(MODEL)
    before = len(engine.seen)
    action()
    return engine.seen[before:]


@pytest.mark.slow
def test_a_rerun_with_some_rows_changed_generates_only_those(tmp_path: Path, fake_runner: JobRunner) -> None:
    first_out, second_out = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first_in = write_jsonl(tmp_path / "v1.jsonl", rows(20))
    assert len(generated_during(lambda: run(fake_runner, first_in, first_out))) == 20

    changed = frozenset({3, 11, 17})
    second_in = write_jsonl(tmp_path / "v2.jsonl", rows(20, changed))
    reports = []
    seen = generated_during(lambda: reports.append(run(fake_runner, second_in, second_out)))
    assert sorted(seen) == sorted(f"r{i}" for i in changed), "exactly the changed rows were generated"
    report = reports[0]
    assert report.reused_from_earlier_jobs == 17 and report.reused_answer_rows == 0
    assert report.status == "completed" and report.request_counts.completed == 20

    before, after = read_jsonl(first_out), read_jsonl(second_out)
    for i in range(20):
        old, new = before[i]["response"]["body"], after[i]["response"]["body"]
        if i not in changed:  # the earlier job's answer under this row's own response id
            assert new["choices"] == old["choices"] and new["id"] != old["id"]
        else:
            assert "(edited)" in new["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_no_answer_is_served_across_engine_settings_sampling_or_with_the_store_off(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    storage = StorageResource(work_root=str(tmp_path / "work"))
    src = write_jsonl(tmp_path / "in.jsonl", rows(6))
    first = JobRunner(instance, storage, fake_engine())
    run(first, src, tmp_path / "a.jsonl")

    # Each later job differs from the first in an option that shapes no answer (its id is another).
    same = JobRunner(instance, storage, fake_engine())
    assert generated_during(lambda: run(same, src, tmp_path / "b.jsonl", {"checkpoint_rows": 100})) == []
    other_engine = JobRunner(instance, storage, fake_engine(dtype="float32"))
    assert len(generated_during(lambda: run(other_engine, src, tmp_path / "c.jsonl", {"checkpoint_rows": 101}))) == 6
    # The same engine, but the store turned off for the job.
    assert len(generated_during(lambda: run(first, src, tmp_path / "d.jsonl", {"answer_store": False}))) == 6
    # Random sampling: never answered from the store, however often asked.
    random_in = write_jsonl(tmp_path / "random.jsonl", [chat_row(f"x{i}", "hi", temperature=0.8) for i in range(3)])
    run(first, random_in, tmp_path / "e.jsonl")
    assert len(generated_during(lambda: run(first, random_in, tmp_path / "f.jsonl", {"checkpoint_rows": 7}))) == 3


@pytest.mark.slow
def test_deleting_the_job_that_generated_answers_removes_them(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    storage = StorageResource(work_root=str(tmp_path / "work"))
    runner = JobRunner(instance, storage, fake_engine())
    src = write_jsonl(tmp_path / "in.jsonl", rows(4))
    report = run(runner, src, tmp_path / "a.jsonl")
    again = write_jsonl(
        tmp_path / "again.jsonl", [*rows(4), chat_row("extra", "another", temperature=0, max_tokens=12)]
    )
    assert generated_during(lambda: run(runner, again, tmp_path / "b.jsonl")) == ["extra"]

    runner.close()
    delete_job(instance, storage.job(report.job_id))
    # The same rows in another order (another input, so another job): "extra" is the second job's answer.
    third = write_jsonl(
        tmp_path / "third.jsonl", [chat_row("extra", "another", temperature=0, max_tokens=12), *rows(4)]
    )
    runner = JobRunner(instance, storage, fake_engine())
    assert sorted(generated_during(lambda: run(runner, third, tmp_path / "c.jsonl"))) == ["r0", "r1", "r2", "r3"]
    runner.close()


def test_the_store_is_bounded_and_keeps_the_newest_answers(tmp_path: Path) -> None:
    store = AnswerStore(tmp_path, "engine", "job", size_limit=1 << 20)
    big = {"choices": [{"message": {"role": "assistant", "content": "x" * 4000}}]}
    store.add((f"fp{i}", RowOutcome(i, f"k{i}", 200, body=big)) for i in range(600))  # about 2.4 MB of answers
    kept = [i for i in range(600) if store.get(f"fp{i}") is not None]
    store.close()
    assert 0 < len(kept) < 600 and 599 in kept and 0 not in kept
    assert sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()) < 2 << 20


# -- never served to a row that asks anything else -----------------------------------------------

BASE = {
    CHAT: {"messages": [{"role": "user", "content": "hello"}], "temperature": 0, "max_tokens": 16},
    COMPLETIONS: {"prompt": "hello", "temperature": 0, "max_tokens": 16},
    EMBEDDINGS: {"input": "hello"},
}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(0, 2, allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def manifest_for(endpoint: str, model: str = MODEL) -> JobManifest:
    return JobManifest(
        job_id="j", input="", input_sha256="", output="", report="", format="jsonl", endpoint=endpoint,
        model=model, model_name=model, options={}, total_rows=1, shards=[], submitted_at=0.0,
    )  # fmt: skip


def key_of(endpoint: str, body: dict[str, Any], options: JobOptions) -> str | None:
    req = resolve_request(InputRow(0, "k", body), "j", endpoint, options, options.max_tokens, None)  # type: ignore[arg-type]
    return fingerprint(req)


@pytest.mark.slow
@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(
    endpoint=st.sampled_from([CHAT, COMPLETIONS, EMBEDDINGS]),
    data=st.data(),
)
def test_a_row_differing_in_any_request_field_is_never_served(tmp_path: Path, endpoint: str, data: Any) -> None:
    """For every body field its endpoint takes (request_fields.py), a row whose value of it differs
    from the stored row's gets nothing from the store; nor does the same row under other job
    sampling defaults or on another engine."""
    name = data.draw(st.sampled_from(sorted(fields_of(endpoint))), label="field")
    base = BASE[endpoint]
    value = data.draw(JSON_VALUES, label="value")
    variant = {**base, name: value}
    assume(not check_body(variant, endpoint, frozenset({MODEL})))  # a row that passes the submit check
    options = JobOptions()
    config = EngineConfig(kind="fake")
    store = AnswerStore(tmp_path / data.draw(st.uuids()).hex, engine_identity(config, manifest_for(endpoint)), "j")
    try:
        stored = key_of(endpoint, base, options)
        assert stored is not None, "the base row is deterministic"
        store.add([(stored, RowOutcome(0, "k", 200, body={"answer": 1}))])
        asked = key_of(endpoint, variant, options)
        if asked is not None and store.get(asked) is not None:
            assert json.dumps(variant, sort_keys=True) == json.dumps(base, sort_keys=True), (name, value)

        if endpoint != EMBEDDINGS:  # the job's sampling defaults shape a generated answer too
            defaults = data.draw(st.sampled_from([{"top_p": 0.5}, {"seed": 3}, {"stop": "x"}, {"top_k": 2}]))
            asked = key_of(endpoint, base, JobOptions(**defaults))
            assert asked is None or store.get(asked) is None, defaults
    finally:
        store.close()


def test_weights_written_again_in_the_same_folder_are_another_identity(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"first")
    before = engine_identity(EngineConfig(), manifest_for(CHAT, model=str(model)))
    assert engine_identity(EngineConfig(), manifest_for(CHAT, model=str(model))) == before
    (model / "model.safetensors").write_bytes(b"second weights")
    assert engine_identity(EngineConfig(), manifest_for(CHAT, model=str(model))) != before


@pytest.mark.parametrize(
    "changed",
    [
        {"dtype": "float32"},
        {"max_model_len": 512},
        {"engine_args": {"quantization": "fp8"}},
        {"kind": "http", "base_url": "http://127.0.0.1:9"},
    ],
)
def test_another_engine_or_model_has_another_identity(changed: dict[str, Any]) -> None:
    base = engine_identity(EngineConfig(), manifest_for(CHAT))
    assert engine_identity(EngineConfig(**changed), manifest_for(CHAT)) != base
    assert engine_identity(EngineConfig(), manifest_for(CHAT, model="some/other-model")) != base
    assert engine_identity(EngineConfig(), manifest_for("responses")) != base
    assert engine_identity(EngineConfig(memory_share=0.5, kv_cache_gib=3), manifest_for(CHAT)) == base, (
        "sizing alone shapes no answer"
    )


# -- a store that others wrote ----------------------------------------------------------------------


class Touches:
    """A pickle that runs ``touch`` when unpickled: what a stored answer must never be able to do."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def test_unreadable_stored_answers_are_dropped_counted_and_generated_again(
    tmp_path: Path, fake_runner: JobRunner
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(6))
    run(fake_runner, src, tmp_path / "a.jsonl")
    ran = tmp_path / "code-ran"
    damage = [
        b"\x80\x04garbage that is no JSON",
        pickle.dumps("a pickled string"),
        json.dumps({"key": "r2", "status_code": 200}).encode(),  # a record without its row index
        pickle.dumps(Touches(ran)),
        json.dumps("a JSON string").encode(),
    ]
    table = tmp_path / "work" / "answer-store" / "answers.sqlite3"
    with sqlite3.connect(table) as db:
        keys = [key for (key,) in db.execute("SELECT key FROM answers ORDER BY key")]
        assert len(keys) == 6
        for key, value in zip(keys, damage, strict=False):
            db.execute("UPDATE answers SET value = ? WHERE key = ?", (value, key))

    reports = []
    generated = generated_during(
        lambda: reports.append(run(fake_runner, src, tmp_path / "b.jsonl", {"checkpoint_rows": 100}))
    )
    report = reports[0]
    assert report.status == "completed" and report.request_counts.completed == 6
    assert len(generated) == 5 and report.reused_from_earlier_jobs == 1
    assert report.unreadable_stored_answers == 5
    assert not ran.exists(), "a stored pickle ran code"
    with sqlite3.connect(table) as db:  # the damaged answers were replaced by the new ones
        values = [v for (v,) in db.execute("SELECT value FROM answers")]
    assert len(values) == 6 and all(json.loads(v)["status_code"] == 200 for v in values)


def test_a_store_folder_others_can_write_is_not_used(
    tmp_path: Path, fake_runner: JobRunner, caplog: pytest.LogCaptureFixture
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(4))
    run(fake_runner, src, tmp_path / "a.jsonl")
    folder = tmp_path / "work" / "answer-store"
    folder.chmod(0o777)
    try:
        with caplog.at_level(logging.WARNING):
            generated = generated_during(lambda: run(fake_runner, src, tmp_path / "b.jsonl", {"checkpoint_rows": 9}))
    finally:
        folder.chmod(0o700)
    assert len(generated) == 4, "no answer came from a folder anyone may write"
    assert any("may be written by other users (mode 0777)" in r.getMessage() for r in caplog.records)


def test_a_store_left_by_an_earlier_version_is_removed_and_never_read(tmp_path: Path) -> None:
    folder = tmp_path / "answer-store"
    (folder / "a1").mkdir(parents=True)
    (folder / "a1" / "big.val").write_bytes(pickle.dumps({"answer": 1}))
    (folder / "cache.db").write_bytes(b"SQLite format 3\x00 an old store")
    store = AnswerStore(tmp_path, "engine", "job")
    store.close()
    assert (folder / "answers.sqlite3").is_file()
    assert not (folder / "a1").exists() and not (folder / "cache.db").exists()


# -- what the identity leaves out ------------------------------------------------------------------

# EngineConfig fields that shape no answer: how the engine is sized or run, or where its client
# sends rows (base_url is in the identity: another server may serve another build of the model).
NOT_ANSWER_SHAPING = {
    "memory_share": 0.5,
    "kv_cache_gib": 3,
    "core_in_process_rows": 256,
    "api_key": "another-key",
    "max_concurrency": 7,
    "timeout_s": 5.0,
    # where the engine runs: the machine's shared server runs the same engine settings
    "machine_server": False,
    "machine_server_idle_s": 5.0,
    "warm_server": True,
    "keep_warm": True,
}
ANSWER_SHAPING = {
    "kind": "http",
    "dtype": "float32",
    "max_model_len": 512,
    "engine_args": {"quantization": "fp8"},
    "base_url": "http://127.0.0.1:9",
}
# The engine's adapters join each job's own at submit: they reach the identity through the job.
THROUGH_THE_JOB = {"lora_modules"}


def test_every_engine_setting_is_known_to_shape_the_answers_or_not() -> None:
    assert set(NOT_ANSWER_SHAPING) | set(ANSWER_SHAPING) | THROUGH_THE_JOB == set(EngineConfig.model_fields)


@pytest.mark.parametrize("name", sorted(ANSWER_SHAPING))
def test_settings_that_shape_answers_are_in_the_identity(name: str) -> None:
    base = engine_identity(EngineConfig(), manifest_for(CHAT))
    assert engine_identity(EngineConfig(**{name: ANSWER_SHAPING[name]}), manifest_for(CHAT)) != base


@pytest.mark.parametrize("name", sorted(NOT_ANSWER_SHAPING))
def test_settings_that_shape_no_answer_are_left_out_of_the_identity(name: str) -> None:
    base = engine_identity(EngineConfig(), manifest_for(CHAT))
    assert engine_identity(EngineConfig(**{name: NOT_ANSWER_SHAPING[name]}), manifest_for(CHAT)) == base


def test_jobs_either_side_of_the_in_process_core_limit_share_answers() -> None:
    """A job of 300 rows and a rerun of 200 of them: vLLM's engine core runs in the command's
    process for one and in processes of its own for the other, which changes no answer."""
    config = EngineConfig(core_in_process_rows=256)
    big, small = manifest_for(CHAT), manifest_for(CHAT)
    big.total_rows, small.total_rows = 300, 200
    assert engine_identity(config, big) == engine_identity(config, small)


def test_a_store_scope_shares_no_answer_with_another(tmp_path: Path) -> None:
    outcome = RowOutcome(0, "k", 200, body={"answer": 1})
    alice = AnswerStore(tmp_path, "engine", "job-a", scope="alice")
    alice.add([("fp", outcome)])
    bob, alice_again = (
        AnswerStore(tmp_path, "engine", "job-b", scope="bob"),
        AnswerStore(tmp_path, "engine", "j", scope="alice"),
    )
    try:
        assert bob.get("fp") is None and alice_again.get("fp") is not None
    finally:
        for store in (alice, bob, alice_again):
            store.close()
