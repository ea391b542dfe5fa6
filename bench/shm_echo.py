"""Echo through shared memory against inline and against the bare ZeroMQ echo (issue 16).

    python -m bench.shm_echo [--seconds 5] [--warmup 1]

For each payload (1 MiB and 16 MiB of float32, one request of batch 1), with 4
requests in flight over tcp loopback:
  bare_echo      bench/echo.py, driven by bench/loadgen.py (the transport reference)
  inline         inferd's echo model, Client.submit with numpy arrays (bytes over the socket)
  shared_memory  the same, each request in flight with its own input and output area of one
                 registered region: Client.submit with a view of it and out= (no tensor bytes
                 over the socket)
bytes/s counts request bytes, the same way for each case: requests sent in the
timed window and answered `ok`, times the payload, over --seconds. Each case's
output is checked once against its input. The daemon runs one CPU worker with
streams 2 and server.allow_client_shm on. JSON lines first, then the table.

  copy_bound     what the supervisor's two copies alone allow: a request's bytes read from a
                 region file with os.preadv and written back with os.pwritev (the calls it
                 makes), timed in this process; the shared_memory case cannot pass it

Targets (same run): shared_memory >= 3 x bare_echo bytes/s at 16 MiB, >= 1.5 x at 1 MiB.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import models
from bench.common import ROOT, run_loadgen, start_daemon, table
from bench.loadgen import percentiles
from bench.run import model_configs
from inferd.client.client import Client
from inferd.harness import free_port
from inferd.system.shm_names import CLIENT_PREFIX, SHM_DIR

CONCURRENCY = 4
SIZES = {"echo1m": models.ECHO_SIZES["1MB"], "echo16m": models.ECHO_SIZES["16MB"]}  # model -> request bytes
CASES = ("bare_echo", "inline", "shared_memory", "copy_bound")
TARGETS = {models.ECHO_SIZES["1MB"]: 1.5, models.ECHO_SIZES["16MB"]: 3.0}  # shared_memory / bare_echo, at least


def drive(client: Client, model: str, slots: Sequence[tuple[np.ndarray, np.ndarray | None]], seconds: float,
          warmup: float) -> dict[str, Any]:
    """Keep one request in flight per slot (its input, and its `out` or None), resending a slot's as soon
    as it is answered; measure the requests sent in the `seconds` after `warmup`, as bench/loadgen.py does."""
    answered: queue.SimpleQueue = queue.SimpleQueue()
    sent_at = [0.0] * len(slots)

    def send(slot: int) -> None:
        x, out = slots[slot]
        sent_at[slot] = time.monotonic()
        client.submit(model, x, out=out).add_done_callback(lambda future: answered.put((slot, future)))

    measure_from = time.monotonic() + warmup
    stop_at = measure_from + seconds
    for slot in range(len(slots)):
        send(slot)
    in_flight, latencies = len(slots), []
    while in_flight:
        slot, future = answered.get(timeout=client.timeout + 5)
        done = time.monotonic()
        in_flight -= 1
        future.result()  # an error stops the benchmark: every request must be answered `ok`
        if measure_from <= sent_at[slot] < stop_at:
            latencies.append(done - sent_at[slot])
        if done < stop_at:
            send(slot)
            in_flight += 1
    return {"requests": len(latencies), "latency_ms": percentiles(latencies)}


def copy_bound(size: int, seconds: float) -> float:
    """Request bytes per second that one read (os.preadv) from a region file into mapped memory and one
    write (os.pwritev) back allow, each copy of `size` bytes, timed over about `seconds`."""
    path = SHM_DIR / f"{CLIENT_PREFIX}bench-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        target = mmap.mmap(-1, size)
        view = memoryview(target)
        view[:] = bytes(size)  # fault the pages in, as an arena's are
        copies, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds or not copies:
            os.preadv(fd, [view], 0)
            os.pwritev(fd, [view], 0)
            copies += 1
        elapsed = time.perf_counter() - started
        view.release()
        target.close()
    finally:
        os.close(fd)
        path.unlink()
    return copies * size / elapsed


def check(client: Client, model: str, x: np.ndarray, out: np.ndarray | None = None) -> None:
    """One request, whose output must equal its input (and lie in `out`, where given)."""
    if out is not None:
        out[...] = 0
    y = client.infer(model, x, out=out)
    if not np.array_equal(y, x) or (out is not None and not np.shares_memory(y, out)):
        raise AssertionError(f"{model}: the output is not the input" + ("" if out is None else " in out="))


def measure(seconds: float, warmup: float) -> list[dict[str, Any]]:
    """Every case at every size: one row each."""
    workdir = Path(tempfile.mkdtemp(prefix="inferd-shm-echo-"))
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    bare_endpoint = f"tcp://127.0.0.1:{free_port()}"
    bare = subprocess.Popen([sys.executable, "-m", "bench.echo", bare_endpoint], cwd=ROOT)
    daemon = None
    try:
        models.save(models.Echo(), workdir / "repo", "echo", "v1")
        configs = model_configs(workdir / "repo")
        daemon = start_daemon(workdir / "daemon", {name: configs[name] for name in SIZES},
                              server={"allow_client_shm": True, "max_message_mb": 64},
                              workers={"devices": ["cpu"], "streams": 2, "shm_mb": 512})
        with Client(bare_endpoint, timeout=30.0) as to_bare, daemon.client(timeout=30.0) as client:
            for model, size in SIZES.items():
                shape = (1, size // 4)
                inputs = [rng.standard_normal(shape).astype(np.float32) for _ in range(CONCURRENCY)]
                check(to_bare, model, inputs[0])
                result = run_loadgen(bare_endpoint, model, shape[1:], CONCURRENCY, seconds, warmup=warmup)
                if result["statuses"] != {"ok": result["requests"]}:
                    raise RuntimeError(f"the bare echo answered {result['statuses']}")
                results = {"bare_echo": {"requests": result["requests"], "latency_ms": result["latency_ms"]}}

                check(client, model, inputs[0])
                results["inline"] = drive(client, model, [(x, None) for x in inputs], seconds, warmup)

                with client.shared_memory(2 * CONCURRENCY * size) as region:
                    slots = []
                    for i, x in enumerate(inputs):  # [input 0, output 0, input 1, output 1, ...]
                        x_view = region.array("float32", shape, offset=2 * i * size)
                        x_view[...] = x
                        slots.append((x_view, region.array("float32", shape, offset=(2 * i + 1) * size)))
                    check(client, model, *slots[0])
                    results["shared_memory"] = drive(client, model, slots, seconds, warmup)
                    del slots, x_view  # no view of the region outlives it

                bound = copy_bound(size, min(seconds, 2.0))
                results["copy_bound"] = {"requests": None, "latency_ms": None}  # no requests: the copies alone
                bare_rate = results["bare_echo"]["requests"] * size / seconds
                for case in CASES:
                    rate = bound if case == "copy_bound" else results[case]["requests"] * size / seconds
                    rows.append({"bench": "shm_echo", "size_bytes": size, "case": case, "concurrency": CONCURRENCY,
                                 "seconds": seconds, "bytes_per_s": round(rate, 1), **results[case],
                                 "ratio_to_bare": round(rate / bare_rate, 3) if bare_rate else None})
    finally:
        bare.kill()
        bare.wait()
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """The results as a table (cells padded so that the columns line up), and each target's verdict."""
    header = ["size", "case", "C", "MiB/s", "x bare echo", "requests", "p50 ms", "p99 ms"]
    cells = [[f"{r['size_bytes'] >> 20} MiB", r["case"], str(r["concurrency"]), f"{r['bytes_per_s'] / 2**20:.0f}",
              f"{r['ratio_to_bare']:.2f}", "-" if r["requests"] is None else str(r["requests"]),
              *([f"{r['latency_ms']['p50']:.2f}", f"{r['latency_ms']['p99']:.2f}"] if r["latency_ms"] else ["-", "-"])]
             for r in rows]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    lines = [table([h.ljust(w) for h, w in zip(header, widths)],
                   [[c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
                    for row in cells]), ""]
    for size, wanted in TARGETS.items():
        ratio = next((r["ratio_to_bare"] for r in rows if r["size_bytes"] == size and r["case"] == "shared_memory"),
                     None)
        verdict = "met" if ratio is not None and ratio >= wanted else "MISSED"
        lines.append(f"target: {size >> 20} MiB shared_memory {ratio} x bare echo bytes/s (>= {wanted:g}): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="timed part of each case")
    parser.add_argument("--warmup", type=float, default=1.0, help="untimed part before it")
    args = parser.parse_args(argv)
    rows = measure(args.seconds, args.warmup)
    for row in rows:
        print(json.dumps(row), flush=True)
    print()
    print(render(rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
