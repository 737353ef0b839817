"""vLLM's engine arguments: read from vLLM's own source, checked before anything loads, the same
on the in-process engine, the machine server's command line and the sharing key, and recorded in
the report (the last test loads the real CPU engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from anex_pipeline.cli import main
from anex_pipeline.cli.parser import build_parser, engine_args_of
from anex_pipeline.engine.config import EngineConfig, EngineSettings
from anex_pipeline.engine.engine_args import (
    EngineArgError,
    canonical,
    check_engine_args,
    cli_flags,
    engine_arg_fields,
    engine_kwargs,
    parse_engine_arg,
)
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path
from anex_pipeline.engine.server.machine_server import server_command, settings_key
from anex_pipeline.engine.vllm import engine as vllm_engine
from anex_pipeline.stages.submit import default_report_path
from anex_pipeline_tests.harness.jobs import REPO, chat_row, read_jsonl, run_job, write_jsonl


def settings(**args: Any) -> EngineSettings:
    return EngineSettings(model="/models/m", model_name="m", engine_args=canonical(args))


# -- the names, from vLLM ------------------------------------------------------------------------


def test_the_names_are_exactly_the_fields_of_vllms_engine_args() -> None:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs  # seconds: only this test imports it

    declared = {f.name for f in dataclasses.fields(EngineArgs) if not f.name.startswith("_")}
    assert set(engine_arg_fields()) == declared
    assert {"tensor_parallel_size", "quantization", "kv_cache_dtype", "speculative_config"} <= declared


def test_rendered_flags_mean_the_same_arguments_to_vllms_own_parser() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = {
        "tensor_parallel_size": 2,
        "max_num_seqs": 7,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "kv_cache_dtype": "fp8",
        "quantization": "fp8",
        "trust_remote_code": True,
        "revision": "main",
        "max_num_batched_tokens": 4096,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        "allowed_media_domains": ["a.example", "b.example"],
    }
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", *cli_flags(args)]))
    assert {key: getattr(parsed, key) for key in args} == args


def test_the_machine_servers_command_line_parses_with_vllms_server_parser() -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    given = settings(max_num_seqs=3, enable_prefix_caching=False, tensor_parallel_size=1)
    command = server_command(given, 8123)
    assert command[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])
    assert (parsed.model, parsed.served_model_name, parsed.port) == ("/models/m", ["m"], 8123)
    assert (parsed.max_num_seqs, parsed.enable_prefix_caching, parsed.tensor_parallel_size) == (3, False, 1)
    assert (parsed.max_model_len, parsed.seed) == (-1, 0)  # the model's context, capped by the KV cache


# -- checking ------------------------------------------------------------------------------------


def test_a_misspelt_key_names_the_nearest_and_a_wrong_kind_of_value_is_refused() -> None:
    with pytest.raises(EngineArgError, match="did you mean max_num_seqs"):
        check_engine_args({"max_num_seqz": 2})
    with pytest.raises(EngineArgError, match="'tensor_parallel_size' must be an integer"):
        check_engine_args({"tensor_parallel_size": "two"})
    with pytest.raises(EngineArgError, match="must be true or false"):
        check_engine_args({"enable_prefix_caching": 1})
    assert check_engine_args({"tensor-parallel-size": 2, "max_num_seqs": None}) == {
        "tensor_parallel_size": 2,
        "max_num_seqs": None,
    }


@pytest.mark.parametrize("key", ["model", "runner", "seed", "max_model_len", "dtype", "gpu_memory_utilization"])
def test_keys_the_pipeline_sets_are_refused_with_what_to_use_instead(key: str) -> None:
    with pytest.raises(EngineArgError, match="set by the pipeline") as caught:
        EngineConfig(engine_args={key: "x"})
    assert any(word in caught.value.message for word in ("option", "--", "endpoint"))


def test_values_are_json_else_strings() -> None:
    assert parse_engine_arg("tensor_parallel_size=2") == ("tensor_parallel_size", 2)
    assert parse_engine_arg("enable_prefix_caching=false") == ("enable_prefix_caching", False)
    assert parse_engine_arg("quantization=fp8") == ("quantization", "fp8")
    assert parse_engine_arg('speculative_config={"method": "ngram"}') == ("speculative_config", {"method": "ngram"})
    with pytest.raises(EngineArgError, match="KEY=VALUE"):
        parse_engine_arg("tensor_parallel_size")


def test_the_common_flags_and_engine_arg_fill_one_set_of_engine_arguments() -> None:
    argv = ["run", "in.jsonl", "-o", "out.jsonl", "--engine-arg", "kv_cache_dtype=fp8", "--tensor-parallel-size", "4"]
    args = build_parser().parse_args([*argv, "--no-enable-prefix-caching", "--quantization", "fp8"])
    assert engine_args_of(args) == {
        "kv_cache_dtype": "fp8",
        "tensor_parallel_size": 4,
        "enable_prefix_caching": False,
        "quantization": "fp8",
    }
    assert engine_args_of(build_parser().parse_args(["serve"])) is None


def test_deployments_give_engine_arguments_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANEX_ENGINE_ARGS", '{"tensor_parallel_size": 2}')
    assert EngineConfig().engine_args == {"tensor_parallel_size": 2}
    assert EngineConfig(engine_args={}).engine_args == {}  # given ones win
    monkeypatch.setenv("ANEX_ENGINE_ARGS", '{"max_num_seqz": 2}')
    with pytest.raises(EngineArgError, match="did you mean max_num_seqs"):
        EngineConfig()
    monkeypatch.setenv("ANEX_ENGINE_ARGS", "[2]")
    with pytest.raises(EngineArgError, match="ANEX_ENGINE_ARGS must be a JSON object"):
        EngineConfig()


def run_cli(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], float]:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hi")])
    env = {**os.environ, "ANEX_WORK_DIR": str(tmp_path / "work"), "DAGSTER_HOME": str(tmp_path / "home")}
    env.pop("ANEX_ENGINE_ARGS", None)
    argv = [sys.executable, "-m", "anex_pipeline.cli", "run", str(src), "-o", str(tmp_path / "out.jsonl"), *flags]
    started = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - started


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("flag", "said"),
    [
        (
            "max_num_seqz=2",
            "engine argument 'max_num_seqz' is not one of vLLM's engine arguments; did you mean max_num_seqs?",
        ),
        (
            "model=x",
            "engine argument 'model' is set by the pipeline: "
            "the job's model comes from the 'model' job option (--model)",
        ),
    ],
    ids=["misspelt", "owned"],
)
def test_the_command_refuses_a_bad_engine_argument_in_seconds_without_loading(
    tmp_path: Path, flag: str, said: str
) -> None:
    done, elapsed = run_cli(tmp_path, "--engine-arg", flag)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {said}"], done.stderr
    assert elapsed < 10, f"{elapsed:.1f} s"
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "work").exists()


# -- one set of arguments everywhere -------------------------------------------------------------


def test_the_machine_server_gets_the_arguments_the_in_process_engine_gets() -> None:
    given = settings(tensor_parallel_size=2, enforce_eager=False, speculative_config={"method": "ngram"})
    kwargs = engine_kwargs(given, on_cpu=True)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["enforce_eager"] is False  # the user's win
    assert kwargs["max_model_len"] == -1 and kwargs["seed"] == 0  # auto-fit; the pipeline's seed
    command = server_command(given, 8123)
    flags = command[3:]
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    assert "--no-enforce-eager" in flags and "--enforce-eager" not in flags
    assert flags[flags.index("--speculative-config") + 1] == '{"method": "ngram"}'
    assert flags[flags.index("--max-model-len") + 1] == "-1"
    assert flags[flags.index("--served-model-name") + 1] == "m"


def test_engines_of_different_arguments_are_never_shared() -> None:
    one, same = settings(max_num_seqs=2, quantization="fp8"), settings(quantization="fp8", max_num_seqs=2)
    other = settings(max_num_seqs=3, quantization="fp8")
    assert one == same and hash(one) == hash(same) and settings_key(one) == settings_key(same)
    assert one != other and settings_key(one) != settings_key(other)
    assert settings_key(settings()) != settings_key(one)


def test_the_report_says_what_engine_the_rows_ran_on(fake_runner: Any, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hi")])
    report = run_job(fake_runner, src, tmp_path / "out.jsonl")
    assert report.engine is not None and report.engine["model"] == DEFAULT_CHAT_MODEL and report.engine["kind"]


# -- the real engine -----------------------------------------------------------------------------


@pytest.mark.engine
def test_run_with_engine_arguments_on_the_cpu_build_loads_them_and_reports_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command's --engine-arg reach the loaded engine's vllm_config, the report lists them,
    and an unset max_model_len gives the model's own context (8192 for SmolLM2)."""
    loaded: list[dict[str, Any]] = []
    real = vllm_engine.VllmLocalEngine

    def load(given: EngineSettings) -> Any:
        engine = real(given)
        config = engine.llm.llm_engine.vllm_config
        loaded.append(
            {
                "max_num_seqs": config.scheduler_config.max_num_seqs,
                "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                "max_model_len": config.model_config.max_model_len,
            }
        )
        return engine

    monkeypatch.setattr(vllm_engine, "VllmLocalEngine", load)
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.delenv("ANEX_ENGINE_ARGS", raising=False)
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"q{i}", f"Say {i}.") for i in range(3)])
    out = tmp_path / "out.jsonl"
    argv = ["run", str(src), "-o", str(out), "--max-tokens", "8", "--quiet"]
    code = main([*argv, "--engine-arg", "max_num_seqs=2", "--engine-arg", "enable_prefix_caching=false"])
    assert code == 0
    assert loaded == [{"max_num_seqs": 2, "enable_prefix_caching": False, "max_model_len": 8192}]
    assert all(row["response"]["status_code"] == 200 for row in read_jsonl(out))
    engine = json.loads(Path(default_report_path(str(out))).read_text())["engine"]
    assert engine["kind"] == "vllm" and engine["model"] == DEFAULT_CHAT_MODEL and engine["vllm_version"]
    assert engine["engine_args"]["max_num_seqs"] == 2 and engine["engine_args"]["enable_prefix_caching"] is False
    assert engine["engine_args"]["dtype"] == "float32"  # the pipeline's own arguments are listed too
    assert (engine["max_model_len"], engine["max_model_len_source"]) == (8192, "model")


@pytest.mark.subprocess
def test_engine_arguments_with_a_server_address_are_refused(tmp_path: Path) -> None:
    done, _ = run_cli(tmp_path, "--base-url", "http://127.0.0.1:9", "--tensor-parallel-size", "2")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "engine arguments (tensor_parallel_size) are for the model this command loads" in line


@pytest.mark.engine
def test_a_kv_cache_smaller_than_the_models_context_cuts_it_and_the_report_says_so() -> None:
    from anex_pipeline.engine.loader import load_engine, release_engines

    small = {"num_gpu_blocks_override": 12}  # 12 blocks of 128 tokens: under SmolLM2's 8192
    given = EngineSettings(
        model=str(local_model_path(DEFAULT_CHAT_MODEL)), model_name=DEFAULT_CHAT_MODEL, engine_args=canonical(small)
    )
    try:
        engine = load_engine(given)
        section = engine.report_section()
        cache = engine.llm.llm_engine.vllm_config.cache_config  # type: ignore[attr-defined]
        assert section["max_model_len_source"] == "kv_cache"
        assert section["max_model_len"] <= cache.num_gpu_blocks * cache.block_size < 8192
        assert section["engine_args"]["num_gpu_blocks_override"] == 12
    finally:
        release_engines()
