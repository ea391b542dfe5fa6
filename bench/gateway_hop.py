"""The gateway's hop to the supervisor: a large request's tensors through the gateway's own shared-memory region
(inferd/oip/hop_region.py, here from 256 KiB on) against in the frames of its message, in one run (both ways set
by bench/variants/gateway_hop).

    python -m bench.gateway_hop [--rounds 3] [--seconds 4] [--protocols http,grpc]

Each round starts one daemon per way, in an order that turns from round to round (one CPU worker of 2 streams,
the echo model at 1 MiB and 16 MiB of float32, server.allow_client_shm on for both), and drives each size with
bench/oip_loadgen.py, 4 requests in flight, 4 s after a 1 s warm-up. The table gives each way's medians over the
rounds: MiB/s of requests answered, p50, and the CPU a request of the gateway and of the supervisor. JSON lines
are appended to bench/results/gateway_hop.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench import models
from bench.common import ROOT, record, run_oip_loadgen, table
from bench.front_ends import parts_cpu_seconds, processes
from bench.run import model_configs
from inferd.harness import DaemonProcess, free_port, local_config

SIZES = {"echo1m": models.ECHO_SIZES["1MB"], "echo16m": models.ECHO_SIZES["16MB"]}
CONCURRENCY = 4
WAYS = {"frames": {"INFERD_FRAMES_ONLY": "1"}, "region": {"INFERD_HOP_MIN_KIB": "256"}}


def start(workdir: Path, repo: Path, env: dict[str, str]) -> DaemonProcess:
    workdir.mkdir(parents=True)
    configs = model_configs(repo)
    config = local_config(workdir, {name: configs[name] for name in SIZES}, queue={"max_size": 4096},
                          server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
                                  "allow_client_shm": True, "max_message_mb": 64},
                          workers={"streams": 2, "shm_mb": 512})
    return DaemonProcess(workdir, config, env=env).start(timeout=120)


def measure(daemon: DaemonProcess, protocol: str, model: str, seconds: float) -> dict[str, Any]:
    parts = processes(daemon)
    before = parts_cpu_seconds(parts)
    address = daemon.config["server"][protocol]  # type: ignore[index]
    result = run_oip_loadgen(protocol, address, model, (SIZES[model] // 4,), CONCURRENCY, seconds, warmup=1.0)
    after = parts_cpu_seconds(parts)
    requests = max(1, result["statuses"].get("ok", 0))
    return {"mib_per_s": round(result["bytes_per_s"] / (1 << 20), 1), "p50_ms": result["latency_ms"]["p50"],
            "statuses": result["statuses"],
            "gateway_cpu_us": round((after[protocol] - before[protocol]) / requests * 1e6, 1),
            "supervisor_cpu_us": round((after["supervisor"] - before["supervisor"]) / requests * 1e6, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--protocols", default="http,grpc")
    args = parser.parse_args()
    protocols = args.protocols.split(",")
    root = Path(tempfile.mkdtemp(prefix="inferd-gateway-hop-"))
    models.save(models.Echo(), root / "repo", "echo", "v1")
    ways = list(WAYS.items())
    rows: list[dict[str, Any]] = []
    for round_number in range(args.rounds):
        turn = round_number % len(ways)
        for way, extra in ways[turn:] + ways[:turn]:
            env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'bench' / 'variants' / 'gateway_hop'}", **extra}
            daemon = start(root / f"{way}-{round_number}", root / "repo", env)
            try:
                for protocol in protocols:
                    for model in SIZES:
                        rows.append({"way": way, "round": round_number, "protocol": protocol, "model": model,
                                     "concurrency": CONCURRENCY, **measure(daemon, protocol, model, args.seconds)})
            finally:
                daemon.stop()
    record("gateway_hop", rows)
    lines = []
    for protocol in protocols:
        for model in SIZES:
            medians = {}
            for way in WAYS:
                runs = [r for r in rows if (r["way"], r["protocol"], r["model"]) == (way, protocol, model)]
                medians[way] = {key: statistics.median(r[key] for r in runs)
                                for key in ("mib_per_s", "p50_ms", "gateway_cpu_us", "supervisor_cpu_us")}
                lines.append([protocol, f"{SIZES[model] >> 20} MiB C={CONCURRENCY}", way,
                              *(medians[way][key] for key in ("mib_per_s", "p50_ms", "gateway_cpu_us",
                                                              "supervisor_cpu_us")),
                              f"{medians[way]['mib_per_s'] / medians['frames']['mib_per_s']:.2f} x"])
    print(table(["protocol", "case", "tensors to the supervisor", "MiB/s", "p50 ms", "gateway CPU us/request",
                 "supervisor CPU us/request", "x frames"], lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
