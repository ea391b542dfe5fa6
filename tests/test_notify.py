"""sd_notify: what systemd hears from the daemon, through a fake $NOTIFY_SOCKET."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ONE_AT_A_TIME, RELOAD_MLP, Daemon, base_config, gated_reload_repo, wait_for
from gates import Gate
from python_models import write
from test_cli import BIN, inferctl
from wire import RawPeer

from inferd.harness import to_toml


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


def test_a_sighup_while_starting_does_not_tell_systemd_the_daemon_is_ready(workdir, reload_repo):
    systemd = FakeSystemd(workdir / "notify.sock", abstract=False)
    daemon = Daemon(workdir, base_config(workdir, reload_repo, {"mlp": RELOAD_MLP}))
    daemon.env = {"NOTIFY_SOCKET": systemd.address}
    try:
        daemon.start(wait=False)
        wait_for(lambda: "starting: pid" in daemon.log(), what="the daemon's signal handlers in place")
        daemon.config["queue"] = {**daemon.config.get("queue", {}), "default_timeout_ms": 12345}
        daemon.config_path.write_text(to_toml(daemon.config))
        daemon.signal(signal.SIGHUP)
        systemd.wait_for("READY=1")
        assert daemon.call("health")["healthy"], f"READY=1 came before the daemon could serve: {systemd.messages}"
        # The SIGHUP is carried out once the daemon serves, with systemd told of it as of any other.
        after = systemd.wait_for("READY=1")
        assert any("RELOADING=1" in m for m in after[after.index("READY=1"):])
        wait_for(lambda: "SIGHUP: applied queue.default_timeout_ms" in daemon.log(), what="the change applied")
        assert "SIGHUP while starting" in daemon.log()
    finally:
        daemon.kill_all()
        systemd.close()


def test_a_sighup_while_draining_is_ignored_and_systemd_hears_no_ready(workdir, repo, gates):
    systemd = FakeSystemd(workdir / "notify.sock", abstract=False)
    daemon = Daemon(workdir, base_config(workdir, repo, {"variable": ONE_AT_A_TIME}, workers={"streams": 1}))
    daemon.env = {"NOTIFY_SOCKET": systemd.address}
    try:
        daemon.start()
        with RawPeer(daemon.endpoint) as peer:
            gate = gates()
            peer.send("running", "variable", [gate.input], timeout_ms=30_000)
            wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy")
            daemon.signal(signal.SIGTERM)
            systemd.wait_for("STOPPING=1")
            daemon.signal(signal.SIGHUP)
            wait_for(lambda: "SIGHUP while stopping: ignored" in daemon.log(), what="the SIGHUP ignored")
            gate.open()
            assert peer.recv()[0]["status"] == "ok", "what was running finishes"
        assert daemon.wait(30) == 0
        messages = systemd.drain()
        stopping = next(i for i, m in enumerate(messages) if "STOPPING=1" in m.split("\n"))
        assert not any("READY=1" in m.split("\n") or "RELOADING=1" in m.split("\n") for m in messages[stopping:])
    finally:
        daemon.kill_all()
        systemd.close()


def said_after_stopping(messages: list[str]) -> list[str]:
    """The fields systemd heard after STOPPING=1, other than STATUS= and WATCHDOG=1."""
    fields = [field for message in messages for field in message.split("\n")]
    return [f for f in fields[fields.index("STOPPING=1") + 1:] if f.split("=")[0] not in ("STATUS", "WATCHDOG")]


def test_a_reload_still_loading_when_the_daemon_stops_tells_systemd_nothing_after_stopping(workdir, reload_repo):
    repo, gate = gated_reload_repo(reload_repo, workdir, "v1")
    systemd = FakeSystemd(workdir / "notify.sock", abstract=False)
    daemon = Daemon(workdir, base_config(workdir, repo, {"mlp": RELOAD_MLP}))
    daemon.env = {"NOTIFY_SOCKET": systemd.address}
    try:
        daemon.start()
        reload = subprocess.Popen([str(BIN / "inferctl"), "--control", daemon.control, "reload", "--version",
                                   "gated"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert "loading mlp gated" in reload.stdout.readline()
        systemd.wait_for("RELOADING=1")
        daemon.signal(signal.SIGTERM)
        systemd.wait_for("STOPPING=1")
        gate.open()  # the load ends (or its worker is stopped under it): either way the reload ends now
        reload.communicate(timeout=60)
        assert daemon.wait(60) == 0
        assert said_after_stopping(systemd.drain()) == [], systemd.messages
    finally:
        gate.close()
        daemon.kill_all()
        systemd.close()


# Waits, as it loads, at the gate its parameters name (tests/gates.py): a step that keeps the daemon starting.
LOADS_AT_GATE = """
from pathlib import Path

class Model:
    def __init__(self, context):
        Path(context.parameters["gate"]).write_bytes(b"loaded")

    def __call__(self, inputs):
        return {"y": inputs["x"]}
"""


def test_a_reload_that_ends_while_the_daemon_starts_does_not_tell_systemd_it_is_ready(workdir, reload_repo):
    gate = Gate(workdir)
    write(workdir / "python", "held", "v1", LOADS_AT_GATE)
    held = {"repository": str(workdir / "python" / "held"), "parameters": {"gate": str(gate.path)},
            "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}],
            "outputs": [{"name": "y", "dtype": "float32", "shape": [2]}]}
    systemd = FakeSystemd(workdir / "notify.sock", abstract=False)
    daemon = Daemon(workdir, base_config(workdir, reload_repo, {"mlp": RELOAD_MLP, "held": held}))
    daemon.env = {"NOTIFY_SOCKET": systemd.address}
    try:
        daemon.start(wait=False)
        wait_for(lambda: "starting: pid" in daemon.log(), what="the daemon's control socket bound")
        wait_for(lambda: daemon.status()["workers"][0]["state"] == "ready", what="mlp's worker ready")
        assert daemon.status()["state"] == "starting", "the held step keeps the daemon starting"
        # A version its worker cannot load: the reload ends at once, while the daemon still starts.
        result = inferctl(daemon, "reload", "--model", "mlp", "--version", "corrupt")
        assert result.returncode == 1 and "v1 keeps serving" in result.stderr, result.stderr
        assert not any("READY=1" in m.split("\n") for m in systemd.drain()), systemd.messages
        gate.open()
        systemd.wait_for("READY=1")
        assert daemon.call("health")["healthy"], f"READY=1 came before the daemon could serve: {systemd.messages}"
    finally:
        gate.close()
        daemon.kill_all()
        systemd.close()
