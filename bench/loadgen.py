"""A load generator: closed loop (`--concurrency` requests in flight) or open loop (`--rate` per second),
on one socket, for `--seconds`.

It speaks the wire protocol directly (one DEALER, one thread), so what it
measures is the daemon and the transport, not a client library. It prints one
JSON line: samples/s, latency percentiles in ms, and the count of each status.

    python -m bench.loadgen --endpoint tcp://127.0.0.1:5555 --model mlp --shape 256 --concurrency 16
    python -m bench.loadgen --endpoint tcp://127.0.0.1:5555 --model mlp --shape 256 --rate 5000 --priority 0

Open loop, requests go out on a Poisson schedule whatever the replies (`--fixed-rate`: evenly spaced),
each with `--timeout-ms` as its deadline; the line also gives the rate actually sent, how far the
sender fell behind its schedule, and the ok replies within their deadline (goodput).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter, deque

import numpy as np
import zmq

from inferd import protocol
from inferd.ipc.sockets import recv_parts, send_parts_tracked


def percentiles(latencies_s: list[float]) -> dict[str, float]:
    """p50/p90/p99/max of latencies given in seconds, in milliseconds."""
    if not latencies_s:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "max": float("nan")}
    ms = np.asarray(latencies_s) * 1000
    return {
        "p50": round(float(np.percentile(ms, 50)), 3),
        "p90": round(float(np.percentile(ms, 90)), 3),
        "p99": round(float(np.percentile(ms, 99)), 3),
        "max": round(float(ms.max()), 3),
    }


def run(endpoint: str, model: str, shape: tuple[int, ...], dtype: str, concurrency: int, seconds: float,
        warmup: float, samples: int = 1, timeout_ms: int = 10_000, trace: str | None = None,
        given: list[list[np.ndarray]] | None = None, group: bool = False) -> dict:
    """Drive the endpoint and return the measurements of the timed part.

    With `trace`, also save every timed request (time.monotonic() at send,
    latency in seconds, ok or not) to that .npz file, for benchmarks that split
    one run into phases. With `given` (each request's inputs), the requests
    cycle through those instead of random ones of `shape`. With `group`, the
    requests sent at one moment (those whose replies came together) go as one
    message, a group, as the Python client sends what its callers submit at once.
    """
    rng = np.random.default_rng(0)
    payload = samples * int(np.prod(shape)) * np.dtype(dtype).itemsize
    variety = int(min(16, max(2, (64 << 20) // payload)))  # a few distinct inputs, at most ~64 MB of them
    inputs = given or [[rng.standard_normal((samples, *shape)).astype(dtype)] for _ in range(variety)]
    if given:
        variety = len(given)
        payload = sum(a.nbytes for request in given for a in request) // variety
    # Every request is encoded before the clock starts, and ids are reused once answered: the
    # generator shares the machine with what it measures, so it spends as little CPU as it can.
    pool = max(2 * concurrency, variety)
    encoded = [protocol.encode_request(i, model, inputs[i % variety], timeout_ms=timeout_ms) for i in range(pool)]
    free = deque(range(pool))
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.connect(endpoint)
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    traced: list[tuple[float, float, bool]] = []
    answered = 0
    cpu_started = time.process_time()
    measure_from = time.monotonic() + warmup
    stop_at = measure_from + seconds
    while True:
        now = time.monotonic()
        if now < stop_at and len(sent_at) < concurrency:
            ids = [free.popleft() for _ in range(concurrency - len(sent_at))]
            # The encoded frames never change, so large ones may go by reference.
            for frames in ([protocol.encode_group([encoded[i] for i in ids])] if group and len(ids) > 1
                           else [encoded[i] for i in ids]):
                send_parts_tracked(socket, frames)
            at = time.monotonic()
            for request_id in ids:
                sent_at[request_id] = at
        elif not sent_at:
            break
        if not socket.poll(1000):
            if time.monotonic() > stop_at + timeout_ms / 1000:
                statuses["lost"] += len(sent_at)
                break
            continue
        while (frames := recv_parts(socket)) is not None:
            done = time.monotonic()
            body = [frame.buffer for frame in frames]
            for reply in (protocol.group_of(body, sys.maxsize) if group else None) or [body]:
                header = protocol.decode_reply_header(reply[0])
                sent = sent_at.pop(header.id)
                free.append(header.id)
                answered += 1
                if measure_from <= sent < stop_at:
                    statuses[header.status] += 1
                    if header.status == protocol.OK:
                        latencies.append(done - sent)
                    if trace:
                        traced.append((sent, done - sent, header.status == protocol.OK))
    cpu_us_per_request = (time.process_time() - cpu_started) / max(1, answered) * 1e6
    socket.close()
    context.term()
    if trace:
        columns = np.array(traced, dtype=np.float64).reshape(-1, 3)
        np.savez(trace, sent=columns[:, 0], latency=columns[:, 1], ok=columns[:, 2].astype(bool))
    ok = statuses.get(protocol.OK, 0)
    return {
        "endpoint": endpoint,
        "model": model,
        "concurrency": concurrency,
        "group": group,
        "samples_per_request": samples,
        "seconds": seconds,
        "requests": sum(statuses.values()),
        "samples_per_s": round(ok * samples / seconds, 1),
        "bytes_per_s": round(ok * payload / seconds, 1),
        "latency_ms": percentiles(latencies),
        "statuses": dict(statuses),
        "cpu_us_per_request": round(cpu_us_per_request, 1),  # the generator's own, warm-up included
    }


OPEN_LOOP_HWM = 4096  # requests the transport may queue for the daemon; past it, counted as pushed back


def open_loop(endpoint: str, model: str, shape: tuple[int, ...], dtype: str, rate: float, seconds: float,
              warmup: float, timeout_ms: int = 1000, priority: int | None = None, poisson: bool = True,
              at: float | None = None, seed: int = 0) -> dict:
    """Offer `rate` requests per second whatever the replies, for `warmup` + `seconds`, then wait for the
    last replies (up to the deadline and a second). Only requests sent in the timed part are counted.

    `at`: the time.monotonic() the timed part begins (it is system-wide, so several generators in
    their own processes measure the same seconds); by default `warmup` after the start. The input's
    bytes are one frame sent with every request; a header is encoded per request id, and ids are
    reused once answered, so the loop does no encoding once the pool covers what is in flight. A
    request the transport will not take (OPEN_LOOP_HWM queued: the daemon is not reading) is counted
    as `pushed_back`, not queued. Latency is from the actual send to the reply."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, *shape)).astype(dtype)
    frame = protocol.encode_request(0, model, [x])[1]
    headers: list[bytes] = []
    free: deque[int] = deque()

    def new_id() -> int:
        headers.append(bytes(protocol.encode_request(len(headers), model, [x], timeout_ms=timeout_ms,
                                                     priority=priority)[0]))
        return len(headers) - 1

    for _ in range(int(min(rate, 50_000) * 0.1) + 16):  # 100 ms of requests, before the clock
        free.append(new_id())
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    socket.setsockopt(zmq.SNDHWM, OPEN_LOOP_HWM)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.connect(endpoint)
    started = time.monotonic()
    measure_from = started + warmup if at is None else at
    stop_at = measure_from + seconds
    # The schedule: gaps between sends, drawn ahead in chunks.
    gaps = rng.exponential(1 / rate, 65536) if poisson else np.full(65536, 1 / rate)
    gap_list = gaps.tolist()
    next_gap = 0
    due = started
    deadline_s = timeout_ms / 1000
    sent_at: dict[int, float] = {}
    timed_ids: set[int] = set()
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    sent = pushed_back = good = 0
    late_s: list[float] = []  # how far behind its schedule each timed send went
    cpu_started = time.process_time()
    poll = socket.poll
    send = socket.send
    recv = socket.recv
    decode = protocol.decode_reply_header
    while True:
        now = time.monotonic()
        if now < stop_at:
            while due <= now:
                request_id = free.popleft() if free else new_id()
                try:
                    send(headers[request_id], zmq.SNDMORE | zmq.DONTWAIT, copy=True)
                    send(frame, 0, copy=True)
                except zmq.Again:
                    free.append(request_id)
                    if due >= measure_from:
                        pushed_back += 1
                else:
                    t = time.monotonic()
                    sent_at[request_id] = t
                    if due >= measure_from:
                        timed_ids.add(request_id)
                        sent += 1
                        late_s.append(t - due)
                due += gap_list[next_gap]
                next_gap += 1
                if next_gap == len(gap_list):
                    gap_list = (rng.exponential(1 / rate, 65536) if poisson else gaps).tolist()
                    next_gap = 0
            # At least 1 ms: spinning would take a core from what is measured; what falls due meanwhile
            # goes out together (send_late_ms says how late).
            wait_ms = max(1, math.ceil((due - time.monotonic()) * 1000))
        elif not sent_at or now > stop_at + deadline_s + 1:
            break
        else:
            wait_ms = 100
        if not poll(wait_ms):
            continue
        while True:
            try:
                first = recv(zmq.DONTWAIT, copy=False)
            except zmq.Again:
                break
            while socket.rcvmore:
                recv(copy=False)
            done = time.monotonic()
            header = decode(first.buffer)
            request_id = header.id
            sent_time = sent_at.pop(request_id)
            free.append(request_id)
            if request_id in timed_ids:
                timed_ids.discard(request_id)
                statuses[header.status] += 1
                if header.status == protocol.OK:
                    latency = done - sent_time
                    latencies.append(latency)
                    good += latency <= deadline_s
    statuses["lost"] += len(timed_ids)  # sent in the timed part, no reply by the deadline and a second
    cpu_s = time.process_time() - cpu_started
    socket.close()
    context.term()
    lateness = np.asarray(late_s or [0.0]) * 1000
    return {
        "endpoint": endpoint,
        "model": model,
        "priority": priority,
        "rate_offered_per_s": rate,
        "rate_sent_per_s": round(sent / seconds, 1),
        "seconds": seconds,
        "timeout_ms": timeout_ms,
        "requests": sent,
        "pushed_back": pushed_back,
        "statuses": {k: v for k, v in statuses.items() if v},
        "samples_per_s": round(statuses.get(protocol.OK, 0) / seconds, 1),
        "goodput_per_s": round(good / seconds, 1),
        "good": good,
        "latency_ms": percentiles(latencies),
        "send_late_ms": {"p50": round(float(np.percentile(lateness, 50)), 3),
                         "p99": round(float(np.percentile(lateness, 99)), 3)},
        "cpu_percent": round(cpu_s / (time.monotonic() - started) * 100, 1),  # of one core, the whole run
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--shape", required=True, help="per-sample shape, e.g. 256 or 3,64,64")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--samples", type=int, default=1, help="samples per request")
    parser.add_argument("--trace", help="save every timed request to this .npz file")
    parser.add_argument("--rate", type=float, help="open loop: requests per second, whatever the replies")
    parser.add_argument("--fixed-rate", action="store_true", help="open loop: evenly spaced, not Poisson")
    parser.add_argument("--priority", type=int, help="open loop: each request's priority (default: none named)")
    parser.add_argument("--timeout-ms", type=int, default=1000, help="open loop: each request's deadline")
    parser.add_argument("--at", type=float, help="open loop: time.monotonic() the timed part begins")
    parser.add_argument("--seed", type=int, default=0, help="open loop: of the schedule")
    parser.add_argument("--group", action="store_true", help="closed loop: what is sent at once, as one group")
    args = parser.parse_args(argv)
    shape = tuple(int(d) for d in args.shape.split(","))
    if args.rate is not None:
        print(json.dumps(open_loop(args.endpoint, args.model, shape, args.dtype, args.rate, args.seconds,
                                   args.warmup, args.timeout_ms, args.priority, not args.fixed_rate, args.at,
                                   args.seed)), flush=True)
        return 0
    result = run(args.endpoint, args.model, shape, args.dtype, args.concurrency, args.seconds, args.warmup,
                 args.samples, trace=args.trace, group=args.group)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
