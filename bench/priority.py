"""Priority under overload: an urgent client and a default-level one on one model, offered 3x capacity.

    python -m bench.priority [--seconds 30] [--model cnn] [--factor 3] [--urgent-share 0.2] [--timeout-ms 1000]

One daemon serves the model (bench/run.py's config: max_batch_size, the
default batch window, two priority levels). In that run, in order:

1. capacity: requests/s answered closed-loop at concurrency 64 (bench/loadgen.py,
   enough to keep every batch full; more measured no higher), for --capacity-seconds;
2. idle: the urgent client alone, open loop at urgent-share x capacity,
   priority 0, for --idle-seconds: its p50/p99 on an otherwise idle daemon;
3. overload: two open-loop clients side by side for --seconds, each in its own
   process on its own connection, timed over the same seconds: urgent
   (priority 0) at urgent-share x capacity, and one that names no priority
   (the default level, 1) with the rest of factor x capacity;
4. capacity again, closed-loop as in 1. The reference the goodput is judged
   against is the mean of 1 and 4: on a shared machine one measurement drifts
   by tens of percent within minutes, and the two bracket the overload.

Open loop: bench/loadgen.py's --rate, Poisson arrivals whatever the replies,
every request with a deadline of --timeout-ms. Latency is the client's, from
send to reply. Goodput: ok replies within their deadline per second, both
clients together.

Targets (the issue's): the urgent client's requests all answered ok; its p99
<= 3 x its p99 on the idle daemon; all shedding (overloaded, timeout) falls on
the default level; goodput >= 0.9 x the capacity measured closed-loop.

The model: the cnn by default. On the 2-core machine this is measured on, the
mlp's capacity (~10k requests/s in the daemon) is bounded by the CPU of the
supervisor and the client per request, not by the model: offering it 3x (~30k
requests/s) takes most of a core in the generators and as much again in the
supervisor receiving and refusing, which is CPU the served requests no longer
get, so its goodput measures the client on the same cores rather than the
scheduling. The cnn costs ~1 ms of compute per sample, so 3x its capacity
(a few thousand requests/s) is cheap to offer and to refuse, and what is
measured is the policy. `--model mlp` runs the same with the mlp.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import models
from bench.common import open_loop_command, record, run_loadgen, run_open_loops, start_daemon, table
from bench.run import model_configs

SHAPES = {"mlp": models.MLP_SHAPE, "cnn": models.CNN_SHAPE}
CAPACITY_CONCURRENCY = 64
START_SLACK_S = 3.0  # from launching the two generators to the timed part: both have imported and connected
P99_FACTOR = 3.0
GOODPUT_SHARE = 0.9


def level_replies(stats: dict[str, Any]) -> dict[str, Counter[str]]:
    """Replies by priority level since start, from the daemon's `stats` of one model (empty if it gives none)."""
    return {level: Counter(v.get("requests", {})) for level, v in (stats.get("priorities") or {}).items()}


def batches(stats: dict[str, Any]) -> Counter[int]:
    """Batches by size since start, from the daemon's `stats` of one model."""
    distribution = stats.get("batch_size", {}).get("distribution", {})
    return Counter({int(size): n for size, n in distribution.items()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="of the overload")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="of the urgent client alone")
    parser.add_argument("--capacity-seconds", type=float, default=5.0)
    parser.add_argument("--model", default="cnn", choices=sorted(SHAPES))
    parser.add_argument("--factor", type=float, default=3.0, help="offered load, times capacity, both clients")
    parser.add_argument("--urgent-share", type=float, default=0.2, help="the urgent client's rate, times capacity")
    parser.add_argument("--timeout-ms", type=int, default=1000, help="each request's deadline")
    parser.add_argument("--window", default=None, help='max_wait_ms for the model (a number or "auto"; default: '
                                                        "bench/run.py's)")
    args = parser.parse_args()
    model, shape = args.model, SHAPES[args.model]
    workdir = Path(tempfile.mkdtemp(prefix="inferd-priority-"))
    models.build(workdir / "repo")
    config = model_configs(workdir / "repo")[model]
    if args.window is not None:
        config["max_wait_ms"] = args.window if args.window == "auto" else float(args.window)
    daemon = start_daemon(workdir / "daemon", {model: config})
    endpoint = daemon.endpoint
    try:
        closed = run_loadgen(endpoint, model, shape, CAPACITY_CONCURRENCY, args.capacity_seconds, warmup=1.0)
        offered = closed["samples_per_s"]  # one sample per request: requests/s
        urgent_rate = args.urgent_share * offered
        default_rate = (args.factor - args.urgent_share) * offered
        common = {"timeout_ms": args.timeout_ms}
        [idle] = run_open_loops([open_loop_command(endpoint, model, shape, urgent_rate, args.idle_seconds,
                                                   warmup=1.0, priority=0, seed=1, **common)])
        stats_before = daemon.call("stats")["models"][model]
        at = time.monotonic() + START_SLACK_S
        urgent, default = run_open_loops([
            open_loop_command(endpoint, model, shape, urgent_rate, args.seconds, priority=0, at=at, seed=2, **common),
            open_loop_command(endpoint, model, shape, default_rate, args.seconds, at=at, seed=3, **common),
        ])
        stats = daemon.call("stats")["models"][model]
        closed_after = run_loadgen(endpoint, model, shape, CAPACITY_CONCURRENCY, args.capacity_seconds, warmup=1.0)
    finally:
        daemon.stop()
    before, after = level_replies(stats_before), level_replies(stats)
    daemon_levels = {level: dict(after[level] - before.get(level, Counter())) for level in after}
    overload_batches = batches(stats) - batches(stats_before)  # the overload's, its warm-up included
    mean_batch = sum(k * n for k, n in overload_batches.items()) / max(1, overload_batches.total())
    compute_ms = stats.get("latency_ms", {}).get("compute", {})  # the daemon's last minute
    capacity = (closed["samples_per_s"] + closed_after["samples_per_s"]) / 2

    urgent_not_ok = urgent["requests"] - urgent["statuses"].get("ok", 0) + urgent["pushed_back"]
    shed = {name: sum(run["statuses"].get(s, 0) for s in ("overloaded", "timeout")) + run["pushed_back"]
            for name, run in (("urgent", urgent), ("default", default))}
    goodput = (urgent["good"] + default["good"]) / args.seconds
    p99_limit = P99_FACTOR * idle["latency_ms"]["p99"]
    targets = {
        "urgent_all_ok": urgent_not_ok == 0,
        "urgent_p99": urgent["latency_ms"]["p99"] <= p99_limit,
        "shedding_on_default_only": shed["urgent"] == 0,
        "goodput": goodput >= GOODPUT_SHARE * capacity,
    }
    row = {"model": model, "seconds": args.seconds, "factor": args.factor, "urgent_share": args.urgent_share,
           "timeout_ms": args.timeout_ms, "max_wait_ms": config.get("max_wait_ms", "default (2)"),
           "capacity_per_s": capacity, "capacity_runs": [closed, closed_after], "idle": idle, "urgent": urgent,
           "default": default,
           "goodput_per_s": round(goodput, 1), "shed": shed, "daemon_levels": daemon_levels,
           "mean_batch": round(mean_batch, 2), "compute_ms": compute_ms, "daemon_goodput": stats.get("goodput"),
           "daemon_priorities_since_start": stats.get("priorities"),
           "targets": targets}
    record("priority", [row])

    def client_row(name: str, run: dict[str, Any]) -> list[Any]:
        statuses = run["statuses"]
        other = sum(v for k, v in statuses.items() if k not in ("ok", "overloaded", "timeout"))
        return [name, run["priority"] if run["priority"] is not None else "(default) 1",
                f"{run['rate_offered_per_s']:.0f}", f"{run['rate_sent_per_s']:.0f}", run["requests"],
                statuses.get("ok", 0), statuses.get("overloaded", 0), statuses.get("timeout", 0),
                other + run["pushed_back"], run["latency_ms"]["p50"], run["latency_ms"]["p99"],
                f"{run['goodput_per_s']:.0f}", f"{run['send_late_ms']['p99']:.1f}", run["cpu_percent"]]

    print()
    print(f"{model}, max_wait_ms {row['max_wait_ms']}, deadline {args.timeout_ms} ms: capacity "
          f"{closed['samples_per_s']:.0f} before, {closed_after['samples_per_s']:.0f} after: {capacity:.0f} "
          f"requests/s closed-loop at C={CAPACITY_CONCURRENCY}; offered {args.factor:g}x (of the first) = "
          f"{urgent_rate + default_rate:.0f} requests/s for {args.seconds:g} s; in the overload mean batch "
          f"{mean_batch:.1f}, the daemon's batch compute p50/p99 {compute_ms.get('p50')}/{compute_ms.get('p99')} ms "
          "(its last minute)")
    print(table(["client", "priority", "offered/s", "sent/s", "sent", "ok", "overloaded", "timeout",
                 "other (pushed back, lost)", "ok p50 ms", "ok p99 ms", "goodput/s", "send late p99 ms",
                 "client CPU %"],
                [client_row("urgent alone (idle daemon)", idle), client_row("urgent", urgent),
                 client_row("default", default)]))
    if daemon_levels:
        print("\nthe daemon's replies by level in the overload: "
              + "; ".join(f"{level}: {dict(sorted(c.items()))}" for level, c in sorted(daemon_levels.items())))
    verdict = {True: "met", False: "MISSED"}
    print()
    print(table(["target", "measured", ""], [
        ["urgent: every request answered ok", f"{urgent_not_ok} not ok of {urgent['requests']}",
         verdict[targets["urgent_all_ok"]]],
        [f"urgent p99 <= {P99_FACTOR:g} x idle p99", f"{urgent['latency_ms']['p99']} ms <= {P99_FACTOR:g} x "
         f"{idle['latency_ms']['p99']} = {p99_limit:.3f} ms ({urgent['latency_ms']['p99'] / p99_limit * P99_FACTOR:.2f}"
         " x idle)", verdict[targets["urgent_p99"]]],
        ["all shedding on the default level", f"urgent {shed['urgent']}, default {shed['default']}",
         verdict[targets["shedding_on_default_only"]]],
        [f"goodput >= {GOODPUT_SHARE} x capacity", f"{goodput:.0f} requests/s = {goodput / capacity:.2f} x "
         f"{capacity:.0f}", verdict[targets["goodput"]]],
    ]))
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
