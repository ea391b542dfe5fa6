"""The gRPC gateway on grpcio's sync server (a thread pool) instead of its asyncio one, for bench.front_ends to
measure one against the other:

    python -m bench.front_ends --protocols grpc --variant aio=$PWD \
        --variant sync=$PWD:$PWD/bench/variants/grpc_sync,INFERD_GRPC_SYNC=64

On a daemon's PYTHONPATH this file is imported by every process at start (Python's sitecustomize) and puts
SyncGrpcServer in the place of the gateway's GrpcServer, with INFERD_GRPC_SYNC threads. Each call's handler runs
on a thread of the pool; the service's methods, which await the gateway's upstream, run on the gateway's loop
(asyncio.run_coroutine_threadsafe), and the thread waits for their answer. It holds the gateway's buffer as the
asyncio server does, for a measurement of the server's cost, not a front end to serve with.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from inferd.config.schema import ServerConfig
from inferd.errors import InvalidRequest
from inferd.oip import rpc
from inferd.oip.budget import Hold

METHODS = {"ServerLive": ("server_live", rpc.pb.ServerLiveRequest),
           "ServerReady": ("server_ready", rpc.pb.ServerReadyRequest),
           "ServerMetadata": ("server_metadata", rpc.pb.ServerMetadataRequest),
           "ModelReady": ("model_ready", rpc.pb.ModelReadyRequest),
           "ModelMetadata": ("model_metadata", rpc.pb.ModelMetadataRequest),
           "ModelConfig": ("model_config", rpc.pb.ModelConfigRequest),
           "ModelInfer": ("model_infer", rpc.pb.ModelInferRequest)}


class SyncGrpcServer:
    """GrpcServer's interface (serve, stop) on grpcio's sync server."""

    def __init__(self, service: rpc.InferenceService, server: ServerConfig, max_message_bytes: int) -> None:
        self.service = service
        self.config = server
        self.max_message_bytes = max_message_bytes
        self._stopped: asyncio.Future[None] | None = None
        self._server: grpc.Server | None = None

    def _handler(self, loop: asyncio.AbstractEventLoop, method: Callable[..., Awaitable[Any]], kind: Any) -> Any:
        budget = self.service.receiving.budget

        def handle(requests: Any, context: grpc.ServicerContext) -> Any:
            hold = Hold(budget)
            if not hold.take(self.max_message_bytes):
                context.abort(grpc.StatusCode.UNAVAILABLE, budget.refusal(self.max_message_bytes))
            try:
                data = next(requests)
                hold.keep(len(data))
                request = kind.FromString(data)
                del data
                future = asyncio.run_coroutine_threadsafe(method(request, context), loop)
                context.add_callback(future.cancel)
                try:
                    return future.result()
                except rpc.RpcError as exc:
                    context.abort(exc.code, exc.message)
                except InvalidRequest as exc:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
                except concurrent.futures.CancelledError:
                    context.abort(grpc.StatusCode.CANCELLED, "cancelled")
            finally:
                hold.release()

        return grpc.stream_unary_rpc_method_handler(handle, response_serializer=lambda m: m.SerializeToString())

    async def serve(self, listening: Callable[[], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(int(os.environ["INFERD_GRPC_SYNC"])),
            options=[("grpc.max_receive_message_length", self.max_message_bytes),
                     ("grpc.max_send_message_length", -1),
                     ("grpc.so_reuseport", int(self.config.grpc_processes > 1))])
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(rpc.SERVICE, {
            name: self._handler(loop, getattr(self.service, method), kind)
            for name, (method, kind) in METHODS.items()}),))
        self._server.add_insecure_port(self.config.grpc)
        self._server.start()
        await listening()
        await self._stopped

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(1)
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)


if os.environ.get("INFERD_GRPC_SYNC"):
    rpc.GrpcServer = SyncGrpcServer  # type: ignore[misc,assignment]
