"""LoRA adapters on the real vLLM engine (the CPU build here): two tiny random adapters of the
embedded model, built offline, served with the base model by one engine. At temperature 0 a row
on an adapter answers differently from the base model, and exactly as vLLM's own
``LLM.generate(..., lora_request=LoRARequest(...))`` does on that adapter, token for token."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest

from anex_pipeline.engine.loader import load_engine, release_engines, vllm_settings
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, prepare_default_chat_model
from anex_pipeline.engine.server.machine_server import server_for, stop_server
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobReport
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline_tests.harness.jobs import local_instance, read_jsonl, real_engine_resource, run_job, write_jsonl
from anex_pipeline_tests.harness.tiny_adapters import build_tiny_lora_adapter

pytestmark = pytest.mark.engine

PROMPTS = ["The capital of France is", "Water boils at"]
MAX_TOKENS = 6


def completion_row(cid: str, prompt: str, **body: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0, **body}
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = prepare_default_chat_model()
    folder = tmp_path_factory.mktemp("adapters")
    return {
        "terse": build_tiny_lora_adapter(folder / "terse", base, seed=1, rank=8),
        "wordy": build_tiny_lora_adapter(
            folder / "wordy", base, seed=2, rank=16, targets=("q_proj", "k_proj", "v_proj")
        ),
    }


def job_rows(adapters: dict[str, Path]) -> list[dict[str, Any]]:
    """Base rows and each adapter's rows on the same prompts."""
    rows = [completion_row(f"base-{n}", p) for n, p in enumerate(PROMPTS)]
    return rows + [completion_row(f"{name}-{n}", p, model=name) for name in adapters for n, p in enumerate(PROMPTS)]


def answers(out: Path) -> dict[str, dict[str, Any]]:
    lines = read_jsonl(out)
    assert all(line["error"] is None for line in lines), [line["error"] for line in lines]
    return {line["custom_id"]: line["response"]["body"] for line in lines}


@pytest.fixture(scope="module")
def in_process(
    tmp_path_factory: pytest.TempPathFactory, real_runner: JobRunner, adapters: dict[str, Path]
) -> tuple[JobReport, dict[str, dict[str, Any]], list[logging.LogRecord]]:
    """The mixed job on the in-process engine: its report, its answers and the loader's lines."""
    folder = tmp_path_factory.mktemp("lora-job")
    src = write_jsonl(folder / "in.jsonl", job_rows(adapters))
    options = {"lora_modules": {name: str(path) for name, path in adapters.items()}}
    handler = logging.Handler()
    records: list[logging.LogRecord] = []
    handler.emit = records.append  # type: ignore[method-assign]
    progress = logging.getLogger("anex_pipeline.progress")
    progress.addHandler(handler)
    level = progress.level
    progress.setLevel(logging.INFO)
    try:
        report = run_job(real_runner, src, folder / "out.jsonl", options)
    finally:
        progress.removeHandler(handler)
        progress.setLevel(level)
    assert report.status == "completed", report.failure_reason
    return report, answers(folder / "out.jsonl"), records


def test_base_rows_and_two_adapters_run_on_one_engine_and_match_vllms_own_lora_output(
    real_runner: JobRunner, adapters: dict[str, Path], in_process: Any
) -> None:
    report, bodies, records = in_process
    loads = [r for r in records if r.getMessage().startswith("loading ") and "into vLLM" in r.getMessage()]
    assert len(loads) == 1  # one engine for the base model and both adapters
    assert report.rows_by_model == {DEFAULT_CHAT_MODEL: 2, "terse": 2, "wordy": 2}
    assert report.engine is not None and report.engine["engine_args"]["enable_lora"] is True
    assert report.engine["engine_args"]["max_lora_rank"] == 16
    assert report.engine["engine_args"]["max_loras"] == 3  # a spare slot: base rows stay the base model's
    for n in range(len(PROMPTS)):
        assert bodies[f"base-{n}"]["model"] == DEFAULT_CHAT_MODEL
        texts = {name: bodies[f"{name}-{n}"]["choices"][0]["text"] for name in ("base", *adapters)}
        assert len(set(texts.values())) == 3, texts  # each adapter changes the answer
        for name in adapters:
            assert bodies[f"{name}-{n}"]["model"] == name

    # vLLM's own generate on the same engine, with its LoRARequest for each adapter
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    manifest = JobDir(Path(real_runner.storage.work_root), report.job_id).manifest()
    engine: Any = load_engine(vllm_settings(real_runner.engine.plain(), manifest))  # the loaded one
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    prompts = [TokensPrompt(prompt_token_ids=engine.tokenizer.encode(p)) for p in PROMPTS]
    requests: dict[str, Any] = {"base": None}
    for n, name in enumerate(sorted(adapters), 1):  # the ids the engine gave them: by name, from 1
        requests[name] = LoRARequest(name, n, str(adapters[name].resolve()))
    for name, request in requests.items():  # base rows too: no adapter may leak into them
        outputs = engine.llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        for n, out in enumerate(outputs):
            own = bodies[f"{name}-{n}"]["choices"][0]
            theirs = out.outputs[0]
            assert own["text"] == theirs.text
            tokens = [lp[t].decoded_token for t, lp in zip(theirs.token_ids, theirs.logprobs, strict=True)]
            assert own["logprobs"]["tokens"] == tokens  # token for token
            values = [lp[t].logprob for t, lp in zip(theirs.token_ids, theirs.logprobs, strict=True)]
            own_values = own["logprobs"]["token_logprobs"]
            assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(own_values, values, strict=True))


def test_the_machines_shared_server_serves_the_same_adapters(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    real_runner: JobRunner,
    adapters: dict[str, Path],
    in_process: Any,
) -> None:
    """The machine's model server for the job's engine settings (``vllm serve`` with
    ``--enable-lora`` and ``--lora-modules``), and the job again on it through the HTTP engine,
    which names each row's adapter: the same answers as in-process."""
    report, bodies, _ = in_process
    manifest = JobDir(Path(real_runner.storage.work_root), report.job_id).manifest()
    settings = vllm_settings(real_runner.engine.plain(), manifest)
    release_engines()  # the in-process engine's memory and cores go to the server
    folder = tmp_path / "machine-server"
    monkeypatch.setenv("ANEX_MACHINE_SERVER_DIR", str(folder))
    src = write_jsonl(tmp_path / "in.jsonl", job_rows(adapters))
    options = {"lora_modules": {name: str(path) for name, path in adapters.items()}}
    storage = StorageResource(work_root=str(tmp_path / "work"))
    try:
        server = server_for(settings, 300.0)
        with local_instance() as inst:
            runner = JobRunner(inst, storage, real_engine_resource(base_url=server.url, api_key=server.token))
            served_report = run_job(runner, src, tmp_path / "out.jsonl", options)
            runner.close()
    finally:
        stop_server(folder)
    assert served_report.status == "completed", served_report.failure_reason
    assert served_report.rows_by_model == report.rows_by_model
    served = answers(tmp_path / "out.jsonl")
    for key, body in bodies.items():
        assert served[key]["model"] == body["model"]
        own, theirs = served[key]["choices"][0], body["choices"][0]
        assert (own["text"], own["logprobs"]["tokens"]) == (theirs["text"], theirs["logprobs"]["tokens"]), key
