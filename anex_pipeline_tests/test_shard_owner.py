"""A shard writer that another attempt has taken over cannot write again (workdir/shard_owner.py).

A real second process claims a shard and writes to its checkpoint, is frozen (SIGSTOP) while
this process claims the shard and writes every row, and is thawed: its next write must fail with
ShardTakenOver and leave the checkpoint as the new owner wrote it, for both checkpoint forms.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from anex_pipeline.workdir.shard_owner import ShardOwner, ShardTakenOver
from anex_pipeline_tests.harness.checkpoints import append, latest_answers, outcomes
from anex_pipeline_tests.harness.jobs import REPO

TAKEN_OVER = 3


WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from anex_pipeline.workdir.shard_owner import ShardOwner, ShardTakenOver
    from anex_pipeline_tests.harness.checkpoints import append, outcomes

    shard_dir, kind = Path(sys.argv[1]), sys.argv[2]
    owner = ShardOwner.claim(shard_dir, 0)
    with owner.writing():
        append(shard_dir / "checkpoint", outcomes(range(0, 5), "first"), kind)
    print("wrote", flush=True)
    sys.stdin.readline()  # the test freezes us here, takes the shard over, thaws us and says go
    try:
        with owner.writing():
            append(shard_dir / "checkpoint", outcomes(range(5, 10), "zombie"), kind)
    except ShardTakenOver as exc:
        print(exc, flush=True)
        sys.exit({taken_over})
    """
).format(taken_over=TAKEN_OVER)


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", ["jsonl", "arrow"])
def test_a_frozen_writer_cannot_append_after_another_attempt_claimed_the_shard(tmp_path: Path, kind: str) -> None:
    shard_dir = tmp_path / "shards" / "00"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(shard_dir), kind],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline().strip() == "wrote"
        writer.send_signal(signal.SIGSTOP)

        retry = ShardOwner.claim(shard_dir, 0)
        with retry.writing():
            append(shard_dir / "checkpoint", outcomes(range(0, 10), "retry"), kind)

        writer.send_signal(signal.SIGCONT)
        writer.stdin.write("go\n")
        writer.stdin.flush()
        said, _ = writer.communicate(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert writer.returncode == TAKEN_OVER, said
    assert "taken over" in said and "writes no more rows" in said
    answers = latest_answers(shard_dir / "checkpoint", kind)
    assert sorted(answers) == list(range(10))
    assert all("retry" in answer for answer in answers.values()), answers
    retry.check()  # the new owner still owns it


def test_the_owner_token_is_checked_before_every_write(tmp_path: Path) -> None:
    first = ShardOwner.claim(tmp_path, 3)
    first.check()
    ShardOwner.claim(tmp_path, 3)
    with pytest.raises(ShardTakenOver, match="shard 3 was taken over"), first.writing():
        pytest.fail("a taken-over owner got to write")
