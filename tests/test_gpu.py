"""The CUDA path: a worker on a GPU, its executors on their own streams, the arena page-locked.

The same executor code runs on the CPU in every other test; these only add
what a GPU changes. They skip where CUDA is not available.
"""

from __future__ import annotations

import time

import models
import numpy as np
import pytest
import torch
from conftest import MLP, PAIR

pytestmark = pytest.mark.gpu


def test_cuda_worker_answers_like_the_model_in_process(start_daemon, repo):
    daemon = start_daemon({"mlp": MLP, "pair": PAIR}, workers={"devices": ["cuda:0"], "streams": 2})
    assert [w["device"] for w in daemon.status()["workers"]] == ["cuda:0"]
    mlp = torch.jit.load(str(repo / "mlp" / "v2" / "model.pt"))
    pair = torch.jit.load(str(repo / "pair" / "v1" / "model.pt"))
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((int(rng.integers(1, 9)), models.MLP_IN), dtype=np.float32) for _ in range(200)]
    with daemon.client() as client:
        futures = [client.submit("mlp", x) for x in inputs]
        for x, future in zip(inputs, futures):
            np.testing.assert_allclose(future.result(), mlp(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)
        a = rng.standard_normal((3, 3, 4), dtype=np.float32)
        b = rng.integers(0, 9, (3, 2), dtype=np.int64)
        y0, y1 = client.infer("pair", [a, b])
    e0, e1 = pair(torch.from_numpy(a), torch.from_numpy(b))
    np.testing.assert_allclose(y0, e0.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(y1, e1.numpy())
    assert "could not page-lock" not in daemon.log()


def test_auto_devices_gives_one_worker_per_visible_gpu(start_daemon):
    daemon = start_daemon({"mlp": MLP}, workers={"devices": "auto"})
    devices = [w["device"] for w in daemon.status()["workers"]]
    assert devices == [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def test_an_idle_gpu_worker_returns_fragmented_cache(start_daemon):
    two = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 4, "warmup_batch_sizes": [1]}
    daemon = start_daemon({"bigtemp": two}, workers={"devices": ["cuda:0"]})
    with daemon.client() as client:
        client.infer("bigtemp", np.ones((1, 2), dtype=np.float32))
    worker = daemon.call("stats")["workers"][0]
    assert worker["torch_reserved_bytes"] >= 512 * 2**20 and worker["fragmentation"] > 0.9
    assert "gpu_memory_used_bytes" in worker and 0 <= worker["gpu_utilization"] <= 1
    deadline = time.monotonic() + 15
    while "returned" not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.2)
    assert "of reserved GPU memory unused; returned" in daemon.log()
