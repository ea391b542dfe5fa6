"""The gateway process: the Open Inference Protocol's HTTP front end, in front of the supervisor.

Spawned by the supervisor (supervisor/gateway.py), which restarts it when it
dies and stops it at the end of a drain. It serves HTTP with uvicorn (httptools)
on its own asyncio loop and sends every inference request to the supervisor's
ipc:// endpoint for its protocol in inferd's own wire protocol; it reads the
models' state from the control socket. It exits on its own when the supervisor
is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Iterator

import msgspec
import setproctitle
import uvicorn
import zmq.asyncio

from inferd import config as config_module
from inferd.logs import setup_logging
from inferd.oip.catalog import Catalog
from inferd.oip.rest import RestApp
from inferd.oip.spec import GatewaySpec
from inferd.oip.upstream import Control, Upstream

log = logging.getLogger("inferd.oip.gateway")

KEEP_ALIVE_S = 5.0  # an idle HTTP connection is closed after this long


class _Server(uvicorn.Server):
    """uvicorn's server, with the gateway's own signal handling (uvicorn's would take SIGINT too)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        log.error("the supervisor is gone; exiting")
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


async def _serve(spec: GatewaySpec, config: config_module.Config) -> None:
    context = zmq.asyncio.Context()
    control = Control(context, spec.control)
    upstream = Upstream(context, spec.http_upstream)
    upstream.start()
    server = config.server
    host, _, port = server.http.rpartition(":")
    app = RestApp(Catalog(config, spec.devices, control), upstream, control,
                  int(server.max_message_mb * (1 << 20)))
    http = _Server(uvicorn.Config(
        app, host=host.strip("[]"), port=int(port), lifespan="off", log_level="warning", access_log=False,
        http="httptools", loop="none", timeout_keep_alive=int(KEEP_ALIVE_S),
        ssl_certfile=server.tls_cert or None, ssl_keyfile=server.tls_key or None,
    ))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: setattr(http, "should_exit", True))
    log.info("Open Inference Protocol over HTTP at %s://%s", "https" if server.tls_cert else "http", server.http)
    try:
        await http.serve()
    finally:
        upstream.close()
        control.close()
        context.term()


def gateway_main(encoded_spec: bytes) -> None:
    """Entry point of the spawned gateway process."""
    spec = msgspec.msgpack.decode(encoded_spec, type=GatewaySpec)
    config = config_module.decode(spec.config)
    setproctitle.setproctitle(f"inferd: gateway http {config.server.http}")
    setup_logging("gateway", config.server.log_level)
    # The supervisor decides when the gateway stops (after the drain); a Ctrl-C reaches the whole group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    asyncio.run(_serve(spec, config))
    log.info("stopped")
    logging.shutdown()
    os._exit(0)
