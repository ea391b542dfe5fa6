"""sd_notify: what systemd hears from the daemon, through a fake $NOTIFY_SOCKET."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest
from conftest import RELOAD_MLP, Daemon, base_config


class FakeSystemd:
    """A datagram socket standing in for systemd's notify socket."""

    def __init__(self, path: Path, abstract: bool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"inferd-test-{path.name}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self.sock.bind(str(path))
            self.address = str(path)
        self.messages: list[str] = []

    def wait_for(self, field: str, timeout: float = 60) -> list[str]:
        """Messages received until one carries `field`; fail when none does in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                message = self.sock.recv(4096).decode()
            except TimeoutError:
                break
            self.messages.append(message)
            if field in message.split("\n"):
                return self.messages
        raise AssertionError(f"no {field} within {timeout} s; got {self.messages}")

    def drain(self) -> list[str]:
        """Receive whatever has arrived, without waiting; return the messages received so far."""
        self.sock.setblocking(False)
        try:
            while True:
                self.messages.append(self.sock.recv(4096).decode())
        except BlockingIOError:
            pass
        finally:
            self.sock.setblocking(True)
        return self.messages

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_ready_reloading_and_stopping_reach_systemd(workdir, reload_repo, abstract):
    systemd = FakeSystemd(workdir / "notify.sock", abstract)
    daemon = Daemon(workdir, base_config(workdir, reload_repo, {"mlp": RELOAD_MLP}))
    daemon.env = {"NOTIFY_SOCKET": systemd.address}
    try:
        daemon.start(wait=False)
        systemd.wait_for("READY=1")
        assert daemon.call("health")["healthy"], "READY=1 came before the daemon could serve"
        assert daemon.call("reload", timeout=60, version="v2")["version"] == "v2"
        after_reload = systemd.wait_for("READY=1")
        assert any("RELOADING=1" in m for m in after_reload)
        daemon.signal(signal.SIGTERM)
        systemd.wait_for("STOPPING=1")
        assert daemon.wait() == 0
    finally:
        daemon.kill_all()
        systemd.close()
