"""Scheduling over the Open Inference Protocol, against the real daemon: a request's priority reaches the
queue, a client that goes away (an HTTP connection closed, a gRPC call cancelled or past its deadline)
takes its request out of the queue, and a gRPC deadline travels as the request's own.

The one executor of `variable` is held by a batch waiting at a gate (tests/gates.py), and the batch after it
by a filler in the executor's pipeline: what comes next waits in the queue until the test opens the gate.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import zmq
from conftest import ONE_AT_A_TIME, Daemon, reference, until, wait_for
from gates import Gate
from test_oip_grpc import client as grpc_client
from test_oip_grpc import mlp_input as grpc_input  # INPUT__0, float32: `variable`'s input too
from tritonclient.utils import InferenceServerException
from wire import RawPeer

from inferd import protocol
from inferd.harness import free_port

FILLER = np.array([[1, 0]], dtype=np.float32)


def daemon_with(start_daemon, *protocols: str, **model) -> Daemon:
    return start_daemon({"variable": {**ONE_AT_A_TIME, **model}},
                        server={name: f"127.0.0.1:{free_port()}" for name in protocols}, workers={"streams": 1})


def block(daemon: Daemon, peer: RawPeer, gate: Gate) -> int:
    """Hold the executor at `gate` and fill its pipeline (over ZeroMQ); the batches computed before."""
    worker = daemon.status()["workers"][0]
    peer.send("blocker", "variable", [gate.input], timeout_ms=30_000)
    wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy")
    peer.send("filler", "variable", [FILLER], timeout_ms=30_000)
    wait_for(lambda: daemon.status()["workers"][0]["batches_in_flight"] == 2, what="the executor's pipeline full")
    return worker["batches"]


def queued(daemon: Daemon, depth: int = 1) -> None:
    wait_for(lambda: daemon.status()["models"]["variable"]["queue_depth"] == depth,
             what=f"{depth} request(s) waiting in the queue")


def by_protocol(daemon: Daemon, name: str) -> dict[str, int]:
    return daemon.call("stats")["models"]["variable"]["requests_by_protocol"].get(name, {})


def unblock(daemon: Daemon, peer: RawPeer, gate: Gate, batches_before: int) -> None:
    """Open `gate`: the blocker and the filler answered; nothing else was computed, and nothing waits."""
    gate.open()
    assert [peer.recv(timeout=30)[0]["status"] for _ in range(2)] == ["ok", "ok"]
    worker = wait_for(lambda: (w := daemon.status()["workers"][0])["batches_in_flight"] == 0 and w,
                      what="the executor idle")
    assert worker["batches"] == batches_before + 2, "the cancelled request was computed"
    assert daemon.status()["models"]["variable"]["queue_depth"] == 0


def no_gateway_errors(daemon: Daemon) -> None:
    log = daemon.log()
    assert "Traceback" not in log and "ERROR" not in log and "raised" not in log, log[-3000:]


def json_body(x: np.ndarray, **parameters) -> bytes:
    body: dict = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(x.shape),
                              "data": x.ravel().tolist()}]}
    if parameters:
        body["parameters"] = parameters
    return json.dumps(body).encode()


def http_post(daemon: Daemon, body: bytes) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://{daemon.config['server']['http']}/v2/models/variable/infer",
                                     data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def served_like_the_model(daemon: Daemon, repo, over: str) -> None:
    x = np.array([[3.0, -1.5]], dtype=np.float32)
    expected = reference(repo, "variable", "v1")(x)
    if over == "http":
        status, answer = http_post(daemon, json_body(x))
        assert status == 200, answer
        got = np.asarray(answer["outputs"][0]["data"], dtype=np.float32).reshape(x.shape)
    else:
        got = grpc_client(daemon).infer("variable", [grpc_input(x)]).as_numpy("OUTPUT__0")
    np.testing.assert_array_equal(got, expected)


# -- cancellation ------------------------------------------------------------------------------------


def test_an_http_client_that_closes_its_connection_takes_its_request_out_of_the_queue(start_daemon, repo, gates):
    daemon = daemon_with(start_daemon, "http")
    host, port = daemon.config["server"]["http"].rsplit(":", 1)
    body = json_body(np.array([[5, 0]], dtype=np.float32))
    with RawPeer(daemon.endpoint) as peer:
        gate = gates()
        before = block(daemon, peer, gate)
        client = socket.create_connection((host, int(port)), timeout=10)
        client.sendall(b"POST /v2/models/variable/infer HTTP/1.1\r\nHost: localhost\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        queued(daemon)
        client.close()
        wait_for(lambda: by_protocol(daemon, "http").get("cancelled") == 1, what="the request answered cancelled")
        assert daemon.status()["models"]["variable"]["queue_depth"] == 0, "it left the queue at once"
        unblock(daemon, peer, gate, before)
    assert by_protocol(daemon, "http") == {"cancelled": 1}
    served_like_the_model(daemon, repo, "http")
    assert by_protocol(daemon, "http") == {"cancelled": 1, "ok": 1}
    no_gateway_errors(daemon)


def test_a_cancelled_grpc_call_takes_its_request_out_of_the_queue(start_daemon, repo, gates):
    daemon = daemon_with(start_daemon, "grpc")
    errors: queue.Queue = queue.Queue()
    with RawPeer(daemon.endpoint) as peer:
        gate = gates()
        before = block(daemon, peer, gate)
        client = grpc_client(daemon)
        call = client.async_infer("variable", [grpc_input(np.array([[5, 0]], dtype=np.float32))],
                                  lambda result, error: errors.put(error))
        queued(daemon)
        call.cancel()
        assert errors.get(timeout=10).status() == "StatusCode.CANCELLED"
        wait_for(lambda: by_protocol(daemon, "grpc").get("cancelled") == 1, what="the request answered cancelled")
        assert daemon.status()["models"]["variable"]["queue_depth"] == 0
        unblock(daemon, peer, gate, before)
        client.close()
    assert by_protocol(daemon, "grpc") == {"cancelled": 1}
    served_like_the_model(daemon, repo, "grpc")
    no_gateway_errors(daemon)


def test_a_grpc_call_past_its_deadline_leaves_the_queue_uncomputed(start_daemon, repo, gates):
    daemon = daemon_with(start_daemon, "grpc")
    with RawPeer(daemon.endpoint) as peer:
        gate = gates()
        before = block(daemon, peer, gate)
        client = grpc_client(daemon)
        assert client.is_server_live()  # the channel is up: the deadline is the call's alone
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as late:
            client.infer("variable", [grpc_input(np.array([[5, 0]], dtype=np.float32))], client_timeout=1.0)
        assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert time.monotonic() - started < 2.0
        # The daemon knew the deadline (the call's, as its timeout_ms) and the gateway cancelled the request
        # as it passed: whichever came first answered it, and it never ran.
        wait_for(lambda: sum(by_protocol(daemon, "grpc").values()) == 1, what="the request answered")
        assert set(by_protocol(daemon, "grpc")) <= {"cancelled", "timeout"}, by_protocol(daemon, "grpc")
        assert daemon.status()["workers"][0]["batches_in_flight"] == 2, "the test needs the blocker still running"
        unblock(daemon, peer, gate, before)
        client.close()
    served_like_the_model(daemon, repo, "grpc")
    no_gateway_errors(daemon)


def test_a_grpc_deadline_is_the_requests_deadline(start_daemon, gates):
    """Deadline-aware admission sees the call's deadline: once `variable` is known to take half a second (a
    batch held that long at a gate), a call that must be answered within 0.2 s is refused at once, its
    deadline named (without it, the daemon's default of 10 s would have it computed, and the client give up)."""
    daemon = daemon_with(start_daemon, "grpc")
    client = grpc_client(daemon)
    gate = gates()
    answered: queue.Queue = queue.Queue()
    client.async_infer("variable", [grpc_input(gate.input)], lambda result, error: answered.put(error))
    wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the batch held")
    until(time.monotonic() + 0.5)
    gate.open()
    assert answered.get(timeout=30) is None  # its compute time is learned
    slow = np.array([[10, 0]], dtype=np.float32)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("variable", [grpc_input(slow)], client_timeout=0.2)
    assert refused.value.status() == "StatusCode.UNAVAILABLE", refused.value
    deadline_ms = int(refused.value.message().rsplit("after its deadline in ", 1)[1].split()[0])
    assert 100 <= deadline_ms <= 200, refused.value.message()
    # The `timeout` parameter still counts where it is sooner than the call's deadline.
    with pytest.raises(InferenceServerException) as sooner:
        client.infer("variable", [grpc_input(slow)], client_timeout=30, timeout=300_000)
    assert "after its deadline in 300 ms" in sooner.value.message()
    client.close()


async def from_gateway(supervisor: zmq.Socket) -> tuple[bytes, list[list[bytes]]]:
    """The next message a gateway's Upstream sent, as its members' frames; the region it registers with each
    connection (oip/hop_region.py) is answered `ok` on the way, as the supervisor answers it."""
    while True:
        while not supervisor.poll(0):
            await asyncio.sleep(0.01)
        identity, *body = supervisor.recv_multipart()
        kept = []
        for member in protocol.group_of(body, 1 << 20) or [body]:
            message = protocol.decode_message(member, 1 << 20)
            if isinstance(message, protocol.RegisterRegion):
                supervisor.send_multipart([identity, protocol.encode_reply(
                    protocol.ReplyHeader(id=message.id, status=protocol.OK, regions=()))])
            else:
                kept.append(member)
        if kept:
            return identity, kept


def test_the_gateway_absorbs_the_cancelled_reply_of_a_request_it_cancelled(tmp_path):
    """Upstream, on a real socket: a cancelled wait sends the supervisor a Cancel naming the request,
    forgets it, and drops the supervisor's `cancelled` reply when it comes."""
    from inferd.oip.upstream import Upstream

    context = zmq.Context()
    supervisor = context.socket(zmq.ROUTER)
    supervisor.bind(f"ipc://{tmp_path}/supervisor")
    upstream = Upstream(context, f"ipc://{tmp_path}/supervisor", default_timeout_ms=10_000, slack_s=1.0)

    async def cancel_one() -> None:
        upstream.start()
        waiting = asyncio.ensure_future(upstream.infer(
            "m", None, [(protocol.TensorMeta("float32", (1, 2)), bytes(8))], None, priority=1))
        identity, (frames,) = await from_gateway(supervisor)
        request = protocol.decode_message(frames, 1 << 20)
        assert isinstance(request, protocol.Request) and request.header.priority == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert request.header.id not in upstream._waiting
        _, (frames,) = await asyncio.wait_for(from_gateway(supervisor), 5)
        assert protocol.decode_message(frames, 1 << 20) == protocol.Cancel(id=request.header.id)
        supervisor.send_multipart([identity, protocol.error_reply(request.header.id, protocol.CANCELLED, "gone")])
        answered = asyncio.ensure_future(upstream.infer(
            "m", None, [(protocol.TensorMeta("float32", (1, 2)), bytes(8))], None))
        identity, ((header, _),) = await from_gateway(supervisor)
        ok = protocol.ReplyHeader(id=json.loads(header)["id"], status=protocol.OK)
        supervisor.send_multipart([identity, protocol.encode_reply(ok)])
        reply, _ = await asyncio.wait_for(answered, 5)
        assert reply.status == protocol.OK and upstream._waiting == {}

    try:
        asyncio.run(cancel_one())
    finally:
        upstream.close()
        supervisor.close()
        context.term()


def test_the_gateway_sends_what_one_turn_asks_as_one_group_and_takes_replies_in_groups(tmp_path):
    """Upstream, on a real socket: three requests made in one turn of the loop reach the supervisor as one
    message, a group of three; a group of their replies answers each of them."""
    from inferd.oip.upstream import Upstream

    context = zmq.Context()
    supervisor = context.socket(zmq.ROUTER)
    supervisor.bind(f"ipc://{tmp_path}/supervisor")
    upstream = Upstream(context, f"ipc://{tmp_path}/supervisor", default_timeout_ms=10_000, slack_s=1.0)

    async def three() -> list[tuple[protocol.ReplyHeader, list[memoryview]]]:
        upstream.start()
        asked = [asyncio.ensure_future(upstream.infer(
            model, None, [(protocol.TensorMeta("float32", (1, 2)), bytes(8))], None)) for model in ("a", "b", "c")]
        identity, members = await from_gateway(supervisor)
        assert len(members) == 3, "one message for the turn's three requests"
        requests = [protocol.decode_message(member, 1 << 20) for member in members]
        assert [r.header.model for r in requests] == ["a", "b", "c"]
        replies = [[protocol.encode_reply(protocol.ReplyHeader(id=r.header.id, status=protocol.OK, model=r.header.model,
                                                               outputs=(protocol.TensorMeta("uint8", (1,)),))),
                    r.header.model.encode()] for r in requests]
        supervisor.send_multipart([identity, *protocol.encode_group(replies)])
        return await asyncio.wait_for(asyncio.gather(*asked), 5)

    try:
        answers = asyncio.run(three())
    finally:
        upstream.close()
        supervisor.close()
        context.term()
    assert [(header.model, bytes(outputs[0])) for header, outputs in answers] == [("a", b"a"), ("b", b"b"), ("c", b"c")]


# -- priority ----------------------------------------------------------------------------------------


def urgent_first(daemon: Daemon, peer: RawPeer, gates: Callable[[], Gate], send_default, send_urgent) -> list[str]:
    """With the executor busy, a request at the default level, then one at the most urgent, each waiting in
    the queue and then at a gate of its own (`send_*(x)` sends x): the order they were computed in."""
    blocker, default, urgent = gates(), gates(), gates()
    block(daemon, peer, blocker)
    threads = []
    for depth, (call, gate) in enumerate(((send_default, default), (send_urgent, urgent)), 1):
        threads.append(threading.Thread(target=call, args=(gate.input,)))
        threads[-1].start()
        queued(daemon, depth)
    blocker.open()
    assert [peer.recv(timeout=30)[0]["status"] for _ in range(2)] == ["ok", "ok"]
    # The one computed first waits at its gate, and the other behind it: were the default one first, the urgent
    # one would never come to its gate while the default one's is closed.
    try:
        urgent.open()
        order = ["urgent", "default"]
    except AssertionError:
        order = ["default", "urgent"]
    default.open()
    urgent.close()
    for thread in threads:
        thread.join(60)
    return order


def test_http_priority_reaches_the_queue_and_a_bad_one_is_refused(start_daemon, gates):
    daemon = daemon_with(start_daemon, "http")

    def infer(**kwargs):
        def call(x: np.ndarray = FILLER) -> None:  # a client of its own: tritonclient.http's is for one thread only
            given = httpclient.InferInput("INPUT__0", [1, 2], "FP32")
            given.set_data_from_numpy(x)
            with httpclient.InferenceServerClient(daemon.config["server"]["http"]) as client:
                np.testing.assert_array_equal(client.infer("variable", [given], **kwargs).as_numpy("OUTPUT__0"), x)
        return call

    with RawPeer(daemon.endpoint) as peer:
        # tritonclient's priority=1: Triton's most urgent level, inferd's 0.
        assert urgent_first(daemon, peer, gates, infer(), infer(priority=1)) == ["urgent", "default"]
    levels = daemon.call("stats")["models"]["variable"]["priorities"]
    assert levels["0"]["requests"] == {"ok": 1} and levels["1"]["requests"] == {"ok": 3}, levels
    # Raw JSON: 2 is Triton's second level, inferd's 1 (the default); 0 and null are the default.
    for given in (2, 0, None):
        status, answer = http_post(daemon, json_body(FILLER, priority=given))
        assert status == 200, answer
    levels = daemon.call("stats")["models"]["variable"]["priorities"]
    assert levels["0"]["requests"] == {"ok": 1} and levels["1"]["requests"] == {"ok": 6}, levels
    for bad in (-1, 1.5, "high", True, [1]):
        status, answer = http_post(daemon, json_body(FILLER, priority=bad))
        assert status == 400 and "parameters.priority must be a whole number" in answer["error"], (bad, answer)
    status, answer = http_post(daemon, json_body(FILLER, priority=3))
    assert status == 400, answer
    assert answer["error"] == ("parameters.priority 3 is not a level; this daemon takes 1 (the most urgent) to 2, "
                               "or 0 for its default")
    with pytest.raises(InferenceServerException, match="parameters.priority 9 is not a level") as refused:
        infer(priority=9)()
    assert refused.value.status() == "400"


def test_grpc_priority_reaches_the_queue_and_the_config_tells_the_levels(start_daemon, gates):
    daemon = daemon_with(start_daemon, "grpc", "http", max_wait_ms="auto")
    client = grpc_client(daemon)

    def infer(**kwargs):
        return lambda x=FILLER: np.testing.assert_array_equal(
            client.infer("variable", [grpc_input(x)], **kwargs).as_numpy("OUTPUT__0"), x)

    def raw(x: np.ndarray = FILLER, **parameter):
        """A call whose priority parameter is as given (tritonclient sends a uint64_param)."""
        request = grpcclient.service_pb2.ModelInferRequest(model_name="variable")
        request.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 2])
        request.raw_input_contents.append(x.tobytes())
        for kind, value in parameter.items():
            setattr(request.parameters["priority"], kind, value)
        import grpc

        with grpc.insecure_channel(daemon.config["server"]["grpc"]) as channel:
            try:
                channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(request.SerializeToString(),
                                                                                 timeout=30)
            except grpc.RpcError as exc:
                return exc.code().name, exc.details()
        return "OK", ""

    with RawPeer(daemon.endpoint) as peer:
        assert urgent_first(daemon, peer, gates, infer(), infer(priority=1)) == ["urgent", "default"]
    with RawPeer(daemon.endpoint) as peer:
        assert urgent_first(daemon, peer, gates, lambda x: raw(x, uint64_param=2),
                            lambda x: raw(x, int64_param=1)) == ["urgent", "default"]
    levels = daemon.call("stats")["models"]["variable"]["priorities"]
    assert levels["0"]["requests"] == {"ok": 2}, levels
    for parameter in ({"int64_param": -1}, {"string_param": "1"}, {"double_param": 1.0}, {"bool_param": True}):
        code, details = raw(**parameter)
        assert code == "INVALID_ARGUMENT" and "parameters.priority must be a whole number" in details, parameter
    code, details = raw(uint64_param=2**64 - 1)
    assert code == "INVALID_ARGUMENT" and f"parameters.priority {2**64 - 1} is not a level" in details, details
    with pytest.raises(InferenceServerException, match="this daemon takes 1 .the most urgent. to 2") as refused:
        infer(priority=3)()
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    # Triton's levels in the model configuration, over both protocols; the "auto" window in its parameters.
    batching = client.get_model_config("variable").config.dynamic_batching
    assert (batching.priority_levels, batching.default_priority_level) == (2, 2)
    assert client.get_model_config("variable").config.parameters["max_wait_ms"].string_value == "auto"
    config = httpclient.InferenceServerClient(daemon.config["server"]["http"]).get_model_config("variable")
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 0, "priority_levels": 2,
                                          "default_priority_level": 2}
    assert config["parameters"] == {"max_wait_ms": {"string_value": "auto"}}
    client.close()
