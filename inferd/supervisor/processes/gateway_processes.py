"""The gateway processes (the Open Inference Protocol's front ends: server.http_processes and
server.grpc_processes of each protocol, sharing its port), supervised like workers.

Each is started once the supervisor's sockets are bound, restarted with backoff
when it dies, given up when it keeps dying (the rest of the daemon serves on), and
stopped at the end of a drain, after the last reply it carries has gone. Its
ports are checked at start, so that one in use is a sentence naming the key to
change rather than a gateway that keeps dying.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable

import msgspec

from inferd.config import loading
from inferd.config.schema import Config
from inferd.ipc import addresses
from inferd.oip.spec import PROTOCOLS, GatewaySpec
from inferd.supervisor.processes.children import CRASH_WINDOW_S, STOP_TIMEOUT_S, ChildProcess
from inferd.supervisor.shared.state import StartupError
from inferd.worker.exits import describe_exit

log = logging.getLogger("inferd.gateway")


def _run(encoded_spec: bytes) -> None:
    # Imported only in the gateway's process: the supervisor never loads the HTTP server.
    from inferd.oip.gateway import gateway_main

    gateway_main(encoded_spec)


def check_port(address: str, key: str) -> None:
    """Refuse to start with a port something else holds: one sentence naming the key."""
    host, port = addresses.split(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError as exc:
            raise StartupError(f"cannot listen at {address} ({exc.strerror}); change {key} or set it to \"\" "
                               "to turn it off") from None


class Gateway(ChildProcess):
    """One gateway process (one protocol's front end): its spec, its process, its restarts."""

    def __init__(self, protocol: str, config: Config, devices: list[str], control: str, upstream: str,
                 name: str) -> None:
        super().__init__()
        self.protocol = protocol
        self.name = name  # the protocol, numbered when it has several processes: "http 2"
        self.config = config
        self.upstream = upstream  # the supervisor's endpoint the gateway sends its requests to
        self._devices, self._control = devices, control
        self.stopping = False
        self.given_up = False
        self.listening = False  # its process said it takes connections

    @property
    def address(self) -> str:
        """HOST:PORT it serves at (server.http or server.grpc)."""
        return str(getattr(self.config.server, self.protocol))

    def check(self) -> None:
        """At start: the port is free, and a warning if it is reachable beyond loopback without TLS."""
        check_port(self.address, f"server.{self.protocol}")
        if not self.config.server.tls_cert and not addresses.loopback(self.address):
            log.warning("the %s front end at %s is reachable from the network without TLS; "
                        "set server.tls_cert and server.tls_key", self.protocol, self.address)

    def start(self) -> None:
        """Spawn the gateway process."""
        self.listening = False
        spec = GatewaySpec(protocol=self.protocol, name=self.name, config=loading.encode(self.config),
                           devices=self._devices, control=self._control, upstream=self.upstream)
        pid = self.spawn(_run, msgspec.msgpack.encode(spec), f"inferd-gateway-{self.name.replace(' ', '-')}")
        log.info("gateway %s started (%s), pid %d", self.name, self.address, pid)

    def reaped(self, now: float, max_restarts: int) -> None:
        """Its process exited: unless stopping, restart it (at once the first time, then with doubling
        backoff), or give it up when it died more than `max_restarts` times within the crash window."""
        reason = describe_exit(self.exited())
        if self.stopping:
            log.info("gateway %s exited (%s)", self.name, reason)
            return
        delay = self.crashed(now, max_restarts)
        if delay is None:
            self.given_up = True
            log.error("gateway %s given up (%d deaths within %g s): %s; it is not restarted again", self.name,
                      len(self.deaths), CRASH_WINDOW_S, reason)
            return
        log.error("gateway %s died (%s); restarting in %.1f s", self.name, reason, delay)

    def up(self) -> bool:
        """Whether it is as far as it will get: listening, or given up."""
        return self.listening or self.given_up

    def respawn_due(self, now: float) -> bool:
        """True when it is down, not given up, and its backoff has passed."""
        return not self.stopping and not self.given_up and self.process is None and now >= self.respawn_at

    def stop(self) -> None:
        """Ask it to finish what it carries and exit."""
        self.stopping = True
        self.signal(signal.SIGTERM)

    def wait(self) -> None:
        """At exit: wait for it, killing it if it outlasts STOP_TIMEOUT_S."""
        if self.process is None:
            return
        self.stop()
        self.wait_or_kill(STOP_TIMEOUT_S)


def configured_gateways(config: Config, devices: list[str], control: str,
                        upstream: Callable[[str], str]) -> list[Gateway]:
    """The gateways of each front end the config turns on (server.http_processes of HTTP's, ...);
    `upstream(protocol)` is the ipc:// endpoint the gateways of a protocol send to."""
    gateways = []
    for protocol in PROTOCOLS:
        if not getattr(config.server, protocol):
            continue
        count = getattr(config.server, f"{protocol}_processes")
        gateways += [Gateway(protocol, config, devices, control, upstream(protocol),
                             protocol if count == 1 else f"{protocol} {index}") for index in range(1, count + 1)]
    return gateways
