"""Deadlines kept to the end: no `ok` leaves after a request's deadline, and a batch that cannot finish
in time for a request is not computed for it."""

from __future__ import annotations

import numpy as np
from wire import RawPeer

# `variable` computes about 1.7 us a step (measured here): 12,000 steps are a batch of ~20 ms, 60,000 one of
# ~100 ms.
VARIABLE = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 4, "warmup_batch_sizes": [1]}
STEPS_20_MS, STEPS_100_MS = 12_000, 60_000


def steps(count: int, samples: int = 1) -> np.ndarray:
    return np.full((samples, 2), count, dtype=np.float32)


def batches_computed(daemon) -> int:
    return daemon.call("stats")["workers"][0]["batches"]


def test_a_request_its_batch_cannot_finish_in_time_for_is_answered_timeout_and_not_computed(start_daemon):
    # One executor, one sample a batch, ~100 ms a batch. C (600 ms) is admitted with time enough: two
    # batches are ahead of it. Four urgent requests come after it and go first, so C is sent after five
    # batches, to follow a sixth, and would end at ~700 ms: C is answered then, and never computed.
    daemon = start_daemon({"variable": {**VARIABLE, "max_batch_size": 1}}, workers={"streams": 1})
    with RawPeer(daemon.endpoint) as peer:
        for i in range(5):  # the compute time is learned
            peer.send(i, "variable", [steps(STEPS_100_MS)], timeout_ms=5_000)
            assert peer.recv()[0]["status"] == "ok"
        before = batches_computed(daemon)
        for i in (10, 11):
            peer.send(i, "variable", [steps(STEPS_100_MS)], timeout_ms=5_000, priority=1)
        peer.send(20, "variable", [steps(STEPS_100_MS)], timeout_ms=600, priority=1)
        for i in range(30, 34):
            peer.send(i, "variable", [steps(STEPS_100_MS)], timeout_ms=5_000, priority=0)
        replies = {header["id"]: header for header, _ in (peer.recv() for _ in range(7))}
    late = replies.pop(20)
    assert late["status"] == "timeout", late
    assert "the request would finish after its deadline" in late["error"] and "it was not computed" in late["error"]
    assert {r["status"] for r in replies.values()} == {"ok"}, replies
    assert batches_computed(daemon) == before + 6, "C's batch was never computed"


def test_a_batch_that_finishes_after_a_deadline_answers_timeout_not_ok(start_daemon):
    daemon = start_daemon({"variable": VARIABLE})
    with RawPeer(daemon.endpoint) as peer:
        for i in range(10):
            peer.send(i, "variable", [steps(STEPS_20_MS)], timeout_ms=5_000)
            assert peer.recv()[0]["status"] == "ok"
        # Expected to take ~20 ms, so it starts; it takes ~500 ms, past its 100 ms deadline.
        peer.send(100, "variable", [steps(100_000)], timeout_ms=100)
        header, outputs = peer.recv()
    assert header["status"] == "timeout" and not outputs, header
    assert "its batch finished" in header["error"] and "ms after the request's deadline; the result was dropped" \
        in header["error"], header
    replies = daemon.call("status")["replies"]
    assert replies.get("timeout") == 1 and replies.get("ok") == 10, replies


def test_under_a_flood_with_short_deadlines_no_ok_leaves_after_its_deadline(start_daemon):
    daemon = start_daemon({"variable": VARIABLE})
    count, timeout_ms = 300, 60
    with RawPeer(daemon.endpoint) as peer:
        for i in range(count):
            peer.send(i, "variable", [steps(STEPS_20_MS)], timeout_ms=timeout_ms)
        replies = [peer.recv()[0] for _ in range(count)]
        assert peer.nothing_more()
    assert sorted(r["id"] for r in replies) == list(range(count)), "each request answered exactly once"
    ok = [r for r in replies if r["status"] == "ok"]
    assert ok and {r["status"] for r in replies} <= {"ok", "timeout", "overloaded"}
    late = [r["timing_us"]["total"] for r in ok if r["timing_us"]["total"] > timeout_ms * 1000]
    assert not late, f"{len(late)} ok replies left after their deadline: {late} us"
