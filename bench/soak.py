"""Overload soak: offer 4x what the daemon can serve, in 16 MiB requests, for a minute; memory stays bounded.

    python -m bench.soak [--seconds 60] [--factor 4] [--mib 16]

First the daemon's capacity is measured (closed loop, concurrency 4). Then open-loop
senders, each on its own connection, offer `factor` times that rate for `seconds`,
reading replies as they come. Every request must be answered `ok` or `overloaded`.
The supervisor's resident memory is printed every 10 s, and its peak (the kernel's
VmHWM) against what it held at the start, plus 1.5 x queue.max_bytes, plus 16 MiB
(docs/operations/memory.md: the queue, and what ZeroMQ holds unread). Afterwards the
daemon must serve normally, and have given the flood's memory back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import zmq

from bench import models
from bench.common import ROOT, record, run_loadgen, start_daemon, table
from bench.loadgen import percentiles
from inferd import protocol
from inferd.config import parse

SENDERS = 4
SAMPLE_EVERY_S = 10.0


SENDER_HWM = 64  # requests a sender queues for the transport; past it, TCP is pushing back


def offer(endpoint: str, floats: int, rate: float, seconds: float) -> dict:
    """Offer requests of `floats` float32 at `rate` per second (open loop) for `seconds`, then wait for
    the last replies. The one request is encoded once and sent by reference every time. A request
    the transport cannot take (the daemon's connection is back-pressured) is counted, not queued:
    what the daemon is offered is what reaches it."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.SNDHWM, SENDER_HWM)
    socket.linger = 0
    socket.connect(endpoint)
    x = np.random.default_rng(0).standard_normal((1, floats)).astype(np.float32)
    header, payload = protocol.encode_request(0, "echo", [x], timeout_ms=10_000)
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    outstanding = 0
    started = time.monotonic()
    due = sent = pushed_back = 0
    while True:
        now = time.monotonic()
        if now - started < seconds:
            while due < int((now - started) * rate):
                due += 1
                try:
                    socket.send_multipart([header, payload], flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pushed_back += 1
                    continue
                sent += 1
                outstanding += 1
        elif not outstanding or now - started > seconds + 60:
            break
        while socket.poll(0 if now - started < seconds else 100):
            reply = protocol.decode_reply_header(socket.recv_multipart(copy=False)[0].buffer)
            outstanding -= 1
            statuses[reply.status] += 1
            if reply.status == protocol.OK and reply.timing_us is not None:
                latencies.append(reply.timing_us.total / 1e6)
        time.sleep(0.001)
    statuses["no reply"] += outstanding
    socket.close()
    context.term()
    return {"offered_per_s": round(due / seconds, 1), "requests": sent, "pushed_back": pushed_back,
            "statuses": dict(statuses), "latencies": latencies}


def ceiling(config: dict, rss_start: int) -> int:
    """The most the supervisor may hold under a flood by the config: docs/operations/memory.md."""
    return rss_start + int(1.5 * parse(config).queue.max_bytes) + 16 * 2**20


def peak_rss(pid: int) -> int:
    """The process's peak resident memory since it started or since reset_peak (VmHWM), in bytes."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_peak(pid: int) -> None:
    """Start the process's peak resident memory again from what it holds now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--mib", type=int, default=16, help="MiB of float32 per request")
    args = parser.parse_args()
    floats = args.mib * 2**18
    workdir = Path(tempfile.mkdtemp(prefix="inferd-soak-"))
    models.build(workdir / "repo")
    echo = {"repository": str(workdir / "repo" / "echo"), "inputs": [{"dtype": "float32", "shape": [floats]}],
            "max_batch_size": 1, "warmup_batch_sizes": [1]}
    server = {"max_message_mb": args.mib + 1}
    daemon = start_daemon(workdir / "daemon", {"echo": echo}, server=server)
    assert daemon.config is not None
    supervisor = psutil.Process(daemon.process.pid)
    try:
        capacity = run_loadgen(daemon.endpoint, "echo", (floats,), 4, 5.0)["samples_per_s"]
        rss_start = supervisor.memory_info().rss
        reset_peak(supervisor.pid)
        limit = ceiling(daemon.config, rss_start)
        samples: list[tuple[float, int]] = [(0.0, rss_start)]
        done = threading.Event()
        began = time.monotonic()

        def watch() -> None:
            while not done.wait(SAMPLE_EVERY_S):
                samples.append((time.monotonic() - began, supervisor.memory_info().rss))
                print(f"  {samples[-1][0]:5.0f} s  supervisor RSS {samples[-1][1] / 2**20:7.0f} MiB "
                      f"(ceiling {limit / 2**20:.0f} MiB)", flush=True)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        outputs = [workdir / f"sender{k}.json" for k in range(SENDERS)]
        senders = [
            subprocess.Popen([sys.executable, "-c",
                              "import json, sys; from bench.soak import offer; "
                              f"json.dump(offer({daemon.endpoint!r}, {floats}, {capacity * args.factor / SENDERS}, "
                              f"{args.seconds}), open(sys.argv[1], 'w'))", str(output)], cwd=ROOT)
            for output in outputs
        ]
        for sender in senders:
            sender.wait()
        done.set()
        watcher.join()
        peak = peak_rss(supervisor.pid)
        time.sleep(1.0)  # two of the supervisor's ticks: it gives freed memory back on each
        samples.append((time.monotonic() - began, supervisor.memory_info().rss))
        parts = [json.loads(output.read_text()) for output in outputs]
        statuses: Counter[str] = Counter()
        for part in parts:
            statuses.update(part["statuses"])
        healthy = daemon.call("health")["healthy"]
        check = run_loadgen(daemon.endpoint, "echo", (floats,), 1, 3.0)
    finally:
        daemon.stop()
    answered = {k: v for k, v in statuses.items() if v}
    only_ok_or_overloaded = set(answered) <= {"ok", "overloaded"}
    row = {"mib_per_request": args.mib, "capacity_per_s": capacity, "factor": args.factor, "seconds": args.seconds,
           "offered_per_s": round(sum(p["offered_per_s"] for p in parts), 1),
           "requests": sum(p["requests"] for p in parts), "pushed_back": sum(p["pushed_back"] for p in parts),
           "statuses": answered,
           "accepted_latency_ms": percentiles([v for p in parts for v in p["latencies"]]),
           "rss_samples": samples, "rss_ceiling": limit, "rss_peak": peak, "healthy_after": healthy,
           "after": {"statuses": check["statuses"], "p50_ms": check["latency_ms"]["p50"]}}
    record("soak", [row])
    print()
    print(table(["", "value"], [
        ["capacity (closed loop, C=4)", f"{capacity} requests/s of {args.mib} MiB"],
        ["offered", f"{row['offered_per_s']} requests/s for {args.seconds:g} s: {row['requests']} sent, "
                    f"{row['pushed_back']} held back by TCP"],
        ["answers", ", ".join(f"{k} {v}" for k, v in sorted(answered.items()))],
        ["every request answered ok or overloaded", "yes" if only_ok_or_overloaded else "NO"],
        ["accepted p50 / p99 (in the daemon)",
         f"{row['accepted_latency_ms']['p50']} / {row['accepted_latency_ms']['p99']} ms"],
        ["supervisor RSS every 10 s", " -> ".join(f"{rss / 2**20:.0f}" for _, rss in samples) + " MiB"],
        ["peak (VmHWM) against start + 1.5 x max_bytes + 16 MiB",
         f"{peak / 2**20:.0f} MiB against {limit / 2**20:.0f} MiB ({'kept' if peak <= limit else 'PASSED'})"],
        ["healthy right after", "yes" if healthy else "NO"],
        ["then, one at a time", f"{check['statuses']} p50 {check['latency_ms']['p50']} ms"],
    ]))
    return 0 if only_ok_or_overloaded and healthy and peak <= limit else 1


if __name__ == "__main__":
    raise SystemExit(main())
