"""Reading an HTTP ``Retry-After`` header, shared by the media fetcher and the HTTP engine."""

from __future__ import annotations

import email.utils
import time


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
