"""What a client can make a gateway hold: its memory under large and unfinished requests.

    python -m bench.gateway_memory [--mb 32]

One daemon (one CPU worker, default server.gateway_buffer_mb and max_message_mb) serves `sum` (float32
[1048576] -> [1]: large requests, small replies) over HTTP and gRPC. Each gateway's resident memory is
sampled every 5 ms through each case:

- json, gzip, grpc_contents: one request of about MB MiB of tensor data as JSON numbers of a few digits, the
  same gzip-compressed, and as gRPC fp32_contents; `ratio` is the gateway's peak growth over the request's
  (inflated) size. The target: at most 5.
- http_slow: 12 connections each send 60 MiB of a 64 MiB body, then nothing; a small request is sent
  meanwhile. `peak_mb` is the gateway's peak (target: under 512 MiB); `refused` how many of the 12 were
  answered 503 at once; `good` the small request's status.
- grpc_slow: 10 calls each send 60 MiB of a 64 MiB message, then nothing.
- after: each gateway's memory 2 s after the last reply, against before the cases (target: within 64 MiB).

JSON lines are appended to bench/results/gateway_memory.jsonl, then a table is printed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import record, start_daemon, table
from bench.hostile import PartialGrpcCall, PeakMemory, answered, gateway_pid, start_http_body
from inferd.harness import DaemonProcess, free_port

FEATURES = 1 << 20
MIB = 1 << 20


class Sum(torch.nn.Module):
    """float32 [F] -> [1]: each sample's sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True)


def serve(workdir: Path) -> DaemonProcess:
    """A daemon serving `sum` over HTTP and gRPC."""
    (workdir / "repo" / "sum" / "v1").mkdir(parents=True)
    torch.jit.script(Sum()).save(str(workdir / "repo" / "sum" / "v1" / "model.pt"))
    model = {"repository": str(workdir / "repo" / "sum"), "inputs": [{"dtype": "float32", "shape": [FEATURES]}],
             "max_batch_size": 16, "warmup_batch_sizes": [1]}
    return start_daemon(workdir / "daemon", {"sum": model}, workers={"devices": ["cpu"], "shm_mb": 512},
                        server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}"})


def post(address: str, body: bytes, headers: dict[str, str]) -> int:
    request = urllib.request.Request(f"http://{address}/v2/models/sum/infer", data=body, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def one_request_cases(http: str, grpc: str, pids: dict[str, int], mb: float) -> list[dict[str, Any]]:
    """json, gzip and grpc_contents: one large request each, its gateway's peak growth over its size."""
    import tritonclient.grpc as grpcclient

    samples = max(1, round(mb * MIB / (4 * FEATURES)))  # "0.3," is four bytes a value
    values = np.round(np.random.default_rng(0).random((samples, FEATURES)), 1)
    body = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(values.shape),
                                   "data": values.ravel().tolist()}]}, separators=(",", ":")).encode()
    rows = []
    for case, data, headers in (("json", body, {}), ("gzip", gzip.compress(body, 1), {"Content-Encoding": "gzip"})):
        with PeakMemory(pids["http"]) as memory:
            status = post(http, data, headers)
        rows.append({"case": case, "status": status, "wire_mb": round(len(data) / MIB, 1),
                     "size_mb": round(len(body) / MIB, 1), "growth_mb": round(memory.growth / MIB, 1),
                     "ratio": round(memory.growth / len(body), 2)})
    message = grpcclient.service_pb2.ModelInferRequest(model_name="sum")
    message.inputs.add(name="INPUT__0", datatype="FP32", shape=list(values.shape)).contents.fp32_contents.extend(
        values.astype(np.float32).ravel())
    client = grpcclient.InferenceServerClient(grpc, channel_args=[("grpc.max_send_message_length", -1)])
    with PeakMemory(pids["grpc"]) as memory:
        client._client_stub.ModelInfer(message)
    size = message.ByteSize()
    rows.append({"case": "grpc_contents", "status": "OK", "wire_mb": round(size / MIB, 1),
                 "size_mb": round(size / MIB, 1), "growth_mb": round(memory.growth / MIB, 1),
                 "ratio": round(memory.growth / size, 2)})
    return rows


def http_slow(http: str, pid: int) -> dict[str, Any]:
    """12 connections each holding 60 MiB of a 64 MiB body, and a small request meanwhile."""
    small = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, FEATURES],
                                    "parameters": {}, "data": [0] * FEATURES}]}).encode()
    with PeakMemory(pid) as memory:
        connections = [start_http_body(http, 64 * MIB, 60 * MIB) for _ in range(12)]
        good = post(http, small, {})
        refused = sum(answered(c, 0.2).startswith(b"HTTP/1.1 503") for c in connections)
        for connection in connections:
            connection.close()
    return {"case": "http_slow", "connections": 12, "refused": refused, "good": good,
            "peak_mb": round(memory.peak / MIB, 1), "growth_mb": round(memory.growth / MIB, 1)}


def grpc_slow(grpc: str, pid: int) -> dict[str, Any]:
    """10 calls each sending 60 MiB of a 64 MiB message, then nothing."""
    with PeakMemory(pid) as memory:
        calls = [PartialGrpcCall(grpc, 64 * MIB, 60 * MIB) for _ in range(10)]
        sent = [call.wait_sent(timeout=30) for call in calls]
        for call in calls:
            call.close()
    return {"case": "grpc_slow", "calls": 10, "sent_whole": sum(s >= 60 * MIB for s in sent),
            "peak_mb": round(memory.peak / MIB, 1), "growth_mb": round(memory.growth / MIB, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=32, help="MiB of JSON text in the one-request cases")
    args = parser.parse_args()
    daemon = serve(Path(tempfile.mkdtemp(prefix="inferd-gwmem-")))
    try:
        server = daemon.config["server"] if daemon.config else {}
        pids = {protocol: gateway_pid(daemon.process.pid, protocol) for protocol in ("http", "grpc")}
        before = {protocol: PeakMemory(pid).rss() for protocol, pid in pids.items()}
        rows = one_request_cases(server["http"], server["grpc"], pids, args.mb)
        rows.append(http_slow(server["http"], pids["http"]))
        rows.append(grpc_slow(server["grpc"], pids["grpc"]))
        time.sleep(2)  # the bound: within 2 s of the last reply
        for protocol, pid in pids.items():
            after = PeakMemory(pid).rss()
            rows.append({"case": f"after_{protocol}", "before_mb": round(before[protocol] / MIB, 1),
                         "after_mb": round(after / MIB, 1), "growth_mb": round((after - before[protocol]) / MIB, 1)})
    finally:
        daemon.stop()
    record("gateway_memory", rows)
    print()
    print(table(["case", "request MiB (on the wire)", "growth MiB", "ratio / peak MiB", "notes"],
                [[row["case"], f"{row.get('size_mb', '')} ({row.get('wire_mb', '')})" if "size_mb" in row else "",
                  row["growth_mb"], row.get("ratio", row.get("peak_mb", "")),
                  ", ".join(f"{k} {row[k]}" for k in ("status", "refused", "good", "sent_whole", "before_mb",
                                                       "after_mb") if k in row)]
                 for row in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
