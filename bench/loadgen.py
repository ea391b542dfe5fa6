"""A closed-loop load generator: `--concurrency` requests in flight on one socket, for `--seconds`.

It speaks the wire protocol directly (one DEALER, one thread), so what it
measures is the daemon and the transport, not a client library. It prints one
JSON line: samples/s, latency percentiles in ms, and the count of each status.

    python -m bench.loadgen --endpoint tcp://127.0.0.1:5555 --model mlp --shape 256 --concurrency 16
"""

from __future__ import annotations

import argparse
import json
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
        warmup: float, samples: int = 1, timeout_ms: int = 10_000, trace: str | None = None) -> dict:
    """Drive the endpoint and return the measurements of the timed part.

    With `trace`, also save every timed request (time.monotonic() at send,
    latency in seconds, ok or not) to that .npz file, for benchmarks that split
    one run into phases.
    """
    rng = np.random.default_rng(0)
    payload = samples * int(np.prod(shape)) * np.dtype(dtype).itemsize
    variety = int(min(16, max(2, (64 << 20) // payload)))  # a few distinct inputs, at most ~64 MB of them
    inputs = [rng.standard_normal((samples, *shape)).astype(dtype) for _ in range(variety)]
    # Every request is encoded before the clock starts, and ids are reused once answered: the
    # generator shares the machine with what it measures, so it spends as little CPU as it can.
    pool = 2 * concurrency
    encoded = [protocol.encode_request(i, model, [inputs[i % variety]], timeout_ms=timeout_ms) for i in range(pool)]
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
        if now < stop_at:
            while len(sent_at) < concurrency:
                request_id = free.popleft()
                # The encoded frames never change, so large ones may go by reference.
                send_parts_tracked(socket, encoded[request_id])
                sent_at[request_id] = time.monotonic()
        elif not sent_at:
            break
        if not socket.poll(1000):
            if time.monotonic() > stop_at + timeout_ms / 1000:
                statuses["lost"] += len(sent_at)
                break
            continue
        while (frames := recv_parts(socket)) is not None:
            done = time.monotonic()
            header = protocol.decode_reply_header(frames[0].buffer)
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
        "samples_per_request": samples,
        "seconds": seconds,
        "requests": sum(statuses.values()),
        "samples_per_s": round(ok * samples / seconds, 1),
        "bytes_per_s": round(ok * payload / seconds, 1),
        "latency_ms": percentiles(latencies),
        "statuses": dict(statuses),
        "cpu_us_per_request": round(cpu_us_per_request, 1),  # the generator's own, warm-up included
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
    args = parser.parse_args(argv)
    shape = tuple(int(d) for d in args.shape.split(","))
    result = run(args.endpoint, args.model, shape, args.dtype, args.concurrency, args.seconds, args.warmup,
                 args.samples, trace=args.trace)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
