"""The client's retry, deadline and reply matching, against a scripted server on a real socket."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from wire import error, ok

from inferd import AsyncClient, Client, InvalidRequest, Overloaded, RetryPolicy, Timeout, Unavailable, protocol
from inferd.client.call import Call
from inferd.client.mailbox import Mailbox

X = np.arange(6, dtype=np.float32).reshape(2, 3)


FAST = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.05, jitter=0.2)


def test_retry_policy_defaults_of_design_md():
    assert RetryPolicy() == RetryPolicy(max_attempts=3, initial_delay=0.1, max_delay=1.0, jitter=0.2)


def test_backoff_doubles_up_to_the_cap_within_the_jitter():
    policy = RetryPolicy(max_attempts=10, initial_delay=0.1, max_delay=1.0, jitter=0.2)
    for attempt, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        delays = [policy.delay(attempt) for _ in range(200)]
        assert all(base * 0.8 - 1e-9 <= d <= base * 1.2 + 1e-9 for d in delays)
        assert max(delays) - min(delays) > 0, "no jitter"


def test_overloaded_is_retried_until_it_gets_through(server_factory):
    server = server_factory(lambda n, h, b: error(h, "overloaded") if n < 3 else ok(h, X * 2))
    with Client(server.endpoint, timeout=5.0, retry=FAST) as client:
        y = client.infer("m", X)
    np.testing.assert_array_equal(y, X * 2)
    assert len(server.headers) == 3
    assert len({h["id"] for h in server.headers}) == 1, "a retry must reuse the request id"
    timeouts = [h["timeout_ms"] for h in server.headers]
    assert timeouts == sorted(timeouts, reverse=True) and timeouts[0] <= 5000
    assert timeouts[-1] < timeouts[0], "each attempt carries the time left, which shrinks"


def test_unavailable_is_retried_and_gives_up_after_max_attempts(server_factory):
    server = server_factory(lambda n, h, b: error(h, "unavailable", "draining"))
    with Client(server.endpoint, timeout=5.0, retry=FAST) as client:
        with pytest.raises(Unavailable, match="draining"):
            client.infer("m", X)
    assert len(server.headers) == 3


def test_invalid_is_not_retried(server_factory):
    server = server_factory(lambda n, h, b: error(h, "invalid", "bad shape"))
    with Client(server.endpoint, timeout=5.0, retry=FAST) as client:
        with pytest.raises(InvalidRequest, match="bad shape"):
            client.infer("m", X)
    assert len(server.headers) == 1


def test_no_retry_starts_once_the_deadline_cannot_be_met(server_factory):
    server = server_factory(lambda n, h, b: error(h, "overloaded"))
    slow_backoff = RetryPolicy(max_attempts=5, initial_delay=2.0, max_delay=2.0, jitter=0.0)
    started = time.monotonic()
    with Client(server.endpoint, timeout=0.5, retry=slow_backoff) as client:
        with pytest.raises(Overloaded):
            client.infer("m", X)
    assert time.monotonic() - started < 1.5  # a retry would have waited its 2 s backoff first
    assert len(server.headers) == 1


def test_no_reply_at_all_is_a_timeout_at_the_deadline(server_factory):
    server = server_factory(lambda n, h, b: None)
    started = time.monotonic()
    with Client(server.endpoint, timeout=0.3, retry=FAST) as client:
        with pytest.raises(Timeout, match="no reply within 0.3 s"):
            client.infer("m", X)
    assert 0.25 < time.monotonic() - started < 2.0
    assert server.headers[0]["timeout_ms"] <= 300


def test_a_timeout_not_finite_and_above_zero_is_refused_and_a_huge_one_is_kept(server_factory):
    # inf and nan once killed the I/O thread (failing every call in flight, and the client), 1e30 overflowed
    # its poll, and 0 ran out before any connection, reported as "no daemon reachable".
    server = server_factory(lambda n, h, b: ok(h, X))
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds above zero, got inf"):
        Client(server.endpoint, timeout=float("inf"))
    with Client(server.endpoint, timeout=5.0) as client:
        for timeout in (float("inf"), float("nan"), 0, -1.0):
            with pytest.raises(ValueError, match="timeout must be a finite number of seconds above zero"):
                client.submit("m", X, timeout=timeout)
        np.testing.assert_array_equal(client.infer("m", X, timeout=1e30), X)
        np.testing.assert_array_equal(client.infer("m", X), X)
    assert server.headers[0]["timeout_ms"] > 1e32


def test_several_outputs_come_back_as_a_tuple_and_replies_match_by_id(server_factory):
    server = server_factory(lambda n, h, b: ok(h, np.frombuffer(b[0], np.float32) + h["id"], X))
    with Client(server.endpoint, timeout=5.0) as client:
        futures = [client.submit("m", X) for _ in range(50)]
        results = [f.result() for f in futures]
    for request_id, (first, second) in enumerate(results, start=1):
        np.testing.assert_array_equal(first, X.ravel() + request_id)
        np.testing.assert_array_equal(second, X)


def test_close_fails_what_is_in_flight(server_factory):
    server = server_factory(lambda n, h, b: None)
    client = Client(server.endpoint, timeout=30.0)
    future = client.submit("m", X)
    while not server.headers:
        time.sleep(0.01)
    client.close()
    with pytest.raises(Unavailable, match="closed"):
        future.result(timeout=5)


def test_async_client_retries_and_times_out(server_factory):
    retried = server_factory(lambda n, h, b: error(h, "overloaded") if n < 2 else ok(h, X))
    silent = server_factory(lambda n, h, b: None)

    async def main():
        async with AsyncClient(retried.endpoint, timeout=5.0, retry=FAST) as client:
            y = await client.infer("m", X)
        async with AsyncClient(silent.endpoint, timeout=0.2, retry=FAST) as client:
            with pytest.raises(Timeout):
                await client.infer("m", X)
        return y

    np.testing.assert_array_equal(asyncio.run(main()), X)
    assert len(retried.headers) == 2


def test_a_call_with_no_attempts_left_reports_the_dropped_connection():
    call = Call(1, lambda left_ms: protocol.encode_request(1, "m", [X], None, left_ms), 5.0,
                RetryPolicy(max_attempts=1))
    call.frames()
    outcome = call.missed()
    assert isinstance(outcome, Unavailable) and "connection" in outcome.message


def test_a_malformed_reply_is_dropped_and_the_client_serves_on(server_factory):
    server = server_factory(lambda n, h, b: [b"\xff not a reply"] if n == 1 else ok(h, X))
    with Client(server.endpoint, timeout=0.5, retry=FAST) as client:
        with pytest.raises(Timeout):
            client.infer("m", X)
        np.testing.assert_array_equal(client.infer("m", X), X)



def test_calls_beyond_the_send_queue_wait_for_room_not_for_their_deadline(server_factory):
    # A server that stops reading for a while: the queues on the way (the client's and
    # the server's, 1000 messages each, and the kernel's) fill, and the calls past them
    # must go out as they drain, not time out as if no daemon were reachable.
    server = server_factory(lambda n, h, b: ok(h, X))
    # The deadline only has to outlast the drain (~200 MB through a Python server: seconds on a
    # slow machine); a call that waited for a reconnect instead would miss any deadline.
    with Client(server.endpoint, timeout=30.0) as client:
        client.infer("m", X)  # connected
        server.reading.clear()
        big = np.zeros((1, 16384), dtype=np.float32)  # 64 KiB
        futures = [client.submit("m", big) for _ in range(3000)]
        time.sleep(1.0)
        server.reading.set()
        for future in futures:
            np.testing.assert_array_equal(future.result(), X)


def test_posting_past_a_full_wake_pipe_neither_blocks_nor_loses_a_post():
    # Nobody drains the wake pipe here, as when the I/O thread is busy or stopping: a post
    # that blocked on the full pipe would hold the mailbox lock the I/O thread needs to shut it.
    mailbox = Mailbox()
    posted = []
    poster = threading.Thread(target=lambda: posted.extend(mailbox.post(None) for _ in range(200_000)), daemon=True)
    poster.start()
    poster.join(timeout=20)
    assert not poster.is_alive(), "a post blocked on the wake pipe"
    mailbox.shut()
    assert all(posted) and len(posted) == 200_000 and mailbox.items.qsize() == 200_000
    assert mailbox.post(None) is False
    mailbox.close()
