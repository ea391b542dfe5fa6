"""Client connections and the open-files limit: the daemon raises its soft limit to the hard one, counts its
ZeroMQ connections, and turns away the connections past what it leaves its clients, keeping descriptors for
its own work (inferctl, workers, gateways), and says so."""

from __future__ import annotations

import os
import re
import resource
import signal
import socket as stdlib_socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import models
import msgspec
import numpy as np
import pytest
import zmq
from conftest import MLP, reference, wait_for
from test_faults import keygen
from test_observability import metrics_config, scrape
from wire import RawPeer

from inferd import Client, protocol
from inferd.harness import DaemonProcess, free_port
from inferd.system.shm_names import SHM_DIR

CLIENTS = 400
LOW = 256  # an open-files limit below what CLIENTS connections take
PINNED_MLP = {**MLP, "version": "v1"}  # TorchScript, which `reference` runs in this process


class Clients:
    """CLIENTS DEALERs on one context, each connected to `endpoint` with one request sent."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.sockets = []
        self.inputs = []
        rng = np.random.default_rng(7)
        for index in range(CLIENTS):
            socket = self.context.socket(zmq.DEALER)
            socket.linger = 0
            socket.connect(endpoint)
            x = rng.standard_normal((1, models.MLP_IN), dtype=np.float32)
            header = {"id": index, "model": "mlp", "inputs": [{"dtype": "float32", "shape": [1, models.MLP_IN]}],
                      "timeout_ms": 120_000}
            socket.send_multipart([msgspec.json.encode(header), x.tobytes()])
            self.sockets.append(socket)
            self.inputs.append(x)
        self.replies: dict[int, tuple[dict, bytes]] = {}
        self.closed: set[int] = set()

    def take_replies(self) -> int:
        """Read the replies that have come; return how many clients have theirs."""
        for index, socket in enumerate(self.sockets):
            if index not in self.replies and socket.poll(0):
                header, *outputs = socket.recv_multipart()
                self.replies[index] = (msgspec.json.decode(header), outputs[0] if outputs else b"")
        return len(self.replies)

    def close_answered(self) -> None:
        """Close the clients that have their replies, freeing their connections."""
        for index in self.replies.keys() - self.closed:
            self.sockets[index].close()
            self.closed.add(index)

    def close(self) -> None:
        """Close every client."""
        for socket in self.sockets:
            socket.close()
        self.context.term()


@pytest.fixture
def descriptors_for_clients() -> Iterator[int]:
    """This process may open what CLIENTS sockets and their connections take (its soft limit raised to the hard
    one, and put back after); the hard limit, which the daemon's may be too. Skipped where it is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 3 * CLIENTS:
        pytest.skip(f"the hard limit on open files here ({hard}) is too low for {CLIENTS} clients")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_descriptors(daemon: DaemonProcess) -> int:
    return len(os.listdir(f"/proc/{daemon.process.pid}/fd"))


def settled(daemon: DaemonProcess) -> None:
    """Wait until the daemon has its reserve of descriptors back: a burst of connections larger than the reserve
    is accepted by ZeroMQ at once, before the loop turns them away (docs/operations/faults.md)."""
    wait_for(lambda: open_descriptors(daemon) <= LOW - 32, what="the burst of connections turned away")


def test_a_soft_limit_below_the_clients_is_raised_to_the_hard_one_and_every_client_is_answered(
        start_daemon, repo, descriptors_for_clients):
    hard = descriptors_for_clients
    daemon = start_daemon({"mlp": PINNED_MLP}, open_files=(LOW, hard))
    run = reference(repo, "mlp", "v1")
    clients = Clients(daemon.endpoint)
    try:
        wait_for(lambda: clients.take_replies() == CLIENTS, timeout=120,
                 what=f"all {CLIENTS} clients answered")
        for index, (header, output) in clients.replies.items():
            assert header["status"] == "ok", header
            np.testing.assert_allclose(np.frombuffer(output, dtype=np.float32).reshape(1, -1),
                                       run(clients.inputs[index]), rtol=1e-5, atol=1e-6)
        wait_for(lambda: daemon.call("stats")["connections"]["zmq"]["open"] == CLIENTS,
                 what=f"the {CLIENTS} connections counted")
    finally:
        clients.close()
    stats = wait_for(lambda: (s := daemon.call("stats"))["connections"]["zmq"]["open"] == 0 and s,
                     what="the closed connections counted out")
    connections = stats["connections"]
    assert connections["zmq"] == {"open": 0, "refused": {"descriptors": 0}}
    assert connections["open_files_limit"] == hard and connections["descriptors_held_by_clients"] == 0
    assert CLIENTS < connections["descriptors_for_clients"] < hard
    assert f"open files: at most {hard} (raised from {LOW} to the hard limit)" in daemon.log()


def test_clients_past_what_the_limit_leaves_them_are_turned_away_and_taken_as_connections_close(
        start_daemon, repo, descriptors_for_clients):
    daemon = start_daemon({"mlp": PINNED_MLP}, open_files=(LOW, LOW), server=metrics_config()["server"])
    run = reference(repo, "mlp", "v1")
    clients = Clients(daemon.endpoint)
    try:
        wait_for(lambda: "was turned away" in daemon.log(), timeout=60, what="clients turned away")
        settled(daemon)
        # Each call is a new connection to the ipc:// control socket, which libzmq cannot refuse: out of
        # descriptors it aborts the daemon instead.
        for _ in range(20):
            assert daemon.call("health")["healthy"]
        connections = daemon.call("stats")["connections"]
        assert connections["zmq"]["refused"]["descriptors"] > 0
        assert connections["open_files_limit"] == LOW
        assert connections["zmq"]["open"] <= connections["descriptors_held_by_clients"] \
            <= connections["descriptors_for_clients"] < LOW - 64, connections

        def everyone_answered() -> bool:
            answered = clients.take_replies()
            clients.close_answered()  # a turned-away client gets in as an answered one leaves
            return answered == CLIENTS

        wait_for(everyone_answered, timeout=120, what=f"all {CLIENTS} clients answered, a limit's worth at a time")
        for index, (header, output) in clients.replies.items():
            assert header["status"] == "ok", header
            np.testing.assert_allclose(np.frombuffer(output, dtype=np.float32).reshape(1, -1),
                                       run(clients.inputs[index]), rtol=1e-5, atol=1e-6)
    finally:
        clients.close()
    assert daemon.process.poll() is None
    line = next(line for line in daemon.log().splitlines() if "was turned away" in line)
    assert f"open-files limit of {LOW}" in line and "LimitNOFILE=" in line, line
    assert "cannot be accepted" not in daemon.log()  # it never ran out
    wait_for(lambda: open_descriptors(daemon) < LOW // 2, timeout=60, what="the daemon's descriptors freed")
    metrics = scrape(daemon)
    assert metrics[("inferd_connections_refused_total", (("protocol", "zmq"), ("reason", "descriptors")))] >= 1
    wait_for(lambda: scrape(daemon)[("inferd_connections", (("protocol", "zmq"),))] == 0,
             what="the closed connections counted out")


def test_regions_past_what_the_limit_leaves_clients_are_refused_overloaded_and_the_daemon_keeps_serving(
        start_daemon, descriptors_for_clients):
    daemon = start_daemon({"mlp": PINNED_MLP}, open_files=(LOW, LOW),
                          server={"allow_client_shm": True, "client_shm_prefix": "inferd-client-test-"})
    shm = SHM_DIR / f"inferd-client-test-{os.getpid()}"
    shm.write_bytes(bytes(64))
    peers: list[RawPeer] = []

    def register(peer: RawPeer, name: str) -> dict:
        op = protocol.RegisterRegion(id=name, name=name, key=shm.name, byte_size=64)
        peer.send_frames([protocol.encode_op(op)])
        return peer.recv()[0]

    try:
        refused = None
        while refused is None and len(peers) < LOW // 64 + 1:  # a connection may have 64 regions
            peers.append(RawPeer(daemon.endpoint))
            for index in range(64):
                reply = register(peers[-1], f"r{index}")
                if reply["status"] != "ok":
                    refused = reply
                    break
        assert refused is not None, "every region registered under a limit of {LOW} descriptors"
        assert refused["status"] == "overloaded", refused
        assert "no descriptor left for another region" in refused["error"] and "LimitNOFILE=" in refused["error"]
        connections = daemon.call("stats")["connections"]
        assert connections["descriptors_held_by_clients"] == connections["descriptors_for_clients"], connections
        assert daemon.call("health")["healthy"]
        last = peers[-1]  # the connection refused, with fewer than 64 regions
        other = RawPeer(daemon.endpoint)  # turned away while the regions hold every descriptor left to clients
        peers.append(other)
        other.send("after", "mlp", [np.zeros((1, models.MLP_IN), np.float32)])
        assert not other.socket.poll(300)
        for name in ("r0", "r1"):
            peers[0].send_frames([protocol.encode_op(protocol.UnregisterRegion(id=name, name=name))])
            assert peers[0].recv()[0]["status"] == "ok"
        assert other.recv()[0]["status"] == "ok"  # taken once a descriptor was freed, and served
        assert register(last, "again")["status"] == "ok"  # the other descriptor freed
        assert register(last, "more")["status"] == "overloaded"
        assert daemon.call("stats")["connections"]["zmq"]["refused"]["descriptors"] >= 1
    finally:
        for peer in peers:
            peer.close()
        shm.unlink()
    wait_for(lambda: daemon.call("stats")["connections"]["descriptors_held_by_clients"] == 0,
             what="the regions closed with their connections")


def test_a_connection_that_never_finishes_its_handshake_is_closed_and_frees_its_descriptor(start_daemon):
    daemon = start_daemon({"mlp": PINNED_MLP})
    host, _, port = daemon.endpoint.removeprefix("tcp://").rpartition(":")
    with stdlib_socket.create_connection((host, int(port))) as silent:  # says nothing, not even ZeroMQ's greeting
        wait_for(lambda: daemon.call("stats")["connections"]["zmq"]["open"] == 1, what="the connection counted")
        silent.settimeout(20)  # 10 s allowed (connections.HANDSHAKE_MS), where libzmq's default is 30
        while silent.recv(4096):  # the daemon's greeting, then its end
            pass
    wait_for(lambda: daemon.call("stats")["connections"]["zmq"]["open"] == 0, what="the connection counted out")
    assert daemon.call("health")["healthy"]


def test_connections_to_a_tcp_control_socket_are_turned_away_too_and_a_worker_restarted_reconnects(
        start_daemon, workdir, descriptors_for_clients):
    keys = workdir / "keys"
    public, secret = keygen(keys, "server")
    _, client_secret = keygen(keys, "client")
    control = f"tcp://127.0.0.1:{free_port()}"
    daemon = start_daemon({"mlp": PINNED_MLP}, wait=False, open_files=(LOW, LOW),
                          server={"control": control, "curve_secret_key": str(secret),
                                  "curve_authorized_keys": str(keys)})
    wait_for(lambda: "ready:" in daemon.log(), timeout=60, what="the daemon serving")
    host, _, port = control.removeprefix("tcp://").rpartition(":")
    held = [stdlib_socket.create_connection((host, int(port))) for _ in range(CLIENTS)]
    try:
        wait_for(lambda: f"a client connecting to {control} was turned away" in daemon.log(), timeout=60,
                 what="connections to the control socket turned away")
        # Turned away too at first, inferctl waits for its turn: the silent connections' handshakes end in 10 s.
        inferctl = subprocess.Popen([str(Path(sys.executable).parent / "inferctl"), "--control", control,
                                     "--timeout", "60", "--server-key", str(public), "--client-key",
                                     str(client_secret), "status"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        settled(daemon)
        pid = int(re.search(r"worker0 ready on \S+ \(pid (\d+)\)", daemon.log()).group(1))  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)  # its successor connects to the supervisor's ipc:// backend socket
        wait_for(lambda: daemon.log().count("worker0 ready") == 2, timeout=60, what="worker0 back")
        endpoint = re.search(r"listening on (tcp://\S+)", daemon.log()).group(1)  # type: ignore[union-attr]
        with Client(endpoint, timeout=10, server_key=public, client_key=client_secret) as client:
            assert client.infer("mlp", np.zeros((1, models.MLP_IN), np.float32)).shape == (1, models.MLP_OUT)
        out, err = inferctl.communicate(timeout=90)
        assert inferctl.returncode == 0 and "serving" in out, err
    finally:
        for connection in held:
            connection.close()
    assert daemon.process.poll() is None
