"""The Open Inference Protocol over gRPC: inference.GRPCInferenceService (KServe v2 with Triton's
model configuration and statistics extensions), served by grpc.aio.

Tensors travel in `raw_input_contents` / `raw_output_contents` (what Triton's clients send), as
typed `contents` lists, or in a shared-memory region the client registered over the same connection
(the tensor's shared_memory_* parameters; oip/shm.py). Every error is a status with one sentence in
its details. Requests are parsed here, not by grpc, so that one which is not a valid message is
INVALID_ARGUMENT with a sentence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import grpc
import grpc.aio
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from inferd import __version__, protocol
from inferd.config.schema import ServerConfig
from inferd.errors import InvalidRequest, quoted
from inferd.oip import inference_pb2 as pb
from inferd.oip import tensors
from inferd.oip.budget import BodyBudget, Hold
from inferd.oip.catalog import GATEWAY_BUG, Catalog, GivenInput, ModelView, NotFound, Refused, server_extensions
from inferd.oip.shm import (
    CUDA_REFUSED,
    SharedMemory,
    check_placed,
    cuda_region_missing,
    region_parameters,
    region_response,
)
from inferd.oip.upstream import Control, Upstream

log = logging.getLogger("inferd.oip.grpc")

SERVICE = "inference.GRPCInferenceService"
Call: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"  # what each method is given besides its request
# `overloaded` is UNAVAILABLE, as Triton answers and clients retry; RESOURCE_EXHAUSTED is grpc's own, for
# a message over server.max_message_mb only.
GRPC_STATUS = {
    protocol.INVALID: grpc.StatusCode.INVALID_ARGUMENT, protocol.OVERLOADED: grpc.StatusCode.UNAVAILABLE,
    protocol.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED, protocol.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    protocol.INTERNAL: grpc.StatusCode.INTERNAL, protocol.CANCELLED: grpc.StatusCode.CANCELLED,
}
# The typed list each datatype's values may come in; FP16 and BF16 have none (raw bytes only).
CONTENTS = {"BOOL": "bool_contents", "UINT8": "uint_contents", "INT8": "int_contents", "INT16": "int_contents",
            "INT32": "int_contents", "INT64": "int64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
            "BYTES": "bytes_contents"}
STOP_GRACE_S = 10.0
ROOM_WAIT_S = 30.0  # the longest a call waits for room in the gateway's buffer to receive its message
READ_HOLD_S = 10.0  # how long a message may take to come while other calls wait for room
HANDSHAKE_TIMEOUT_MS = 10_000  # a connection that never completes its HTTP/2 handshake is closed
IDLE_TIMEOUT_MS = 60_000  # one that carries no call for this long is closed
MAX_METADATA_BYTES = 16 << 10


class RpcError(Exception):
    """An error reply: a status code and one sentence."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _parameter(value: pb.InferParameter) -> Any:
    choice = value.WhichOneof("parameter_choice")
    return None if choice is None else getattr(value, choice)


def _parameters(parameters: Any) -> dict[str, Any]:
    return {key: _parameter(value) for key, value in parameters.items()}


def _given(request: pb.ModelInferRequest) -> list[GivenInput]:
    regions = [region_parameters(_parameters(t.parameters), f"input {quoted(t.name)}") for t in request.inputs]
    raw = list(request.raw_input_contents)
    inline = sum(region is None for region in regions)
    if raw and len(raw) != inline:
        raise InvalidRequest(f"the request has {inline} inputs outside shared memory but {len(raw)} "
                             "raw_input_contents")
    given = []
    for tensor, region in zip(request.inputs, regions):
        what = f"input {quoted(tensor.name)}"
        if region is not None:
            given.append(GivenInput(tensor.name, tensor.datatype, list(tensor.shape), None, None, region))
            continue
        if raw:
            if tensor.HasField("contents"):
                raise InvalidRequest(f"{what} has contents, but the request has raw_input_contents")
            given.append(GivenInput(tensor.name, tensor.datatype, list(tensor.shape), raw.pop(0)))
            continue
        field = CONTENTS.get(tensor.datatype)
        if not tensor.HasField("contents"):
            raise InvalidRequest(f"{what} has neither contents nor raw_input_contents")
        if field is None:
            raise InvalidRequest(f"{what} is {quoted(tensor.datatype)}, which has no typed contents; "
                                 "send it in raw_input_contents")
        others = [f.name for f, values in tensor.contents.ListFields() if f.name != field and len(values)]
        if others:  # the one its datatype names is read: what the client put in the others would be dropped
            raise InvalidRequest(f"{what} is {tensor.datatype}, whose values go in contents.{field}, but it has "
                                 f"contents.{others[0]} too; send its values in one")
        # The typed list itself, not a list of it: converted element by element, as a Python list it
        # would take some 32 bytes an element.
        given.append(GivenInput(tensor.name, tensor.datatype, list(tensor.shape), None,
                                getattr(tensor.contents, field)))
    return given


class Receiving:
    """How a call's message is received within the gateway's buffer (server.gateway_buffer_mb).

    grpc receives a message whole before it hands it over, and a message may be as large as
    server.max_message_mb: so a call is given room for that much before its message is received, in turn
    with the others that wait for room, and keeps only the message's size once it has come. What waits costs
    the process no more than its stream's flow-control window. A message that takes over READ_HOLD_S to come
    while other calls wait for room is cut: a client that sends part of a message and then nothing would
    otherwise keep its room for as long as it likes."""

    def __init__(self, budget: BodyBudget, max_message_bytes: int) -> None:
        self.budget = budget
        self.max_message_bytes = max_message_bytes

    async def message(self, context: Call) -> tuple[Hold, bytes]:
        """The call's one message, and what it holds of the budget (the caller releases it once the call is
        answered); RpcError UNAVAILABLE if no room came in time, or the message came too slowly while others
        waited."""
        hold = Hold(self.budget)
        try:
            remaining = context.time_remaining()
            wait = ROOM_WAIT_S if remaining is None else min(ROOM_WAIT_S, remaining)
            if not await hold.wait_for(self.max_message_bytes, wait):
                raise RpcError(grpc.StatusCode.UNAVAILABLE, self.budget.refusal(self.max_message_bytes))
            data = await self._read(context)
        except BaseException:
            hold.release()
            raise
        hold.keep(len(data))
        return hold, data

    async def _read(self, context: Call) -> bytes:
        # A timer looks in on the read each READ_HOLD_S (not a task per call: the call's own task is cancelled
        # if it must be cut).
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        cut = False
        timer: asyncio.TimerHandle

        def look_in() -> None:
            nonlocal cut, timer
            if not self.budget.contended:
                timer = loop.call_later(READ_HOLD_S, look_in)
                return
            log.warning("cutting a call from %s: its request message took over %g s to come while other calls "
                        "waited for room", context.peer(), READ_HOLD_S)
            cut = True
            task.cancel()

        timer = loop.call_later(READ_HOLD_S, look_in)
        try:
            data = await context.read()
        except asyncio.CancelledError:
            if not cut:
                raise
            task.uncancel()
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"the request message took over {READ_HOLD_S:g} s to arrive "
                           "while other calls waited for room in the gateway's buffer (server.gateway_buffer_mb); "
                           "send it faster, or retry") from None
        finally:
            timer.cancel()
        if data is grpc.aio.EOF:
            raise InvalidRequest("the call carries no request message")
        return data


def _within_deadline(timeout_ms: int | None, remaining_s: float | None) -> int | None:
    """The request's deadline: its `timeout` parameter's, or the call's if that is sooner (or the only one),
    so the daemon does not compute what no one will read."""
    if remaining_s is None:
        return timeout_ms
    left_ms = max(1, int(remaining_s * 1000))
    return left_ms if timeout_ms is None else min(timeout_ms, left_ms)


def _set_parameters(target: Any, parameters: dict[str, Any]) -> None:
    for key, value in parameters.items():
        if isinstance(value, str):
            target[key].string_param = value
        else:
            target[key].int64_param = value


class InferenceService:
    """The service's methods, each answering one request or raising RpcError."""

    def __init__(self, catalog: Catalog, upstream: Upstream, control: Control, shared_memory: SharedMemory,
                 receiving: Receiving) -> None:
        self.catalog = catalog
        self.upstream = upstream
        self.control = control
        self.shared_memory = shared_memory
        self.receiving = receiving

    async def server_live(self, request: pb.ServerLiveRequest, call: Call) -> pb.ServerLiveResponse:
        await self.control.call("status")
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: pb.ServerReadyRequest, call: Call) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=(await self.control.call("health"))["healthy"])

    async def server_metadata(self, request: pb.ServerMetadataRequest, call: Call) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="inferd", version=__version__,
                                         extensions=server_extensions(self.shared_memory.enabled))

    async def model_ready(self, request: pb.ModelReadyRequest, call: Call) -> pb.ModelReadyResponse:
        # As Triton answers: a model (or version) it does not serve is not ready, not an error.
        try:
            model = await self._model(request.name, request.version)
        except RpcError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=model.ready)

    async def model_metadata(self, request: pb.ModelMetadataRequest, call: Call) -> pb.ModelMetadataResponse:
        model = await self._model(request.name, request.version)
        return json_format.ParseDict(model.metadata(), pb.ModelMetadataResponse())

    async def model_config(self, request: pb.ModelConfigRequest, call: Call) -> pb.ModelConfigResponse:
        model = await self._model(request.name, request.version)
        return pb.ModelConfigResponse(config=json_format.ParseDict(model.triton_config(), pb.ModelConfig()))

    async def model_statistics(self, request: pb.ModelStatisticsRequest, call: Call) -> pb.ModelStatisticsResponse:
        if request.name:
            await self._model(request.name, request.version)
        statistics = await self.catalog.statistics(request.name or None, request.version or None)
        return json_format.ParseDict(statistics, pb.ModelStatisticsResponse())

    async def repository_index(self, request: pb.RepositoryIndexRequest, call: Call) -> pb.RepositoryIndexResponse:
        entries = await self.catalog.index(request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**e) for e in entries])

    async def repository_model_load(self, request: pb.RepositoryModelLoadRequest,
                                    call: Call) -> pb.RepositoryModelLoadResponse:
        await _unless_refused(self.catalog.load(request.model_name))
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(self, request: pb.RepositoryModelUnloadRequest,
                                      call: Call) -> pb.RepositoryModelUnloadResponse:
        await _unless_refused(self.catalog.unload(request.model_name))
        return pb.RepositoryModelUnloadResponse()

    async def model_infer(self, request: pb.ModelInferRequest, call: Call) -> pb.ModelInferResponse:
        try:
            model = await self._model(request.model_name, request.model_version, for_infer=True)
        except Refused as exc:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        version = model.named(request.model_version or None)
        timeout, priority = (request.parameters.get(key) for key in ("timeout", "priority"))
        requested = model.request(_given(request), None if timeout is None else _parameter(timeout),
                                  None if priority is None else _parameter(priority))
        wanted = {model.check_output(output.name, _parameters(output.parameters)) for output in request.outputs} or None
        if wanted is not None and len(wanted) < len(request.outputs):
            names = [output.name for output in request.outputs]
            raise InvalidRequest(f"output {next(n for n in names if names.count(n) > 1)!r} is requested twice")
        regions = {output.name: region for output in request.outputs
                   if (region := region_parameters(_parameters(output.parameters), f"output {output.name!r}"))}
        places = [model.place(name, regions[name], requested.samples) if name in regions else None
                  for name in model.output_names] if regions else []
        peer_if_needed = self.shared_memory.grpc_peer(call.peer()) if places or requested.in_regions else None
        # Cancelled by its client, or past its deadline, the call's task is cancelled and with it the request.
        reply, outputs = await self.upstream.infer(model.name, version, requested.inputs,
                                                   _within_deadline(requested.timeout_ms, call.time_remaining()),
                                                   places, peer_if_needed, requested.level,
                                                   model.output_bytes(requested.samples))
        if reply.status != protocol.OK:
            raise RpcError(GRPC_STATUS.get(reply.status, grpc.StatusCode.INTERNAL), reply.error or reply.status)
        check_placed(model.output_names, places, reply.outputs, outputs)
        response = pb.ModelInferResponse(model_name=model.name, model_version=reply.version or "", id=request.id)
        if model.pipeline:
            response.parameters["step_versions"].string_param = reply.version or ""
        frames = iter(outputs)
        raw: list[bytes] = []
        for name, meta in zip(model.output_names, reply.outputs):
            data = next(frames) if meta.region is None else None
            if wanted is not None and name not in wanted:
                continue
            output = response.outputs.add(name=name, datatype=tensors.WIRE_TO_DATATYPE[meta.dtype], shape=meta.shape)
            if data is None:
                _set_parameters(output.parameters, region_response(meta))
            # Triton's clients find an output's bytes at its position: one in a region keeps its place
            # empty (the C++ client reads a place for every output, and crashes on a missing one).
            raw.append(b"" if data is None else bytes(data))
        response.raw_output_contents.extend(raw)
        return response

    async def system_shared_memory_status(self, request: pb.SystemSharedMemoryStatusRequest,
                                          call: Call) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in await self.shared_memory.status(self.shared_memory.grpc_peer(call.peer()), request.name or None):
            response.regions[region["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return response

    async def system_shared_memory_register(self, request: pb.SystemSharedMemoryRegisterRequest,
                                            call: Call) -> pb.SystemSharedMemoryRegisterResponse:
        # A new connection from an address an old one had: its inode, not the old one's.
        await self.shared_memory.register(self.shared_memory.grpc_peer(call.peer(), fresh=True), request.name,
                                          request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def system_shared_memory_unregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                              call: Call) -> pb.SystemSharedMemoryUnregisterResponse:
        await self.shared_memory.unregister(self.shared_memory.grpc_peer(call.peer()), request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_shared_memory_status(self, request: pb.CudaSharedMemoryStatusRequest,
                                        call: Call) -> pb.CudaSharedMemoryStatusResponse:
        if request.name:
            raise InvalidRequest(cuda_region_missing(request.name))
        return pb.CudaSharedMemoryStatusResponse()

    async def cuda_shared_memory_register(self, request: pb.CudaSharedMemoryRegisterRequest,
                                          call: Call) -> pb.CudaSharedMemoryRegisterResponse:
        raise InvalidRequest(CUDA_REFUSED)

    async def cuda_shared_memory_unregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                            call: Call) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()  # none is registered

    async def _model(self, name: str, version: str, for_infer: bool = False) -> ModelView:
        if not name:
            raise InvalidRequest("the request names no model")
        try:
            return await (self.catalog.for_infer if for_infer else self.catalog.model)(name, version or None)
        except NotFound as exc:
            raise RpcError(grpc.StatusCode.NOT_FOUND, str(exc)) from None

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler that serves every method of the service."""
        methods: dict[str, tuple[Callable[[Any, Call], Awaitable[Message]], type[Message]]] = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest),
            "ModelConfig": (self.model_config, pb.ModelConfigRequest),
            "ModelStatistics": (self.model_statistics, pb.ModelStatisticsRequest),
            "ModelInfer": (self.model_infer, pb.ModelInferRequest),
            "RepositoryIndex": (self.repository_index, pb.RepositoryIndexRequest),
            "RepositoryModelLoad": (self.repository_model_load, pb.RepositoryModelLoadRequest),
            "RepositoryModelUnload": (self.repository_model_unload, pb.RepositoryModelUnloadRequest),
            "SystemSharedMemoryStatus": (self.system_shared_memory_status, pb.SystemSharedMemoryStatusRequest),
            "SystemSharedMemoryRegister": (self.system_shared_memory_register, pb.SystemSharedMemoryRegisterRequest),
            "SystemSharedMemoryUnregister": (self.system_shared_memory_unregister,
                                             pb.SystemSharedMemoryUnregisterRequest),
            "CudaSharedMemoryStatus": (self.cuda_shared_memory_status, pb.CudaSharedMemoryStatusRequest),
            "CudaSharedMemoryRegister": (self.cuda_shared_memory_register, pb.CudaSharedMemoryRegisterRequest),
            "CudaSharedMemoryUnregister": (self.cuda_shared_memory_unregister, pb.CudaSharedMemoryUnregisterRequest),
        }
        # Every method is served as a stream of requests, which its clients' unary calls are on the wire: so the
        # handler runs before the message is received, and receives it only once the gateway's buffer has room.
        return grpc.method_handlers_generic_handler(SERVICE, {
            name: grpc.stream_unary_rpc_method_handler(
                _answering(name, method, kind, self.receiving),
                response_serializer=lambda message: message.SerializeToString())
            for name, (method, kind) in methods.items()
        })


async def _unless_refused(command: Awaitable[None]) -> None:
    """Run a model repository command; the daemon's refusal is FAILED_PRECONDITION with its sentence."""
    try:
        await command
    except Refused as exc:
        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None


def _answering(name: str, method: Callable[[Any, Call], Awaitable[Message]], kind: type[Message],
               receiving: Receiving) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]:
    """`method` as a grpc handler: the request received within the gateway's buffer and parsed from its bytes,
    every error a status and a sentence."""

    async def handle(requests: Any, context: Call) -> Message:
        try:
            hold, data = await receiving.message(context)
            try:
                try:
                    request = kind.FromString(data)
                except DecodeError:
                    raise InvalidRequest(f"the request is not a {kind.DESCRIPTOR.full_name} message") from None
                del data  # parsed: the message's bytes are not kept while the daemon computes
                return await method(request, context)
            finally:
                hold.release()
        except RpcError as exc:
            code, message = exc.code, exc.message
        except InvalidRequest as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, exc.message
        except ConnectionError as exc:
            code, message = grpc.StatusCode.UNAVAILABLE, str(exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handling %s raised", name)
            code, message = grpc.StatusCode.INTERNAL, GATEWAY_BUG
        remaining = context.time_remaining()
        if context.done() or (remaining is not None and remaining <= 0):
            # The call ended first (its deadline passed as the daemon answered `timeout`, or its client went):
            # grpc has told the client, and a status sent now fails in grpc's core, which logs it as an error.
            raise asyncio.CancelledError
        await context.abort(code, message)
        raise AssertionError("abort returns only by raising")

    return handle


class GrpcServer:
    """The Open Inference Protocol's gRPC front end: serves `service` at server.grpc until stopped."""

    def __init__(self, service: InferenceService, server: ServerConfig, max_message_bytes: int) -> None:
        self._service = service
        self._config = server
        self._max_message_bytes = max_message_bytes
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def serve(self, listening: Callable[[], Awaitable[None]]) -> None:
        """Serve until stop(), calling `listening` once calls are taken; calls in progress are answered
        first (for at most STOP_GRACE_S)."""
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.max_metadata_size", MAX_METADATA_BYTES),
            ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
            ("grpc.max_connection_idle_ms", IDLE_TIMEOUT_MS),
            # A port another process holds is an error, not a shared port, unless this protocol has several
            # gateway processes: then they share it, and the kernel spreads the connections over them.
            ("grpc.so_reuseport", int(self._config.grpc_processes > 1)),
        ])
        self._server.add_generic_rpc_handlers((self._service.handler(),))
        if self._config.tls_cert:
            credentials = grpc.ssl_server_credentials([(_read(self._config.tls_key), _read(self._config.tls_cert))])
            self._server.add_secure_port(self._config.grpc, credentials)
        else:
            self._server.add_insecure_port(self._config.grpc)
        await self._server.start()
        await listening()
        await self._server.wait_for_termination()

    def stop(self) -> None:
        """Stop taking calls; serve() returns once those in progress are answered."""
        if self._server is not None and self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._server.stop(STOP_GRACE_S))


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()
