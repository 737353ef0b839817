"""Receivers that hurt their sender on purpose: the webhook sender of ``serve`` reads no more of an
answer than its status and headers and a few KiB, ends each try at its deadline, and never makes
one event wait behind another's slow try. Real parts: the service (in a thread, or ``serve`` as
its own process), loopback receivers, the fake engine."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import httpx
import pytest
from dagster._core.instance.ref import InstanceRef

from anex_pipeline.batch_api.webhooks import WebhookSettings
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.batch_api import KEY_A, KEY_B, client, rows, serve_process, serving, submit, wait
from anex_pipeline_tests.harness.jobs import write_jsonl
from anex_pipeline_tests.harness.webhooks import SECRET, HugeBody, Trickle, no_event_pending, receiving

MIB = 2**20


def _memory(pid: int) -> dict[str, int]:
    """The process's resident size now (VmRSS) and at its peak (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM")}


def _deliveries(base_url: str) -> dict[str, float]:
    """The service's webhook tries so far, by result (``anex_webhook_deliveries_total``)."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    found = dict.fromkeys(("delivered", "failed", "dropped"), 0.0)
    for line in text.splitlines():
        if line.startswith('anex_webhook_deliveries_total{result="'):
            found[line.split('"')[1]] = float(line.split()[-1])
    return found


@pytest.mark.subprocess
def test_a_receiver_answering_a_huge_body_costs_serve_no_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver answers 200 and then 512 MiB, made as the connection takes them: the event is
    delivered, the sender stops reading after a few KiB, and serve's peak resident size (reset as
    the answer starts) grows by far less than the body."""
    huge = HugeBody(512 * MIB)
    with receiving(answers={0: huge}) as receiver:
        env = {"ANEX_WEBHOOK_URL": receiver.url, "ANEX_WEBHOOK_SECRET": SECRET}
        with serve_process(tmp_path, "--webhook-allowed-host", "127.0.0.1", env=env) as (process, url):
            sdk = client(url)
            batch = wait(sdk, submit(sdk, write_jsonl(tmp_path / "in.jsonl", rows(1)), {"max_tokens": 4}).id)
            assert huge.asked.wait(60), "the event was not sent"
            with open(f"/proc/{process.pid}/clear_refs", "w") as f:
                f.write("5")  # the peak resident size starts again from the present one
            before = _memory(process.pid)["VmRSS"]
            huge.go.set()
            assert huge.ended.wait(60), "the sender kept reading"
            monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
            with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(tmp_path / "dagster_home"))) as instance:
                no_event_pending(instance, str(tmp_path / "work"))
            grown = _memory(process.pid)["VmHWM"] - before
            assert _deliveries(url) == {"delivered": 1, "failed": 0, "dropped": 0}
    assert grown < 64 * MIB, f"serve's peak grew by {grown / MIB:.0f} MiB"
    assert huge.sent < 64 * MIB, f"the sender took {huge.sent / MIB:.0f} MiB of the answer"
    (headers, body, _) = receiver.requests[0]
    assert json.loads(body)["data"]["id"] == batch.id and headers["webhook-signature"].startswith("v1,")


@pytest.mark.slow
def test_a_trickling_receiver_is_cut_at_the_deadline_and_holds_up_no_other_event(
    tmp_path: Path, fake_runner: JobRunner
) -> None:
    """The first try gets its answer one byte a second, each byte well within any one read's
    timeout: the try still ends at its deadline, and the other tenant's batch's event, sent
    meanwhile, is delivered while the slow try is still open; the slow event is then tried again
    and delivered."""
    deadline_s = 6.0
    trickle = Trickle(pace_s=1.0)
    with receiving(answers={0: trickle}) as receiver:
        settings = WebhookSettings(receiver.url, SECRET, ("127.0.0.1",), retry_first_s=0.2, timeout_s=deadline_s)
        try:
            with serving(fake_runner, webhook=settings) as url:
                before = _deliveries(url)
                src = write_jsonl(tmp_path / "in.jsonl", rows(1))
                tenants = [client(url, KEY_A), client(url, KEY_B)]
                ids = [submit(sdk, src, {"max_tokens": 4}).id for sdk in tenants]
                assert [wait(sdk, i).status for sdk, i in zip(tenants, ids, strict=True)] == ["completed", "completed"]
                receiver.wait_for(2, timeout=deadline_s)  # the second event, while the first trickles
                assert trickle.ended.wait(deadline_s + 10), "the slow try did not end at its deadline"
                receiver.wait_for(3)  # the first event again, answered at once this time
                no_event_pending(fake_runner.instance, fake_runner.storage.work_root)
                after = _deliveries(url)
                assert {k: after[k] - before[k] for k in after} == {"delivered": 2, "failed": 1, "dropped": 0}
        finally:
            trickle.stop.set()
    assert trickle.closed_at is not None and receiver.arrived[1] < trickle.closed_at
    assert trickle.lasted is not None and deadline_s - 1 < trickle.lasted < deadline_s + 3
    first = json.loads(receiver.requests[0][1])
    assert json.loads(receiver.requests[2][1]) == first  # the same event, tried again
    assert sorted(e["data"]["id"] for e in receiver.delivered()) == sorted(ids)
