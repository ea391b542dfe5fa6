"""The Open Inference Protocol's connections: TLS on both front ends, and clients that hold a connection
without finishing a request or send more header than a request needs."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import models
import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
from conftest import MLP, Daemon, reference, wait_for
from tritonclient.utils import InferenceServerException

from inferd.harness import free_port

HEAD_TIMEOUT_S = 10.0  # inferd/oip/http/server.py, and the gRPC handshake timeout in rpc.py
ONE = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, models.MLP_IN],
                              "data": [0.5] * models.MLP_IN}]}).encode()


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def http_infer(url: str, context: ssl.SSLContext | None = None) -> int:
    request = urllib.request.Request(f"{url}/v2/models/mlp/infer", data=ONE, method="POST")
    with urllib.request.urlopen(request, timeout=20, context=context) as answer:
        return answer.status


def grpc_infer(target: str, **kwargs) -> np.ndarray:
    given = grpcclient.InferInput("INPUT__0", [1, models.MLP_IN], "FP32")
    given.set_data_from_numpy(np.full((1, models.MLP_IN), 0.5, dtype=np.float32))
    return grpcclient.InferenceServerClient(target, **kwargs).infer("mlp", [given]).as_numpy("OUTPUT__0")


def closed_by_server(connection: socket.socket, within: float) -> bool:
    connection.settimeout(within)
    try:
        while connection.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_connections_that_never_finish_a_request_are_closed_and_others_are_served(oip_daemon):
    server = oip_daemon.config["server"]
    started = time.monotonic()
    with socket.create_connection(address(server["http"])) as http_loris, \
            socket.create_connection(address(server["http"])) as body_loris, \
            socket.create_connection(address(server["grpc"])) as grpc_loris:
        http_loris.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: localhost\r\n")  # and never the rest
        body_loris.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{")
        assert http_infer(f"http://{server['http']}") == 200
        assert grpc_infer(server["grpc"]).shape == (1, models.MLP_OUT)
        assert closed_by_server(http_loris, HEAD_TIMEOUT_S + 10)
        assert closed_by_server(body_loris, HEAD_TIMEOUT_S + 10)
        assert closed_by_server(grpc_loris, HEAD_TIMEOUT_S + 10)
    assert time.monotonic() - started >= HEAD_TIMEOUT_S - 1, "closed for its slowness, not at once"


@pytest.mark.parametrize("head, sentence", [
    (b"".join(b"X-%d: 1\r\n" % i for i in range(101)), b"more than 100 headers"),
    (b"X-Big: " + b"a" * (70 << 10) + b"\r\n", b"a request head of over 65536 bytes"),
], ids=["too many headers", "too big a head"])
def test_too_much_header_is_refused_with_a_sentence(oip_daemon, head, sentence):
    with socket.create_connection(address(oip_daemon.config["server"]["http"])) as connection:
        connection.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n" + head + b"\r\n")
        connection.settimeout(20)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400") and sentence in answer, answer[:300]
    assert http_infer(f"http://{oip_daemon.config['server']['http']}") == 200


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_tls_on_both_front_ends(start_daemon, certificate):
    cert, key = certificate
    daemon: Daemon = start_daemon({"mlp": MLP}, server={
        "http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
        "tls_cert": str(cert), "tls_key": str(key)})
    server = daemon.config["server"]
    trusted = ssl.create_default_context(cafile=str(cert))
    assert http_infer(f"https://{server['http']}", trusted) == 200
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        http_infer(f"https://{server['http']}", ssl.create_default_context())
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        http_infer(f"http://{server['http']}")  # plain HTTP to a TLS port
    assert grpc_infer(server["grpc"], ssl=True, root_certificates=str(cert)).shape == (1, models.MLP_OUT)
    with pytest.raises(InferenceServerException, match="UNAVAILABLE"):
        grpc_infer(server["grpc"])  # no TLS
    assert "without TLS" not in daemon.log()
    assert "Open Inference Protocol at https://" in daemon.log()
    assert "Open Inference Protocol at grpcs://" in daemon.log()


def test_a_supervisor_that_does_not_answer_makes_the_probes_fail_with_503_and_unavailable(oip_daemon):
    """The liveness probes' reason to exist: a stopped supervisor is not alive, and the answer says so."""
    server = oip_daemon.config["server"]
    os.kill(oip_daemon.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://{server['http']}/v2/health/live", timeout=30)
        assert refused.value.code == 503 and "did not answer status" in json.loads(refused.value.read())["error"]
        with pytest.raises(InferenceServerException) as unavailable:
            grpcclient.InferenceServerClient(server["grpc"]).is_server_live()
        assert unavailable.value.status() == "StatusCode.UNAVAILABLE"
    finally:
        os.kill(oip_daemon.process.pid, signal.SIGCONT)
    assert http_infer(f"http://{server['http']}") == 200


def served(protocol_name: str, target: str) -> bool:
    """One inference over `protocol_name` at `target` answered; False while nothing serves there."""
    try:
        return http_infer(f"http://{target}") == 200 if protocol_name == "http" else grpc_infer(target) is not None
    except (OSError, InferenceServerException):  # refused, or reset by a gateway that died
        return False


@pytest.mark.parametrize("protocol_name", ["http", "grpc"])
def test_the_daemon_is_healthy_only_once_every_gateway_takes_connections(start_daemon, protocol_name):
    # A service started right after `systemctl start inferd` (READY=1, the same moment) must not be refused.
    daemon = start_daemon({"mlp": MLP}, server={protocol_name: f"127.0.0.1:{free_port()}",
                                                f"{protocol_name}_processes": 2})
    assert served(protocol_name, daemon.config["server"][protocol_name]), "healthy, and the front end refused"
    gateways = daemon.status()["gateways"]
    assert len(gateways) == 2 and all(g["listening"] for g in gateways), gateways


@pytest.mark.parametrize("protocol_name", ["http", "grpc"])
def test_a_dead_gateway_is_restarted_and_serves_again(start_daemon, protocol_name):
    daemon = start_daemon({"mlp": MLP}, server={protocol_name: f"127.0.0.1:{free_port()}"})
    target = daemon.config["server"][protocol_name]
    assert served(protocol_name, target)
    [before] = daemon.status()["gateways"]
    os.kill(before["pid"], signal.SIGKILL)
    wait_for(lambda: served(protocol_name, target), timeout=30, what="the new gateway serving")
    assert f"gateway {protocol_name} died (killed by signal 9" in daemon.log()
    [after] = daemon.status()["gateways"]
    assert after["protocol"] == protocol_name and after["restarts"] == 1 and after["pid"] not in (None, before["pid"])


def test_a_crash_looping_gateway_is_given_up_and_zeromq_serves_on(start_daemon):
    daemon = start_daemon({"mlp": MLP}, server={"http": f"127.0.0.1:{free_port()}"}, workers={"max_restarts": 2})
    target = daemon.config["server"]["http"]

    def given_up() -> bool:
        return "gateway http given up" in daemon.log()

    def gateway_pid() -> int | None:
        return daemon.status()["gateways"][0]["pid"]

    deaths = 0
    while not given_up():
        pid = wait_for(lambda: given_up() or gateway_pid(), what="a gateway process")
        if given_up():
            break
        os.kill(pid, signal.SIGKILL)
        deaths += 1
        wait_for(lambda p=pid: given_up() or gateway_pid() not in (None, p), what="a replacement or the give-up")
    assert deaths == 3, "the third death within a minute is more than workers.max_restarts (2)"
    assert ("gateway http given up (3 deaths within 60 s): killed by signal 9 (SIGKILL) (perhaps out of memory?); "
            "it is not restarted again") in daemon.log()
    [gateway] = daemon.status()["gateways"]
    assert gateway["pid"] is None and gateway["restarts"] == 2 and gateway["given_up"]
    assert not served("http", target)
    assert daemon.call("health")["healthy"], "the models are served over ZeroMQ"
    with daemon.client() as client:
        assert client.infer("mlp", np.zeros((1, models.MLP_IN), np.float32)).shape == (1, models.MLP_OUT)


@pytest.mark.parametrize("protocol_name", ["http", "grpc"])
def test_a_port_in_use_is_one_sentence_naming_the_key(start_daemon, protocol_name):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = start_daemon({"mlp": MLP}, server={protocol_name: f"127.0.0.1:{port}"}, wait=False)
        assert daemon.wait(60) == 1
    assert (f"cannot listen at 127.0.0.1:{port} (Address already in use); change server.{protocol_name}"
            in daemon.log())


def test_beyond_loopback_without_tls_is_a_warning_for_each_front_end(start_daemon):
    daemon = start_daemon({"mlp": MLP}, server={"http": f"0.0.0.0:{free_port()}", "grpc": f"0.0.0.0:{free_port()}"})
    for name in ("http", "grpc"):
        assert f"the {name} front end at {daemon.config['server'][name]} is reachable from the network without TLS" \
            in daemon.log()


def test_several_gateway_processes_share_each_port_and_the_kernel_spreads_connections_over_them(start_daemon):
    daemon = start_daemon({"mlp": MLP}, server={"http": f"127.0.0.1:{free_port()}",
                                                "grpc": f"127.0.0.1:{free_port()}",
                                                "http_processes": 2, "grpc_processes": 2})
    gateways = {g["name"]: g for g in daemon.status()["gateways"]}
    assert sorted(gateways) == ["grpc 1", "grpc 2", "http 1", "http 2"]
    assert len({g["pid"] for g in gateways.values()}) == 4
    http_host, http_port = address(daemon.config["server"]["http"])
    connections = [http.client.HTTPConnection(http_host, http_port, timeout=20) for _ in range(16)]
    for connection in connections:  # each a connection of its own, kept open
        connection.request("POST", "/v2/models/mlp/infer", body=ONE)
        answer = connection.getresponse()
        assert answer.status == 200 and answer.read()
    channels = [grpcclient.InferenceServerClient(daemon.config["server"]["grpc"],
                                                 channel_args=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(16)]
    for channel in channels:
        given = grpcclient.InferInput("INPUT__0", [1, models.MLP_IN], "FP32")
        given.set_data_from_numpy(np.zeros((1, models.MLP_IN), dtype=np.float32))
        channel.infer("mlp", [given])

    def held(name: str) -> int:
        """Established connections the gateway process `name` holds on its port."""
        port = address(daemon.config["server"][name.split()[0]])[1]
        return sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
                   for c in psutil.Process(gateways[name]["pid"]).net_connections("tcp"))

    # 32 connections, each process of a protocol holds some (all on one: odds of 1 in 2**15 per protocol).
    assert all(held(name) > 0 for name in gateways), {name: held(name) for name in gateways}
    assert sum(held(name) for name in ("http 1", "http 2")) == 16
    for connection in connections:
        connection.close()
    for channel in channels:
        channel.close()
    # One that dies is restarted; its sibling serves on, untouched.
    os.kill(gateways["http 1"]["pid"], signal.SIGKILL)
    wait_for(lambda: {g["name"]: g for g in daemon.status()["gateways"]}["http 1"]["pid"]
             not in (None, gateways["http 1"]["pid"]), timeout=30, what="http 1 restarted")
    assert {g["name"]: g for g in daemon.status()["gateways"]}["http 2"]["pid"] == gateways["http 2"]["pid"]
    wait_for(lambda: served("http", daemon.config["server"]["http"]), timeout=30, what="HTTP served")
    assert "gateway http 1 died (killed by signal 9" in daemon.log()


def read_responses(connection: socket.socket) -> list[tuple[int, dict[str, str], bytes]]:
    """Every response the server sends on `connection` until it closes it: status, headers, body."""
    connection.settimeout(30)
    raw = b""
    while chunk := connection.recv(65536):
        raw += chunk
    responses = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        length = int(headers["content-length"])
        responses.append((int(status_line.split()[1]), headers, raw[:length]))
        raw = raw[length:]
    return responses


def infer_request(x: np.ndarray) -> bytes:
    """An HTTP/1.1 request for mlp with `x` as JSON, bytes as they go on the wire."""
    body = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.ravel().tolist()}]}).encode()
    return (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


@pytest.mark.parametrize("malformed, sentence", [
    (b"NOT HTTP AT ALL\r\n\r\n", b"Invalid HTTP request received."),
    (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
     b"Invalid HTTP request received."),
    (b"GET /v2/health/live HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n",
     b"The request was refused: more than 100 headers."),
], ids=["malformed head", "malformed body", "too many headers"])
def test_pipelined_requests_are_answered_in_order_before_the_400_of_a_malformed_one(oip_daemon, repo, malformed,
                                                                                    sentence):
    xs = np.random.default_rng(11).standard_normal((2, 1, models.MLP_IN), dtype=np.float32)
    with socket.create_connection(address(oip_daemon.config["server"]["http"])) as connection:
        connection.sendall(infer_request(xs[0]) + infer_request(xs[1]) + malformed)  # in one write
        answers = read_responses(connection)
    assert [status for status, _, _ in answers] == [200, 200, 400], answers
    expected = reference(repo, "mlp", "v2")
    for x, (_, _, body) in zip(xs, answers):
        np.testing.assert_allclose(np.array(json.loads(body)["outputs"][0]["data"]).reshape(1, -1), expected(x),
                                   rtol=1e-5, atol=1e-6)
    assert answers[2][1]["connection"] == "close" and answers[2][2] == sentence
    assert http_infer(f"http://{oip_daemon.config['server']['http']}") == 200


def test_a_body_framed_by_both_content_length_and_chunks_is_read_by_its_chunks_then_the_connection_closes(
        oip_daemon, repo):
    # Triton's test_content_encoding_chunked_manually: `requests` adds Content-Length to the body its caller
    # chunk-framed and marked Transfer-Encoding: chunked.
    x = np.random.default_rng(12).standard_normal((2, models.MLP_IN), dtype=np.float32)
    data = x.tobytes()
    framed = b"%X\r\n%s\r\n0\r\n\r\n" % (len(data), data)
    answer = requests.post(f"http://{oip_daemon.config['server']['http']}/v2/models/mlp/infer", data=framed,
                           timeout=20, headers={"Inference-Header-Content-Length": "0", "Transfer-Encoding": "chunked"})
    assert answer.request.headers["content-length"] == str(len(framed)), "sent as Triton's test sends it"
    assert answer.status_code == 200, answer.text
    split = int(answer.headers["inference-header-content-length"])
    np.testing.assert_allclose(np.frombuffer(answer.content[split:], dtype=np.float32).reshape(2, -1),
                               reference(repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)
    assert answer.headers["connection"] == "close"
    # Content-Length with any Transfer-Encoding not ending in chunked is still refused, as llhttp refuses it.
    with socket.create_connection(address(oip_daemon.config["server"]["http"])) as connection:
        connection.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n"
                           b"Transfer-Encoding: gzip\r\n\r\n%s" % (len(framed), framed))
        [(status, _, body)] = read_responses(connection)
    assert status == 400 and b"Content-Length with a Transfer-Encoding that does not end in chunked" in body


def test_zeromq_io_threads_of_each_gateway_do_not_preempt_its_loop(oip_daemon):
    # SCHED_BATCH, as the supervisor's: a request sent upstream wakes the I/O thread, which then waits for the
    # gateway's loop to block instead of taking its core.
    gateways = oip_daemon.status()["gateways"]
    assert sorted(g["name"] for g in gateways) == ["grpc", "http"]
    for gateway in gateways:
        io_threads = [int(task.name) for task in Path(f"/proc/{gateway['pid']}/task").iterdir()
                      if (task / "comm").read_text().startswith("ZMQbg/IO")]
        assert io_threads
        assert all(os.sched_getscheduler(tid) == os.SCHED_BATCH for tid in io_threads), gateway["name"]


def test_an_http_gateway_out_of_descriptors_says_so_once_and_serves_when_connections_close(start_daemon):
    limit, flood = 256, 400  # more connections than the gateway's limit on open files
    daemon = start_daemon({"mlp": MLP}, open_files=(limit, limit), server={"http": f"127.0.0.1:{free_port()}"})
    url = f"http://{daemon.config['server']['http']}"
    held = []
    try:
        for _ in range(flood):
            held.append(socket.create_connection(address(daemon.config["server"]["http"])))
        wait_for(lambda: "cannot be accepted and waits until a connection closes" in daemon.log(), timeout=30,
                 what="the gateway saying it cannot accept a connection")
    finally:
        for connection in held:
            connection.close()
    assert http_infer(url) == 200
    # asyncio says it for each connection it fails to accept (dozens at once, again each second): the gateway
    # says it once a minute.
    lines = [line for line in daemon.log().splitlines() if "cannot be accepted" in line]
    assert len(lines) == 1, lines
    assert f"all {limit} descriptors its limit allows" in lines[0] and "LimitNOFILE=" in lines[0], lines[0]
    assert "out of system resource" not in daemon.log()
