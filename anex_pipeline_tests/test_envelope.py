"""The batch output envelope, built in one place for the JSONL result and the Batch API's files."""

from __future__ import annotations

import json

import msgspec

from anex_pipeline.formats import StoredOutcome
from anex_pipeline.formats.envelope import answered_line, unanswered_line


def test_a_row_that_ran_keeps_its_stored_body_byte_for_byte() -> None:
    body = b'{"id":"c1","choices":[{"message":{"content":"caf\xc3\xa9"}}],  "spaced" : 1}'
    line = answered_line(StoredOutcome(i=0, key="q-1", status_code=200, body=msgspec.Raw(body)))
    assert line == (
        b'{"id":"batch_req_q-1","custom_id":"q-1","response":{"status_code":200,"request_id":"req_q-1",'
        b'"body":' + body + b'},"error":null}\n'
    )


def test_a_failed_row_has_a_response_without_a_body_and_its_error() -> None:
    error = {"message": "too long", "type": "invalid_request_error", "code": "context_length_exceeded", "param": None}
    line = answered_line(StoredOutcome(i=3, key='k "ü"', status_code=400, error=error))
    assert line.endswith(b"\n") and b"\n" not in line[:-1]
    assert json.loads(line) == {
        "id": 'batch_req_k "ü"',
        "custom_id": 'k "ü"',
        "response": {"status_code": 400, "request_id": 'req_k "ü"', "body": None},
        "error": error,
    }
    assert "ü".encode() in line  # text stays UTF-8, not escaped


def test_a_row_that_never_ran_has_no_response() -> None:
    error = {"message": "not run", "type": "batch_error", "code": "batch_cancelled", "param": None}
    line = unanswered_line("ré-1", error)
    expected = {"id": "batch_req_ré-1", "custom_id": "ré-1", "response": None, "error": error}
    assert line == (json.dumps(expected, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
    none_status = answered_line(StoredOutcome(i=0, key="x", status_code=None, error=error))
    assert json.loads(none_status)["response"]["status_code"] is None
