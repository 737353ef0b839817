"""Where inputs come from and results go: local paths, or ``s3://bucket/key`` URIs.

Results are published atomically: a local file is written beside its destination and renamed
into place; an S3 object appears whole when its upload completes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")


class OutputNotWritable(Exception):
    """The result location cannot be written; the finished rows stay in the job's work folder."""


def publish(src: Path, dest: str, s3_client: Any = None) -> str:
    """Copies a finished file to its destination so that readers never see a part of it."""
    if is_s3(dest):
        if s3_client is None:
            raise OutputNotWritable(f"cannot write {dest}: no S3 client is configured")
        bucket, key = split_s3(dest)
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
            f"{src.parent} and the job can be finished again once the location is writable"
        ) from None
    return str(target)


def localize_input(uri: str, dest_dir: Path, s3_client: Any = None) -> Path:
    """A local path for the input: the path itself, or a downloaded copy of an S3 object."""
    if not is_s3(uri):
        return Path(uri).expanduser()
    if s3_client is None:
        raise ValueError(f"cannot read {uri}: no S3 client is configured")
    bucket, key = split_s3(uri)
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / Path(key).name
    tmp = target.with_name(f".{target.name}.partial")
    s3_client.download_file(bucket, key, str(tmp))
    os.replace(tmp, target)
    return target
