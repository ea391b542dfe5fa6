"""Ray Serve serving the benchmark mlp for bench/compare.py, until it is stopped.

    python -m bench.serve_rayserve MODEL.pt PORT

A local Ray of two CPUs, a replica per CPU, batches by @serve.batch; max_ongoing_requests raised from its
default of 5 to two batches, as Ray's batching guide asks (at least max_batch_size). Requests and replies are
the sample's raw float32 bytes, at /mlp.
"""

from __future__ import annotations

import signal
import sys
import time

import numpy as np
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from bench.rivals import BATCH, REPLICAS, WINDOW_S, forward, load


@serve.deployment(num_replicas=REPLICAS, ray_actor_options={"num_cpus": 1}, max_ongoing_requests=2 * BATCH)
class MLP:
    """The model behind Ray Serve's HTTP proxy."""

    def __init__(self, path: str) -> None:
        self.model = load(path)

    @serve.batch(max_batch_size=BATCH, batch_wait_timeout_s=WINDOW_S)
    async def infer(self, samples: list[np.ndarray]) -> list[bytes]:
        return [row.tobytes() for row in forward(self.model, samples)]

    async def __call__(self, request: Request) -> Response:
        sample = np.frombuffer(await request.body(), dtype=np.float32)
        return Response(await self.infer(sample), media_type="application/octet-stream")


def main(path: str, port: int) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so that Ray's own processes are stopped below
    ray.init(num_cpus=REPLICAS, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(MLP.bind(path), name="mlp", route_prefix="/mlp")
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
