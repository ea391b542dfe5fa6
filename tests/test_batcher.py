"""The RequestQueue and the Batcher's policy over it, driven with explicit clocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.protocol import RequestHeader, TensorMeta
from inferd.supervisor.queueing.batcher import (
    AUTO_LEAD_S,
    NO_TIMES,
    Batcher,
    BatchTimes,
    Capacity,
    ModelPolicy,
)
from inferd.supervisor.queueing.queue import (
    EXPIRED,
    REMOVED,
    TAKEN,
    Bounds,
    Levels,
    QueuedRequest,
    Refusal,
    RequestQueue,
)


def request(model: str = "a", samples: int = 1, received: float = 0.0, timeout: float = 10.0, rid: int = 0,
            client: str = "c", nbytes: int = 8, priority: int = 0):
    header = RequestHeader(id=rid, model=model, inputs=(TensorMeta("float32", (samples, 2)),))
    return QueuedRequest(header, [b""], None, client, samples, nbytes, received, received + timeout, priority)


def bounds(max_size: int = 100, max_per_client: int = 0) -> Bounds:
    return Bounds(max_size, 1 << 30, max_per_client, 1 << 30)


def cap(idle: bool, spare: bool, free_at: float = 0.0):
    """Capacity that is the same for every model."""
    return lambda model: Capacity(idle, spare, free_at)


def made(limits: Bounds, policies: dict[str, ModelPolicy], levels: Levels | None = None,
         times: BatchTimes | None = None) -> tuple[RequestQueue, Batcher]:
    """A queue and the batcher over it."""
    q = RequestQueue(limits, policies, levels or Levels())
    return q, Batcher(q, policies, times or NO_TIMES)


def queue(max_size: int = 100, **policies: ModelPolicy) -> tuple[RequestQueue, Batcher]:
    return made(bounds(max_size), policies or {"a": ModelPolicy(max_batch_size=4, max_wait_s=0.005)})


def test_put_refuses_beyond_max_size_and_changes_nothing():
    q, b = queue(max_size=3)
    assert all(q.put(request(rid=i)) is None for i in range(3))
    assert q.put(request(rid=99)) == Refusal.FULL
    assert len(q) == 3 and q.depth("a") == 3


def test_one_client_cannot_take_more_than_its_share():
    q, b = made(bounds(max_per_client=2), {"a": ModelPolicy(4, 0.0)})
    assert q.put(request(client="flood")) is None and q.put(request(client="flood")) is None
    assert q.put(request(client="flood")) == Refusal.CLIENT_FULL
    assert q.put(request(client="other")) is None, "another client still gets in"
    b.take(cap(True, True), 0.0)
    assert q.queued_by("flood") == 0 and q.queued_by("other") == 0
    assert q.put(request(client="flood")) is None, "taken requests no longer count"
    q.put(request(client="x", timeout=0.001))
    q.expire(1.0)
    assert q.queued_by("x") == 0


def test_an_idle_executor_takes_a_lone_request_at_once():
    q, b = queue()
    q.put(request())
    assert b.take(cap(True, True), 0.0) is not None


def test_a_partial_batch_waits_while_every_executor_is_busy():
    q, b = queue()
    q.put(request(received=0.0))
    assert b.take(cap(False, True), 0.001) is None
    name, batch = b.take(cap(False, True), 0.005)
    assert name == "a" and len(batch) == 1


def test_a_full_batch_goes_behind_a_running_one_without_waiting():
    q, b = queue()
    for i in range(4):
        q.put(request(rid=i))
    name, batch = b.take(cap(False, True), 0.0)
    assert [r.header.id for r in batch] == [0, 1, 2, 3]


def test_nothing_is_taken_when_no_executor_has_room():
    q, b = queue()
    for i in range(8):
        q.put(request(rid=i))
    assert b.take(cap(False, False), 100.0) is None


def test_a_batch_never_exceeds_max_batch_size_in_samples_and_keeps_order():
    q, b = queue()
    for rid, samples in enumerate([2, 1, 2, 1]):
        q.put(request(samples=samples, rid=rid))
    _, first = b.take(cap(True, True), 0.0)
    assert [r.header.id for r in first] == [0, 1]  # 2 + 1; the next (2) would make 5
    _, second = b.take(cap(True, True), 0.0)
    assert [r.header.id for r in second] == [2, 3]
    assert all(r.state == TAKEN for r in first + second)
    assert len(q) == 0


def test_expired_requests_come_back_once_and_are_never_batched():
    q, b = queue()
    q.put(request(rid=1, received=0.0, timeout=0.010))
    q.put(request(rid=2, received=0.0, timeout=5.0))
    q.put(request(rid=3, received=0.0, timeout=0.020))
    expired = q.expire(now=0.015)
    assert [r.header.id for r in expired] == [1] and expired[0].state == EXPIRED
    assert q.expire(now=0.015) == []
    _, batch = b.take(cap(True, True), 0.016)
    assert [r.header.id for r in batch] == [2, 3]
    assert q.expire(now=100.0) == [], "a request already taken expired again"


def test_next_wakeup_is_the_nearest_batch_age_or_deadline():
    q, b = queue()
    assert b.next_wakeup(0.0) is None
    q.put(request(received=0.0, timeout=1.0))
    assert b.next_wakeup(0.0) == pytest.approx(0.005)
    for _ in range(3):
        q.put(request(received=0.0, timeout=1.0))
    assert b.next_wakeup(0.0) == pytest.approx(1.0), "a full batch needs no age timer"


def test_models_are_served_round_robin():
    q, b = queue(a=ModelPolicy(1, 0.0), b=ModelPolicy(1, 0.0))
    for i in range(5):
        q.put(request("a", rid=i))
    q.put(request("b", rid=100))
    order = [b.take(cap(True, True), 0.0)[0] for _ in range(3)]
    assert order == ["a", "b", "a"]


def test_a_model_without_capacity_does_not_block_one_with_capacity():
    q, b = queue(a=ModelPolicy(4, 0.0), b=ModelPolicy(4, 0.0))
    q.put(request("a", rid=1))
    q.put(request("b", rid=2))
    only_b = {"a": Capacity(False, False), "b": Capacity(True, True)}
    name, batch = b.take(only_b.__getitem__, 0.0)
    assert name == "b" and q.depth("a") == 1


def test_drain_returns_every_waiting_request():
    q, b = queue()
    for i in range(5):
        q.put(request(rid=i))
    assert len(q.drain()) == 5 and len(q) == 0 and b.take(cap(True, True), 0.0) is None


def test_bytes_are_bounded_over_all_and_per_connection_and_freed_when_requests_leave():
    q, b = made(Bounds(max_size=100, max_bytes=1000, max_per_client=0, max_bytes_per_client=600),
                   {"a": ModelPolicy(4, 0.0)})
    assert q.put(request(client="x", nbytes=500)) is None
    assert q.put(request(client="x", nbytes=200)) == Refusal.CLIENT_BYTES, "x would hold 700 of its 600"
    assert q.put(request(client="y", nbytes=500)) is None
    assert q.put(request(client="z", nbytes=1)) == Refusal.BYTES, "1001 of 1000 over all"
    assert len(q) == 2 and q.nbytes == 1000
    b.take(cap(True, True), 0.0)  # both go in one batch
    assert q.nbytes == 0
    assert q.put(request(client="x", nbytes=600)) is None, "taken requests no longer count"
    q.put(request(client="y", nbytes=100, timeout=0.001))
    q.expire(1.0)
    assert q.nbytes == 600, "expired ones neither"
    q.drain()
    assert q.nbytes == 0 and q.put(request(client="x", nbytes=600)) is None


def test_the_deadline_heap_stays_bounded_with_long_deadlines():
    q, b = queue(max_size=10)
    for i in range(5000):
        q.put(request(rid=i, timeout=1e9))
        b.take(cap(True, True), 0.0)
    assert len(q._deadlines) <= 2 * 10 + 1024 + 1


def test_an_aged_lane_waiting_for_an_executor_does_not_hide_the_next_deadline():
    q, b = queue()
    q.put(request(received=0.0, timeout=1.0))
    # At 10 ms the lane is past max_wait and waits only for an executor, whose answer
    # wakes the loop anyway; the next thing to wake for is the deadline at 1 s.
    assert b.next_wakeup(0.010) == pytest.approx(0.990)


def test_a_max_batch_size_lowered_under_a_waiting_request_does_not_jam_its_lane():
    q, b = queue()
    q.put(request(samples=4, rid=1))
    q.put(request(samples=1, rid=2))
    lowered = {"a": ModelPolicy(max_batch_size=2, max_wait_s=0.005)}
    q.configure(bounds(), lowered, Levels())
    b.configure(lowered)
    name, batch = b.take(cap(True, True), 0.0)
    assert [r.header.id for r in batch] == [1], "the request accepted under the old limit goes alone"
    name, batch = b.take(cap(True, True), 0.0)
    assert [r.header.id for r in batch] == [2]


class Times:
    """Compute times as a fixed table: seconds per batch whatever its size."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def batch_s(self, model: str, samples: int, elements: int | None = None) -> float | None:
        return self.seconds


def levelled(count: int = 2, share: float = 0.1, max_batch: int = 4, max_size: int = 100,
             wait: float | None = 0.0, times: Times | None = None) -> tuple[RequestQueue, Batcher]:
    return made(bounds(max_size), {"a": ModelPolicy(max_batch, wait)}, Levels(count, count - 1, share),
                times or Times(None))


def test_a_batch_is_led_by_the_most_urgent_level_and_filled_from_the_rest():
    q, b = levelled(max_batch=3)
    for rid, priority in enumerate([1, 1, 0, 1, 0]):
        q.put(request(rid=rid, received=rid * 0.001, priority=priority))
    _, batch = b.take(cap(True, True), 0.01)
    assert [r.header.id for r in batch] == [2, 4, 0], "urgent first, then the oldest of the next level"
    _, batch = b.take(cap(True, True), 0.01)
    assert [r.header.id for r in batch] == [1, 3]


@pytest.mark.parametrize("share, turn", [(0.1, 9), (0.01, None)], ids=["share 0.1", "no share to speak of"])
def test_a_less_urgent_level_leads_one_batch_in_ten_however_much_urgent_work_waits(share, turn):
    """With the default share it leads the batch after the nine it waited through; with a share too small
    to matter it waits through all 30 (the rule is what serves it)."""
    q, b = levelled(max_batch=1, share=share)
    q.put(request(rid="low", priority=1))
    taken = []
    for step in range(30):
        q.put(request(rid=step, received=step, priority=0))
        taken.append(b.take(cap(True, True), step)[1][0].header.id)
    assert (taken.index("low") if "low" in taken else None) == turn


def test_a_full_queue_lets_an_urgent_request_displace_the_newest_less_urgent_one():
    q, b = levelled(max_size=3)
    old, new = request(rid="old", priority=1), request(rid="new", priority=1, received=1.0)
    q.put(old)
    q.put(new)
    q.put(request(rid="urgent", priority=0))
    urgent = request(rid="urgent2", priority=0, received=2.0)
    assert q.put(urgent) == Refusal.FULL
    assert q.displace_for(urgent) == [new] and new.state == REMOVED
    assert q.put(urgent) is None and len(q) == 3 and q.samples_ahead("a", 1) == 3
    same = request(rid="same", priority=1, received=3.0)
    assert q.put(same) == Refusal.FULL and q.displace_for(same) is None, "an equal level displaces nothing"
    assert q.displace_for(request(rid="u3", priority=0)) == [old]


def test_displacement_for_bytes_removes_nothing_when_the_less_urgent_bytes_would_not_make_room():
    q, b = made(Bounds(max_size=100, max_bytes=100, max_per_client=0, max_bytes_per_client=1000),
                   {"a": ModelPolicy(4, 0.0)}, Levels(2, 1, 0.1))
    q.put(request(rid=1, nbytes=30, priority=1))
    q.put(request(rid=2, nbytes=60, priority=0))
    big = request(rid=3, nbytes=80, priority=0)
    assert q.put(big) == Refusal.BYTES
    assert q.displace_for(big) is None and len(q) == 2
    fits = request(rid=4, nbytes=35, priority=0)
    assert q.put(fits) == Refusal.BYTES and [r.header.id for r in q.displace_for(fits)] == [1]


def test_cancel_removes_only_that_clients_waiting_request():
    q, b = levelled()
    mine, theirs = request(rid=7, client="me"), request(rid=7, client="them")
    q.put(mine)
    q.put(theirs)
    assert q.cancel("me", 7) is mine and mine.state == REMOVED
    assert q.cancel("me", 7) is None and len(q) == 1 and q.queued_by("me") == 0
    q.expire(100.0)
    assert mine.state == REMOVED, "a cancelled request never expires as well"


def test_auto_waits_for_company_until_an_executor_is_about_to_be_free():
    q, b = levelled(wait=None, times=Times(0.004))
    q.put(request(rid=1, received=0.0))
    assert b.take(cap(False, True, free_at=0.010), 0.001) is None
    assert b.next_wakeup(0.001) == pytest.approx(0.010 - AUTO_LEAD_S - 0.001)
    assert b.take(cap(False, True, free_at=0.010), 0.0098) is not None


def test_auto_never_holds_a_request_past_the_time_its_deadline_needs_it_sent():
    q, b = levelled(wait=None, times=Times(0.004))
    q.put(request(rid=1, received=0.0, timeout=0.010))
    # The executor frees at 50 ms, but the request must start computing by 10 - 4 ms.
    assert b.take(cap(False, True, free_at=0.050), 0.0045) is None
    assert b.take(cap(False, True, free_at=0.050), 0.006 - AUTO_LEAD_S) is not None


def test_auto_sends_a_full_batch_at_once_while_no_more_urgent_traffic_is_about():
    q, b = levelled(wait=None, max_batch=2, times=Times(0.004))
    q.put(request(rid=1, priority=1))
    q.put(request(rid=2, priority=1))
    assert b.take(cap(False, True, free_at=0.010), 0.0) is not None


def test_auto_forms_a_full_batch_just_before_the_executor_is_free_so_urgent_arrivals_join_it():
    q, b = levelled(wait=None, max_batch=2, times=Times(0.004))
    q.put(request(rid=1, priority=0))
    assert b.take(cap(True, True, free_at=0.0), 0.0) is not None, "an idle executor gets whatever waits"
    q.put(request(rid=2, priority=1))
    q.put(request(rid=3, priority=1))
    assert b.take(cap(False, True, free_at=0.010), 0.0) is None
    q.put(request(rid=4, priority=0, received=0.005))
    _, batch = b.take(cap(False, True, free_at=0.010), 0.0098)
    assert [r.header.id for r in batch] == [4, 2]


def test_fewer_levels_on_sighup_move_waiting_requests_to_the_least_urgent_left():
    q, b = levelled(count=3)
    q.put(request(rid=1, priority=2))
    policies = {"a": ModelPolicy(4, 0.0)}
    q.configure(bounds(), policies, Levels(2, 1, 0.1))
    b.configure(policies)
    assert q.samples_ahead("a", 1) == 1 and q.cancel("c", 1).priority == 1


def test_a_batch_taken_before_a_sighup_removed_its_level_is_put_back_at_the_least_urgent_left():
    """Its worker died after the SIGHUP: its requests are queued again, not lost to a level that is gone."""
    q, b = levelled(count=3)
    q.put(request(rid=1, priority=2))
    _, taken = b.take(cap(True, True), 0.0)
    policies = {"a": ModelPolicy(4, 0.0)}
    q.configure(bounds(), policies, Levels(2, 1, 0.1))
    b.configure(policies)
    q.put_back(taken)
    assert q.samples_ahead("a", 1) == 1 and b.take(cap(True, True), 0.0)[1] == taken


def test_displacement_never_bypasses_the_requesters_own_share():
    q, b = made(Bounds(max_size=2, max_bytes=1 << 30, max_per_client=1, max_bytes_per_client=1 << 30),
                   {"a": ModelPolicy(4, 0.0)}, Levels(2, 1, 0.1))
    q.put(request(rid=1, client="greedy", priority=0))
    q.put(request(rid=2, client="other", priority=1))
    again = request(rid=3, client="greedy", priority=0)
    assert q.put(again) == Refusal.FULL
    assert q.displace_for(again) is None and len(q) == 2, "it would be refused for its own share anyway"


@pytest.mark.parametrize("share, patience", [(0.1, 9), (0.25, 3), (0.3, 2), (0.5, 1), (0.15, 5)])
def test_a_level_leads_at_least_its_share_of_batches(share, patience):
    assert Levels(2, 1, share).patience == patience
    assert 1 / (patience + 1) >= share


def test_put_back_returns_requests_to_the_head_of_their_level_as_if_never_taken():
    q, b = queue()
    for i in range(3):
        q.put(request(rid=i, client="c"))
    name, taken = b.take(cap(True, True), 0.0)
    assert [r.header.id for r in taken] == [0, 1, 2] and len(q) == 0 and q.queued_by("c") == 0
    q.put(request(rid=3, client="c"))
    q.put_back(taken[1:])
    assert len(q) == 3 and q.depth("a") == 3 and q.queued_by("c") == 3
    assert [r.header.id for r in b.take(cap(True, True), 0.0)[1]] == [1, 2, 3]
    late = request(rid=4, timeout=0.5)
    q.put(late)
    name, taken = b.take(cap(True, True), 0.0)
    q.put_back(taken)
    assert q.expire(1.0) == [late], "a request put back still expires at its deadline"


OPERATIONS = st.lists(st.tuples(st.sampled_from(["put", "take", "cancel", "expire", "displace", "put_back",
                                                 "remove", "drain"]),
                                st.sampled_from("abcd"), st.integers(0, 1), st.integers(1, 3)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(OPERATIONS)
def test_the_lanes_walked_are_those_holding_requests_and_each_gets_its_turn_in_the_round(operations):
    """The batcher and placement walk only the queue's busy lanes (a daemon may configure a thousand models):
    after any mix of what changes a lane, they are the lanes holding requests, and the round-robin over them
    is the one over every model in config order, skipping the empty."""
    policies = {name: ModelPolicy(max_batch_size=3, max_wait_s=0.0) for name in "abcd"}
    q, b = made(bounds(max_size=6), policies, Levels(2, 1))
    taken_last: str | None = None
    for step, (operation, model, priority, samples) in enumerate(operations):
        now = step * 0.1
        if operation == "put":
            q.put(request(model, samples, now, timeout=1.5, rid=step, client=model, priority=priority))
        elif operation in ("take", "put_back"):
            busy_before = [name for name in "abcd" if q.lanes[name].samples]
            batch = b.take(cap(True, True), now)
            if batch is None:
                assert not busy_before
                continue
            after = "abcd".index(taken_last) + 1 if taken_last else 0
            assert batch[0] == next(name for name in "abcd"[after:] + "abcd"[:after] if name in busy_before)
            taken_last = batch[0]
            if operation == "put_back":
                q.put_back(batch[1])
        elif operation == "cancel":
            waiting = [r for level in q.lanes[model].levels for r in level]
            if waiting:
                assert q.cancel(waiting[-1].client, waiting[-1].header.id) is waiting[-1]
        elif operation == "expire":
            q.expire(now)
        elif operation == "displace":
            urgent = request(model, 1, now, rid=1000 + step, client=f"urgent{step}", priority=0)
            if q.put(urgent) is not None and q.displace_for(urgent) is not None:
                q.put(urgent)
        elif operation == "remove":
            q.remove_model(model)
        else:
            q.drain()
        assert q.busy == {name: lane for name, lane in q.lanes.items() if lane.samples}
        assert sum(len(lane) for lane in q.busy.values()) == len(q)
        assert (b.next_wakeup(now) is None) == (len(q) == 0)
