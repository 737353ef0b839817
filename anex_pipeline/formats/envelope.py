"""The OpenAI batch output envelope of one row, the one line per row of a JSONL result and of the
Batch API's output and error files::

    {"id":"batch_req_<key>","custom_id":"<key>","response":{"status_code":..,"request_id":"req_<key>","body":..},"error":..}

A row that ran has a response (its body null when it failed); a row the Batch API never ran (a
cancelled or expired batch) has ``"response":null`` and its error. Lines are compact JSON, keys
in this order, text as UTF-8; the stored body passes through byte for byte.
"""

from __future__ import annotations

from typing import Any

import msgspec

from anex_pipeline.formats import StoredOutcome

_encode = msgspec.json.encode
_STATUS = {200: b"200", None: b"null"}
# The key goes in as JSON text without its opening quote, so that it follows a prefix.
_HEAD = b'{"id":"batch_req_%b,"custom_id":"%b,"response":'
_ANSWERED = _HEAD + b'{"status_code":%b,"request_id":"req_%b,"body":%b},"error":%b}\n'
_UNANSWERED = _HEAD + b'null,"error":%b}\n'


def answered_line(o: StoredOutcome) -> bytes:
    """The line of a row that ran: its response, and its error when it failed."""
    key = _encode(o.key)[1:]
    status = _STATUS.get(o.status_code) or _encode(o.status_code)
    body, error = (o.body, b"null") if o.error is None else (b"null", _encode(o.error))
    return _ANSWERED % (key, key, status, key, body, error)


def unanswered_line(key: str, error: dict[str, Any]) -> bytes:
    """The line of a row that never ran: no response, only the error."""
    quoted = _encode(key)[1:]
    return _UNANSWERED % (quoted, quoted, _encode(error))
