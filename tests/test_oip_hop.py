"""The gateways' own shared-memory regions (inferd/oip/hop_region.py): a large request's tensors go to the
supervisor through its gateway's region and its answer's come back there, over HTTP and gRPC, spoken by
Triton's clients; answers checked against the models in-process. The region's blocks, on a real file in
/dev/shm, are tried directly, and a gateway's link to the supervisor (a region for each connection) against a
stand-in supervisor on real sockets."""

from __future__ import annotations

import gc
import http.client
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import models
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import MLP, Daemon, module_daemon, reference, wait_for
from python_models import SCALE_CONFIG
from tritonclient.utils import InferenceServerException

from inferd import protocol
from inferd.harness import free_port
from inferd.oip import hop_region
from inferd.oip.hop_region import HopRegion
from inferd.protocol import ReplyHeader, TensorMeta
from inferd.system.shm_names import GATEWAY_REGION_PREFIX, SHM_DIR

CLIENTS = {"http": httpclient, "grpc": grpcclient}
FEATURES = 1 << 20  # 4 MiB of float32 a sample: a request of one is as large as the region takes
LARGE = {"inputs": [{"dtype": "float32", "shape": [FEATURES]}], "max_batch_size": 2}
SUMMED = {"inputs": [{"name": "x", "dtype": "float32", "shape": [FEATURES]}], "outputs": ["total"],
          "steps": [{"model": "sum", "inputs": {"INPUT__0": "x"}, "outputs": {"OUTPUT__0": "total"}}]}


@pytest.fixture(scope="module")
def daemon(repo: Path, python_repo: Path) -> Iterator[Daemon]:
    """`variable` (its input back) and `sum` (a large input, a small output) at FEATURES, the mlp, a pipeline
    of `sum`, and the Python model `scale` at FEATURES (which refuses a negative value), over HTTP and gRPC;
    client shared memory off, as by default."""
    scale = {**SCALE_CONFIG, "repository": str(python_repo / "scale"), "version": "v1", "max_batch_size": 1,
             "parameters": {"factor": 2.0},
             "inputs": [{**SCALE_CONFIG["inputs"][0], "shape": [FEATURES]}],
             "outputs": [{**SCALE_CONFIG["outputs"][0], "shape": [FEATURES]}, SCALE_CONFIG["outputs"][1]]}
    with module_daemon(repo, {"variable": LARGE, "sum": LARGE, "mlp": MLP, "scale": scale}, with_summed,
                       workers={"shm_mb": 128},
                       server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}"}) as started:
        yield started


def with_summed(config: dict[str, Any], _: Path) -> None:
    config["pipelines"] = {"summed": SUMMED}


def gateway_regions(daemon: Daemon, protocol_name: str) -> list[dict[str, Any]]:
    """The regions the gateway of `protocol_name` registered, as `inferctl stats` lists them."""
    return [r for r in daemon.call("stats")["regions"] if r["owner"] == f"the {protocol_name} gateway"]


def gateway_region(daemon: Daemon, protocol_name: str) -> dict[str, Any]:
    """The one region the gateway of `protocol_name` has (it registers it once connected to the supervisor)."""
    wait_for(lambda: len(gateway_regions(daemon, protocol_name)) == 1, what=f"the {protocol_name} gateway's region")
    (region,) = gateway_regions(daemon, protocol_name)
    return region


def infer(daemon: Daemon, protocol_name: str, model: str, x: np.ndarray, name: str = "INPUT__0") -> np.ndarray:
    module = CLIENTS[protocol_name]
    client = module.InferenceServerClient(daemon.config["server"][protocol_name])
    given = module.InferInput(name, list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = client.infer(model, [given])
    return result.as_numpy(result.get_response(**({"as_json": True} if protocol_name == "grpc" else {}))
                           ["outputs"][0]["name"])


@pytest.mark.parametrize("protocol_name", CLIENTS)
def test_a_large_requests_tensors_go_through_its_gateways_region_and_answer_like_the_model(daemon, repo,
                                                                                         protocol_name):
    rng = np.random.default_rng(21)
    before = gateway_region(daemon, protocol_name)
    assert before["key"].startswith(GATEWAY_REGION_PREFIX)
    assert not list(SHM_DIR.glob(f"{GATEWAY_REGION_PREFIX}*")), "a gateway's region left a name in /dev/shm"
    for samples in (1, 2):
        x = rng.random((samples, FEATURES), dtype=np.float32)
        x[:, 0] = 0  # `variable` computes as many steps as its first value says
        np.testing.assert_array_equal(infer(daemon, protocol_name, "variable", x), x)  # in and out the region
        np.testing.assert_allclose(infer(daemon, protocol_name, "sum", x), reference(repo, "sum", "v1")(x),
                                   rtol=1e-5)
    assert gateway_region(daemon, protocol_name)["requests"] == before["requests"] + 4
    small = rng.standard_normal((2, models.MLP_IN), dtype=np.float32)
    np.testing.assert_allclose(infer(daemon, protocol_name, "mlp", small), reference(repo, "mlp", "v2")(small),
                               rtol=1e-5, atol=1e-6)
    assert gateway_region(daemon, protocol_name)["requests"] == before["requests"] + 4, "a small request went there"


@pytest.mark.parametrize("protocol_name", CLIENTS)
def test_a_large_request_its_model_refuses_is_computed_once(daemon, protocol_name):
    x = np.random.default_rng(23).random((1, FEATURES), dtype=np.float32)
    x[0, 7] = -1
    before = gateway_region(daemon, protocol_name)["requests"]
    invalid = daemon.call("stats")["models"]["scale"]["requests"].get("invalid", 0)
    with pytest.raises(InferenceServerException, match="negative values are refused"):
        infer(daemon, protocol_name, "scale", x, "x")
    assert gateway_region(daemon, protocol_name)["requests"] == before + 1, "it went through the region"
    assert daemon.call("stats")["models"]["scale"]["requests"]["invalid"] == invalid + 1, "computed again"


@pytest.mark.parametrize("protocol_name", CLIENTS)
def test_a_pipeline_takes_a_large_request_in_its_message(daemon, repo, protocol_name):
    x = np.random.default_rng(22).random((2, FEATURES), dtype=np.float32)
    before = gateway_region(daemon, protocol_name)["requests"]
    np.testing.assert_allclose(infer(daemon, protocol_name, "summed", x, "x"), reference(repo, "sum", "v1")(x),
                               rtol=1e-5)
    assert gateway_region(daemon, protocol_name)["requests"] == before


def test_a_gateways_region_goes_with_the_gateway(daemon):
    old = gateway_region(daemon, "http")
    (gateway,) = [g for g in daemon.status()["gateways"] if g["protocol"] == "http"]
    os.kill(gateway["pid"], signal.SIGKILL)

    def replaced() -> bool:
        regions = gateway_regions(daemon, "http")
        return len(regions) == 1 and regions[0]["key"] != old["key"]

    wait_for(replaced, timeout=60, what="the new gateway's region, and the old one's gone")
    x = np.random.default_rng(23).random((1, FEATURES), dtype=np.float32)
    x[:, 0] = 0
    wait_for(lambda: _answers(daemon, x), timeout=60, what="the new gateway answering")
    assert gateway_region(daemon, "http")["requests"] >= 1


def _answers(daemon: Daemon, x: np.ndarray) -> bool:
    try:
        return bool(np.array_equal(infer(daemon, "http", "variable", x), x))
    except Exception:  # noqa: BLE001 - the gateway is not listening yet
        return False


def test_a_request_too_large_as_inferds_message_is_refused_and_the_connection_kept(repo):
    # 2 x FEATURES zeros as JSON are a 4 MiB body, within server.max_message_mb; as float32 they are 8 MiB, over
    # it. A pipeline's tensors always go in frames: sent to the supervisor, that message would make ZeroMQ drop
    # the gateway's connection, with every reply on it and the gateway's region.
    with module_daemon(repo, {"variable": LARGE, "sum": LARGE}, with_summed, workers={"shm_mb": 128},
                       server={"http": f"127.0.0.1:{free_port()}", "max_message_mb": 5}) as daemon:
        body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, %d], "data": [%s0]}]}' % (
            FEATURES, b"0," * (2 * FEATURES - 1))
        connection = http.client.HTTPConnection(daemon.config["server"]["http"], timeout=30)
        connection.request("POST", "/v2/models/summed/infer", body, {"Content-Type": "application/json"})
        answer = connection.getresponse()
        error = json.loads(answer.read())["error"]
        assert answer.status == 400 and "over server.max_message_mb (5 MiB)" in error, error
        x = np.random.default_rng(24).random((1, FEATURES), dtype=np.float32)
        x[:, 0] = 0
        before = gateway_region(daemon, "http")
        np.testing.assert_array_equal(infer(daemon, "http", "variable", x), x)
        assert gateway_region(daemon, "http") == {**before, "requests": before["requests"] + 1}, \
            "the gateway's connection, and its region, were kept"


@pytest.fixture
def region() -> Iterator[HopRegion]:
    made = HopRegion("test", 4 * hop_region.MIN_BYTES)
    made.registered()  # no supervisor here: the name goes at once, as once one has the file open
    yield made


def written(lease: Any, outputs: list[tuple[int, ...]]) -> ReplyHeader:
    """The reply the supervisor sends once it wrote `outputs` (float32 shapes) at the lease's places."""
    return ReplyHeader(id=1, status=protocol.OK, outputs=tuple(
        TensorMeta("float32", shape, place.region, place.offset) for shape, place in zip(outputs, lease.places)))


def test_a_block_is_taken_again_only_once_its_lease_and_its_answers_views_are_gone(region):
    x = np.arange(hop_region.MIN_BYTES // 4, dtype=np.float32).reshape(1, -1)  # and an output of its size
    inputs = [(TensorMeta("float32", x.shape), memoryview(x))]
    first, second = region.lease(inputs, [x.nbytes]), region.lease(inputs, [x.nbytes])
    assert first is not None and second is not None and region.lease(inputs, [x.nbytes]) is None, "it holds two"
    (meta, data), = first.inputs
    assert data is None and meta.region == region.name
    _, (view,) = first.answer(written(first, [x.shape]), [])
    del first
    gc.collect()
    assert region.lease(inputs, [x.nbytes]) is None, "a view of its answer still holds the block"
    del view
    gc.collect()
    assert region.lease(inputs, [x.nbytes]) is not None, "the block came back"
    gc.collect()
    del second
    gc.collect()
    assert region.lease(inputs, [3 * x.nbytes]) is not None, "the blocks given back join into one"


def test_a_small_request_or_one_of_bytes_goes_in_frames(region):
    small = np.zeros((1, hop_region.MIN_BYTES // 8), np.float32)  # half of it, and an output of 4 bytes
    assert region.lease([(TensorMeta("float32", small.shape), memoryview(small))], [4]) is None
    big = np.zeros((1, FEATURES), np.float32)
    text = protocol.pack_bytes([b"a"])
    assert region.lease([(TensorMeta("float32", big.shape), memoryview(big)),
                         (TensorMeta(protocol.BYTES, (1, 1)), text)], [None]) is None
    assert region.lease([(TensorMeta("float32", big.shape), None)], [None]) is None, "an input in a client's region"


@pytest.mark.parametrize("answered", [True, False], ids=["registered", "registering"])
def test_each_connection_to_the_supervisor_gets_a_region_of_its_own(tmp_path, answered):
    """Upstream, on real sockets, against a stand-in supervisor that goes and comes back (the socket closed and
    bound again, as a dropped connection is), having answered the first connection's region or not yet: ZeroMQ
    connects again, the gateway registers a new region on the new connection at once (not after the lost
    answer's time is up), and a large request then goes through that one, its tensor's bytes in its file."""
    import asyncio

    import zmq

    from inferd.oip.upstream import Upstream

    address = f"ipc://{tmp_path}/supervisor"
    context = zmq.Context()
    first = context.socket(zmq.ROUTER)
    first.bind(address)
    upstream = Upstream(context, address, default_timeout_ms=60_000, slack_s=1.0)
    opened: dict[str, int] = {}  # the regions registered, by name: a descriptor of each one's file

    async def next_message(supervisor: zmq.Socket) -> tuple[bytes, protocol.RegisterRegion | protocol.Request]:
        while not supervisor.poll(0):
            await asyncio.sleep(0.01)
        identity, *frames = supervisor.recv_multipart()
        return identity, protocol.decode_message(frames, 64 << 20)

    async def registration(supervisor: zmq.Socket, answer: bool = True) -> str:
        """The name of the region registered on `supervisor`'s connection, once its file is opened and (with
        `answer`) `ok` answered, as the supervisor does, and the gateway has taken the answer (the file's name
        gone from /dev/shm: the gateway uses a region from then on, and sends in frames until then). A lost
        answer would be the gateway's own sweep's after a minute (default_timeout_ms): a registration within
        20 s is one made for the new connection."""
        identity, message = await asyncio.wait_for(next_message(supervisor), 20)
        assert isinstance(message, protocol.RegisterRegion) and message.peer == protocol.GATEWAY_PEER, message
        opened[message.name] = os.open(SHM_DIR / message.key, os.O_RDONLY)
        if answer:
            supervisor.send_multipart([identity, protocol.encode_reply(ReplyHeader(id=message.id,
                                                                                   status=protocol.OK))])
            async with asyncio.timeout(20):
                while (SHM_DIR / message.key).exists():
                    await asyncio.sleep(0.01)
        return message.name

    async def reconnected() -> tuple[str, str, bytes, np.ndarray]:
        upstream.start()
        before = await registration(first, answered)
        first.close()
        second = context.socket(zmq.ROUTER)
        second.bind(address)
        try:
            after = await registration(second)
            x = np.arange(hop_region.MIN_BYTES // 4, dtype=np.float32).reshape(1, -1)
            asked = asyncio.ensure_future(upstream.infer(
                "m", None, [(TensorMeta("float32", x.shape), memoryview(x))], None, output_bytes=[4]))
            identity, request = await asyncio.wait_for(next_message(second), 10)
            assert isinstance(request, protocol.Request), request
            (meta,) = request.header.inputs
            got = os.pread(opened[meta.region], x.nbytes, meta.offset)
            second.send_multipart([identity, protocol.encode_reply(ReplyHeader(
                id=request.header.id, status=protocol.OK, outputs=(TensorMeta("float32", (1, 1)),))),
                np.float32(7).tobytes()])
            reply, (answer,) = await asyncio.wait_for(asked, 10)
            assert reply.status == protocol.OK and meta.region == after, (reply, meta)
            return before, after, got, np.frombuffer(answer, np.float32).copy()
        finally:
            second.close()

    try:
        before, after, got, answer = asyncio.run(reconnected())
    finally:
        upstream.close()
        context.term()
        for fd in opened.values():
            os.close(fd)
    assert before != after, "the new connection has a region of its own"
    assert got == np.arange(hop_region.MIN_BYTES // 4, dtype=np.float32).tobytes(), "the tensor lies in the new one"
    assert answer.tolist() == [7.0]
    ours = f"{GATEWAY_REGION_PREFIX}{os.getpid()}-"
    assert not [p for p in SHM_DIR.iterdir() if p.name.startswith(ours)], "each region's name left /dev/shm"
