"""The one retry policy of every HTTP client here (anex_pipeline.net.retry), with no network."""

from __future__ import annotations

import email.utils
import random
import time

import pytest

from anex_pipeline.net.retry import RetryPolicy, retry_after_seconds, retryable_status


@pytest.mark.parametrize(("status", "again"), [(408, True), (429, True), (500, True), (503, True), (599, True)])
def test_timeouts_rate_limits_and_server_faults_are_tried_again(status: int, again: bool) -> None:
    assert retryable_status(status) is again


@pytest.mark.parametrize("status", [200, 301, 400, 401, 403, 404, 413, 422])
def test_answers_that_will_not_change_are_final(status: int) -> None:
    assert not retryable_status(status)


def test_a_request_gets_exactly_retries_further_tries() -> None:
    policy = RetryPolicy(retries=2)
    assert [policy.may_retry(n) for n in (1, 2, 3)] == [True, True, False]
    assert not RetryPolicy(retries=0).may_retry(1)


def test_backoff_doubles_per_try_is_capped_and_jittered_down_to_half(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = RetryPolicy(backoff_s=1.0, max_wait_s=5.0)
    monkeypatch.setattr(random, "uniform", lambda low, high: high)  # no jitter: the full wait
    assert [policy.backoff(n) for n in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    monkeypatch.setattr(random, "uniform", lambda low, high: low)  # the most jitter: half of it
    assert [policy.backoff(n) for n in range(5)] == [0.5, 1.0, 2.0, 2.5, 2.5]


def test_jittered_waits_stay_within_half_and_all_of_the_backoff() -> None:
    policy = RetryPolicy(backoff_s=0.2, max_wait_s=60.0)
    waits = [policy.backoff(3) for _ in range(200)]
    assert all(0.8 <= w <= 1.6 for w in waits)
    assert len(set(waits)) > 1  # clients that failed together do not come back together


def test_retry_after_in_seconds_and_as_an_http_date() -> None:
    assert retry_after_seconds("7") == 7.0
    assert retry_after_seconds("1.5") == 1.5
    assert retry_after_seconds("-3") == 0.0  # never a negative wait
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25.0 <= retry_after_seconds(later) <= 30.0  # type: ignore[operator]
    earlier = email.utils.formatdate(time.time() - 30, usegmt=True)
    assert retry_after_seconds(earlier) == 0.0


@pytest.mark.parametrize("value", [None, "", "soon", "Mon, 99 Foo 2024"])
def test_an_absent_or_unreadable_retry_after_is_none(value: str | None) -> None:
    assert retry_after_seconds(value) is None


def test_the_servers_retry_after_wins_over_the_backoff_and_is_not_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = RetryPolicy(backoff_s=1.0, max_wait_s=2.0)
    monkeypatch.setattr(random, "uniform", lambda low, high: high)
    assert policy.wait(0, "120") == 120.0
    assert policy.wait(3, "never") == 2.0  # unreadable: the backoff
    assert policy.wait(1) == 2.0
