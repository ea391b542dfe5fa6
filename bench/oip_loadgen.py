"""A closed-loop load generator for the Open Inference Protocol: `--concurrency` requests in flight over
HTTP (the binary tensor extension, one keep-alive connection per request in flight) or gRPC (ModelInfer
with raw_input_contents, every call on one channel), for `--seconds`.

Like bench/loadgen.py for the ZeroMQ path, each request is encoded before the clock starts and each
reply is read only as far as its status, so what it measures is the daemon, not a client library. It
prints one JSON line of the same shape: samples/s, latency percentiles in ms, the count of each status.

    python -m bench.oip_loadgen --protocol http --address 127.0.0.1:8000 --model mlp --shape 256 --concurrency 64

With `--request FILE` (HTTP only) it sends the bytes of FILE, a whole HTTP/1.1 request of one sample, instead
of an inference request of its own: bench/compare.py drives other servers' own HTTP APIs with the same loop.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from bench.loadgen import percentiles

Send = Callable[[], Awaitable[str]]  # one request; its status ("ok", an HTTP code, a gRPC code)


def http_request(model: str, data: np.ndarray) -> bytes:
    """One binary inference request: headers, the JSON part, the tensor's bytes."""
    raw = data.tobytes()
    header = json.dumps({
        "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(data.shape),
                    "parameters": {"binary_data_size": len(raw)}}],
        "outputs": [{"name": "OUTPUT__0", "parameters": {"binary_data": True}}],
    }).encode()
    return (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(header) + len(raw)}\r\n\r\n"
            ).encode() + header + raw


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection that sends a request and hands back its response's status once the whole
    response (its head and Content-Length bytes) has come. It reads into a buffer of its own: asyncio's streams
    read each time into a new 256 KiB bytes object, which the allocator maps and unmaps, and the generator
    shares the cores with what it measures."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray(1 << 16)
        self._size = 0  # of what the buffer holds
        self._answer: asyncio.Future[str] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes) -> asyncio.Future[str]:
        """Send `request`; its response's status (an HTTP code, "ok" for 200) once the response has come."""
        assert self.transport is not None
        self._answer = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._answer

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._size == len(self._buffer):
            self._buffer.extend(bytes(len(self._buffer)))
        return memoryview(self._buffer)[self._size:]

    def buffer_updated(self, nbytes: int) -> None:
        self._size += nbytes
        end = self._buffer.find(b"\r\n\r\n", 0, self._size)
        if end < 0:
            return
        head = bytes(self._buffer[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        length = int(head[at + 17:].split(b"\r\n", 1)[0]) if at >= 0 else 0
        if self._size < end + 4 + length or self._answer is None:
            return
        self._size = 0  # one response at a time: nothing follows it
        self._answer.set_result("ok" if head[9:12] == b"200" else head[9:12].decode())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(ConnectionError("the server closed the connection"))


async def http_senders(address: str, request: bytes, count: int) -> list[Send]:
    """`count` keep-alive connections, each sending `request` and reading one response per call."""
    host, _, port = address.rpartition(":")
    loop = asyncio.get_running_loop()
    senders = []
    for _ in range(count):
        _, connection = await loop.create_connection(_Connection, host, int(port))
        senders.append(functools.partial(connection.send, request))
    return senders


def grpc_senders(address: str, model: str, data: np.ndarray, count: int) -> list[Send]:
    """`count` callers of ModelInfer on one channel (HTTP/2 carries the calls side by side)."""
    import grpc
    import grpc.aio
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT__0", datatype="FP32", shape=list(data.shape))
    request.raw_input_contents.append(data.tobytes())
    encoded = request.SerializeToString()
    channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", -1),
                                                           ("grpc.max_send_message_length", -1)])
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

    async def send() -> str:
        try:
            await call(encoded)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "ok"

    return [send] * count


async def drive(senders: list[Send], seconds: float, warmup: float) -> tuple[list[float], Counter[str]]:
    """Each sender in a closed loop until the time is up: the latencies and statuses of the timed part."""
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    measure_from = time.monotonic() + warmup
    stop_at = measure_from + seconds

    async def loop(send: Send) -> None:
        while (sent := time.monotonic()) < stop_at:
            status = await send()
            if sent >= measure_from:
                statuses[status] += 1
                if status == "ok":
                    latencies.append(time.monotonic() - sent)

    await asyncio.gather(*(loop(send) for send in senders))
    return latencies, statuses


async def run(protocol: str, address: str, model: str, shape: tuple[int, ...], concurrency: int, seconds: float,
              warmup: float, request: bytes | None = None) -> dict:
    """Drive the front end (with `request`, over HTTP: those bytes) and return the measurements of the timed part."""
    data = np.random.default_rng(0).standard_normal((1, *shape)).astype(np.float32)
    if protocol == "http":
        senders = await http_senders(address, request or http_request(model, data), concurrency)
    else:
        senders = grpc_senders(address, model, data, concurrency)
    cpu_started = time.process_time()
    latencies, statuses = await drive(senders, seconds, warmup)
    answered = sum(statuses.values())
    ok = statuses.get("ok", 0)
    return {
        "protocol": protocol, "address": address, "model": model, "concurrency": concurrency,
        "samples_per_request": 1, "seconds": seconds, "requests": answered,
        "samples_per_s": round(ok / seconds, 1), "bytes_per_s": round(ok * data.nbytes / seconds, 1),
        "latency_ms": percentiles(latencies), "statuses": dict(statuses),
        # the generator's own, warm-up included, per timed request
        "cpu_us_per_request": round((time.process_time() - cpu_started) / max(1, answered) * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", choices=["http", "grpc"], required=True)
    parser.add_argument("--address", required=True, help="HOST:PORT")
    parser.add_argument("--model", required=True)
    parser.add_argument("--shape", required=True, help="per-sample shape, e.g. 256 or 3,64,64")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--request", type=Path, help="a file holding the HTTP request to send (--protocol http)")
    args = parser.parse_args(argv)
    if args.request and args.protocol != "http":
        parser.error("--request is an HTTP request: use it with --protocol http")
    shape = tuple(int(d) for d in args.shape.split(","))
    request = args.request.read_bytes() if args.request else None
    result = asyncio.run(run(args.protocol, args.address, args.model, shape, args.concurrency, args.seconds,
                             args.warmup, request))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
