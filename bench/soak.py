"""Overload soak: offer 4x what the daemon can serve, for a minute, and check it stays whole.

    python -m bench.soak [--seconds 60] [--factor 4]

First the daemon's capacity is measured (closed loop, concurrency 64). Then an
open-loop sender offers `factor` times that rate for `seconds`, reading replies
as they come. Every request must be answered `ok` or `overloaded`; the accepted
requests' p99 must stay bounded by the queue; the supervisor's and workers' RSS
is printed at the start and the end; afterwards the daemon must serve normally.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import zmq

from bench import models
from bench.common import ROOT, record, run_loadgen, start_daemon, table
from bench.loadgen import percentiles
from bench.run import model_configs
from inferd import protocol

SENDERS = 4


def offer(endpoint: str, rate: float, seconds: float) -> dict:
    """Send at `rate` requests/s (open loop) for `seconds`, then wait for the last replies."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.linger = 0
    socket.connect(endpoint)
    x = np.random.default_rng(0).standard_normal((1, *models.MLP_SHAPE)).astype(np.float32)
    sent_at: dict[int, float] = {}
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    started = time.monotonic()
    next_id = 0
    while True:
        now = time.monotonic()
        if now - started < seconds:
            due = int((now - started) * rate)
            while next_id < due:
                socket.send_multipart(protocol.encode_request(next_id, "mlp", [x], timeout_ms=10_000), copy=False)
                sent_at[next_id] = time.monotonic()
                next_id += 1
        elif not sent_at or now - started > seconds + 15:
            break
        while socket.poll(0 if now - started < seconds else 100):
            header, _ = protocol.decode_reply([f.buffer for f in socket.recv_multipart(copy=False)])
            sent_at.pop(header.id)
            statuses[header.status] += 1
            if header.status == protocol.OK:
                # The daemon's own measure: this process lags behind its replies at this rate.
                latencies.append(header.timing_us.total / 1e6)
        time.sleep(0.0005)
    statuses["no reply"] += len(sent_at)
    socket.close()
    context.term()
    return {"offered_per_s": round(next_id / seconds, 1), "requests": next_id, "statuses": dict(statuses),
            "latencies": latencies}


def rss(daemon) -> dict[str, int]:
    """Resident memory of the supervisor and each worker, in bytes."""
    out = {"supervisor": psutil.Process(daemon.process.pid).memory_info().rss}
    for w in daemon.status()["workers"]:
        out[f"worker{w['worker']}"] = psutil.Process(w["pid"]).memory_info().rss
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--factor", type=float, default=4.0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="inferd-soak-"))
    models.build(workdir / "repo")
    daemon = start_daemon(workdir / "daemon", {"mlp": model_configs(workdir / "repo")["mlp"]})
    try:
        capacity = run_loadgen(daemon.endpoint, "mlp", models.MLP_SHAPE, 64, 5.0)["samples_per_s"]
        before = rss(daemon)
        # Several senders: one Python process cannot both send and read this many messages.
        outputs = [workdir / f"sender{k}.json" for k in range(SENDERS)]
        senders = [
            subprocess.Popen([sys.executable, "-c",
                              "import json, sys; from bench.soak import offer; "
                              f"json.dump(offer({daemon.endpoint!r}, {capacity * args.factor / SENDERS}, "
                              f"{args.seconds}), open(sys.argv[1], 'w'))", str(output)], cwd=ROOT)
            for output in outputs
        ]
        samples = [before]
        while any(sender.poll() is None for sender in senders):
            time.sleep(args.seconds / 4)
            samples.append(rss(daemon))
        parts = [json.loads(output.read_text()) for output in outputs]
        statuses: Counter[str] = Counter()
        for part in parts:
            statuses.update(part["statuses"])
        result = {
            "offered_per_s": round(sum(p["offered_per_s"] for p in parts), 1),
            "requests": sum(p["requests"] for p in parts),
            "statuses": dict(statuses),
            "accepted_latency_ms": percentiles([v for p in parts for v in p["latencies"]]),
            "undelivered": daemon.status()["undelivered_replies"],
        }
        after = rss(daemon)
        healthy = daemon.call("health")["healthy"]
        check = run_loadgen(daemon.endpoint, "mlp", models.MLP_SHAPE, 1, 3.0)
    finally:
        daemon.stop()
    row = {"capacity_per_s": capacity, "factor": args.factor, "seconds": args.seconds, **result,
           "rss_start": before, "rss_end": after, "rss_samples": samples, "healthy_after": healthy,
           "after": {"statuses": check["statuses"], "p50_ms": check["latency_ms"]["p50"]}}
    record("soak", [row])
    statuses = {k: v for k, v in result["statuses"].items() if v}
    only_ok_or_overloaded = set(statuses) <= {"ok", "overloaded"}
    print()
    print(table(["", "value"], [
        ["capacity (closed loop, C=64)", f"{capacity} requests/s"],
        ["offered", f"{result['offered_per_s']} requests/s for {args.seconds:g} s ({result['requests']} requests)"],
        ["answers", ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))],
        ["every request answered ok or overloaded", "yes" if only_ok_or_overloaded else "NO"],
        ["accepted p50 / p99 (in the daemon)",
         f"{result['accepted_latency_ms']['p50']} / {result['accepted_latency_ms']['p99']} ms"],
        *[[f"RSS {name} (every {args.seconds / 4:g} s)", " -> ".join(f"{s[name] / 2**20:.0f}" for s in samples) + " MiB"]
          for name in before],
        ["healthy right after", "yes" if healthy else "NO"],
        ["then, one at a time", f"{check['statuses']} p50 {check['latency_ms']['p50']} ms"],
    ]))
    return 0 if only_ok_or_overloaded and healthy else 1


if __name__ == "__main__":
    raise SystemExit(main())
