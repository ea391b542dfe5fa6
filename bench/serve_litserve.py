"""LitServe serving the benchmark mlp for bench/compare.py, until it is stopped.

    python -m bench.serve_litserve MODEL.pt PORT

A worker process per replica, its ZeroMQ queue on (`fast_queue`, LitServe's advice above 100 requests/s).
Requests are JSON, `{"input": [256 numbers]}`: LitServe parses every request body as JSON (or a form) before
decode_request sees it; the reply is `{"output": [10 numbers]}`.
"""

from __future__ import annotations

import sys
from typing import Any

import litserve as ls
import numpy as np

from bench.rivals import BATCH, REPLICAS, WINDOW_S, forward, load


class MLPAPI(ls.LitAPI):
    """The model behind LitServe's /predict (a module-level class: LitServe pickles it into its workers)."""

    def __init__(self, path: str) -> None:
        super().__init__(max_batch_size=BATCH, batch_timeout=WINDOW_S)
        self.path = path

    def setup(self, device: str) -> None:
        self.model = load(self.path)

    def decode_request(self, request):  # unannotated: LitServe then hands it the body parsed as JSON
        return np.asarray(request["input"], dtype=np.float32)

    def batch(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return inputs

    def predict(self, x: list[np.ndarray]) -> np.ndarray:
        return forward(self.model, x)

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output: np.ndarray) -> dict[str, Any]:
        return {"output": output.tolist()}


def main(path: str, port: int) -> None:
    server = ls.LitServer(MLPAPI(path), accelerator="cpu", workers_per_device=REPLICAS, fast_queue=True)
    server.run(host="127.0.0.1", port=port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
