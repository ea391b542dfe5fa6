"""bfloat16 on the ZeroMQ path, end to end: ml_dtypes arrays and torch tensors in, ml_dtypes arrays
out, equal bit for bit to the same model run in this process, batched like any other dtype."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import models
import numpy as np
import pytest
import torch
from conftest import BF16, ONE_AT_A_TIME, Daemon, base_config, wait_for
from wire import RawPeer

from inferd import InvalidRequest
from inferd.arrays import BFLOAT16, from_numpy, to_numpy

FEATURES = models.BF16_FEATURES
Reference = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


@pytest.fixture(scope="module")
def bf16_daemon(repo: Path) -> Iterator[Daemon]:
    """One daemon for this module: the bfloat16 model, in precision fp32 (inputs passed as given), on a CPU worker
    of one executor, which a batch of `variable` held at a gate keeps busy."""
    path = Path(tempfile.mkdtemp(prefix="inferd-b"))
    daemon = Daemon(path, base_config(path, repo, {"bf16": {**BF16, "precision": "fp32"}, "variable": ONE_AT_A_TIME},
                                      workers={"devices": ["cpu"], "streams": 1}))
    daemon.start()
    yield daemon
    daemon.kill_all()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(repo: Path) -> Reference:
    """The model file the daemon serves, run in this process on one request's array."""
    module = torch.jit.load(str(repo / "bf16" / "v1" / "model.pt"))

    def run(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with torch.inference_mode():
            y0, y1 = module(from_numpy(x))
        return to_numpy(y0), to_numpy(y1)

    return run


def bf16_inputs(seed: int, sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, FEATURES), dtype=np.float32).astype(ml_dtypes.bfloat16) for n in sizes]


def assert_same(got: tuple[np.ndarray, ...], expected: tuple[np.ndarray, ...]) -> None:
    """Same dtypes, shapes and bits (bfloat16 compared as its raw 16 bits)."""
    assert [(g.dtype, g.shape) for g in got] == [(e.dtype, e.shape) for e in expected]
    for g, e in zip(got, expected):
        assert g.tobytes() == e.tobytes()


def test_bfloat16_in_bfloat16_and_float32_out_equal_the_model_in_process(bf16_daemon, reference):
    with bf16_daemon.client() as client:
        for x in bf16_inputs(1, [1, 3, 8]):
            y0, y1 = client.infer("bf16", x)
            assert y0.dtype == BFLOAT16 and y1.dtype == np.float32
            assert y0.shape == (len(x), FEATURES) and y1.shape == (len(x), 1)
            assert_same((y0, y1), reference(x))


def test_the_reply_header_names_bfloat16_and_carries_two_bytes_a_value(bf16_daemon, reference):
    (x,) = bf16_inputs(2, [2])
    with RawPeer(bf16_daemon.endpoint) as peer:
        peer.send(1, "bf16", [x])  # a header written by hand, not by inferd's encoder
        header, outputs = peer.recv()
    assert header["status"] == "ok", header
    assert header["outputs"] == [{"dtype": "bfloat16", "shape": [2, FEATURES]}, {"dtype": "float32", "shape": [2, 1]}]
    assert outputs[0].nbytes == 2 * FEATURES * 2
    assert_same(tuple(outputs), reference(x))


def test_a_torch_bfloat16_tensor_travels_too_even_a_strided_one(bf16_daemon, reference):
    torch.manual_seed(3)
    x = torch.randn(4, 2 * FEATURES).to(torch.bfloat16)[:, ::2]
    assert not x.is_contiguous()
    with bf16_daemon.client() as client:
        got = client.infer("bf16", x)
    assert_same(got, reference(to_numpy(x.contiguous())))


def test_concurrent_bfloat16_requests_share_batches_and_each_gets_its_own_rows(bf16_daemon, reference, gates):
    inputs = bf16_inputs(4, [1 + i % 3 for i in range(32)])  # 64 samples
    gate = gates()
    before = sum(w["batches"] for w in bf16_daemon.status()["workers"])
    with RawPeer(bf16_daemon.endpoint) as peer:
        peer.send("held", "variable", [gate.input])
        wait_for(lambda: bf16_daemon.status()["workers"][0]["executors_busy"], what="the executor held")
        for index, x in enumerate(inputs):
            peer.send(index, "bf16", [x])
        assert peer.barrier() == [], "every request is in, waiting behind the held batch"
        gate.open()
        replies = dict((header["id"], (header, outputs)) for header, outputs in
                       (peer.recv() for _ in range(len(inputs) + 1)))
    batches = sum(w["batches"] for w in bf16_daemon.status()["workers"]) - before - 1
    # All waited together, so they were stacked up to max_batch_size (8) samples a batch: a batch takes
    # requests of 1 to 3 samples until the next would not fit, so none holds fewer than 6.
    assert batches <= -(-64 // 6), f"{batches} batches for {len(inputs)} requests of 64 samples"
    results = []
    for index in range(len(inputs)):
        header, outputs = replies[index]
        assert header["status"] == "ok", header
        results.append(tuple(outputs))
    for x, got in zip(inputs, results):
        assert_same(got, reference(x))


def test_float32_for_a_bfloat16_input_is_invalid_and_names_both(bf16_daemon):
    with bf16_daemon.client() as client:
        with pytest.raises(InvalidRequest, match="input 0 is float32 but bf16 takes bfloat16"):
            client.infer("bf16", np.zeros((1, FEATURES), dtype=np.float32))


def test_an_unknown_dtype_gets_the_sentence_that_lists_bfloat16(bf16_daemon):
    header = b'{"id": 3, "model": "bf16", "inputs": [{"dtype": "bfloat17", "shape": [1, 8]}]}'
    with RawPeer(bf16_daemon.endpoint) as peer:
        peer.send_frames([header, b"\0" * 16])
        reply, _ = peer.recv()
    assert reply["status"] == "invalid"
    assert reply["error"] == ("input 0 has unknown dtype 'bfloat17'; known: bool, uint8, int8, int16, int32, "
                              "int64, float16, float32, float64, bfloat16, bytes")


def test_an_array_that_cannot_travel_is_refused_by_the_client_with_the_known_dtypes(bf16_daemon):
    with bf16_daemon.client() as client:
        with pytest.raises(InvalidRequest, match="dtype float8_e4m3fn cannot travel; use one of .*, bfloat16, bytes$"):
            client.infer("bf16", np.zeros((1, FEATURES), dtype=ml_dtypes.float8_e4m3fn))
