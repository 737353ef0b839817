"""Names that come from input (custom_ids, file names, job ids, S3 keys, option values) never make
a job write outside its work folder or its output location / prefix."""

from __future__ import annotations

import json
import posixpath
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from anex_pipeline.errors import ExitCode
from anex_pipeline.orchestration.inboxes import S3InboxSettings, bucket_arrivals
from anex_pipeline.runner import JobRunner
from anex_pipeline.storage import OutputNotWritable, localize_input, publish, unsafe_key
from anex_pipeline.workdir.manifest import JobDir, make_job_id
from anex_pipeline_tests.harness.jobs import chat_row, run_job, write_jsonl

# Traversal pieces, absolute paths, separators, NUL, odd unicode and very long runs.
PIECES = ["..", "../", "/", "./", "\\..\\", "\x00", "%2e%2e%2f", "~", "\u202e", "\u00e9", "\U0001f600", "a" * 300]
hostile = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=12)), max_size=8).map("".join)
ESCAPE = f"/tmp/anex-escape-{uuid.uuid4().hex}"  # a file appearing here would be an escape


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


@settings(deadline=None)  # slow machines: no per-example time limit
@given(job_id=hostile)
@example(job_id="../../etc")
@example(job_id="/etc/cron.d/x")
@example(job_id="..")
@example(job_id="a/../../b")
@example(job_id="x" * 5000)
def test_a_job_id_is_one_folder_under_the_work_root_or_refused(job_id: str) -> None:
    root = Path("/srv/work")
    try:
        job = JobDir(root, job_id)
    except ValueError as exc:
        assert "cannot name a job folder" in str(exc)
        return
    assert job.root.parent == root and job.root.name == job_id and job_id not in (".", "..")


@settings(deadline=None)  # slow machines: no per-example time limit
@given(stem=hostile)
@example(stem="../../../etc/passwd")
@example(stem="\x00")
def test_job_ids_made_from_any_input_name_are_safe(stem: str) -> None:
    job = JobDir("/srv/work", make_job_id(Path(f"{stem}.jsonl"), "sha", {"model": stem}))
    assert job.root.parent == Path("/srv/work")


class RecordingS3:
    """The two calls of an S3 client that storage makes; downloads write a small JSONL file."""

    def __init__(self) -> None:
        self.uploaded: list[str] = []

    def download_file(self, bucket: str, key: str, filename: str) -> None:
        Path(filename).write_text(json.dumps(chat_row("a", "hi")) + "\n")

    def upload_file(self, filename: str, bucket: str, key: str) -> None:
        self.uploaded.append(key)


@settings(deadline=None)  # slow machines: no per-example time limit
@given(key=hostile)
@example(key="in/../../../../etc/passwd")
@example(key="..")
@example(key="a/..")
@example(key="")
@example(key="/abs/x.jsonl")
@example(key="x" * 600 + ".jsonl")
def test_a_downloaded_input_lands_in_the_job_folder(key: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "work" / "job" / "input"
        local = localize_input(f"s3://bucket/{key}", dest, RecordingS3())
        assert local.parent == dest and local.is_file()
        assert files_under(Path(tmp)) == {local}


@settings(deadline=None)  # slow machines: no per-example time limit
@given(name=hostile)
@example(name="../../../escape")
@example(name="a/./../b")
@example(name="a?x=1#/../../b")
@example(name="/" * 5)
@example(name="\x00")
def test_result_keys_stay_under_the_output_prefix(name: str) -> None:
    inbox = S3InboxSettings(bucket="bucket", prefix="in/", output_prefix="results/")
    obj = {"Key": f"in/{name}.jsonl", "LastModified": datetime.now(UTC), "ETag": '"e"'}
    arrivals = [a for a in bucket_arrivals([obj], inbox) if not a.refused]
    if not arrivals:  # a hidden name (not an input), or one whose result key would be unsafe or ambiguous
        return
    client = RecordingS3()
    with tempfile.NamedTemporaryFile() as src:
        publish(Path(src.name), arrivals[0].output, client)  # never refused: unsafe keys are skipped at arrival
    (key,) = client.uploaded
    assert key == arrivals[0].output.removeprefix("s3://bucket/")  # the key is taken literally
    assert key.startswith("results/") and posixpath.normpath(key).startswith("results/")
    assert unsafe_key(key) is None


IDS = ["../../../../x", "/etc/passwd", f"{ESCAPE}/a", "a\x00b", "\u202egnp.exe", "\U0001f600", "y" * 2000]


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(hostile.filter(bool), min_size=1, max_size=6, unique=True), stem=hostile)
@example(ids=IDS, stem="../../evil")
def test_a_job_on_hostile_names_writes_only_to_its_work_folder_and_output(
    tmp_path: Path, fake_runner: JobRunner, ids: list[str], stem: str
) -> None:
    # Deep folders, so that climbing out of the work folder or the output still lands in tmp_path.
    base = tmp_path / uuid.uuid4().hex / "a" / "b" / "c" / "d" / "e"
    inputs, out_dir = base / "inputs", base / "out"
    inputs.mkdir(parents=True)
    work = Path(fake_runner.storage.work_root)
    safe_stem = stem.replace("/", "_").replace("\x00", "_").encode()[:200].decode(errors="ignore")
    src = write_jsonl(inputs / f"{safe_stem}.jsonl", [chat_row(cid, f"say {n}") for n, cid in enumerate(ids)])
    options: dict[str, Any] = {  # what a sidecar could hold: strings that look like paths
        "system_prompt": f"{ESCAPE}/system",
        "stop": ["../../stop", ESCAPE],
        "prompt_column": "../../column",
    }
    before = files_under(tmp_path)

    report = run_job(fake_runner, src, out_dir / "result.jsonl", options)

    assert report.status == "completed"
    lines = (out_dir / "result.jsonl").read_bytes().split(b"\n")[:-1]  # only "\n" ends a JSONL line
    assert [json.loads(line)["custom_id"] for line in lines] == ids
    written = files_under(tmp_path) - before
    assert written and all(inside(p, work) or inside(p, out_dir) for p in written), sorted(map(str, written))
    assert not Path(ESCAPE).exists()


@pytest.mark.parametrize("job_id", ["../escape", "/etc", "a/b"])
def test_backfill_refuses_a_job_id_that_is_not_a_folder_name(
    job_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from anex_pipeline import cli

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    assert cli.main(["backfill", job_id, "--quiet"]) == ExitCode.REJECTED
    assert "cannot name a job folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "dest", ["s3://bucket/results/../x.jsonl", "s3://bucket/results//x.jsonl", "s3://bucket/a\x00b"]
)
def test_publish_refuses_keys_that_could_leave_their_prefix(tmp_path: Path, dest: str) -> None:
    src = tmp_path / "result.jsonl"
    src.write_text("{}\n")
    client = RecordingS3()
    with pytest.raises(OutputNotWritable, match="choose another output key"):
        publish(src, dest, client)
    assert client.uploaded == []
