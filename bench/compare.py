"""inferd beside the servers a team would otherwise pick, serving the same model on the same machine.

    python -m bench.compare [--seconds 5] [--levels 1,4,16,64] [--servers inferd,torchserve,litserve,rayserve]

The benchmark mlp (bench/models.py: float32 [256] -> 1024 -> 1024 -> 10), one TorchScript file of the same
weights, served by each server in turn on 127.0.0.1, each set up alike: two model replicas (executors) of one
torch thread each, batches of up to 32 samples, a batch window of 2 ms. Each is driven over its own HTTP API
by bench/oip_loadgen.py's closed loop (C keep-alive connections, one sample per request, the request's bytes
made before the clock starts, each reply read as far as its status), at each concurrency for --seconds after
a warm-up. Before the load, one request to each server is checked against the model run in this process.

- inferd: one CPU worker of 2 streams, its HTTP gateway (the Open Inference Protocol with the binary tensor
  extension), max_wait_ms 2 (its default: a partial batch waits only while every executor is busy).
- TorchServe 0.12: 2 workers, batchSize 32, maxBatchDelay 2 ms; raw float32 bodies (bench/torchserve_handler.py).
- LitServe: workers_per_device 2, max_batch_size 32, batch_timeout 2 ms, fast_queue; JSON bodies, the only
  kind its decode_request is given (bench/serve_litserve.py).
- Ray Serve: 2 replicas on a local Ray of 2 CPUs, @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002),
  max_ongoing_requests 64; raw float32 bodies (bench/serve_rayserve.py).

NVIDIA Triton is not among them: it ships as a container image (NGC), its Python wheel only inside that
image, and PyPI's `tritonserver` is a placeholder whose install fails by design. Where a container can run,
Triton's own perf_analyzer drives inferd too (bench/perf_analyzer.py).

`make bench-compare` installs the others (the `compare` extra) and runs this. A server whose package is not
installed is skipped, saying so. With --rounds N every server runs N times, in an order that rotates, and the
chart shows each server's median. JSON lines go to bench/results/compare.jsonl, the chart to
docs/img/compare-mlp.png (`--chart-only` draws the chart again from the last run recorded, measuring nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import models, oip_loadgen
from bench.common import RESULTS, ROOT, record, run_oip_loadgen, start_daemon, table
from bench.run import model_configs
from inferd.harness import free_port

LEVELS = (1, 4, 16, 64)
CHART = ROOT / "docs" / "img" / "compare-mlp.png"
READY_TIMEOUT_S = 240.0  # TorchServe's JVM and Ray's processes start slowly on a busy 2-core machine
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Which code was measured, in the JSON lines ("" outside a git checkout).
COMMIT = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                        check=False).stdout.strip()


@dataclass(frozen=True)
class Api:
    """How a server is asked for one sample over HTTP, and how its answer is read."""

    path: str
    content_type: str
    encode: Callable[[np.ndarray], tuple[dict[str, str], bytes]]  # one sample -> extra headers, body
    decode: Callable[[http.client.HTTPResponse, bytes], np.ndarray]  # response, body -> the sample's output

    def request(self, sample: np.ndarray) -> bytes:
        """The whole HTTP/1.1 request, as the load generator sends it."""
        headers, body = self.encode(sample)
        lines = [f"POST {self.path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {self.content_type}",
                 *(f"{name}: {value}" for name, value in headers.items()), f"Content-Length: {len(body)}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    def ask(self, port: int, sample: np.ndarray) -> np.ndarray | None:
        """One request with the standard library's client: the output, or None while the server is not ready."""
        headers, body = self.encode(sample)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request("POST", self.path, body, {"Content-Type": self.content_type, **headers})
            response = connection.getresponse()
            content = response.read()
        except OSError:
            return None
        finally:
            connection.close()
        return self.decode(response, content) if response.status == 200 else None


def raw(sample: np.ndarray) -> tuple[dict[str, str], bytes]:
    return {}, sample.astype(np.float32).tobytes()


def from_raw(response: http.client.HTTPResponse, body: bytes) -> np.ndarray:
    return np.frombuffer(body, dtype=np.float32)


def oip_binary(sample: np.ndarray) -> tuple[dict[str, str], bytes]:
    """inferd's fastest HTTP form: the binary tensor extension (bench/oip_loadgen.py's request)."""
    request = oip_loadgen.http_request("mlp", sample[None])
    head, _, body = request.partition(b"\r\n\r\n")
    length = next(line.split(b":")[1].strip() for line in head.split(b"\r\n")
                  if line.lower().startswith(b"inference-header-content-length"))
    return {"Inference-Header-Content-Length": length.decode()}, body


def from_oip_binary(response: http.client.HTTPResponse, body: bytes) -> np.ndarray:
    return np.frombuffer(body[int(response.headers["Inference-Header-Content-Length"]):], dtype=np.float32)


def litserve_json(sample: np.ndarray) -> tuple[dict[str, str], bytes]:
    return {}, json.dumps({"input": sample.tolist()}).encode()


def from_litserve_json(response: http.client.HTTPResponse, body: bytes) -> np.ndarray:
    return np.asarray(json.loads(body)["output"], dtype=np.float32)


APIS = {
    "inferd": Api("/v2/models/mlp/infer", "application/octet-stream", oip_binary, from_oip_binary),
    "torchserve": Api("/predictions/mlp", "application/octet-stream", raw, from_raw),
    "litserve": Api("/predict", "application/json", litserve_json, from_litserve_json),
    "rayserve": Api("/mlp", "application/octet-stream", raw, from_raw),
}
NAMES = {"inferd": "inferd", "torchserve": "TorchServe", "litserve": "LitServe", "rayserve": "Ray Serve"}
PACKAGES = {"torchserve": "ts", "litserve": "litserve", "rayserve": "ray.serve"}  # the module each needs


def missing(server: str) -> str | None:
    """Why `server` cannot run here, or None."""
    module = PACKAGES.get(server)
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"{module} is not installed (`make bench-compare` installs it)"


def version_of(server: str) -> str:
    from importlib.metadata import version

    return version({"inferd": "inferd", "torchserve": "torchserve", "litserve": "litserve",
                    "rayserve": "ray"}[server])


@contextlib.contextmanager
def child(argv: list[str], log: Path, cwd: Path) -> Iterator[subprocess.Popen]:
    """A server process in its own session; on the way out it and every process it started are stopped."""
    with log.open("ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=out, cwd=cwd, start_new_session=True,
                                   env={**os.environ, **SINGLE_THREAD, "PYTHONPATH": str(ROOT)})
    try:
        yield process
    finally:
        family = [process]
        with contextlib.suppress(psutil.NoSuchProcess):
            family += psutil.Process(process.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs([psutil.Process(p.pid) for p in family if psutil.pid_exists(p.pid)],
                                     timeout=30)
        for leftover in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()
        process.wait()


@contextlib.contextmanager
def serve_inferd(workdir: Path, model: Path, port: int) -> Iterator[subprocess.Popen]:
    # The folder also holds a v2 of other weights (the reload benchmark's): serve the file the others serve.
    config = {**model_configs(model.parent.parent.parent)["mlp"], "version": model.parent.name, "max_wait_ms": 2}
    daemon = start_daemon(workdir, {"mlp": config}, server={"http": f"127.0.0.1:{port}"})
    try:
        yield daemon.process
    finally:
        daemon.stop()


@contextlib.contextmanager
def serve_torchserve(workdir: Path, model: Path, port: int) -> Iterator[subprocess.Popen]:
    """A model folder made by torch-model-archiver (no archive), its batching in the model's config file."""
    bin_dir = Path(sys.executable).parent
    store = workdir / "store"
    store.mkdir(parents=True, exist_ok=True)
    model_config = workdir / "model-config.yaml"
    model_config.write_text("minWorkers: 2\nmaxWorkers: 2\nbatchSize: 32\nmaxBatchDelay: 2\nresponseTimeout: 120\n")
    subprocess.run([str(bin_dir / "torch-model-archiver"), "--model-name", "mlp", "--version", "1.0",
                    "--serialized-file", str(model), "--handler", str(ROOT / "bench" / "torchserve_handler.py"),
                    "--config-file", str(model_config), "--export-path", str(store),
                    "--archive-format", "no-archive", "--force"], check=True, cwd=workdir)
    properties = workdir / "config.properties"
    properties.write_text("\n".join([
        f"inference_address=http://127.0.0.1:{port}", f"management_address=http://127.0.0.1:{free_port()}",
        f"metrics_address=http://127.0.0.1:{free_port()}", f"model_store={store}", "load_models=mlp",
        "disable_token_authorization=true", "enable_envvars_config=false", ""]))
    argv = [str(bin_dir / "torchserve"), "--start", "--foreground", "--ncs", "--model-store", str(store),
            "--ts-config", str(properties), "--disable-token-auth"]
    with child(argv, workdir / "server.log", workdir) as process:
        yield process


def serve(server: str, workdir: Path, model: Path, port: int) -> contextlib.AbstractContextManager[subprocess.Popen]:
    """`server` serving `model` on 127.0.0.1:`port`, its process (ready once a first request is answered)."""
    workdir.mkdir(parents=True, exist_ok=True)
    if server == "inferd":
        return serve_inferd(workdir, model, port)
    if server == "torchserve":
        return serve_torchserve(workdir, model, port)
    argv = [sys.executable, "-m", f"bench.serve_{server}", str(model), str(port)]
    return child(argv, workdir / "server.log", workdir)


def wait_until_right(server: str, process: subprocess.Popen, port: int, sample: np.ndarray,
                     expected: np.ndarray) -> None:
    """Ask until the server answers, then check its answer against the model run here."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while (output := APIS[server].ask(port, sample)) is None:
        if process.poll() is not None:
            raise RuntimeError(f"{NAMES[server]} exited with status {process.returncode} before it answered")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{NAMES[server]} did not answer within {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.5)
    if not np.allclose(output, expected, rtol=1e-4, atol=1e-5):
        raise RuntimeError(f"{NAMES[server]} answered {output[:4]}..., not the model's {expected[:4]}...")


def measure(server: str, workdir: Path, model: Path, levels: tuple[int, ...], seconds: float,
            round_: int) -> list[dict[str, Any]]:
    """Start `server`, check one answer, drive it at each concurrency, stop it: a row per concurrency."""
    sample = np.random.default_rng(0).standard_normal(models.MLP_SHAPE).astype(np.float32)
    expected = reference(model, sample)
    request_file = workdir / f"{server}.http"
    request_file.write_bytes(APIS[server].request(sample))
    port = free_port()
    rows = []
    started = time.monotonic()
    with serve(server, workdir / f"{server}-{round_}", model, port) as process:
        wait_until_right(server, process, port, sample, expected)
        ready_s = time.monotonic() - started
        for level in levels:
            result = run_oip_loadgen("http", f"127.0.0.1:{port}", "mlp", models.MLP_SHAPE, level, seconds,
                                     warmup=2.0, request=request_file)
            rows.append({"bench": "compare", "server": server, "version": version_of(server), "commit": COMMIT,
                         "round": round_,
                         "concurrency": level, "samples_per_s": result["samples_per_s"],
                         "p50": result["latency_ms"]["p50"], "p99": result["latency_ms"]["p99"],
                         "statuses": result["statuses"], "ready_s": round(ready_s, 1)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def reference(model: Path, sample: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return torch.jit.load(str(model)).eval()(torch.from_numpy(sample[None]))[0].numpy()


def medians(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, float]]:
    """Per (server, concurrency): the median over rounds of samples/s, p50 and p99."""
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault((row["server"], row["concurrency"]), []).append(row)
    return {key: {field: statistics.median(r[field] for r in group) for field in ("samples_per_s", "p50", "p99")}
            for key, group in grouped.items()}


def plot(summary: dict[tuple[str, int], dict[str, float]], servers: list[str], levels: tuple[int, ...],
         rounds: int, path: Path) -> None:
    """Samples/s and p99 latency per concurrency, a bar per server (the median of `rounds`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"inferd": "tab:red", "torchserve": "tab:blue", "litserve": "tab:purple", "rayserve": "tab:green"}
    # 7.2 inches wide: the page shows it about 700 px wide, so its 9-point text reads at the page's size.
    plt.rcParams.update({"font.size": 9})
    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(7.2, 3.9))
    width = 0.8 / len(servers)
    positions = np.arange(len(levels))
    for index, server in enumerate(servers):
        offsets = positions + (index - (len(servers) - 1) / 2) * width
        for axis, field in ((throughput, "samples_per_s"), (latency, "p99")):
            values = [summary.get((server, level), {}).get(field, np.nan) for level in levels]
            axis.bar(offsets, values, width, label=NAMES[server], color=colors[server])
    for axis, label in ((throughput, "samples/s (higher is better)"), (latency, "p99 latency, ms (lower is better)")):
        axis.set_xticks(positions, [f"C={level}" for level in levels])
        axis.set_xlabel("requests in flight, one sample each")
        axis.set_ylabel(label)
        axis.grid(True, axis="y", alpha=0.3)
    latency.set_yscale("log")
    throughput.legend(fontsize=8)
    figure.suptitle(f"The benchmark mlp over each server's HTTP API, 2-core CPU, median of {rounds} round(s)\n"
                    "2 replicas of 1 torch thread, batches of up to 32, 2 ms window (make bench-compare)",
                    fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=160)
    plt.close(figure)


def redraw(path: Path) -> int:
    """The chart of the last run recorded, drawn again (after a change to the drawing, say)."""
    rows = [json.loads(line) for line in (RESULTS / "compare.jsonl").read_text().splitlines() if line.strip()]
    last = [row for row in rows if row["when"] == rows[-1]["when"]]
    servers = [server for server in APIS if any(row["server"] == server for row in last)]
    levels = tuple(sorted({row["concurrency"] for row in last}))
    summary = medians(last)
    plot(summary, servers, levels, len({row["round"] for row in last}), path)
    print(render(summary, servers, levels))
    print(f"\nsaved {path} from the run of {last[0]['when']}")
    return 0


def render(summary: dict[tuple[str, int], dict[str, float]], servers: list[str], levels: tuple[int, ...]) -> str:
    header = ["C", *(f"{NAMES[s]} samples/s, p50 / p99 ms" for s in servers)]
    lines = []
    for level in levels:
        cells: list[Any] = [level]
        for server in servers:
            m = summary.get((server, level))
            cells.append(f"{m['samples_per_s']:.0f}, {m['p50']:.2f} / {m['p99']:.2f}" if m else "")
        lines.append(cells)
    return table(header, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="of each load generator run")
    parser.add_argument("--levels", type=lambda t: tuple(int(c) for c in t.split(",")), default=LEVELS,
                        help="concurrency levels, comma-separated (default 1,4,16,64)")
    parser.add_argument("--servers", type=lambda t: t.split(","), default=list(APIS),
                        help="comma-separated, of " + ", ".join(APIS))
    parser.add_argument("--rounds", type=int, default=1, help="runs of every server, in a rotating order")
    parser.add_argument("--chart", type=Path, default=CHART)
    parser.add_argument("--chart-only", action="store_true",
                        help="measure nothing: draw the chart again from the last run in bench/results/compare.jsonl")
    args = parser.parse_args(argv)
    if args.chart_only:
        return redraw(args.chart)
    unknown = [s for s in args.servers if s not in APIS]
    if unknown:
        parser.error(f"unknown server(s) {', '.join(unknown)}: choose from {', '.join(APIS)}")
    servers = []
    for server in args.servers:
        reason = missing(server)
        if reason:
            print(f"skipping {NAMES[server]}: {reason}", file=sys.stderr)
        else:
            servers.append(server)
    workdir = Path(tempfile.mkdtemp(prefix="inferd-compare-"))
    models.build(workdir / "repo")
    model = workdir / "repo" / "mlp" / "v1" / "model.pt"
    rows: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for server in servers[round_ % len(servers):] + servers[:round_ % len(servers)]:
            rows += measure(server, workdir, model, args.levels, args.seconds, round_)
    record("compare", rows)
    summary = medians(rows)
    plot(summary, servers, args.levels, args.rounds, args.chart)
    print()
    print(render(summary, servers, args.levels))
    print(f"\nsaved {args.chart} ({time.strftime('%Y-%m-%d %H:%M')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
