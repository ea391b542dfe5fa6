"""Client connections and the open-files limit: the daemon raises its soft limit to the hard one, counts its
ZeroMQ connections, and says when a client cannot be accepted for want of descriptors."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

import models
import msgspec
import numpy as np
import pytest
import zmq
from conftest import MLP, reference, wait_for
from test_observability import metrics_config, scrape

from inferd.harness import DaemonProcess

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

    def take_replies(self) -> int:
        """Read the replies that have come; return how many clients have theirs."""
        for index, socket in enumerate(self.sockets):
            if index not in self.replies and socket.poll(0):
                header, *outputs = socket.recv_multipart()
                self.replies[index] = (msgspec.json.decode(header), outputs[0] if outputs else b"")
        return len(self.replies)

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
    assert stats["connections"] == {"zmq": {"open": 0, "refused": {"descriptors": 0}}, "open_files_limit": hard}
    assert f"open files: at most {hard} (raised from {LOW} to the hard limit)" in daemon.log()


def test_clients_past_a_hard_limit_are_told_of_in_the_log_and_the_metrics(start_daemon, descriptors_for_clients):
    daemon = start_daemon({"mlp": PINNED_MLP}, open_files=(LOW, LOW), server=metrics_config()["server"])
    clients = Clients(daemon.endpoint)
    try:
        # While the daemon has no descriptor left, nothing is asked of it over ipc:// (libzmq 4.3.5 aborts
        # the process when it cannot accept such a connection): the log is read instead.
        wait_for(lambda: "cannot be accepted" in daemon.log(), timeout=60,
                 what="the daemon saying a client cannot be accepted")
        answered = wait_for(clients.take_replies, what="the clients it accepted answered")
    finally:
        clients.close()
    assert answered < LOW, f"{answered} clients answered with {LOW} descriptors"
    line = next(line for line in daemon.log().splitlines() if "cannot be accepted" in line)
    assert f"all {LOW} descriptors its limit allows" in line and "LimitNOFILE=" in line, line
    wait_for(lambda: open_descriptors(daemon) < LOW // 2, timeout=60, what="the daemon's descriptors freed")
    metrics = scrape(daemon)
    assert metrics[("inferd_connections_refused_total", (("protocol", "zmq"), ("reason", "descriptors")))] >= 1
    assert daemon.call("stats")["connections"]["zmq"]["refused"]["descriptors"] >= 1
    wait_for(lambda: scrape(daemon)[("inferd_connections", (("protocol", "zmq"),))] == 0,
             what="the closed connections counted out")
