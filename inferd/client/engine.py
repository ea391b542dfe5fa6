"""The client's I/O thread: it owns the sockets, sends calls, reads replies and connection events,
and keeps the calls' deadlines."""

from __future__ import annotations

import concurrent.futures
import heapq
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from inferd import protocol
from inferd.client.call import Call, Outputs
from inferd.client.endpoints import Endpoint, EndpointPool
from inferd.client.mailbox import Cancel, Mailbox
from inferd.client.retry import Retry
from inferd.client.shared_memory import SharedMemoryRegion
from inferd.errors import InferdError, InvalidRequest, Unavailable

# The longest one poll blocks: posts wake it anyway, and a deadline far off (a timeout of 1e30 s) in
# milliseconds would overflow the poll.
MAX_POLL_S = 1.0
RESEND_S = 0.005  # how soon a send that found every connected endpoint's queue full is tried again
FromRegion = Callable[[protocol.TensorMeta], np.ndarray]  # an output written to a region -> a view of it
log = logging.getLogger("inferd.client")


def _settle(future: concurrent.futures.Future, outcome: Any) -> None:
    """Give a call's future its result or error, unless its caller cancelled it meanwhile."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        if not future.cancelled():
            raise
        # cancelled from another thread meanwhile; the cancel is on its way to the I/O thread


class IOLoop:
    """The client's I/O thread: sends calls, reads replies and connection events, keeps deadlines."""

    def __init__(self, pool: EndpointPool, mailbox: Mailbox, regions: dict[str, SharedMemoryRegion],
                 from_region: FromRegion, ids: Iterator[int], group_bytes: int = 0) -> None:
        """`group_bytes`: the most a message of calls posted in one turn, sent as a group, may hold (0: each
        call its own message)."""
        self.pool = pool
        self.group_bytes = group_bytes
        self.mailbox = mailbox
        self.regions = regions
        self.from_region = from_region
        self.ids = ids
        self.wake = mailbox.wake_r
        self.pending: dict[int, Call] = {}
        self.waiting: dict[int, None] = {}  # calls with no connected endpoint to go to, oldest first
        self.timers: list[tuple[float, int, str]] = []  # (when, call id, "send" | "deadline")
        self.poller = zmq.Poller()
        self.poller.register(self.wake, zmq.POLLIN)
        self.by_socket: dict[zmq.Socket, Endpoint] = {}
        for endpoint in pool.endpoints.values():
            self._watch(endpoint)

    def run(self) -> None:
        """Serve until the client posts None; then fail what is left and close the sockets."""
        try:
            self._serve()
            leftover: InferdError = Unavailable("the client was closed before the reply came")
        except Exception as exc:  # a bug here must not leave callers waiting forever
            leftover = InferdError(f"the client's I/O thread failed: {exc!r}")
            raise
        finally:
            self.mailbox.shut()
            while not self.mailbox.items.empty():
                item = self.mailbox.items.get()
                if isinstance(item, Call) and not item.future.cancelled():
                    self.pending[item.id] = item
            for call in self.pending.values():
                _settle(call.future, type(leftover)(leftover.message, call.id))
            self.pool.close()

    def _serve(self) -> None:
        running = True
        while running:
            now = time.monotonic()
            wait = min(self.timers[0][0] - now, MAX_POLL_S) if self.timers else MAX_POLL_S
            for target, _ in self.poller.poll(max(0, int(wait * 1000) + 1)):
                if target == self.wake:
                    running = self._take_posts()
                    continue
                endpoint = self.by_socket.get(target)
                if endpoint is None:  # closed earlier in this round
                    continue
                if target is endpoint.socket:
                    self._read_replies(endpoint)
                else:
                    self._read_events(endpoint)
            self._fire_timers()

    def _watch(self, endpoint: Endpoint) -> None:
        for sock in (endpoint.socket, endpoint.monitor):
            self.by_socket[sock] = endpoint
            self.poller.register(sock, zmq.POLLIN)

    def _forget_if_done(self, endpoint: Endpoint) -> None:
        if endpoint.retired and not endpoint.in_flight:
            for sock in (endpoint.socket, endpoint.monitor):
                self.poller.unregister(sock)
                del self.by_socket[sock]
            self.pool.remove(endpoint)

    def _take_posts(self) -> bool:
        try:
            while os.read(self.wake, 4096):
                pass
        except BlockingIOError:
            pass
        posted: list[Call] = []
        while not self.mailbox.items.empty():
            item = self.mailbox.items.get()
            if item is None:
                self._send_posted(posted)
                return False
            if isinstance(item, tuple):
                added, retired = self.pool.update(*item)
                for endpoint in added:
                    self._watch(endpoint)
                for endpoint in retired:
                    self._forget_if_done(endpoint)
            elif isinstance(item, Cancel):
                self._cancel(item.call_id)
            elif not item.future.cancelled():  # left pending, not running: a caller may still cancel it
                self.pending[item.id] = item
                heapq.heappush(self.timers, (item.deadline, item.id, "deadline"))
                posted.append(item)
        self._send_posted(posted)
        return True

    def _send_posted(self, calls: list[Call]) -> None:
        """Send the calls posted in one turn: those bound for one daemon together as groups (each within
        MAX_GROUP calls and group_bytes), a call alone as a message of its own."""
        if not self.group_bytes or len(calls) < 2:
            for call in calls:
                self._send(call)
            return
        now = time.monotonic()
        bound: dict[Endpoint, list[tuple[Call, list[Any]]]] = {}
        for call in calls:
            connected = self.pool.ranked(call.avoid, now)
            if not connected:
                self._send(call)  # it waits for a connection, or fails, as a call alone does
                continue
            # Counted in flight at once, so that the next call ranks the daemons with this one sent.
            connected[0].in_flight.add(call.id)
            call.endpoint = connected[0]
            bound.setdefault(connected[0], []).append((call, call.frames()))
        for endpoint, members in bound.items():
            group: list[tuple[Call, list[Any]]] = []
            size = 0
            for call, frames in members:
                nbytes = sum(len(frame) for frame in frames)
                if group and (len(group) == protocol.MAX_GROUP or size + nbytes > self.group_bytes):
                    self._send_group(endpoint, group)
                    group, size = [], 0
                group.append((call, frames))
                size += nbytes
            self._send_group(endpoint, group)

    def _send_group(self, endpoint: Endpoint, group: list[tuple[Call, list[Any]]]) -> None:
        """Send calls counted in flight at `endpoint` as one message (a group where there are several); where its
        queue is full, each goes the way of a call alone."""
        frames = group[0][1] if len(group) == 1 else protocol.encode_group([frames for _, frames in group])
        try:
            endpoint.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            for call, _ in group:
                endpoint.in_flight.discard(call.id)
                call.endpoint = None
                call.attempts -= 1  # its frames were made for an attempt that was not sent
                self._send(call)

    def _send(self, call: Call) -> None:
        frames = call.frames()
        connected = self.pool.ranked(call.avoid, time.monotonic())
        for endpoint in connected:
            try:
                # Never block: a blocking send would stop this thread, and every deadline with it.
                endpoint.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # its queue is full (the high-water mark), or it just went down
                continue
            endpoint.in_flight.add(call.id)
            call.endpoint = endpoint
            return
        call.attempts -= 1
        if connected:
            heapq.heappush(self.timers, (time.monotonic() + RESEND_S, call.id, "send"))
        elif self.pool.refused_everywhere():
            self._finish(call, call.refused())
        else:
            self.waiting[call.id] = None

    def _finish(self, call: Call, outcome: Outputs | InferdError | Retry) -> None:
        if call.endpoint is not None:
            call.endpoint.in_flight.discard(call.id)
            call.avoid, call.endpoint = call.endpoint, None
        self.waiting.pop(call.id, None)
        if isinstance(outcome, Retry):
            heapq.heappush(self.timers, (time.monotonic() + outcome.delay, call.id, "send"))
            return
        del self.pending[call.id]
        _settle(call.future, outcome)

    def _cancel(self, call_id: int) -> None:
        """A caller cancelled this call's future: tell the daemon that has it, and forget it."""
        call = self.pending.pop(call_id, None)
        if call is None:
            return
        self.waiting.pop(call_id, None)
        endpoint = call.endpoint
        if endpoint is None:  # between attempts: no daemon holds it
            return
        endpoint.in_flight.discard(call_id)
        try:
            endpoint.socket.send(protocol.encode_op(protocol.Cancel(id=call_id)), flags=zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: the daemon computes it, and its reply finds no call
            log.debug("could not send the cancel of call %d to %s", call_id, endpoint.address)
        self._forget_if_done(endpoint)

    def _read_replies(self, endpoint: Endpoint) -> None:
        while endpoint.socket.poll(0):
            body = [frame.buffer for frame in endpoint.socket.recv_multipart(copy=False)]
            try:
                members = protocol.group_of(body, sys.maxsize)
            except InvalidRequest as exc:
                log.warning("dropped a malformed group of replies from %s: %s", endpoint.address, exc)
                continue
            for reply in members or (body,):
                self._take_reply(endpoint, reply)
        self._forget_if_done(endpoint)

    def _take_reply(self, endpoint: Endpoint, body: Sequence[Any]) -> None:
        try:
            header, outputs = protocol.decode_reply(body, self.from_region)
        except Exception as exc:  # noqa: BLE001 - whatever a reply not of the protocol raises; no call to give it to
            log.warning("dropped a malformed reply from %s: %s", endpoint.address, exc)
            return
        endpoint.answered(header.status, time.monotonic())
        call = self.pending.get(header.id) if isinstance(header.id, int) else None  # None: its deadline passed
        if call is not None:
            self._finish(call, call.settle(header, outputs))

    def _read_events(self, endpoint: Endpoint) -> None:
        while endpoint.monitor.poll(0):
            event = parse_monitor_message(endpoint.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                endpoint.connected, endpoint.refused = True, False
                self._register_again(endpoint)
                waiting, self.waiting = self.waiting, {}
                for call_id in waiting:
                    self._send(self.pending[call_id])
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                endpoint.refused = True
                if self.pool.refused_everywhere():
                    for call_id in list(self.waiting):
                        self._finish(self.pending[call_id], self.pending[call_id].refused())
            elif event == zmq.EVENT_DISCONNECTED:
                for call_id in sorted(endpoint.dropped(time.monotonic())):
                    call = self.pending.get(call_id)
                    if call is not None:
                        self._finish(call, call.missed())
                self._forget_if_done(endpoint)
                if endpoint.retired:
                    return  # closed: its monitor is gone

    def _register_again(self, endpoint: Endpoint) -> None:
        """A new connection has none of the regions the last one registered: register them again, before
        any request that names them. The answers are not waited for (no call has their ids)."""
        for region in list(self.regions.values()):
            op = protocol.RegisterRegion(id=next(self.ids), name=region.name, key=region.key,
                                         byte_size=region.byte_size, offset=region.offset)
            try:
                endpoint.socket.send(protocol.encode_op(op), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("could not register region %r again on %s", region.name, endpoint.address)

    def _fire_timers(self) -> None:
        if len(self.timers) > 4 * len(self.pending) + 1024:
            # Answered calls leave their deadline entries behind until due; with long
            # timeouts they would pile up, so sweep them out now and then.
            self.timers = [t for t in self.timers if t[1] in self.pending]
            heapq.heapify(self.timers)
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, call_id, kind = heapq.heappop(self.timers)
            call = self.pending.get(call_id)
            if call is None:
                continue
            if kind == "send":
                if call.endpoint is None and call.id not in self.waiting:
                    self._send(call)
            else:
                unreachable = self.pool.describe() if call.id in self.waiting else None
                endpoint = call.endpoint
                self._finish(call, call.expired(unreachable))
                if endpoint is not None:
                    self._forget_if_done(endpoint)
