"""One process of a race on the Batch API's store, for the tests that race processes.

Run as ``python -m anex_pipeline_tests.harness.store_racer HOME WORK ACTION ARGS_JSON``: it opens the
Dagster instance of HOME, prints ``{"ready": true}``, waits for a line on standard input, does the
action and prints ``{"result": ...}``. Processes that race go through each round together: each
waits at a :class:`FileBarrier` in a folder they share until all of them have arrived, so every
round is a real race. :class:`Racer` starts one such process from a test.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

ROUND_TIMEOUT_S = 60.0
RACER = (sys.executable, "-m", "anex_pipeline_tests.harness.store_racer")


class FileBarrier:
    """Rounds that ``parties`` processes enter together: each leaves a file named after the round
    and itself in ``folder``, then waits until every party's file is there."""

    def __init__(self, folder: str, name: str, parties: int):
        self.folder = Path(folder)
        self.name = name
        self.parties = parties

    def wait(self, round_name: str) -> None:
        (self.folder / f"{round_name}.{self.name}").touch()
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while len(list(self.folder.glob(f"{round_name}.*"))) < self.parties:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other racers never reached round {round_name}")
            time.sleep(0.0005)


def _store(instance: Any, work: str, keep_events: bool = False) -> Any:
    from anex_pipeline.batches.store import Store

    store = Store(instance, work)
    store.keep_events = keep_events
    return store


def create(instance: Any, work: str, args: dict[str, Any], barrier: FileBarrier) -> Any:
    """Creates a batch from the file with each idempotency key in turn: for each, the batch id it
    got, whether it was this process's own, and when the call started and ended."""
    from anex_pipeline_tests.harness.batch_records import batch_of

    store = _store(instance, work)
    file = store.file(args["owner"], args["file_id"])
    made = []
    for key in args["keys"]:
        barrier.wait(key)
        mine = batch_of(file)
        began = time.time()
        got = store.add_batch(mine, key)
        made.append({"key": key, "id": got.id, "mine": got.id == mine.id, "began": began, "ended": time.time()})
    return made


def make_from(instance: Any, work: str, args: dict[str, Any], barrier: FileBarrier) -> Any:
    """Makes a batch from each file in turn: ``created`` or the API error's status."""
    from anex_pipeline.batches.objects import ApiError, FileRecord
    from anex_pipeline_tests.harness.batch_records import batch_of

    store = _store(instance, work)
    outcomes = {}
    for file_id in args["file_ids"]:
        barrier.wait(file_id)
        record = batch_of(FileRecord(id=file_id, owner=args["owner"], filename="", purpose="", bytes=0, created_at=0))
        try:
            outcomes[file_id] = ("created", store.add_batch(record, None).id)
        except ApiError as exc:
            outcomes[file_id] = (exc.status, None)
    return outcomes


def delete(instance: Any, work: str, args: dict[str, Any], barrier: FileBarrier) -> Any:
    """Deletes each file in turn unless a batch uses it: ``deleted`` or the API error's status."""
    from anex_pipeline.batches.objects import ApiError

    store = _store(instance, work)
    outcomes = {}
    for file_id in args["file_ids"]:
        barrier.wait(file_id)
        try:
            store.remove_unused_file(args["owner"], file_id)
            outcomes[file_id] = "deleted"
        except ApiError as exc:
            outcomes[file_id] = exc.status
    return outcomes


def cancel(instance: Any, work: str, args: dict[str, Any], barrier: FileBarrier) -> Any:
    """Marks each batch cancelling, as a cancel does: whether the batch had ended already."""
    from anex_pipeline.batches.objects import now

    store = _store(instance, work, keep_events=True)
    ended = {}
    for batch_id in args["batch_ids"]:
        barrier.wait(batch_id)
        ended[batch_id] = store.update_batch(batch_id, cancelling_at=now()).finished
    return ended


def finalize(instance: Any, work: str, args: dict[str, Any], barrier: FileBarrier) -> Any:
    """Ends each batch as the worker's finalize does (cancelled if it saw a cancel, else
    completed): whether it saw the cancel."""
    from anex_pipeline.batches.objects import now

    store = _store(instance, work, keep_events=True)
    saw = {}
    for batch_id in args["batch_ids"]:
        barrier.wait(batch_id)
        record = store.update_batch(batch_id, finalizing_at=now())
        saw[batch_id] = record.cancelling_at is not None
        store.update_batch(batch_id, **{"cancelled_at" if saw[batch_id] else "completed_at": now()})
    return saw


def expire(instance: Any, work: str, args: dict[str, Any], barrier: FileBarrier) -> Any:
    """Ends each batch as expired, as the worker does when its window ends: its status after."""
    from anex_pipeline.batches.objects import now

    store = _store(instance, work, keep_events=True)
    statuses = {}
    for batch_id in args["batch_ids"]:
        barrier.wait(batch_id)
        statuses[batch_id] = store.update_batch(batch_id, expired_at=now()).status
    return statuses


def claim(instance: Any, work: str, args: dict[str, Any], barrier: FileBarrier) -> Any:
    """Claims each event in turn: the ones this process got."""
    from anex_pipeline.batches.objects import holder_name

    store, holder = _store(instance, work), holder_name("racer")
    got = []
    for event_id in args["event_ids"]:
        barrier.wait(event_id)
        if store.claim_event(event_id, holder, 300):
            got.append(event_id)
    return got


def hold(instance: Any, work: str, args: dict[str, Any], barrier: FileBarrier) -> Any:
    """Takes the batch's lease and renews it every quarter of its time until the process is killed
    (it never returns): prints whether it got the lease."""
    store = _store(instance, work)
    ttl_s = args["ttl_s"]
    _say({"held": store.take_up(args["batch_id"], args["holder"], ttl_s)})
    tick = threading.Event()
    while not tick.wait(ttl_s / 4):  # never set: the pace of the renewals
        if not store.renew(args["batch_id"], args["holder"], ttl_s):
            raise RuntimeError("the lease was lost while its holder was alive")


def take_over(instance: Any, work: str, args: dict[str, Any], barrier: FileBarrier) -> Any:
    """Tries to take the batch up until it wins or another taker holds it: whether it won, when."""
    from anex_pipeline.batches.objects import holder_name

    store, me = _store(instance, work), holder_name("taker")
    barrier.wait("take-over")
    deadline = time.monotonic() + args["within_s"]
    while time.monotonic() < deadline:
        if store.take_up(args["batch_id"], me, 60):
            return {"won": True, "holder": me, "at": time.time()}
        holder = store.lease(args["batch_id"])
        if holder is not None and holder[0] not in (me, args["dead"]):
            return {"won": False, "holder": me, "at": time.time()}
        time.sleep(0.01)
    return {"won": False, "holder": me, "at": None}


def open_store(instance: Any, work: str, args: dict[str, Any], barrier: FileBarrier) -> Any:
    """Opens the store (which makes its tables and moves earlier records in, once)."""
    barrier.wait("open")
    _store(instance, work)
    return True


ACTIONS: dict[str, Callable[[Any, str, dict[str, Any], FileBarrier], Any]] = {
    f.__name__: f for f in (create, make_from, delete, cancel, finalize, expire, claim, hold, take_over, open_store)
}


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    home, work, action, raw = sys.argv[1:5]
    args = json.loads(raw)
    barrier = FileBarrier(args["barrier"], args["name"], args["parties"])
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(home)) as instance:
        _say({"ready": True})
        sys.stdin.readline()
        _say({"result": ACTIONS[action](instance, work, args, barrier)})


class Racer:
    """A racing process started from a test: ``ready()`` once it has opened the instance,
    ``go()`` to start it, ``result()`` for what it did."""

    def __init__(self, home: Path, work: Path, action: str, log: Path, **args: Any):
        self.log = log
        self.process = subprocess.Popen(
            [*RACER, str(home), str(work), action, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("ab"),
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "DAGSTER_HOME": str(home)},
        )

    def line(self, timeout: float = 120) -> dict[str, Any]:
        """The process's next message (within ``timeout`` seconds)."""
        out: IO[bytes] = self.process.stdout  # type: ignore[assignment]
        ready, _, _ = select.select([out], [], [], timeout)
        text = out.readline() if ready else b""
        if not text:
            raise AssertionError(
                f"the racer ended, or said nothing within {timeout:g} s: {self.log.read_text()[-3000:]}"
            )
        return json.loads(text)

    def go(self) -> None:
        stdin: IO[bytes] = self.process.stdin  # type: ignore[assignment]
        stdin.write(b"go\n")
        stdin.flush()

    def result(self, timeout: float = 120) -> Any:
        found = self.line(timeout)["result"]
        assert self.process.wait(timeout) == 0, self.log.read_text()[-3000:]
        return found

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


if __name__ == "__main__":
    main()
