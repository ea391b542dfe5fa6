"""What the benchmarks share: a daemon to measure, the load generator in its own process, results."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from inferd.harness import DaemonProcess, local_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def start_daemon(workdir: Path, models: dict[str, dict[str, Any]], timeout: float = 120,
                 **sections: dict[str, Any]) -> DaemonProcess:
    """Start a daemon serving `models` with its sockets and state in `workdir`; wait `timeout` for it to serve."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = local_config(workdir, models, queue={"max_size": 4096})
    for section, values in sections.items():
        config[section].update(values)
    return DaemonProcess(workdir, config).start(timeout=timeout)


def loadgen_command(endpoint: str, model: str, shape: tuple[int, ...], concurrency: int, seconds: float,
                    warmup: float = 2.0, trace: Path | None = None, dtype: str = "float32",
                    group: bool = False) -> list[str]:
    """The command line of one load generator run."""
    command = [sys.executable, "-m", "bench.loadgen", "--endpoint", endpoint, "--model", model,
               "--shape", ",".join(map(str, shape)), "--concurrency", str(concurrency),
               "--seconds", str(seconds), "--warmup", str(warmup), "--dtype", dtype]
    return command + (["--trace", str(trace)] if trace else []) + (["--group"] if group else [])


def run_loadgen(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run the load generator in its own process and return its JSON line."""
    out = subprocess.run(loadgen_command(*args, **kwargs), cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def open_loop_command(endpoint: str, model: str, shape: tuple[int, ...], rate: float, seconds: float,
                      warmup: float = 2.0, priority: int | None = None, timeout_ms: int = 1000,
                      at: float | None = None, seed: int = 0, dtype: str = "float32") -> list[str]:
    """The command line of one open-loop load generator run (`rate` requests/s whatever the replies)."""
    command = [sys.executable, "-m", "bench.loadgen", "--endpoint", endpoint, "--model", model,
               "--shape", ",".join(map(str, shape)), "--rate", str(rate), "--seconds", str(seconds),
               "--warmup", str(warmup), "--timeout-ms", str(timeout_ms), "--seed", str(seed), "--dtype", dtype]
    command += ["--priority", str(priority)] if priority is not None else []
    return command + (["--at", repr(at)] if at is not None else [])


def run_open_loops(commands: list[list[str]]) -> list[dict[str, Any]]:
    """Run load generators side by side, each in its own process, and return their JSON lines."""
    processes = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, text=True) for c in commands]
    try:
        outs = [p.communicate()[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, command in zip(processes, commands):
        if p.returncode:
            raise subprocess.CalledProcessError(p.returncode, command)
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def run_oip_loadgen(protocol: str, address: str, model: str, shape: tuple[int, ...], concurrency: int,
                    seconds: float, warmup: float = 2.0, request: Path | None = None) -> dict[str, Any]:
    """Run the Open Inference Protocol's load generator in its own process and return its JSON line (with
    `request`, a file: it sends that HTTP request instead of its own)."""
    command = [sys.executable, "-m", "bench.oip_loadgen", "--protocol", protocol, "--address", address,
               "--model", model, "--shape", ",".join(map(str, shape)), "--concurrency", str(concurrency),
               "--seconds", str(seconds), "--warmup", str(warmup)]
    command += ["--request", str(request)] if request else []
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def record(name: str, rows: list[dict[str, Any]]) -> Path:
    """Print each row as a JSON line and append them to bench/results/NAME.jsonl."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    with path.open("a") as out:
        for row in rows:
            line = json.dumps({"when": stamp, **row})
            print(line)
            out.write(line + "\n")
    return path


def cpu_seconds(processes: list[psutil.Process]) -> list[float]:
    """Each process's CPU time so far (user and system), in seconds."""
    return [sum(p.cpu_times()[:2]) for p in processes]


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
