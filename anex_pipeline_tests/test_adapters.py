"""LoRA adapters around the engine: the flag and the options, the checks at submit, how rows
choose an adapter, and what the HTTP engine, the machine's server, answer reuse, prefix order,
the report and the Batch API make of them. The real engine's side is test_engine_lora.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anex_pipeline.batch_api.requests import ServedModels
from anex_pipeline.batches.objects import ApiError
from anex_pipeline.cli import main
from anex_pipeline.engine.adapters import (
    AdapterError,
    adapter_rank,
    lora_kwargs,
    lora_modules_of,
    parse_lora_module,
)
from anex_pipeline.engine.base import Engine, EngineRequest, resolve_request
from anex_pipeline.engine.config import EngineSettings, HttpSettings
from anex_pipeline.engine.http.engine import OpenAIHttpEngine, ServerUnavailable, request_body
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL
from anex_pipeline.engine.prefix_order import PrefixCache, prefix_order
from anex_pipeline.engine.server.machine_server import server_command
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import InputRow, JobOptions, RowOutcome
from anex_pipeline.stages.generate_answer_book import fingerprint
from anex_pipeline.testing import fake_engine, shared_fake_engine
from anex_pipeline.validate import ModelNames, check_body
from anex_pipeline_tests.harness.batch_api import KEY_A, client, serving, wait
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, run_job, write_jsonl
from anex_pipeline_tests.harness.openai_server import SERVED, FakeServer


def adapter_folder(folder: Path, **config: Any) -> Path:
    """An adapter's configuration alone: what the checks at submit read (the weights are the
    engine's business, and the fake engine loads none)."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], **config}
    (folder / "adapter_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


class Recorder(Engine):
    """The fake engine, noting the adapter each row reached it with."""

    model_name = "fake-model"

    def __init__(self) -> None:
        self.adapters: dict[str, str | None] = {}

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        self.adapters.update({r.key: r.adapter for r in requests})
        return shared_fake_engine().run(requests)


RECORDER = Recorder()
BASE = DEFAULT_CHAT_MODEL
register_engine("lora-recorder", lambda config, manifest: RECORDER)


def test_the_flag_takes_vllms_two_spellings() -> None:
    assert parse_lora_module("sql=/models/sql-lora") == ("sql", "/models/sql-lora")
    assert parse_lora_module('{"name": "sql", "path": "org/sql-lora"}') == ("sql", "org/sql-lora")
    for bad in ("sql", "=path", "sql=", '{"name": "sql"}', "{not json"):
        with pytest.raises(AdapterError, match="--lora-modules"):
            parse_lora_module(bad)
    assert lora_modules_of(["a=/x", "b=/y", "a=/x"]) == {"a": "/x", "b": "/y"}
    with pytest.raises(AdapterError, match="twice"):
        lora_modules_of(["a=/x", "a=/z"])


def test_the_engine_is_sized_for_the_largest_adapter(tmp_path: Path) -> None:
    small, large = adapter_folder(tmp_path / "small", r=8), adapter_folder(tmp_path / "large", r=20)
    modules = {"s": str(small), "l": str(large)}
    assert lora_kwargs({}, on_cpu=True) == {}
    assert lora_kwargs(modules, on_cpu=False) == {
        "enable_lora": True,
        "max_loras": 2,
        "max_cpu_loras": 2,
        "max_lora_rank": 32,  # vLLM reserves 1, 8, 16, 32, ...: the first that holds rank 20
    }
    # the CPU build keeps a slot empty: its LoRA operations read a base row's slot as the last one
    assert lora_kwargs(modules, on_cpu=True)["max_loras"] == 3
    many = {f"a{n}": str(small) for n in range(12)}
    assert lora_kwargs(many, on_cpu=False)["max_loras"] == 8 and lora_kwargs(many, on_cpu=False)["max_cpu_loras"] == 12
    patterned = adapter_folder(tmp_path / "patterned", r=8, rank_pattern={"q_proj": 64})
    assert adapter_rank(str(patterned)) == 64


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: p, "has no adapter_config.json"),
        (lambda p: adapter_folder(p, r=1024), "rank 1024"),
        (lambda p: adapter_folder(p, use_dora=True), "DoRA"),
        (lambda p: adapter_folder(p, peft_type="PREFIX_TUNING"), "only LoRA"),
        (lambda p: adapter_folder(p, r=0), "positive integers"),
    ],
)
def test_an_adapter_vllm_would_refuse_is_refused_at_submit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, words: str
) -> None:
    folder = tmp_path / "adapter"
    folder.mkdir()
    make(folder)
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "Hi", model="mine")])
    for command in (["validate", str(src)], ["run", str(src), "-o", str(tmp_path / "out.jsonl")]):
        assert main([*command, "--lora-modules", f"mine={folder}"]) == 2
        err = capsys.readouterr().err
        assert "field 'lora_modules'" in err and "adapter 'mine'" in err and words in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_row_naming_an_unknown_adapter_is_refused_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = adapter_folder(tmp_path / "sql")
    rows = [chat_row("a", "Hi", model="sql"), chat_row("b", "Hi", model="sqll"), chat_row("c", "Hi")]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(["run", str(src), "-o", str(out), "--lora-modules", f"sql={folder}"]) == 2
    err = capsys.readouterr().err
    assert "line 2, field 'body.model'" in err and "'sqll'" in err and "adapters (sql)" in err, err
    assert "line 1" not in err and "line 3" not in err and "Traceback" not in err
    assert not out.exists()
    # without adapters a row naming another model says how to add one
    assert main(["validate", str(src)]) == 2
    assert "--lora-modules sql=PATH" in capsys.readouterr().err
    # a job-level adapter the job does not have
    assert main(["validate", str(src), "--lora-modules", f"sql={folder}", "--set", "adapter=nosuch"]) == 2
    err = capsys.readouterr().err
    assert "field 'adapter'" in err and "'nosuch'" in err


@pytest.mark.slow
def test_rows_choose_their_adapter_and_the_report_counts_rows_per_model(
    tmp_path: Path, instance: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    sql, chat = adapter_folder(tmp_path / "sql"), adapter_folder(tmp_path / "chat")
    storage = StorageResource(work_root=str(tmp_path / "work"))
    runner = JobRunner(instance, storage, fake_engine("lora-recorder"))
    rows = [
        chat_row("base", "Hi"),
        chat_row("named-base", "Hi", model=BASE),
        chat_row("sql-1", "Hi", model="sql"),
        chat_row("sql-2", "Ho", model="sql"),
        chat_row("chat", "Hi", model="chat"),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = {"lora_modules": {"sql": str(sql), "chat": str(chat)}}
    report = run_job(runner, src, tmp_path / "out.jsonl", options)
    assert report.status == "completed"
    assert RECORDER.adapters == {"base": None, "named-base": None, "sql-1": "sql", "sql-2": "sql", "chat": "chat"}
    assert report.rows_by_model == {BASE: 2, "chat": 1, "sql": 2}
    # a job-level adapter serves the rows that name no model (as every Parquet row)
    report = run_job(runner, src, tmp_path / "out2.jsonl", {**options, "adapter": "chat"})
    assert RECORDER.adapters["base"] == "chat" and RECORDER.adapters["named-base"] is None
    assert report.rows_by_model == {BASE: 1, "chat": 2, "sql": 2}
    assert len(read_jsonl(tmp_path / "out2.jsonl")) == 5


def request(body: dict[str, Any], **options: Any) -> EngineRequest:
    opts = JobOptions(lora_modules={"sql": "/a/sql", "chat": "/a/chat"}, **options)
    return resolve_request(InputRow(0, "k", body), "job", "chat", opts, 8, None)


def test_answer_reuse_and_prefix_order_keep_adapters_apart() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    base = request({"messages": messages, "temperature": 0})
    sql = request({"messages": messages, "temperature": 0, "model": "sql"})
    defaulted = request({"messages": messages, "temperature": 0}, adapter="chat")
    assert (base.adapter, sql.adapter, defaulted.adapter) == (None, "sql", "chat")
    assert len({fingerprint(base), fingerprint(sql), fingerprint(defaulted)}) == 3
    # the same long prompt on three models: only the two base rows can share cached blocks
    prompt = list(range(600))
    cache = PrefixCache(block_tokens=128, capacity_tokens=512)
    order = prefix_order([prompt, prompt, prompt, prompt], cache, ["sql", None, "chat", None])
    assert order is not None and order[:2] == [1, 3] and sorted(order[2:]) == [0, 2]
    assert prefix_order([prompt, prompt], cache, ["sql", None]) is None  # nothing shared at all


def test_the_http_engine_and_the_machine_server_pass_adapters_through(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert request_body(request({"messages": messages, "model": "sql"}), "base-model")["model"] == "sql"
    assert request_body(request({"messages": messages}, adapter="chat"), "base-model")["model"] == "chat"
    assert request_body(request({"messages": messages}), "base-model")["model"] == "base-model"
    sql = adapter_folder(tmp_path / "sql", r=16)
    settings = EngineSettings(model="/m", model_name="m", lora_modules=json.dumps({"sql": str(sql)}))
    command = server_command(settings, 8000)
    assert command[command.index("--lora-modules") + 1] == f"sql={sql.resolve()}"
    assert "--enable-lora" in command and command[command.index("--max-lora-rank") + 1] == "16"
    assert command[command.index("--max-loras") + 1] == "2"  # the CPU build's spare slot


def test_batches_name_the_operators_adapters_and_never_a_path(tmp_path: Path, instance: Any) -> None:
    sql = adapter_folder(tmp_path / "sql")
    storage = StorageResource(work_root=str(tmp_path / "work"))
    runner = JobRunner(instance, storage, fake_engine("lora-recorder", lora_modules={"sql": str(sql)}))
    served = ServedModels([], adapters=["sql"])
    assert "sql" in served.listed()
    rows = [chat_row("a", "Hi", model="sql"), chat_row("b", "Hi")]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with serving(runner) as url:
        sdk = client(url)
        with src.open("rb") as f:
            file_id = sdk.files.create(file=f, purpose="batch").id
        base = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        assert [m.id for m in sdk.models.list().data][-1] == "sql"
        for options, param in (
            ({"lora_modules": {"evil": "/etc"}}, "anex_options.lora_modules"),
            ({"lora_modules": {"sql": str(sql)}}, "anex_options.lora_modules"),
            ({"adapter": "/etc/passwd"}, "anex_options.adapter"),
        ):
            answer = httpx.post(
                f"{url}/batches", json={**base, "anex_options": options}, headers={"Authorization": f"Bearer {KEY_A}"}
            )
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
        done = wait(sdk, sdk.batches.create(**base).id)
        assert done.status == "completed", done
        assert RECORDER.adapters["a"] == "sql" and RECORDER.adapters["b"] is None
        # a row naming a path, or an adapter the operator does not serve, fails the batch at submit
        bad = write_jsonl(tmp_path / "bad.jsonl", [chat_row("a", "Hi", model=str(sql))])
        with bad.open("rb") as f:
            bad_id = sdk.files.create(file=f, purpose="batch").id
        failed = wait(sdk, sdk.batches.create(**{**base, "input_file_id": bad_id}).id)
        assert failed.status == "failed" and failed.errors is not None and failed.errors.data
        error = failed.errors.data[0]
        assert (error.line, error.param) == (1, "body.model") and "adapters (sql)" in (error.message or "")


hostile_names = st.one_of(
    st.sampled_from(["/etc/passwd", "../../adapters/x", "~/.ssh", "sql/../../etc", "SQL", "sql ", "\x00", ""]),
    st.text(max_size=40),
)


@settings(max_examples=200, deadline=None)
@given(name=hostile_names)
def test_a_tenant_adapter_outside_the_operators_list_is_one_400(name: str) -> None:
    served = ServedModels([], adapters=["sql"])
    if name == "sql":
        return
    with pytest.raises(ApiError) as refused:
        served.check_adapters({"adapter": name})
    assert (refused.value.status, refused.value.body["error"]["param"]) == (400, "anex_options.adapter")
    with pytest.raises(ApiError) as refused:
        served.check_adapters({"lora_modules": {"sql": name}})
    assert refused.value.body["error"]["param"] == "anex_options.lora_modules"


@settings(max_examples=200, deadline=None)
@given(name=hostile_names)
def test_a_row_naming_anything_but_the_jobs_model_or_adapters_is_refused_at_its_field(name: str) -> None:
    names = ModelNames(BASE, [], ["sql", "chat"])
    found = check_body({"model": name, "messages": [{"role": "user", "content": "Hi"}]}, "chat", names)
    if name in names:
        assert not found
    else:
        assert [p.field for p in found] == ["body.model"] and "chat, sql" in found[0].message


def test_a_parquet_job_runs_on_its_job_level_adapter(tmp_path: Path, instance: Any) -> None:
    sql = adapter_folder(tmp_path / "sql")
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["p1", "p2"], "prompt": ["Hi", "Ho"]}), src)
    runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "work")), fake_engine("lora-recorder"))
    options = {"lora_modules": {"sql": str(sql)}, "adapter": "sql"}
    report = run_job(runner, src, tmp_path / "out.parquet", options)
    assert report.status == "completed" and report.rows_by_model == {"sql": 2}
    assert RECORDER.adapters["p1"] == RECORDER.adapters["p2"] == "sql"


def test_a_model_server_without_the_jobs_adapters_is_refused_before_any_row() -> None:
    server = FakeServer()
    try:
        with pytest.raises(ServerUnavailable, match=r"without the job.s adapter\(s\) sql; start it with --enable-lora"):
            OpenAIHttpEngine(HttpSettings(base_url=server.url, model_name=SERVED, model_named=True, adapters=("sql",)))
        assert not server.received  # no row was sent
    finally:
        server.close()
