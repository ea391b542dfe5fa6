"""The CUDA path: a worker on a GPU, its executors on their own streams, the arena page-locked.

The same executor code runs on the CPU in every other test; these only add
what a GPU changes. They skip where CUDA is not available.
"""

from __future__ import annotations

import threading

import ml_dtypes
import models
import numpy as np
import pytest
import torch
from conftest import BF16, MLP, PAIR, wait_for
from wire import RawPeer

from inferd.arrays import from_numpy, to_numpy
from inferd.fleet.scrape import scrape
from inferd.harness import free_port

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
    wait_for(lambda: "of reserved GPU memory unused; returned" in daemon.log(), timeout=15, what="the trim")


def test_a_requested_trim_returns_the_cache_and_the_metrics_inferd_fleet_reads_show_it(start_daemon):
    two = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 4, "warmup_batch_sizes": [1]}
    metrics = f"127.0.0.1:{free_port()}"
    # fragmentation_trim 1: the worker never trims by itself, so only the request can.
    daemon = start_daemon({"bigtemp": two}, workers={"devices": ["cuda:0"], "fragmentation_trim": 1.0},
                          server={"metrics": metrics})
    with daemon.client() as client:
        client.infer("bigtemp", np.ones((1, 2), dtype=np.float32))
    before = scrape(metrics, 5)
    assert before.reserved_bytes >= 512 * 2**20 and before.unused_bytes > 0.9 * before.reserved_bytes
    assert daemon.call("trim") == {"workers": [0]}
    wait_for(lambda: "asked to trim: returned" in daemon.log(), timeout=15, what="the trim")
    after = wait_for(lambda: (m := scrape(metrics, 5)).reserved_bytes < before.reserved_bytes / 2 and m,
                     timeout=15, what="the metrics to show the trim")
    assert after.unused_bytes < before.unused_bytes / 2


@pytest.mark.parametrize("precision, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_a_reduced_precision_model_answers_float32_close_to_the_model_in_that_precision(start_daemon, repo,
                                                                                         precision, dtype):
    daemon = start_daemon({"mlp": {**MLP, "precision": precision}}, workers={"devices": ["cuda:0"]})
    mlp = torch.jit.load(str(repo / "mlp" / "v2" / "model.pt")).to("cuda:0").to(dtype)
    x = np.random.default_rng(1).standard_normal((5, models.MLP_IN), dtype=np.float32)
    with daemon.client() as client:
        y = client.infer("mlp", x)
    assert y.dtype == np.float32, "outputs come back in float32"
    expected = mlp(torch.from_numpy(x).to("cuda:0").to(dtype)).float().cpu().detach().numpy()
    np.testing.assert_allclose(y, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_bfloat16_model_answers_like_the_model_in_process_in_either_precision(start_daemon, repo, precision):
    daemon = start_daemon({"bf16": {**BF16, "precision": precision}}, workers={"devices": ["cuda:0"]})
    module = torch.jit.load(str(repo / "bf16" / "v1" / "model.pt"), map_location="cuda:0")
    x = np.random.default_rng(2).standard_normal((5, models.BF16_FEATURES), dtype=np.float32)
    x = x.astype(ml_dtypes.bfloat16)
    with daemon.client() as client:
        got = client.infer("bf16", x)
    with torch.inference_mode():
        outputs = module(from_numpy(x).to("cuda:0"))
    # fp32 passes bfloat16 inputs and outputs as they are; bf16 answers its floating outputs in float32.
    expected = [to_numpy((y.float() if precision == "bf16" else y).cpu()) for y in outputs]
    first = np.float32 if precision == "bf16" else ml_dtypes.bfloat16
    assert [y.dtype for y in got] == [y.dtype for y in expected] == [first, np.float32]
    # On CUDA, TorchScript fuses elementwise ops once a module has run a few times (the daemon's has,
    # in its warm-up): a fused kernel may round the intermediate once less, one bfloat16 step apart.
    np.testing.assert_allclose(got[0].astype(np.float32), expected[0].astype(np.float32), rtol=2**-7)
    np.testing.assert_array_equal(got[1], expected[1])


def test_out_of_memory_on_the_device_fails_the_batch_and_the_worker_serves_on(start_daemon):
    one = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 1, "warmup_batch_sizes": [1]}
    daemon = start_daemon({"allocates": one}, workers={"devices": ["cuda:0"]})
    pid = daemon.status()["workers"][0]["pid"]
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "allocates", [np.array([[2.0**40, 0]], dtype=np.float32)])  # 4 TiB
        failed = peer.recv()[0]
        peer.send(2, "allocates", [np.array([[16, 0]], dtype=np.float32)])
        served = peer.recv()[0]
    assert failed["status"] == "internal" and "out of memory on cuda:0 for batch" in failed["error"], failed
    assert served["status"] == "ok"
    assert daemon.status()["workers"][0]["pid"] == pid, "out of memory does not end the worker"


def test_cuda_graphs_answer_like_the_model_in_process_and_a_reload_captures_beside_live_traffic(start_daemon, repo):
    graphed = {**MLP, "version": "v1", "batch_buckets": [1, 2, 4, 8], "cuda_graphs": True}
    daemon = start_daemon({"mlp": graphed}, workers={"devices": ["cuda:0"], "streams": 2})
    assert "captured CUDA graphs of mlp v1 at batch sizes [1, 2, 4, 8] on each of 2 executors (8 graphs)" \
        in daemon.log()
    versions = {v: torch.jit.load(str(repo / "mlp" / v / "model.pt")) for v in ("v1", "v2")}
    rng = np.random.default_rng(4)

    def matches(x: np.ndarray, y: np.ndarray, version: str) -> bool:
        return np.allclose(y, versions[version](torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)

    answered: list[tuple[np.ndarray, np.ndarray]] = []
    stop = threading.Event()

    def traffic() -> None:  # runs through the reload: v2 is captured while v1's graphs replay
        with daemon.client() as client:
            while not stop.is_set():
                futures = [(x, client.submit("mlp", x)) for x in
                           (rng.standard_normal((int(n), models.MLP_IN), dtype=np.float32)
                            for n in rng.integers(1, 17, 32))]
                answered.extend((x, future.result()) for x, future in futures)

    sender = threading.Thread(target=traffic)
    sender.start()
    try:
        wait_for(lambda: len(answered) >= 64, what="traffic before the reload")
        assert daemon.call("reload", timeout=120, version="v2")["version"] == "v2"
        seen = len(answered)
        wait_for(lambda: len(answered) >= seen + 64, what="traffic after the reload")
    finally:
        stop.set()
        sender.join()
    assert "captured CUDA graphs of mlp v2" in daemon.log()
    assert all(matches(x, y, "v1") or matches(x, y, "v2") for x, y in answered)
    with daemon.client() as client:
        for samples in (1, 3, 8, 12):  # 12: above the largest bucket, without a graph
            x = rng.standard_normal((samples, models.MLP_IN), dtype=np.float32)
            assert matches(x, client.infer("mlp", x), "v2"), samples
