"""A gateway process: one of the Open Inference Protocol's front ends (HTTP or gRPC), in front of the
supervisor.

Spawned by the supervisor (supervisor/processes/gateway_processes.py), which restarts it when it
dies and stops it at the end of a drain. It serves its protocol on its own
asyncio loop and sends every inference request to the supervisor's ipc://
endpoint for that protocol, in inferd's own wire protocol; it reads the models'
state from the control socket. It exits on its own when the supervisor is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from inferd.config import loading
from inferd.config.schema import Config, client_shm_protocols
from inferd.ipc import addresses
from inferd.oip.accept_failures import AcceptFailures
from inferd.oip.budget import MIB, BodyBudget
from inferd.oip.catalog import Catalog
from inferd.oip.shm import SharedMemory
from inferd.oip.spec import GatewaySpec
from inferd.oip.upstream import Control, Upstream
from inferd.system import heap
from inferd.system.child import begin_child
from inferd.worker.exits import WorkerExit

log = logging.getLogger("inferd.oip.gateway")

# How long past a request's deadline and the hung-batch timeout the gateway waits for its answer.
ANSWER_SLACK_S = 30.0
GIVE_BACK_S = 1.0


class FrontEnd(Protocol):
    """A protocol's server: HttpServer or GrpcServer."""

    async def serve(self, listening: Callable[[], Awaitable[None]]) -> None: ...

    def stop(self) -> None: ...


async def _serve(spec: GatewaySpec, config: Config) -> None:
    context = zmq.asyncio.Context()
    data_context = zmq.Context()
    if hasattr(os, "SCHED_BATCH"):
        # As the supervisor's (supervisor/parts.py): ZeroMQ's I/O threads, woken by a request sent upstream,
        # wait for the loop to block instead of preempting it (at 64 requests in flight, the send held 20 % of
        # the HTTP gateway's profile before, 8 % after).
        for each in (context, data_context):
            each.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    control = Control(context, spec.control)
    server = config.server
    max_message_bytes = int(server.max_message_mb * MIB)
    upstream = Upstream(data_context, spec.upstream, config.queue.default_timeout_ms,
                        config.workers.batch_timeout_s + ANSWER_SLACK_S, max_message_bytes)
    upstream.start()
    catalog = Catalog(config.workers.streams, spec.devices, control)
    # Over HTTP, a sixteenth is kept for small bodies; gRPC cannot tell a small message before it has come.
    budget_bytes = int(server.gateway_buffer_mb * MIB)
    budget = BodyBudget(budget_bytes, budget_bytes // 16 if spec.protocol == "http" else 0)
    address = server.http if spec.protocol == "http" else server.grpc
    shared_memory = SharedMemory(upstream, int(addresses.split(address)[1]), sweep=spec.protocol == "grpc",
                                 enabled=spec.protocol in client_shm_protocols(server),
                                 server_wide=server.client_shm_scope == "server")
    # Each front end imports only its own server.
    if spec.protocol == "http":
        from inferd.oip.http.rest import RestApp
        from inferd.oip.http.server import HttpServer

        allowed = frozenset(h.lower() for h in server.http_allowed_hosts) if addresses.loopback(address) else None
        front: FrontEnd = HttpServer(RestApp(catalog, upstream, control, max_message_bytes, shared_memory, allowed),
                                     server, budget, shared_memory.closed)
        scheme = "https" if server.tls_cert else "http"
    else:
        from inferd.oip.rpc import GrpcServer, InferenceService, Receiving

        front = GrpcServer(InferenceService(catalog, upstream, control, shared_memory,
                                            Receiving(budget, max_message_bytes)), server, max_message_bytes)
        scheme = "grpcs" if server.tls_cert else "grpc"
    loop = asyncio.get_running_loop()
    AcceptFailures(f"{scheme}://{address}").install(loop)
    loop.add_signal_handler(signal.SIGTERM, front.stop)
    giving_back = loop.create_task(_give_back_freed_memory(upstream))

    async def listening() -> None:
        # The daemon is ready, and says so to systemd and `inferctl health`, only once its front ends take
        # connections: a client started right after `systemctl start` must not be refused.
        log.info("Open Inference Protocol at %s://%s", scheme, address)
        await control.call("gateway_listening", name=spec.name, pid=os.getpid())

    try:
        await front.serve(listening)
    finally:
        giving_back.cancel()
        upstream.close()
        control.close()
        context.term()
        data_context.term()


async def _give_back_freed_memory(upstream: Upstream) -> None:
    """Hand the system, each GIVE_BACK_S, what the requests freed: glibc keeps freed memory for the process, and
    the hop region its pages; after a flood of large requests a gateway would keep the flood's size
    (system/heap.py)."""
    while True:
        await asyncio.sleep(GIVE_BACK_S)
        heap.give_back()
        upstream.give_back()


def gateway_main(encoded_spec: bytes) -> None:
    """Entry point of a spawned gateway process."""
    spec = msgspec.msgpack.decode(encoded_spec, type=GatewaySpec)
    config = loading.decode(spec.config)
    # It stops after the drain, once the last reply it carries has gone.
    begin_child(f"inferd: gateway {spec.name}", f"gateway-{spec.name.replace(' ', '-')}", config.server.log_level,
                WorkerExit.PARENT_GONE)
    asyncio.run(_serve(spec, config))
    log.info("stopped")
    logging.shutdown()
    os._exit(0)
