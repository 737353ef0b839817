"""When and how long to wait before trying an HTTP request again: the one policy of every HTTP
client here (the media fetcher, the HTTP engine and its servers' health probes).

A request that failed in a way that may pass (408, 429, a 5xx answer, a lost connection) is tried
again up to ``retries`` more times. Before each new try the client waits what the server asked for
in ``Retry-After`` (seconds or an HTTP date) or else backs off exponentially from ``backoff_s``,
doubling per try, capped at ``max_wait_s`` and jittered down to half so that clients that failed
together do not come back together.
"""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 4  # further tries after the first
    backoff_s: float = 1.0  # the first wait; doubles on every try
    max_wait_s: float = 60.0  # cap on one backoff wait

    def may_retry(self, failed_tries: int) -> bool:
        """Whether a request that has failed ``failed_tries`` times gets another try."""
        return failed_tries <= self.retries

    def backoff(self, attempt: int) -> float:
        """The jittered wait after the ``attempt``-th failure (0 for the first)."""
        return min(self.max_wait_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)

    def wait(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds before the next try: the server's ``Retry-After`` when it sent a readable one
        (not capped: the caller decides whether it waits that long), else the backoff."""
        asked = retry_after_seconds(retry_after)
        return self.backoff(attempt) if asked is None else asked


def retryable_status(status: int) -> bool:
    """An answer that may be different a moment later: timeout, rate limit or a server fault."""
    return status in (408, 429) or status >= 500


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds a server asked us to wait: ``Retry-After`` as seconds or as an HTTP date; None when
    the header is absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
