"""The limits a client meets at the Open Inference Protocol's gateways, against the real daemon: what its
requests may make a gateway hold (server.gateway_buffer_mb), how slowly a body may come
(server.min_body_kib_s), what parsing a request may cost, the memory a gateway gives back after a flood,
and values a tensor's datatype cannot hold. Each gateway's memory is its process's resident set, sampled
every 5 ms (bench/hostile.py); answers are checked against the model run in-process."""

from __future__ import annotations

import gzip
import json
import select
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import PAIR, Daemon, module_daemon, reference, wait_for

from bench.hostile import PartialGrpcCall, PeakMemory, answered, gateway_pid, start_http_body
from inferd.harness import free_port

MIB = 1 << 20
FEATURES = 1 << 20  # `sum` takes float32 [FEATURES]: 4 MiB a sample, one float back
SUM = {"inputs": [{"dtype": "float32", "shape": [FEATURES]}], "max_batch_size": 8, "warmup_batch_sizes": [1]}
UNAVAILABLE = "14"  # gRPC's status code


@pytest.fixture(scope="module")
def limits(repo) -> Daemon:
    """`sum` and `pair` over HTTP and gRPC, with the default buffer (256 MiB) and body pace (64 KiB/s)."""
    with module_daemon(repo, {"sum": SUM, "pair": PAIR}, workers={"shm_mb": 256},
                       server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}"}) as daemon:
        yield daemon


def address(daemon: Daemon, protocol: str) -> str:
    return daemon.config["server"][protocol]


def post(daemon: Daemon, body: bytes, headers: dict[str, str] | None = None, model: str = "sum") -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{address(daemon, 'http')}/v2/models/{model}/infer", data=body,
                                     method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def json_request(values: np.ndarray, name: str = "INPUT__0", datatype: str = "FP32") -> bytes:
    return json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": list(values.shape),
                                   "data": values.ravel().tolist()}]}, separators=(",", ":")).encode()


def sums(repo, values: np.ndarray) -> np.ndarray:
    return reference(repo, "sum", "v1")(values.astype(np.float32))


def test_unfinished_http_bodies_hold_at_most_the_buffer_and_a_small_request_is_served_meanwhile(limits, repo):
    small = np.full((1, FEATURES), 0.5)
    with PeakMemory(gateway_pid(limits.process.pid, "http")) as memory:
        # Each declares 64 MiB (server.max_message_mb) and sends 60: three fit the 240 MiB that bodies over 64 KiB
        # may hold; the rest are refused before a byte of their bodies is read.
        held = [start_http_body(address(limits, "http"), 64 * MIB, 60 * MIB) for _ in range(12)]
        status, answer = post(limits, json_request(small))
        refusals = [answered(connection, 1.0) for connection in held]
    for connection in held:
        connection.close()
    assert status == 200 and np.allclose(answer["outputs"][0]["data"], sums(repo, small).ravel())
    refused = [r for r in refusals if r.startswith(b"HTTP/1.1 503")]
    assert len(refused) == 9 and not any(r for r in refusals if r not in refused), refusals
    assert all(b"retry-after: 1" in r.lower() and b"connection: close" in r.lower() for r in refused)
    assert b"(server.gateway_buffer_mb)" in refused[0]
    assert memory.peak < 512 * MIB, f"the HTTP gateway peaked at {memory.peak / MIB:.0f} MiB"


def test_a_chunked_body_is_cut_where_it_would_pass_the_buffer_and_the_others_are_answered(repo):
    # A buffer of 8 MiB, of which bodies over 64 KiB may hold 7.5: three chunked bodies of 3 MiB cannot all be
    # held, so whichever passes the bound is cut; the other two are read to their end and answered.
    features = 1 << 18
    model = {"inputs": [{"dtype": "float32", "shape": [features]}], "max_batch_size": 3, "warmup_batch_sizes": [1]}
    with module_daemon(repo, {"sum": model}, workers={"shm_mb": 64},
                       server={"http": f"127.0.0.1:{free_port()}", "gateway_buffer_mb": 8,
                                                     "max_message_mb": 4}) as daemon:
        values = np.full((3, features), 0.25)
        body = json_request(values)
        assert 3 * MIB < len(body) < 4 * MIB
        host, _, port = address(daemon, "http").rpartition(":")
        connections = []
        for _ in range(3):
            connection = socket.create_connection((host, int(port)))
            connection.sendall(b"POST /v2/models/sum/infer HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                               b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % (3 * MIB) + body[:3 * MIB] + b"\r\n")
            connections.append(connection)
        cut = wait_for(lambda: [c for c in connections if select.select([c], [], [], 0)[0]], timeout=30,
                       what="a body cut")
        assert len(cut) == 1
        refusal = answered(cut[0], 5.0)
        assert refusal.startswith(b"HTTP/1.1 503") and b"(server.gateway_buffer_mb)" in refusal, refusal[:300]
        rest = body[3 * MIB:]
        for connection in connections:
            if connection is not cut[0]:
                connection.sendall(b"%x\r\n" % len(rest) + rest + b"\r\n0\r\n\r\n")
                reply = answered(connection, 10.0)
                assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
                outputs = json.loads(reply.partition(b"\r\n\r\n")[2])["outputs"]
                assert np.allclose(outputs[0]["data"], sums(repo, values).ravel())
            connection.close()


def test_a_body_that_trickles_is_answered_408_once_it_comes_slower_than_the_pace(limits):
    # A byte a second keeps the connection busy forever if only idleness is timed.
    connection = start_http_body(address(limits, "http"), MIB, 100 << 10)
    began = time.monotonic()
    connection.settimeout(0.05)
    answer = b""
    while not answer and time.monotonic() - began < 40:
        try:
            connection.sendall(b"0")
            answer = connection.recv(65536)
        except TimeoutError:
            time.sleep(0.95)
        except ConnectionError:
            break
    connection.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"server.min_body_kib_s" in answer, answer
    assert time.monotonic() - began >= 9, "cut for its pace over 10 s, not at once"


def test_partial_grpc_messages_hold_at_most_the_buffer_and_a_call_is_served_once_one_is_cut(limits, repo):
    small = np.full((1, FEATURES), 2.0, dtype=np.float32)
    given = grpcclient.InferInput("INPUT__0", list(small.shape), "FP32")
    given.set_data_from_numpy(small)
    grpc_address = address(limits, "grpc")
    with PeakMemory(gateway_pid(limits.process.pid, "grpc")) as memory:
        # Room for four whole messages of server.max_message_mb: four are received, the fifth and the good
        # call wait their turn, until the stalled ones are cut (only while others wait: one each).
        calls = [PartialGrpcCall(grpc_address, 64 * MIB, 60 * MIB) for _ in range(5)]
        sent = [call.wait_sent(timeout=60) for call in calls]
        result = grpcclient.InferenceServerClient(grpc_address).infer("sum", [given], client_timeout=60)
        cut = [call for call in calls if call.status is not None]
    for call in calls:
        call.close()
    assert sum(s > 60 * MIB for s in sent) == 4, sent
    assert np.allclose(result.as_numpy("OUTPUT__0"), sums(repo, small))
    assert cut and all(call.status == UNAVAILABLE for call in cut), [call.status for call in calls]
    assert "took over 10 s to come while other calls waited for room" in limits.log()
    assert memory.growth < 256 * MIB + 64 * MIB, f"the gRPC gateway grew by {memory.growth / MIB:.0f} MiB"


def grpc_contents_call(daemon: Daemon, values: np.ndarray) -> float:
    message = grpcclient.service_pb2.ModelInferRequest(model_name="sum")
    message.inputs.add(name="INPUT__0", datatype="FP32", shape=list(values.shape)).contents.fp32_contents.extend(
        values.astype(np.float32).ravel())
    client = grpcclient.InferenceServerClient(address(daemon, "grpc"))
    answer = client._client_stub.ModelInfer(message, timeout=60)
    return float(np.frombuffer(answer.raw_output_contents[0], dtype=np.float32)[0])


@pytest.mark.parametrize("form", ["json", "gzip", "grpc contents"])
def test_a_large_request_costs_its_gateway_at_most_five_times_its_size(limits, repo, form):
    values = np.round(np.random.default_rng(3).random((4, FEATURES)), 1)  # 16 MiB as JSON: "0.3," a value
    protocol = "grpc" if form == "grpc contents" else "http"
    body = json_request(values)
    with PeakMemory(gateway_pid(limits.process.pid, protocol)) as memory:
        if form == "grpc contents":
            size = 4 * values.size + 64  # the message: each float's four bytes
            got = grpc_contents_call(limits, values)
        else:
            size = len(body)
            status, answer = post(limits, gzip.compress(body, 1) if form == "gzip" else body,
                                  {"Content-Encoding": "gzip"} if form == "gzip" else {})
            assert status == 200, answer
            got = answer["outputs"][0]["data"]
    assert np.allclose(got, sums(repo, values)[:1].ravel() if form == "grpc contents" else sums(repo, values).ravel())
    assert memory.growth <= 5 * size, f"{form}: the gateway grew by {memory.growth / size:.1f}x the request's size"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_gateway_gives_its_memory_back_within_two_seconds_of_a_flood(limits, protocol):
    # The flood the fuzzers left the gateways holding for minutes: as many large bodies or messages as the
    # buffer takes, each sent but for its end, then dropped.
    memory = PeakMemory(gateway_pid(limits.process.pid, protocol))
    before = memory.rss()
    if protocol == "http":
        held = [start_http_body(address(limits, "http"), 64 * MIB, 60 * MIB) for _ in range(12)]
        wait_for(lambda: memory.rss() > before + 150 * MIB, what="the bodies received")
        for connection in held:
            connection.close()
    else:
        calls = [PartialGrpcCall(address(limits, "grpc"), 64 * MIB, 60 * MIB) for _ in range(10)]
        wait_for(lambda: sum(call.sent_bytes > 60 * MIB for call in calls) >= 4, timeout=60,
                 what="the messages received")
        for call in calls:
            call.close()
    wait_for(lambda: memory.rss() < before + 64 * MIB, timeout=2.5,
             what=f"the {protocol} gateway back within 64 MiB of its {before / MIB:.0f} MiB")


def pair_request(a: str = "[" + ",".join(["0.5"] * 12) + "]", b: str = "[1,2]") -> bytes:
    """A request of `pair` whose inputs' JSON data is `a` (FP32 [1, 3, 4]) and `b` (INT64 [1, 2]), as written."""
    return (b'{"inputs":[{"name":"INPUT__0","datatype":"FP32","shape":[1,3,4],"data":' + a.encode() +
            b'},{"name":"INPUT__1","datatype":"INT64","shape":[1,2],"data":' + b.encode() + b"}]}")


def twelve(*first: str) -> str:
    return "[" + ",".join([*first, *["0.5"] * (12 - len(first))]) + "]"


@pytest.mark.parametrize("body, message", [
    (pair_request(a=twelve("1e39")), "input 'INPUT__0' has values that FP32 cannot hold, the first at element 0"),
    (pair_request(a=twelve("0.5", "0.5", "-1e300")), "input 'INPUT__0' has values that FP32 cannot hold, the "
                                                     "first at element 2"),
    (pair_request(b="[1,9223372036854775808]"), "input 'INPUT__1' has values outside the range of INT64, the first "
                                                "at element 1"),
    (pair_request(a=twelve("0.5", "NaN")), "NaN and Infinity are not JSON numbers"),
    (pair_request(b="[1,-Infinity]"), "NaN and Infinity are not JSON numbers"),
], ids=["1e39", "-1e300", "int64", "NaN", "-Infinity"])
def test_a_value_the_datatype_cannot_hold_is_refused_with_where_it_is(limits, body, message):
    status, answer = post(limits, body, model="pair")
    assert status == 400 and message in answer["error"], answer
    assert post(limits, pair_request(), model="pair")[0] == 200
