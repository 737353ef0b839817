"""The registry of file formats: detection by first bytes, names that contradict them, and the
names every caller reads from the format objects."""

from __future__ import annotations

from pathlib import Path

from anex_pipeline.formats.jsonl import JsonlFormat
from anex_pipeline.formats.parquet import ParquetFormat
from anex_pipeline.formats.registry import FORMATS, misnamed, sniff
from anex_pipeline.orchestration.inboxes import is_input_name
from anex_pipeline.stages.submit import default_report_path


def test_a_file_is_parquet_by_its_magic_and_jsonl_otherwise(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"PAR1rest")
    (tmp_path / "b").write_bytes(b'{"custom_id": "x"}\n')
    (tmp_path / "c").write_bytes(b"PA")  # shorter than the magic
    (tmp_path / "d").write_bytes(b"")
    assert isinstance(sniff(tmp_path / "a"), ParquetFormat)
    assert isinstance(sniff(tmp_path / "b"), JsonlFormat)
    assert isinstance(sniff(tmp_path / "c"), JsonlFormat)
    assert sniff(tmp_path / "d") is None


def test_a_name_that_contradicts_the_bytes_is_told() -> None:
    jsonl, parquet = FORMATS["jsonl"], FORMATS["parquet"]
    assert misnamed(Path("in.PARQUET"), jsonl) == (
        "in.PARQUET is named .parquet but is not a Parquet file (no PAR1 header); is it JSONL?"
    )
    assert misnamed(Path("in.parquet"), parquet) is None
    assert misnamed(Path("in.jsonl"), parquet) is None  # JSONL has no magic to contradict
    assert misnamed(Path("in.txt"), jsonl) is None


def test_every_format_is_registered_under_its_own_name_with_distinct_files() -> None:
    assert {name: type(f).name for name, f in FORMATS.items()} == {"jsonl": "jsonl", "parquet": "parquet"}
    files = [name for f in FORMATS.values() for name in (f.shard_file, f.checkpoint_file)]
    assert len(set(files)) == len(files)
    assert [f.error_field for f in FORMATS.values()] == ["error", "error_type"]


def test_suffixes_come_from_the_registry() -> None:
    assert default_report_path("out/r.parquet") == "out/r.report.json"
    assert default_report_path("out/r.jsonl") == "out/r.report.json"
    assert default_report_path("out/r.json") == "out/r.report.json"
    assert default_report_path("out/r") == "out/r.report.json"
    assert is_input_name("team/a.parquet") and is_input_name("team/a.JSONL") and not is_input_name("a.csv")
