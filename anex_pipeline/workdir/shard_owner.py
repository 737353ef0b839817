"""Which attempt at a shard may write its checkpoint: the one that claimed it last.

On a cluster, a node that froze or lost its network can come back and carry on with a shard that
a retry elsewhere has taken over meanwhile. Two writers on one checkpoint could lose rows: the
Arrow checkpoint cuts a file back to its last whole batch before it appends, which would cut off
a batch the other writer has half written, and JSON lines of two writers can interleave. So each
attempt claims the shard when it starts (writing a new owner token) and checks the token before
every append, under a lock that a claim takes too: once a later attempt has claimed the shard,
an earlier one cannot append another row, and fails with :class:`ShardTakenOver` instead.

The lock is ``flock`` on a file in the shard's folder, held only for one check and one append,
so it works wherever the work folder's ``flock`` does (local disks; NFS maps it onto its locks).
A reader of a running shard's rows takes it too, for as long as it copies the checkpoint
(:func:`copy_checkpoint`): the copy then holds whole appends only, each already on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from anex_pipeline.errors import AnexError
from anex_pipeline.workdir.locks import LockTimeout, locked
from anex_pipeline.workdir.manifest import atomic_write_text

OWNER_FILE = "owner.json"
LOCK_FILE = "owner.lock"
CLAIM_WAIT_S = 60.0  # a writer holds the lock for one append; longer than this, it is stuck


class ShardTakenOver(AnexError):
    """A later attempt has claimed the shard: this one must not write to it again."""


class ShardLocked(AnexError):
    """The shard's lock stayed held for longer than one append could take."""


class ShardOwner:
    """One attempt's claim on a shard's checkpoint (see the module)."""

    def __init__(self, shard_dir: Path, shard: int):
        self.shard_dir, self.shard = shard_dir, shard
        self.token = uuid.uuid4().hex
        self.host, self.pid = socket.gethostname(), os.getpid()

    @classmethod
    def claim(cls, shard_dir: Path, shard: int) -> ShardOwner:
        """Makes a new attempt the shard's owner; an append of the previous owner in progress
        finishes first, and none follows."""
        owner = cls(shard_dir, shard)
        shard_dir.mkdir(parents=True, exist_ok=True)
        with owner._locked():
            record = {"token": owner.token, "host": owner.host, "pid": owner.pid, "claimed_at": time.time()}
            atomic_write_text(shard_dir / OWNER_FILE, json.dumps(record))
        return owner

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Holds the shard for one write, after checking that this attempt still owns it."""
        with self._locked():
            self._check()
            yield

    def check(self) -> None:
        """Raises :class:`ShardTakenOver` when a later attempt has claimed the shard."""
        with self._locked():
            self._check()

    def _check(self) -> None:
        try:
            current = json.loads((self.shard_dir / OWNER_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            current = {}
        if current.get("token") != self.token:
            since = current.get("claimed_at")
            when = time.strftime("%H:%M:%S", time.localtime(since)) if isinstance(since, float) else "?"
            raise ShardTakenOver(
                f"shard {self.shard} was taken over at {when} by another attempt "
                f"(host {current.get('host', '?')}, pid {current.get('pid', '?')}) while this one "
                f"(host {self.host}, pid {self.pid}) was not heard from: this one writes no more rows, "
                "the other one finishes the shard"
            )

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            with locked(self.shard_dir / LOCK_FILE, timeout=CLAIM_WAIT_S):
                yield
        except LockTimeout:
            raise ShardLocked(
                f"shard {self.shard}'s checkpoint lock ({self.shard_dir / LOCK_FILE}) has been held for "
                f"{CLAIM_WAIT_S:.0f} s by a writer that does not go on (a frozen process?); "
                "end that process, or retry the shard"
            ) from None


def copy_checkpoint(shard_dir: Path, shard: int, source: Path, target: Path) -> None:
    """Copies a shard's checkpoint to ``target`` between two appends, under the lock every append
    takes: no append is half written in the copy, and none that could still be cut back (a write
    that fails is cut back before its writer lets go). A checkpoint not written yet copies as no
    file. What a writer killed mid-append left stays in the copy as it stays in the checkpoint, and
    the checkpoint's readers skip it alike."""
    if not shard_dir.is_dir():
        return
    owner = ShardOwner(shard_dir, shard)
    with owner._locked():
        try:
            with source.open("rb") as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except FileNotFoundError:
            target.unlink(missing_ok=True)
