"""Scheduling against the real daemon: priority order and its no-starvation share, displacement when
the queue is full, cancellation (waiting and running, raw and through the clients), deadline-aware
admission, goodput, and the "auto" window.

`variable` runs one sample at a time on one executor, computing as many tiny steps as its input's
first value (about 5 us each), or held at a gate until the test opens it (tests/gates.py), so a test
decides how long each batch runs and in what order the waiting ones were taken: their replies come back
in that order.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import models
import numpy as np
import psutil
import pytest
from conftest import MLP, ONE_AT_A_TIME, Daemon, reference, until, wait_for
from gates import Gate
from test_observability import metrics_config, scrape
from wire import RawPeer

from inferd import AsyncClient, Client, RetryPolicy, protocol

QUICK = np.array([[1, 0]], dtype=np.float32)
LONG_MS = 60_000


def variable_daemon(start_daemon, **queue: Any) -> Daemon:
    return start_daemon({"variable": ONE_AT_A_TIME}, workers={"streams": 1}, queue=queue)


def stats(daemon: Daemon, model: str = "variable") -> dict[str, Any]:
    return daemon.call("stats")["models"][model]


def batches(daemon: Daemon) -> int:
    return sum(stats(daemon)["batch_size"]["distribution"].values())


def occupy(daemon: Daemon, peer: RawPeer, gate: Gate) -> None:
    """Keep the one executor busy: a batch held at `gate` and a quick one queued behind it, so what is sent
    next waits in the queue until the gate opens."""
    peer.send("block", "variable", [gate.input], timeout_ms=LONG_MS)
    peer.send("behind", "variable", [QUICK], timeout_ms=LONG_MS)
    wait_for(lambda: batches(daemon) == 2 and stats(daemon)["queue_depth"] == 0, what="the executor busy")


def replies(peer: RawPeer, count: int) -> list[dict[str, Any]]:
    return [peer.recv()[0] for _ in range(count)]


def computed_order(answers: list[dict[str, Any]]) -> list[Any]:
    return [a["id"] for a in answers if a["status"] == "ok" and a["id"] not in ("block", "behind")]


def test_urgent_requests_are_computed_before_the_default_level_waiting_ahead_of_them(start_daemon, gates):
    daemon = variable_daemon(start_daemon)
    with RawPeer(daemon.endpoint) as peer:
        occupy(daemon, peer, gate := gates())
        for rid in ("d1", "d2", "d3"):
            peer.send(rid, "variable", [QUICK], timeout_ms=LONG_MS)
        peer.send("u1", "variable", [QUICK], timeout_ms=LONG_MS, priority=0)
        peer.send("u2", "variable", [QUICK], timeout_ms=LONG_MS, priority=0)
        wait_for(lambda: stats(daemon)["queue_depth"] == 5)
        gate.open()
        assert computed_order(replies(peer, 7)) == ["u1", "u2", "d1", "d2", "d3"]
    levels = stats(daemon)["priorities"]
    assert levels["0"]["requests"] == {"ok": 2} and levels["1"]["requests"] == {"ok": 5}


@pytest.mark.parametrize("share, default_turn", [(0.25, 3), (0.01, 8)], ids=["share 0.25", "no share to speak of"])
def test_a_less_urgent_level_leads_its_share_of_batches_however_much_urgent_work_waits(
        start_daemon, gates, share, default_turn):
    """With priority_share 0.25 the default request leads the batch after the three it waited through;
    with a share too small to matter it waits behind all eight urgent ones (the rule is what serves it)."""
    daemon = variable_daemon(start_daemon, priority_share=share)
    with RawPeer(daemon.endpoint) as peer:
        occupy(daemon, peer, gate := gates())
        peer.send("default", "variable", [QUICK], timeout_ms=LONG_MS)
        for index in range(8):
            peer.send(f"u{index}", "variable", [QUICK], timeout_ms=LONG_MS, priority=0)
        wait_for(lambda: stats(daemon)["queue_depth"] == 9)
        gate.open()
        assert computed_order(replies(peer, 11)).index("default") == default_turn


def test_a_full_queue_displaces_the_newest_less_urgent_request_for_an_urgent_one(start_daemon, gates):
    daemon = variable_daemon(start_daemon, max_size=2)
    with RawPeer(daemon.endpoint) as peer:
        occupy(daemon, peer, gate := gates())
        peer.send("d1", "variable", [QUICK], timeout_ms=LONG_MS)
        peer.send("d2", "variable", [QUICK], timeout_ms=LONG_MS)
        wait_for(lambda: stats(daemon)["queue_depth"] == 2)
        peer.send("urgent", "variable", [QUICK], timeout_ms=LONG_MS, priority=0)
        displaced = peer.recv()[0]
        assert displaced["id"] == "d2" and displaced["status"] == "overloaded"
        assert "displaced by a more urgent request (priority 0)" in displaced["error"]
        peer.send("d3", "variable", [QUICK], timeout_ms=LONG_MS)
        refused = peer.recv()[0]
        assert refused["id"] == "d3" and refused["status"] == "overloaded" and "queue is full" in refused["error"]
        gate.open()
        answers = replies(peer, 4)
        assert computed_order(answers) == ["urgent", "d1"]
        assert peer.nothing_more(0.2), "every request had exactly one reply"
    assert stats(daemon)["priorities"]["1"]["requests"] == {"ok": 3, "overloaded": 2}


def test_a_cancelled_waiting_request_is_answered_at_once_and_never_computed(start_daemon, gates):
    daemon = variable_daemon(start_daemon)
    with RawPeer(daemon.endpoint) as peer:
        occupy(daemon, peer, gate := gates())
        peer.send("doomed", "variable", [QUICK], timeout_ms=LONG_MS)
        peer.send("kept", "variable", [QUICK], timeout_ms=LONG_MS)
        wait_for(lambda: stats(daemon)["queue_depth"] == 2)
        peer.send_frames([protocol.encode_op(protocol.Cancel(id="doomed"))])
        first = peer.recv()[0]
        assert first["id"] == "doomed" and first["status"] == "cancelled", "answered before the long batch ends"
        assert "cancelled by its client before it ran" in first["error"]
        peer.send_frames([protocol.encode_op(protocol.Cancel(id="doomed"))])  # again, and of an unknown id:
        peer.send_frames([protocol.encode_op(protocol.Cancel(id="never-sent"))])  # nothing happens
        gate.open()
        assert [a["id"] for a in replies(peer, 3)] == ["block", "behind", "kept"]
        assert peer.nothing_more(0.2)
    assert batches(daemon) == 3, "block, behind and kept: the cancelled one never ran"
    assert stats(daemon)["requests"] == {"ok": 3, "cancelled": 1}


def test_a_cancel_from_another_connection_touches_nothing(start_daemon, gates):
    daemon = variable_daemon(start_daemon)
    with RawPeer(daemon.endpoint) as peer, RawPeer(daemon.endpoint) as other:
        occupy(daemon, peer, gate := gates())
        peer.send("mine", "variable", [QUICK], timeout_ms=LONG_MS)
        wait_for(lambda: stats(daemon)["queue_depth"] == 1)
        other.send_frames([protocol.encode_op(protocol.Cancel(id="mine"))])
        assert other.barrier() == [], "the cancel was read, and answered nothing"
        gate.open()
        assert computed_order(replies(peer, 3)) == ["mine"]
        assert other.nothing_more(0.1)


def test_a_cancelled_running_request_finishes_and_its_result_is_dropped(start_daemon, gates):
    daemon = variable_daemon(start_daemon)
    with RawPeer(daemon.endpoint) as peer:
        gate = gates()
        peer.send("running", "variable", [gate.input], timeout_ms=LONG_MS)
        wait_for(lambda: batches(daemon) == 1 and stats(daemon)["queue_depth"] == 0)
        peer.send_frames([protocol.encode_op(protocol.Cancel(id="running"))])
        assert peer.barrier() == [], "answered once its batch is back"
        gate.open()
        answer, outputs = peer.recv()
        assert answer["id"] == "running" and answer["status"] == "cancelled" and outputs == []
        assert "cancelled while its batch ran; the result was dropped" in answer["error"]
        peer.send("after", "variable", [QUICK])
        after, outputs = peer.recv()
        assert after["id"] == "after" and after["status"] == "ok", "no second reply to the cancelled one"
        np.testing.assert_allclose(outputs[0], QUICK)
    assert batches(daemon) == 2, "it was computed; only its result went"


def test_cancelling_a_client_future_or_an_asyncio_task_cancels_the_request(start_daemon, gates):
    daemon = variable_daemon(start_daemon)
    with RawPeer(daemon.endpoint) as peer, Client(daemon.endpoint, timeout=60) as client:
        occupy(daemon, peer, gate := gates())
        future = client.submit("variable", QUICK)
        wait_for(lambda: stats(daemon)["queue_depth"] == 1)
        assert future.cancel() and future.cancelled()
        wait_for(lambda: stats(daemon)["requests"].get("cancelled") == 1, what="the daemon told")

        async def cancel_a_task() -> None:
            async with AsyncClient(daemon.endpoint, timeout=60) as aclient:
                task = asyncio.ensure_future(aclient.infer("variable", QUICK))
                await asyncio.to_thread(wait_for, lambda: stats(daemon)["queue_depth"] == 1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await asyncio.to_thread(wait_for, lambda: stats(daemon)["requests"].get("cancelled") == 2)

        asyncio.run(cancel_a_task())
        gate.open()
        assert client.infer("variable", QUICK).tolist() == QUICK.tolist(), "the client serves on"
        replies(peer, 2)
    assert batches(daemon) == 3, "block, behind, and the last: neither cancelled request ran"


def test_a_request_that_cannot_finish_before_its_deadline_is_refused_at_once(start_daemon):
    daemon = variable_daemon(start_daemon)
    # 0.15 s of compute on a quiet machine at 100_000 steps made the twin's five batches 0.78 s, under the
    # 0.8 s the test shows it misses: 150_000 steps, a quarter to half a second.
    quarter = np.array([[150_000, 0]], dtype=np.float32)
    with RawPeer(daemon.endpoint) as peer:
        peer.send("learn", "variable", [quarter], timeout_ms=LONG_MS)
        assert peer.recv()[0]["status"] == "ok"
        assert stats(daemon)["admission"]["estimate_ms"] > 0, "the compute time is known now"
        for rid in ("a", "b", "c", "d"):
            peer.send(rid, "variable", [quarter], timeout_ms=LONG_MS)
        wait_for(lambda: batches(daemon) == 3 and stats(daemon)["queue_depth"] == 2)
        # The worker is stopped until the refusal has come, so a cannot finish first on a slow machine
        # (it once did, in the time the wait above took); the estimate only grows meanwhile.
        worker = psutil.Process(daemon.status()["workers"][0]["pid"])
        worker.suspend()
        try:
            sent = time.monotonic()
            # Ahead of it: a running, b queued behind a, c and d waiting: four batches like its own.
            peer.send("late", "variable", [quarter], timeout_ms=800)
            peer.send("twin", "variable", [quarter], timeout_ms=LONG_MS)
            late = peer.recv()[0]
            assert late["id"] == "late" and late["status"] == "overloaded", "refused before anything finished"
            assert "at the soonest" in late["error"] and "after its deadline in 800 ms" in late["error"]
            shown = stats(daemon)["admission"]
            assert shown["refused_as_late"] == 1 and shown["estimate_ms"] > 800
        finally:
            worker.resume()
        answers = {a["id"]: time.monotonic() for a in replies(peer, 5)}
        assert answers["twin"] - sent > 0.8, "the same request admitted at that moment did miss that deadline"
        peer.send("idle", "variable", [quarter], timeout_ms=800)
        assert peer.recv()[0]["status"] == "ok", "with nothing ahead, the same deadline is met"


def test_goodput_counts_ok_replies_and_a_late_result_is_a_timeout(start_daemon, gates):
    daemon = variable_daemon(start_daemon)
    with RawPeer(daemon.endpoint) as peer:
        # Before any compute time is known nothing is refused: this one is computed, finishes after its
        # deadline, and is answered timeout, never ok.
        gate = gates()
        sent = time.monotonic()
        peer.send("late", "variable", [gate.input], timeout_ms=200)
        wait_for(lambda: batches(daemon) == 1, what="the batch computing")
        until(sent + 0.3)
        gate.open()
        assert peer.recv()[0]["status"] == "timeout"
        for index in range(5):
            peer.send(index, "variable", [QUICK], timeout_ms=LONG_MS)
            assert peer.recv()[0]["status"] == "ok"
    model = stats(daemon)
    assert model["requests"] == {"ok": 5, "timeout": 1} and model["goodput"]["requests"] == 5


def test_priority_levels_goodput_and_admission_in_prometheus(start_daemon, repo):
    daemon = start_daemon({"mlp": MLP}, server=metrics_config()["server"])
    x = np.ones((1, models.MLP_IN), dtype=np.float32)
    with Client(daemon.endpoint, priority=0) as client:
        for _ in range(3):
            client.infer("mlp", x)
        np.testing.assert_allclose(client.infer("mlp", x, priority=1), reference(repo, "mlp", "v2")(x), rtol=1e-5)
    samples = scrape(daemon)
    assert samples[("inferd_requests_by_priority_total", (("model", "mlp"), ("priority", "0"),
                                                          ("status", "ok")))] == 3
    assert samples[("inferd_request_duration_by_priority_seconds_count", (("model", "mlp"),
                                                                          ("priority", "1")))] == 1
    assert samples[("inferd_goodput_requests_total", (("model", "mlp"),))] == 4
    assert samples[("inferd_admission_estimate_seconds", (("model", "mlp"),))] > 0


def test_the_auto_window_serves_concurrent_clients_correctly_and_batches_them(start_daemon, repo):
    daemon = start_daemon({"mlp": {**MLP, "max_wait_ms": "auto"}}, workers={"streams": 1})
    run = reference(repo, "mlp", "v2")
    xs = [np.random.default_rng(k).standard_normal((1 + k % 3, models.MLP_IN), dtype=np.float32)
          for k in range(200)]
    with Client(daemon.endpoint, timeout=30) as client:
        futures = [client.submit("mlp", x) for x in xs]
        for x, future in zip(xs, futures):
            np.testing.assert_allclose(future.result(), run(x), rtol=1e-5, atol=1e-6)
    model = stats(daemon, "mlp")
    assert model["requests"] == {"ok": 200} and model["batch_size"]["mean"] > 2, "requests shared batches"


def test_an_overloaded_default_level_is_shed_while_the_urgent_client_is_served(start_daemon, gates):
    """A small queue flooded at the default level: urgent requests still get in, by displacement."""
    daemon = variable_daemon(start_daemon, max_size=4, max_per_client=0)
    once = RetryPolicy(max_attempts=1)
    with Client(daemon.endpoint, timeout=60, retry=once) as flood, Client(daemon.endpoint, priority=0) as urgent:
        with RawPeer(daemon.endpoint) as peer:
            occupy(daemon, peer, gate := gates())
            shed = [flood.submit("variable", QUICK) for _ in range(10)]
            wait_for(lambda: stats(daemon)["queue_depth"] == 4)
            served = urgent.submit("variable", QUICK, timeout=60)
            wait_for(lambda: stats(daemon)["requests"].get("overloaded") == 7, what="one displaced by the urgent one")
            gate.open()
            assert served.result(timeout=60).tolist() == QUICK.tolist()
            replies(peer, 2)
        outcomes = [type(f.exception(timeout=60)).__name__ for f in shed]
    assert outcomes.count("Overloaded") == 7 and outcomes.count("NoneType") == 3, outcomes
    assert stats(daemon)["priorities"]["0"]["requests"] == {"ok": 1}
