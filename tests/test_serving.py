"""End to end on one shared daemon: correct answers, batching, bad input, several models."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import models
import msgspec
import numpy as np
import psutil
import pytest
import torch
import zmq
from conftest import SLOW, Daemon, base_config, requests_accounted, wait_for
from wire import RawPeer

from inferd import AsyncClient, InferenceError, InvalidRequest, RetryPolicy


def reference(repo, name: str, version: str = "v1"):
    """The same model file the daemon serves, loaded in this process."""
    files = list((repo / name / version).glob("model.pt*"))
    path = str(files[0])
    module = torch.export.load(path).module() if files[0].suffix == ".pt2" else torch.jit.load(path)

    def run(*arrays: np.ndarray):
        with torch.inference_mode():
            out = module(*(torch.from_numpy(np.array(a)) for a in arrays))
        return tuple(o.numpy() for o in out) if isinstance(out, tuple) else out.numpy()

    return run


def test_concurrent_requests_get_their_own_correct_answers(shared_daemon, repo):
    expected_fn = reference(repo, "mlp", "v2")  # "latest" is v2
    rng = np.random.default_rng(1234)
    inputs = [rng.standard_normal((int(rng.integers(1, 6)), models.MLP_IN), dtype=np.float32) for _ in range(300)]
    with shared_daemon.client() as client:
        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(lambda x: client.infer("mlp", x), inputs))
    for x, y in zip(inputs, outputs):
        assert y.shape == (x.shape[0], models.MLP_OUT)
        np.testing.assert_allclose(y, expected_fn(x), rtol=1e-5, atol=1e-6)


def test_requests_are_batched_together(shared_daemon):
    before = sum(w["batches"] for w in shared_daemon.status()["workers"])
    x = np.ones((1, 64), dtype=np.float32)
    with shared_daemon.client() as client:
        futures = [client.submit("slow", x) for _ in range(64)]
        for future in futures:
            future.result()
    batches = sum(w["batches"] for w in shared_daemon.status()["workers"]) - before
    # 64 one-sample requests of a model whose compute takes milliseconds, with
    # max_batch_size 4 and 4 executors: they must have shared batches.
    assert 16 <= batches < 64


def test_two_inputs_two_outputs_two_dtypes(shared_daemon, repo):
    expected_fn = reference(repo, "pair")
    rng = np.random.default_rng(7)
    a = rng.standard_normal((5, 3, 4), dtype=np.float32)
    b = rng.integers(-100, 100, (5, 2), dtype=np.int64)
    with shared_daemon.client() as client:
        y0, y1 = client.infer("pair", [a, b])
    e0, e1 = expected_fn(a, b)
    assert y0.dtype == np.float32 and y1.dtype == np.int64
    np.testing.assert_allclose(y0, e0, rtol=1e-5)
    np.testing.assert_array_equal(y1, e1)


def test_torch_tensor_in_numpy_out(shared_daemon, repo):
    x = torch.randn(3, models.MLP_IN)
    with shared_daemon.client() as client:
        y = client.infer("mlp", x)
    assert isinstance(y, np.ndarray)
    np.testing.assert_allclose(y, reference(repo, "mlp", "v2")(x.numpy()), rtol=1e-5, atol=1e-6)


def test_reply_header_names_version_and_timing(shared_daemon):
    x = np.zeros((2, models.MLP_IN), dtype=np.float32)
    with RawPeer(shared_daemon.endpoint) as peer:
        peer.send("req-a", "mlp", [x])
        header, outputs = peer.recv()
    assert header["id"] == "req-a"
    assert header["status"] == "ok"
    assert header["model"] == "mlp" and header["version"] == "v2"
    assert header["outputs"] == [{"dtype": "float32", "shape": [2, models.MLP_OUT]}]
    timing = header["timing_us"]
    assert timing["total"] >= timing["queue"] >= 0 and timing["compute"] > 0
    assert outputs[0].shape == (2, models.MLP_OUT)


def test_req_socket_with_delimiter_is_answered(shared_daemon, repo):
    x = np.random.default_rng(3).standard_normal((1, models.MLP_IN), dtype=np.float32)
    with RawPeer(shared_daemon.endpoint, zmq.REQ) as peer:
        peer.send(5, "mlp", [x])
        header, outputs = peer.recv()
    assert header["status"] == "ok" and header["id"] == 5
    np.testing.assert_allclose(outputs[0], reference(repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)


def test_ipc_endpoint_serves_too(shared_daemon):
    ipc = shared_daemon.config["server"]["listen"][1]
    assert ipc.startswith("ipc://")
    with RawPeer(ipc) as peer:
        peer.send(1, "mlp", [np.zeros((1, models.MLP_IN), dtype=np.float32)])
        assert peer.recv()[0]["status"] == "ok"


def test_async_client(shared_daemon, repo):
    expected_fn = reference(repo, "mlp", "v2")
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((2, models.MLP_IN), dtype=np.float32) for _ in range(40)]

    async def main():
        async with AsyncClient(shared_daemon.endpoint, timeout=20.0) as client:
            tasks = [client.submit("mlp", x) for x in inputs]
            return await asyncio.gather(*tasks)

    for x, y in zip(inputs, asyncio.run(main())):
        np.testing.assert_allclose(y, expected_fn(x), rtol=1e-5, atol=1e-6)


GOOD = np.zeros((1, models.MLP_IN), dtype=np.float32)
BAD_INPUTS = [
    ("not json", [b"{not json", GOOD.tobytes()], "not a JSON object"),
    ("json array", [b"[1, 2]", GOOD.tobytes()], "Expected `object`"),
    ("missing model", [b'{"id": 1, "inputs": []}'], "missing required field `model`"),
    ("unknown field", [b'{"id": 1, "model": "mlp", "inputs": [], "urgency": 3}'], "unknown field `urgency`"),
    ("priority not a level", [b'{"id": 1, "model": "mlp", "inputs": [], "priority": 3}'],
     "priority 3 is not a level; this daemon has levels 0 (the most urgent) to 1"),
    ("unknown model", [b'{"id": 1, "model": "nope", "inputs": [{"dtype": "float32", "shape": [1, 16]}]}',
                       GOOD.tobytes()], "unknown model 'nope'"),
    ("unknown dtype", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float128", "shape": [1, 16]}]}',
                       GOOD.tobytes()], "unknown dtype 'float128'"),
    ("wrong dtype", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float64", "shape": [1, 16]}]}',
                     np.zeros((1, 16)).tobytes()], "is float64 but mlp takes float32"),
    ("zero dim", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [0, 16]}]}', b""],
     "every dim must be at least 1"),
    ("negative dim", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [-1, 16]}]}', b""],
     "every dim must be at least 1"),
    ("wrong sample shape", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [1, 8]}]}',
                            np.zeros((1, 8), np.float32).tobytes()], "mlp takes [N, 16]"),
    ("no batch dim", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [16]}]}',
                      np.zeros(16, np.float32).tobytes()], "mlp takes [N, 16]"),
    ("batch too big", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [17, 16]}]}',
                       np.zeros((17, 16), np.float32).tobytes()], "over max_batch_size 16"),
    ("too few buffers", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [1, 16]}]}'],
     "declares 1 input(s) but 0 buffer(s)"),
    ("too many buffers", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [1, 16]}]}',
                          GOOD.tobytes(), GOOD.tobytes()], "declares 1 input(s) but 2 buffer(s)"),
    ("short buffer", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [1, 16]}]}',
                      GOOD.tobytes()[:-4]], "is 60 bytes"),
    ("wrong input count", [b'{"id": 1, "model": "pair", "inputs": [{"dtype": "float32", "shape": [1, 3, 4]}]}',
                           np.zeros((1, 3, 4), np.float32).tobytes()], "takes 2 input(s)"),
    ("not the live version", [b'{"id": 1, "model": "mlp", "version": "v1", '
                              b'"inputs": [{"dtype": "float32", "shape": [1, 16]}]}', GOOD.tobytes()],
     "the live version is 'v2'"),
    ("zero timeout", [b'{"id": 1, "model": "mlp", "timeout_ms": 0, '
                      b'"inputs": [{"dtype": "float32", "shape": [1, 16]}]}', GOOD.tobytes()],
     "timeout_ms must be positive"),
    ("huge dims", [b'{"id": 1, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [4000000000, 4000000000]}]}',
                   b"x"], "is 1 bytes"),
    ("not utf-8", [b'\xff\xfe{"id": 1}', b""], "not a JSON object"),
]


@pytest.mark.parametrize("case, frames, message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_one_invalid_reply_and_the_daemon_keeps_serving(shared_daemon, case, frames, message):
    with RawPeer(shared_daemon.endpoint) as peer:
        peer.send_frames(frames)
        header, _ = peer.recv()
        assert header["status"] == "invalid", header
        assert message in header["error"], header["error"]
        assert peer.nothing_more(0.1), "more than one reply"
        peer.send(2, "mlp", [GOOD])
        assert peer.recv()[0]["status"] == "ok"


def test_invalid_reply_names_the_request_id_when_it_can(shared_daemon):
    with RawPeer(shared_daemon.endpoint) as peer:
        peer.send(77, "nope", [GOOD])
        header, _ = peer.recv()
    assert header == {"id": 77, "status": "invalid", "error": header["error"]}


def test_client_raises_invalid_request(shared_daemon):
    with shared_daemon.client() as client:
        with pytest.raises(InvalidRequest, match="takes \\[N, 16\\]"):
            client.infer("mlp", np.zeros((2, 3), dtype=np.float32))


def test_model_exception_fails_only_its_own_batch(shared_daemon):
    with shared_daemon.client(retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(InferenceError, match="negative input refused by the model"):
            client.infer("failing", np.array([[-1.0, 2.0]], dtype=np.float32))
        y = client.infer("failing", np.array([[1.0, 2.0]], dtype=np.float32))
    np.testing.assert_array_equal(y, [[3.0, 6.0]])


def test_two_workers_share_the_load(shared_daemon):
    before = {w["worker"]: w["batches"] for w in shared_daemon.status()["workers"]}
    x = np.ones((4, 64), dtype=np.float32)
    with shared_daemon.client() as client:
        for future in [client.submit("slow", x) for _ in range(40)]:
            future.result()
    after = {w["worker"]: w["batches"] for w in shared_daemon.status()["workers"]}
    assert len(after) == 2
    assert all(after[w] > before[w] for w in after), (before, after)


def test_a_slow_model_does_not_hold_up_a_fast_one(shared_daemon):
    x_slow = np.ones((4, 64), dtype=np.float32)  # a whole batch each
    x_fast = np.ones((1, models.MLP_IN), dtype=np.float32)
    # A backlog of seconds, longer on a busy machine: 60 s for each of its requests, not the default 20.
    with shared_daemon.client(timeout=60.0) as flood, RawPeer(shared_daemon.endpoint) as fast:
        started = time.monotonic()
        slow = [flood.submit("slow", x_slow) for _ in range(500)]  # under queue.max_per_client
        slow[0].result()  # the daemon is working through the backlog
        fast.send(1, "mlp", [x_fast])
        header = fast.recv()[0]
        for future in slow:
            future.result()
        backlog_s = time.monotonic() - started
    # Timed by the daemon: this process, busy with 500 replies on two cores, reads its own late.
    # The fast request waits for an executor to finish the slow batch it runs, not for the backlog.
    assert header["status"] == "ok"
    assert header["timing_us"]["total"] / 1e6 < backlog_s / 5, (header["timing_us"], backlog_s)


def test_a_client_that_leaves_mid_request_costs_only_its_request(shared_daemon):
    def answered() -> int:
        return sum(shared_daemon.status()["replies"].values())

    supervisor = psutil.Process(shared_daemon.process.pid)
    port = int(shared_daemon.endpoint.rsplit(":", 1)[1])

    def peers() -> int:
        return sum(c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
                   for c in supervisor.net_connections("tcp"))

    status = shared_daemon.status()
    before, undelivered, connected = answered(), status["undelivered_replies"], peers()
    read_before = requests_accounted(shared_daemon)
    # The workers are stopped until the daemon has seen the peer go, so no reply is on its way before
    # (ZeroMQ would take one and drop it unseen): on a slow machine every reply once beat the hang-up.
    workers = [psutil.Process(w["pid"]) for w in status["workers"]]
    for worker in workers:
        worker.suspend()
    try:
        with RawPeer(shared_daemon.endpoint) as peer:
            peer.socket.linger = 5000  # leave only once the requests are on their way
            for i in range(20):
                peer.send(i, "slow", [np.ones((4, 64), dtype=np.float32)])
            wait_for(lambda: requests_accounted(shared_daemon) == read_before + 20, what="every request read")
        wait_for(lambda: peers() == connected, what="the daemon seeing the peer hang up")
    finally:
        for worker in workers:
            worker.resume()
    # The peer is gone; its requests still run, their replies go nowhere, and
    # nobody else notices.
    with shared_daemon.client() as client:
        assert client.infer("mlp", GOOD).shape == (1, models.MLP_OUT)
    deadline = time.monotonic() + 10
    while answered() < before + 21 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert answered() == before + 21
    assert shared_daemon.status()["undelivered_replies"] > undelivered
    assert shared_daemon.call("health")["healthy"]


def test_status_lists_models_and_workers(shared_daemon):
    status = shared_daemon.status()
    assert status["state"] == "serving"
    assert status["models"]["mlp"]["live_version"] == "v2"
    assert status["models"]["pair"]["live_version"] == "v1"
    assert [w["device"] for w in status["workers"]] == ["cpu", "cpu"]
    assert all(w["state"] == "ready" and w["pid"] for w in status["workers"])


def test_many_threads_hammering_one_client(shared_daemon, repo):
    expected_fn = reference(repo, "mlp", "v2")
    errors: list[BaseException] = []
    x = np.ones((1, models.MLP_IN), dtype=np.float32)
    with shared_daemon.client() as client:
        def hammer():
            try:
                for _ in range(50):
                    mine = x * random.random()  # each thread's own input: a crossed reply shows
                    np.testing.assert_allclose(client.infer("mlp", mine), expected_fn(mine), rtol=1e-5, atol=1e-6)
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors


def test_supervisor_never_imports_torch(shared_daemon):
    supervisor = psutil.Process(shared_daemon.process.pid)
    maps = open(f"/proc/{supervisor.pid}/maps").read()
    assert "libtorch" not in maps
    worker_pid = shared_daemon.status()["workers"][0]["pid"]
    assert "libtorch" in open(f"/proc/{worker_pid}/maps").read()


def test_zeromq_io_threads_of_the_supervisor_do_not_preempt_its_loop(shared_daemon):
    # SCHED_BATCH: a woken I/O thread waits for the loop to block instead of taking its core.
    pid = shared_daemon.process.pid
    io_threads = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()
                  if (task / "comm").read_text().startswith("ZMQbg/IO")]
    assert io_threads
    assert all(os.sched_getscheduler(tid) == os.SCHED_BATCH for tid in io_threads)


def test_msgspec_header_is_plain_json(shared_daemon):
    # A client in any language can speak the protocol: nothing but JSON and raw bytes.
    with RawPeer(shared_daemon.endpoint) as peer:
        header = {"id": 9, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [1, 16]}], "timeout_ms": 5000}
        peer.send_frames([msgspec.json.encode(header), GOOD.tobytes()])
        assert peer.recv()[0]["status"] == "ok"


@pytest.mark.serial  # measures the supervisor's CPU time: another file's daemons would blur it
def test_the_supervisor_sleeps_when_idle_and_does_not_spin_behind_busy_executors(repo, workdir):
    # With a spin long enough to fill every gap between batches, were it allowed while requests
    # wait, the supervisor must cost about what it costs with no spin at all.
    spinning = _supervisor_cpu_seconds(repo, workdir / "spin", spin_us=100_000)
    sleeping = _supervisor_cpu_seconds(repo, workdir / "sleep", spin_us=0)
    assert spinning["idle"] < 0.1 and sleeping["idle"] < 0.1, (spinning, sleeping)
    assert spinning["backlog"] < 2 * sleeping["backlog"] + 0.1, (spinning, sleeping)


def _supervisor_cpu_seconds(repo: Path, workdir: Path, spin_us: int) -> dict[str, float]:
    """CPU seconds of the supervisor over 2 s idle, then while 300 requests wait for one executor."""
    workdir.mkdir()
    config = base_config(workdir, repo, {"slow": SLOW}, server={"spin_us": spin_us},
                         workers={"devices": ["cpu"], "streams": 1})
    daemon = Daemon(workdir, config).start()
    try:
        supervisor = psutil.Process(daemon.process.pid)
        time.sleep(1.0)
        used = {"idle": _cpu_used(supervisor, lambda: time.sleep(2.0))}
        x = np.ones((4, models.SLOW_FEATURES), dtype=np.float32)
        # What is measured is CPU time, so a busy machine may stretch the backlog (about 10 s on a quiet
        # one, and beside a CPU burner): 180 s, not the default 20.
        with daemon.client(timeout=180.0) as client:
            def backlog() -> None:
                for future in [client.submit("slow", x) for _ in range(300)]:
                    future.result(timeout=180)
            used["backlog"] = _cpu_used(supervisor, backlog)
    finally:
        daemon.stop()
    return used


def _cpu_used(process: psutil.Process, work: Callable[[], None]) -> float:
    before = sum(process.cpu_times()[:2])
    work()
    return sum(process.cpu_times()[:2]) - before


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP starts no team anyway")
def test_a_cpu_worker_computes_on_cpu_threads_threads_in_its_executors_too(workdir, repo):
    # OpenMP's thread count is per thread: an executor thread that did not set it ran MKL's matmuls on
    # a team of one thread per core, which starts when the first batch computes and stays.
    config = base_config(workdir, repo, {"slow": SLOW}, workers={"devices": ["cpu"], "streams": 1, "cpu_threads": 1})
    daemon = Daemon(workdir, config).start()
    try:
        worker = psutil.Process(daemon.status()["workers"][0]["pid"])
        before = worker.num_threads()
        with daemon.client() as client:
            for _ in range(5):
                client.infer("slow", np.ones((4, models.SLOW_FEATURES), dtype=np.float32))
        assert worker.num_threads() == before, "a thread pool started for the batches"
    finally:
        daemon.stop()
