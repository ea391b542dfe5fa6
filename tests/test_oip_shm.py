"""Triton's system shared-memory extension, spoken by Triton's own clients (tritonclient.http and .grpc
with tritonclient.utils.shared_memory), unmodified, against the real daemon; answers checked against
the same models run in-process, and each of the extension's safety rules tried."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import models
import msgspec
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from conftest import MLP, NAMED_PAIR, Daemon, base_config, reference, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from inferd.harness import free_port
from inferd.system.shm_names import GATEWAY_REGION_PREFIX

CLIENTS = {"http": httpclient, "grpc": grpcclient}
# float32 [2, L] -> [L] and [4]: outputs whose size the model decides, from each request's L.
RAGGED = {"inputs": [{"dtype": "float32", "shape": [2, -1], "max_shape": [2, models.RAGGED_MAX], "name": "x"}],
          "outputs": [{"name": "running"}, {"name": "pooled"}], "max_batch_size": 4}
PREFIX = "inferd-client-"


@pytest.fixture(scope="module")
def daemon(repo: Path) -> Iterator[Daemon]:
    """mlp, pair and ragged over HTTP and gRPC, with client shared memory allowed."""
    path = Path(tempfile.mkdtemp(prefix="inferd-s"))
    config = base_config(path, repo, {"mlp": MLP, "pair": NAMED_PAIR, "ragged": RAGGED},
                         server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
                                 "allow_client_shm": True})
    started = Daemon(path, config)
    started.start()
    yield started
    started.kill_all()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def regions() -> Iterator[Callable[[int], tuple[Any, str]]]:
    """Make shared-memory regions as tritonclient does: (handle, key) each; all destroyed at the end."""
    made = []

    def make(size: int) -> tuple[Any, str]:
        key = f"/{PREFIX}oip-{uuid.uuid4().hex[:12]}"
        made.append(shm.create_shared_memory_region(key[1:], key, size))
        return made[-1], key

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


@pytest.fixture(scope="module")
def fuzz_region() -> Iterator[None]:
    """A region file the fuzz tests may name, so that some of their registrations succeed."""
    path = Path("/dev/shm") / f"{PREFIX}fuzz"
    path.write_bytes(bytes(4096))
    yield
    path.unlink()


def connect(daemon: Daemon, protocol: str) -> Any:
    """A client on a connection of its own (gRPC channels of one process otherwise share theirs)."""
    own = {"channel_args": [("grpc.use_local_subchannel_pool", 1)]} if protocol == "grpc" else {}
    return CLIENTS[protocol].InferenceServerClient(daemon.config["server"][protocol], **own)


def in_region(module: ModuleType, name: str, array: np.ndarray, region: str, datatype: str = "FP32") -> Any:
    given = module.InferInput(name, list(array.shape), datatype)
    given.set_shared_memory(region, array.nbytes)
    return given


def region_status(client: Any, protocol: str) -> dict[str, dict[str, Any]]:
    """The client's regions by name, from the status call (the two protocols shape it differently)."""
    status = client.get_system_shared_memory_status(**({"as_json": True} if protocol == "grpc" else {}))
    listed = status.get("regions", {}).values() if protocol == "grpc" else status
    return {r["name"]: r for r in listed}


def registered(daemon: Daemon) -> list[dict[str, Any]]:
    """The clients' regions `inferctl stats` lists (not the gateways' own, tests/test_oip_hop.py)."""
    return [r for r in daemon.call("stats")["regions"] if not r["key"].startswith(GATEWAY_REGION_PREFIX)]


def error_of(call: Callable[[], Any]) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return str(caught.value)


@pytest.mark.parametrize("protocol", CLIENTS)
def test_inputs_and_outputs_in_shared_memory_answer_like_the_model_in_process(daemon, repo, regions, protocol):
    module = CLIENTS[protocol]
    client = connect(daemon, protocol)
    assert "system_shared_memory" in client.get_server_metadata(
        **({"as_json": True} if protocol == "grpc" else {}))["extensions"]
    x = np.random.default_rng(1).standard_normal((5, models.MLP_IN)).astype(np.float32)
    inputs, in_key = regions(x.nbytes)
    outputs, out_key = regions(5 * models.MLP_OUT * 4 + 64)
    shm.set_shared_memory_region(inputs, [x])
    client.register_system_shared_memory("in", in_key, x.nbytes)
    client.register_system_shared_memory("out", out_key, 5 * models.MLP_OUT * 4, offset=64)
    listed = region_status(client, protocol)
    assert set(listed) == {"in", "out"} and listed["in"]["key"] == in_key[1:]
    wanted = module.InferRequestedOutput("OUTPUT__0")
    wanted.set_shared_memory("out", 5 * models.MLP_OUT * 4)
    result = client.infer("mlp", [in_region(module, "INPUT__0", x, "in")], outputs=[wanted])
    answer = result.get_response(**({"as_json": True} if protocol == "grpc" else {}))["outputs"][0]
    if protocol == "grpc":
        assert answer["parameters"]["shared_memory_region"] == {"string_param": "out"}
    else:  # as Triton answers: Triton's C++ client takes an HTTP output's parameters for binary data
        assert "parameters" not in answer and "data" not in answer
    got = shm.get_contents_as_numpy(outputs, np.float32, [5, models.MLP_OUT], offset=64)
    np.testing.assert_allclose(got, reference(repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)
    owners = {r["owner"] for r in registered(daemon)}
    assert len(owners) == 1 and owners.pop().startswith(f"{protocol} client 127.0.0.1:")
    served = {r["name"]: r["requests"] for r in registered(daemon)}
    assert served == {"in": 1, "out": 1}
    client.unregister_system_shared_memory("in")
    assert set(region_status(client, protocol)) == {"out"}
    client.unregister_system_shared_memory()
    assert region_status(client, protocol) == {}
    client.close()


@pytest.mark.parametrize("protocol", CLIENTS)
def test_an_output_the_model_sizes_is_never_written_past_its_window(daemon, repo, regions, protocol):
    module = CLIENTS[protocol]
    client = connect(daemon, protocol)
    x = np.random.default_rng(41).random((1, 2, 16), np.float32)  # `running` is 16 floats
    handle, key = regions(256)
    shm.set_shared_memory_region(handle, [np.full(64, -7.0, np.float32)])
    client.register_system_shared_memory("out", key, 256)
    given = module.InferInput("x", list(x.shape), "FP32")
    given.set_data_from_numpy(x)

    def running_in(window: int) -> Any:
        wanted = module.InferRequestedOutput("running")
        wanted.set_shared_memory("out", window)
        return client.infer("ragged", [given], outputs=[wanted])

    assert "output 'running' came to 64 bytes, more than its shared_memory_byte_size 8" in error_of(
        lambda: running_in(8))
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [64]), np.full(64, -7.0))
    running_in(64)
    got = shm.get_contents_as_numpy(handle, np.float32, [1, 16])
    np.testing.assert_allclose(got, reference(repo, "ragged", "v1")(x)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [64])[16:], np.full(48, -7.0))
    client.unregister_system_shared_memory()
    client.close()


@pytest.mark.parametrize("protocol", CLIENTS)
def test_a_request_may_mix_tensors_in_shared_memory_with_tensors_inline(daemon, repo, regions, protocol):
    module = CLIENTS[protocol]
    client = connect(daemon, protocol)
    a = np.random.default_rng(2).standard_normal((3, 3, 4)).astype(np.float32)
    b = np.arange(6, dtype=np.int64).reshape(3, 2)
    handle, key = regions(a.nbytes + 64)
    shm.set_shared_memory_region(handle, [a])
    client.register_system_shared_memory("mixed", key, a.nbytes + 64)
    inline_b = module.InferInput("b", list(b.shape), "INT64")
    inline_b.set_data_from_numpy(b)
    scaled = module.InferRequestedOutput("scaled")
    scaled.set_shared_memory("mixed", 36, offset=a.nbytes)
    doubled = module.InferRequestedOutput("doubled")
    result = client.infer("pair", [in_region(module, "a", a, "mixed"), inline_b], outputs=[scaled, doubled])
    want_scaled, want_doubled = reference(repo, "pair", "v1")(a, b)
    np.testing.assert_array_equal(result.as_numpy("doubled"), want_doubled)
    np.testing.assert_allclose(shm.get_contents_as_numpy(handle, np.float32, [3, 3], offset=a.nbytes),
                               want_scaled, rtol=1e-6)
    client.unregister_system_shared_memory()
    client.close()


@pytest.mark.parametrize("protocol", CLIENTS)
def test_a_region_is_its_connections_only_and_goes_with_it(daemon, regions, protocol):
    module = CLIENTS[protocol]
    owner, other = connect(daemon, protocol), connect(daemon, protocol)
    x = np.ones((1, models.MLP_IN), dtype=np.float32)
    handle, key = regions(x.nbytes)
    owner.register_system_shared_memory("mine", key, x.nbytes)
    assert region_status(other, protocol) == {}, "another connection sees none of them"
    refused = error_of(lambda: other.infer("mlp", [in_region(module, "INPUT__0", x, "mine")]))
    assert "no region 'mine' is registered on this connection" in refused
    assert "mine" in region_status(owner, protocol)
    owner.close()  # its connection closes: the gateway sees it gone and unregisters what it had
    wait_for(lambda: not registered(daemon), timeout=15, what="the closed connection's region gone")
    other.close()


@pytest.mark.parametrize("protocol", CLIENTS)
def test_hostile_registrations_and_references_are_refused_with_a_sentence(daemon, regions, protocol):
    module = CLIENTS[protocol]
    client = connect(daemon, protocol)
    handle, key = regions(256)
    arena = next(Path("/dev/shm").glob(f"inferd-{daemon.status()['pid']}-*"))
    link = Path("/dev/shm") / f"{PREFIX}link-{uuid.uuid4().hex[:8]}"
    link.symlink_to(Path("/dev/shm") / key[1:])
    try:
        for name, region_key, size, sentence in [
            ("arena", f"/{arena.name}", 64, "one of the daemon's own arenas"),
            ("link", f"/{link.name}", 64, "it is a symbolic link"),
            ("prefix", "/some-other-name", 64, f"does not start with '{PREFIX}'"),
            ("outside", "/../etc/passwd", 64, "is not a shared-memory name"),
            ("big", key, 4096, "too small for byte_size 4096"),
            ("empty", key, 0, "byte_size must be a number of bytes, at least 1"),
        ]:
            assert sentence in error_of(functools.partial(client.register_system_shared_memory, name, region_key,
                                                          size))
    finally:
        link.unlink()
    client.register_system_shared_memory("small", key, 256)
    x = np.ones((1, models.MLP_IN), dtype=np.float32)
    too_small = module.InferRequestedOutput("OUTPUT__0")
    too_small.set_shared_memory("small", 8)
    assert "shared_memory_byte_size is 8" in error_of(
        lambda: client.infer("mlp", [in_region(module, "INPUT__0", x, "small")], outputs=[too_small]))
    os.truncate(Path("/dev/shm") / key[1:], 16)  # shrunk under the daemon: a sentence, not a SIGBUS
    assert "region 'small' was truncated" in error_of(
        lambda: client.infer("mlp", [in_region(module, "INPUT__0", x, "small")]))
    plain = module.InferInput("INPUT__0", list(x.shape), "FP32")
    plain.set_data_from_numpy(x)
    assert client.infer("mlp", [plain]).as_numpy("OUTPUT__0").shape == (1, models.MLP_OUT)
    assert daemon.status()["state"] == "serving"
    client.unregister_system_shared_memory()
    client.close()


@pytest.mark.parametrize("protocol", CLIENTS)
def test_shared_memory_is_refused_where_the_operator_did_not_allow_it(start_daemon, regions, protocol):
    daemon = start_daemon({"mlp": MLP}, server={"http": f"127.0.0.1:{free_port()}",
                                                "grpc": f"127.0.0.1:{free_port()}", "allow_client_shm": ["zmq"]})
    client = connect(daemon, protocol)
    _, key = regions(256)
    refused = error_of(lambda: client.register_system_shared_memory("r", key, 256))
    assert f"client shared memory is not allowed on {protocol}" in refused
    assert registered(daemon) == []
    client.close()


shm_bodies = st.one_of(
    st.binary(max_size=64),
    st.builds(msgspec.json.encode, st.dictionaries(
        st.sampled_from(["key", "offset", "byte_size", "x"]),
        st.one_of(st.none(), st.integers(-2**70, 2**70), st.booleans(), st.text(max_size=12),
                  st.sampled_from([f"/{PREFIX}fuzz", f"{PREFIX}fuzz", "/etc/passwd", "../x", ""])),
        max_size=4)),
)
shm_paths = st.tuples(st.sampled_from(["GET", "POST", "PUT"]),
                      st.sampled_from(["", "/region/fuzz", "/region/..", "/region/a%2Fb", "/region/" + "x" * 300]),
                      st.sampled_from(["status", "register", "unregister", "nope"]))
tensor_parameters = st.dictionaries(
    st.sampled_from(["shared_memory_region", "shared_memory_offset", "shared_memory_byte_size", "binary_data_size"]),
    st.one_of(st.none(), st.integers(-5, 2**62), st.booleans(), st.text(max_size=6), st.just("fuzz")), max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=shm_paths, body=shm_bodies, parameters=tensor_parameters, out_parameters=tensor_parameters)
def test_any_shared_memory_call_over_http_gets_one_answer_and_the_daemon_serves_on(
        daemon, fuzz_region, request, body, parameters, out_parameters):
    import urllib.error
    import urllib.request

    address = daemon.config["server"]["http"]
    method, region, action = request

    def call(path: str, data: bytes | None, verb: str) -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"http://{address}{path}", data=data, method=verb),
                                        timeout=20) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            assert exc.code == 405 or "error" in msgspec.json.decode(exc.read())
            return exc.code

    assert call(f"/v2/systemsharedmemory{region}/{action}", body if method != "GET" else None, method) in (
        200, 400, 404, 405)
    infer = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, models.MLP_IN],
                         "parameters": parameters, **({} if "shared_memory_region" in parameters
                                                      else {"data": [0.0] * models.MLP_IN})}],
             "outputs": [{"name": "OUTPUT__0", "parameters": out_parameters}]}
    assert call("/v2/models/mlp/infer", msgspec.json.encode(infer), "POST") in (200, 400)
    good = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, models.MLP_IN],
                        "data": [0.0] * models.MLP_IN}]}
    assert call("/v2/models/mlp/infer", msgspec.json.encode(good), "POST") == 200


def _register_message(name: str, key: str, offset: int, byte_size: int) -> bytes:
    from tritonclient.grpc import service_pb2

    return service_pb2.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset,
                                                          byte_size=byte_size).SerializeToString()


grpc_shm_messages = st.one_of(
    st.binary(max_size=64),
    st.builds(_register_message, st.sampled_from(["fuzz", "", "..", "x" * 300]),
              st.sampled_from([f"/{PREFIX}fuzz", "/etc/passwd", "", "../x"]),
              st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
                               "SystemSharedMemoryStatus"]), message=grpc_shm_messages)
def test_any_shared_memory_call_over_grpc_gets_one_status_and_the_daemon_serves_on(daemon, fuzz_region, method,
                                                                                    message):
    import grpc

    with grpc.insecure_channel(daemon.config["server"]["grpc"]) as channel:
        try:
            channel.unary_unary(f"/inference.GRPCInferenceService/{method}")(message, timeout=20)
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), exc
            assert exc.details()
        channel.unary_unary("/inference.GRPCInferenceService/SystemSharedMemoryUnregister")(b"", timeout=20)
    client = connect(daemon, "grpc")
    x = np.zeros((1, models.MLP_IN), dtype=np.float32)
    given = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    assert client.infer("mlp", [given]).as_numpy("OUTPUT__0").shape == (1, models.MLP_OUT)
    client.close()


def test_a_new_connection_from_an_old_ones_address_has_none_of_its_regions(daemon, regions):
    """On loopback a closed connection's port comes straight back: a client that takes it gets nothing
    the old connection registered."""
    import http.client
    import socket

    host, port = daemon.config["server"]["http"].rsplit(":", 1)
    _, key = regions(256)
    with socket.socket() as probe:  # a local port to come from twice
        probe.bind(("127.0.0.1", 0))
        local = probe.getsockname()

    def status(connection: http.client.HTTPConnection, headers: dict[str, str] | None = None) -> list:
        connection.request("GET", "/v2/systemsharedmemory/status", headers=headers or {})
        return msgspec.json.decode(connection.getresponse().read())

    old = http.client.HTTPConnection(host, int(port), timeout=20, source_address=local)
    old.request("POST", "/v2/systemsharedmemory/region/old/register",
                body=msgspec.json.encode({"key": key, "byte_size": 256}))
    answer = old.getresponse()
    assert answer.status == 200 and answer.read() == b""
    # http.client closes as soon as it has read a reply; a second descriptor keeps the connection open until
    # the server has closed its side, so the TIME_WAIT is the server's and the client's port is free at once.
    keeper = old.sock.dup()
    assert [r["name"] for r in status(old, {"Connection": "close"})] == ["old"]
    old.close()
    keeper.settimeout(20)
    assert keeper.recv(1) == b"", "the server closes a connection that asked for it"
    keeper.close()
    new = http.client.HTTPConnection(host, int(port), timeout=20, source_address=local)
    assert status(new) == [], "the new connection sees the old one's region"
    new.close()
    wait_for(lambda: not registered(daemon), timeout=15, what="the old connection's region gone")


def test_a_grpc_connections_region_stays_until_that_connection_closes(daemon, repo, regions):
    # gRPC listens on a dual-stack socket, whose IPv4 clients the kernel lists by IPv4-mapped addresses: the
    # gateway must still find each connection, or its sweep takes every connection's regions for gone.
    x = np.random.default_rng(37).standard_normal((2, models.MLP_IN)).astype(np.float32)
    handle, key = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    staying, leaving = connect(daemon, "grpc"), connect(daemon, "grpc")
    staying.register_system_shared_memory("staying", key, x.nbytes)
    leaving.register_system_shared_memory("leaving", key, x.nbytes)
    assert {r["name"] for r in registered(daemon)} == {"staying", "leaving"}
    leaving.close()
    wait_for(lambda: {r["name"] for r in registered(daemon)} == {"staying"}, timeout=15,
             what="the closed connection's region gone, and only it")
    result = staying.infer("mlp", [in_region(grpcclient, "INPUT__0", x, "staying")])
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), reference(repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)
    staying.unregister_system_shared_memory()
    staying.close()


def test_a_region_is_its_connections_unless_client_shm_scope_makes_it_the_servers(daemon, start_daemon, repo,
                                                                                  regions):
    x = np.random.default_rng(31).standard_normal((2, models.MLP_IN)).astype(np.float32)
    expected = reference(repo, "mlp", "v2")(x)
    inputs, in_key = regions(x.nbytes)
    shm.set_shared_memory_region(inputs, [x])
    # "connection", the default: another connection does not see the region.
    owner, other = connect(daemon, "http"), connect(daemon, "http")
    owner.register_system_shared_memory("in", in_key, x.nbytes)
    with pytest.raises(InferenceServerException, match="no region 'in' is registered on this connection"):
        other.infer("mlp", [in_region(httpclient, "INPUT__0", x, "in")])
    owner.unregister_system_shared_memory()
    # "server": registered over one HTTP connection, used by tritonclient's pool of several and over gRPC,
    # as Triton's clients and perf_analyzer do; a connection that closes takes nothing with it.
    wide = start_daemon({"mlp": MLP}, server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
                                              "allow_client_shm": True, "client_shm_scope": "server"})
    registering = connect(wide, "http")
    registering.register_system_shared_memory("in", in_key, x.nbytes)
    registering.close()
    pool = httpclient.InferenceServerClient(wide.config["server"]["http"], concurrency=4)
    pending = [pool.async_infer("mlp", [in_region(httpclient, "INPUT__0", x, "in")]) for _ in range(16)]
    for request in pending:
        np.testing.assert_allclose(request.get_result().as_numpy("OUTPUT__0"), expected, rtol=1e-5, atol=1e-6)
    over_grpc = connect(wide, "grpc")
    result = over_grpc.infer("mlp", [in_region(grpcclient, "INPUT__0", x, "in")])
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), expected, rtol=1e-5, atol=1e-6)
    assert set(region_status(over_grpc, "grpc")) == {"in"} and set(region_status(pool, "http")) == {"in"}
    assert [r["requests"] for r in registered(wide)] == [17]
    over_grpc.unregister_system_shared_memory("in")
    assert registered(wide) == [] and region_status(pool, "http") == {}
    pool.close()
