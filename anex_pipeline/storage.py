"""Where inputs come from and results go: local paths, or ``s3://bucket/key`` URIs.

Results are published atomically: a local file is written beside its destination and renamed
into place; an S3 object appears whole when its upload completes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import uuid
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from anex_pipeline.errors import AnexError
from anex_pipeline.paths import default_work_root

if TYPE_CHECKING:
    from anex_pipeline.workdir.manifest import JobDir


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


class FileTooLarge(AnexError):
    """A file holds more bytes than its reader takes."""


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. Anything else (a FIFO, a device, a
    folder) raises ValueError at once: the file is opened non-blocking, so a FIFO with no writer is
    never waited on. A larger file raises FileTooLarge before it is read (and one that grows while
    it is read, once ``limit`` bytes are in)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file (a FIFO, a device or a folder)")
        if info.st_size > limit:
            raise FileTooLarge(f"{path} holds {info.st_size:,} bytes, over the limit of {limit:,}")
        data = f.read(limit + 1)
        if len(data) > limit:
            raise FileTooLarge(f"{path} holds more than {limit:,} bytes, the limit")
        return data


def split_s3(uri: str) -> tuple[str, str]:
    """Bucket and key, the key taken literally (a URL parser would cut it at '?' or '#')."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def unsafe_key(key: str) -> str | None:
    """Why an S3 key must not be written (a client or server that resolves ``..`` could put the
    object outside its prefix), or None when it is safe."""
    if "\0" in key:
        return "holds a NUL character"
    if len(key.encode("utf-8", "surrogatepass")) > 1024:
        return "is longer than S3's limit of 1,024 bytes"
    if any(part in ("", ".", "..") for part in key.split("/")):
        return "has an empty, '.' or '..' path segment"
    return None


def local_name(key: str) -> str:
    """A safe file name for a downloaded object: the last part of its key, in plain characters."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", PurePosixPath(key).name)[-100:].lstrip(".")
    return name or "input"


class OutputNotWritable(AnexError):
    """The result location cannot be written; the finished rows stay in the job's work folder."""


def publish(src: Path, dest: str, s3_client: Any = None) -> str:
    """Copies a finished file to its destination so that readers never see a part of it."""
    if is_s3(dest):
        if s3_client is None:
            raise OutputNotWritable(f"cannot write {dest}: no S3 client is configured")
        bucket, key = split_s3(dest)
        problem = unsafe_key(key)
        if problem:
            raise OutputNotWritable(f"cannot write {dest[:300]!r}: the key {problem}; choose another output key")
        s3_client.upload_file(str(src), bucket, key)
        return dest
    target = Path(dest).expanduser()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with src.open("rb") as fin, tmp.open("wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):  # the temp file may not even be creatable there
            tmp.unlink(missing_ok=True)
        raise OutputNotWritable(
            f"cannot write the result to {target}: {exc.strerror or exc}; the finished rows are kept in "
            f"{src.parent}: make the location writable (or choose another) and run the same command again, "
            "which publishes them without generating them again"
        ) from None
    return str(target)


def output_problem(dest: str, s3_client: Any = None) -> str | None:
    """Why a result could not be written to ``dest``, found before any work by writing and removing
    a small probe there (an S3 client with short timeouts and no retries keeps this quick); None
    when it can be written."""
    if is_s3(dest):
        if s3_client is None:
            return f"cannot write {dest}: no S3 client is configured"
        bucket, key = split_s3(dest)
        problem = unsafe_key(key)
        if problem:
            return f"cannot write {dest[:300]!r}: the key {problem}; choose another output key"
        prefix = key.rpartition("/")[0]
        probe = f"{prefix}/.anex-probe-{uuid.uuid4().hex}" if prefix else f".anex-probe-{uuid.uuid4().hex}"
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            s3_client.put_object(Bucket=bucket, Key=probe, Body=b"")
            s3_client.delete_object(Bucket=bucket, Key=probe)
        except (BotoCoreError, ClientError) as exc:
            return f"cannot write {dest}: {exc}; check the bucket name and the S3 credentials, or choose another output"
        return None
    target = Path(dest).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        cause = exc.strerror or exc
        return f"cannot write {target}: {cause}; make its folder writable or choose another location"
    return None


def localize_input(uri: str, dest_dir: Path, s3_client: Any = None) -> Path:
    """A local path for the input: the path itself, or a downloaded copy of an S3 object."""
    if not is_s3(uri):
        return Path(uri).expanduser()
    if s3_client is None:
        raise ValueError(f"cannot read {uri}: no S3 client is configured")
    from botocore.exceptions import BotoCoreError, ClientError

    from anex_pipeline.spec import JobRejected, Problem

    bucket, key = split_s3(uri)
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / local_name(key)
    tmp = target.with_name(f".{target.name}.partial")
    try:
        s3_client.download_file(bucket, key, str(tmp))
    except (BotoCoreError, ClientError) as exc:
        tmp.unlink(missing_ok=True)
        raise JobRejected([Problem(f"cannot read the input {uri}: {exc}")]) from None
    os.replace(tmp, target)
    return target


class StorageConfig(BaseModel):
    """The work folder for every job's shards and checkpoints, and S3 access for s3:// paths (the
    Dagster resource :class:`~anex_pipeline.orchestration.resources.StorageResource` carries the
    same fields)."""

    work_root: str = Field(default_factory=default_work_root, description="Folder for job work files.")
    s3_endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint; unset = AWS.")
    s3_region: str | None = None

    def job(self, job_id: str) -> JobDir:
        from anex_pipeline.workdir.manifest import JobDir

        return JobDir(Path(self.work_root).expanduser(), job_id)

    def local_input(self, uri: str, downloads: Path) -> Path:
        """The input as a local file: a path as it is, an s3:// object downloaded into a folder of
        ``downloads`` named after the URI (with the quick client: an endpoint that never answers
        refuses the job as soon as the output probe would)."""
        if not is_s3(uri):
            return Path(uri).expanduser()
        folder = downloads / hashlib.sha256(uri.encode()).hexdigest()[:16]
        return localize_input(uri, folder, self.s3_client(quick=True))

    def s3_client(self, quick: bool = False) -> Any:
        """A boto3 S3 client; ``quick`` bounds its timeouts and makes one attempt per call, for
        what submit does before a job is accepted (the output probe, the input's download, whose
        reads s3transfer still retries when a stream breaks) and must answer in seconds."""
        import boto3
        from botocore.config import Config

        config = Config(connect_timeout=5, read_timeout=10, retries={"total_max_attempts": 1}) if quick else None
        return boto3.client("s3", endpoint_url=self.s3_endpoint_url, region_name=self.s3_region, config=config)
