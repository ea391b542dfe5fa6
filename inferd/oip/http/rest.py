"""The Open Inference Protocol over HTTP: KServe v2's REST API with Triton's extensions, as an ASGI app.

    GET  /v2/health/live | /v2/health/ready | /v2
    GET  /v2/models/{m}[/versions/{v}] | .../ready | .../config | .../stats
    POST /v2/models/{m}[/versions/{v}]/infer
    GET  /v2/systemsharedmemory[/region/{r}]/status
    POST /v2/systemsharedmemory/region/{r}/register | /v2/systemsharedmemory[/region/{r}]/unregister
    POST /v2/repository/index | /v2/repository/models/{m}/load | /v2/repository/models/{m}/unload

An inference request is JSON, or JSON followed by raw tensor bytes (Triton's
binary tensor extension: the JSON's length in `Inference-Header-Content-Length`,
each binary input's size in its `parameters.binary_data_size`). Bodies may be
gzip or deflate. A tensor whose parameters name a `shared_memory_region` lies
in a region the client registered over the same connection (oip/shm.py).
Every error is `{"error": SENTENCE}` with the status the protocol gives it.

A client that closes its connection while its request waits for the daemon takes the request out
of the queue (or has its result dropped, if its batch runs): the gateway sends the supervisor a
cancel and answers no one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import zlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple, TypeVar

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from inferd import __version__, protocol
from inferd.errors import InvalidRequest, cut, quoted
from inferd.ipc import addresses
from inferd.oip import tensors
from inferd.oip.catalog import (
    GATEWAY_BUG,
    Catalog,
    GivenInput,
    ModelView,
    NotFound,
    Refused,
    Requested,
    server_extensions,
)
from inferd.oip.http.body_guard import BodyGuard, BodyRefused
from inferd.oip.http.server import BODY, CONNECTION, WATCH, Watch
from inferd.oip.shm import (
    CUDA_REFUSED,
    InRegion,
    SharedMemory,
    check_placed,
    cuda_region_missing,
    region_parameters,
)
from inferd.oip.upstream import Control, Upstream
from inferd.protocol import Buffer, ReplyHeader

log = logging.getLogger("inferd.oip.http.rest")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# Each status as the HTTP status google.rpc.Code gives its gRPC twin (rpc.GRPC_STATUS). `overloaded` is
# Triton's 503 with Retry-After (OVERLOAD_HEADERS), never 429: 503 is what retry policies such as
# `retry_on: [502, 503, 504]` retry. `cancelled` is 499 (CANCELLED's, "Client Closed Request"): the
# gateway cancels a request only once its client has gone, so a client that still reads it should
# never see one.
HTTP_STATUS = {
    protocol.INVALID: 400, protocol.OVERLOADED: 503, protocol.TIMEOUT: 504,
    protocol.UNAVAILABLE: 503, protocol.INTERNAL: 500, protocol.CANCELLED: 499,
}
OVERLOAD_HEADERS = [(b"retry-after", b"1")]
MAX_HEADER_JSON = 1 << 20  # the JSON part of a binary request: names, shapes and parameters, never data
_ROUTE = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(?:/(ready|infer|config|stats))?$")
_REPOSITORY_ROUTE = re.compile(r"^/v2/repository/models/([^/]+)/(load|unload)$")
_GET_ENDPOINTS = frozenset({"/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/stats"})
_SHM_ROUTE = re.compile(r"^/v2/(system|cuda)sharedmemory(?:/region/([^/]+))?/(status|register|unregister)$")
T = TypeVar("T")
_json = msgspec.json.Decoder()
FIELD_BYTES = 64 << 10  # the most JSON a request's field other than tensor data may take: names, shapes, parameters
# A \uD800-\uDFFF escape outside a high-low pair: it names no character. msgspec says "truncated" of one.
LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                            rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


class _InputText(msgspec.Struct):
    """One input of a request as its JSON gives it, each field left as its text (fields the protocol does not
    name are skipped, never decoded)."""

    name: msgspec.Raw | UnsetType = UNSET
    datatype: msgspec.Raw | UnsetType = UNSET
    shape: msgspec.Raw | UnsetType = UNSET
    parameters: msgspec.Raw | UnsetType = UNSET
    data: msgspec.Raw | UnsetType = UNSET


class _RequestText(msgspec.Struct):
    """An inference request's JSON, each field left as its text (those the protocol does not name skipped)."""

    id: msgspec.Raw | UnsetType = UNSET
    parameters: msgspec.Raw | UnsetType = UNSET
    inputs: msgspec.Raw | UnsetType = UNSET
    outputs: msgspec.Raw | UnsetType = UNSET


_request_text = msgspec.json.Decoder(_RequestText)
# The inputs as a struct of at most MAX_TENSORS places, so that a list of more stops the decode at once: as a
# list it would be decoded whole, a Python object an entry, before its length was checked.
_inputs_text = msgspec.json.Decoder(msgspec.defstruct(
    "_InputsText", [(f"input{i}", _InputText | UnsetType, UNSET) for i in range(protocol.MAX_TENSORS)],
    array_like=True, forbid_unknown_fields=True))


def _decode_request(text: Buffer) -> Any:
    """An inference request's JSON. A large one's inputs keep their `data` as its text (msgspec.Raw, which
    tensors.from_json decodes a chunk at a time), and its other fields are decoded only where they are small:
    so that no part of it is decoded into a Python object an element. A small one is decoded whole, in one
    call (the cost of most requests: a request's own JSON where its tensors are binary)."""
    if len(text) <= FIELD_BYTES:
        return _json.decode(text)
    try:
        fields = _request_text.decode(text)
    except msgspec.ValidationError:
        raise InvalidRequest("the request is not a JSON object") from None
    request = {name: _small(value, f"the request's {name}") for name in ("id", "parameters", "outputs")
               if (value := getattr(fields, name)) is not UNSET}
    if fields.inputs is UNSET:
        return request
    try:
        entries = [entry for entry in msgspec.structs.astuple(_inputs_text.decode(fields.inputs)) if entry is not UNSET]
    except msgspec.ValidationError as exc:
        if memoryview(fields.inputs)[:1] != b"[":
            return request  # no list of inputs: JsonRequest.parse says what the model takes
        if "at most length" in str(exc):
            raise InvalidRequest(f"the request has over {protocol.MAX_TENSORS} inputs") from None
        raise InvalidRequest("each input is an object with a name") from None
    request["inputs"] = [{key: value if key == "data" else _small(value, f"an input's {key}")
                          for key in _InputText.__struct_fields__ if (value := getattr(entry, key)) is not UNSET}
                         for entry in entries]
    return request


def _small(text: msgspec.Raw, what: str) -> Any:
    """A request's field other than tensor data, decoded: refused beyond FIELD_BYTES of JSON."""
    if len(text) > FIELD_BYTES:
        raise InvalidRequest(f"{what} is over {FIELD_BYTES} bytes of JSON; only tensor data may be larger")
    return _json.decode(text)
_encode = msgspec.json.Encoder().encode
JSON = b"application/json"
BINARY = b"application/octet-stream"  # Triton's type for a response with binary tensors after its JSON
Answer = tuple[int, bytes, list[tuple[bytes, bytes]]]  # status, body, headers (content-type: JSON unless named)


class HttpError(Exception):
    """An error reply: HTTP status and one sentence (and headers, for an overload's Retry-After)."""

    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


async def _read_body(receive: Receive, scope: Scope, limit: int) -> Buffer:
    """The request's body, of at most `limit` bytes, read through its BodyGuard: into one buffer of its
    Content-Length where it has one (not chunks joined at the end: twice its size for a moment), whose memory
    is taken as the bytes come.

    How long a body may take to arrive is the server's to bound (BodyGuard's pace): it refuses the body, and
    receive() then returns for this to answer."""
    guard: BodyGuard = scope[BODY]
    expected = guard.expected
    body: np.ndarray | bytearray | None = None
    size = 0
    more = True
    while more:
        message = await receive()
        if guard.refusal is not None:
            raise guard.refusal
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if size + len(chunk) > limit:
            raise HttpError(413, f"the request body is over {limit} bytes (server.max_message_mb)")
        if body is None:
            if not more:  # the whole body in one piece, as most are
                return chunk
            body = np.empty(expected, dtype=np.uint8) if expected is not None and expected <= limit else bytearray()
        if isinstance(body, np.ndarray):
            body[size:size + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
        else:
            body += chunk
        size += len(chunk)
    return b"" if body is None else body.data if isinstance(body, np.ndarray) else body


INFLATE_STEP = 1 << 20  # bytes inflated at a time, each held from the gateway's budget before the next


def _inflate(body: Buffer, encoding: str, limit: int, guard: BodyGuard) -> bytearray:
    """A gzip or deflate body, inflated to at most `limit` bytes (a zip bomb stops there), each step of it
    held from the gateway's budget: a body is counted by what it inflates to."""
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding)
    if wbits is None:
        raise HttpError(415, f"Content-Encoding {quoted(encoding)} is not supported; use gzip, deflate or none")
    inflater = zlib.decompressobj(wbits)
    data = bytearray()
    pending: Buffer = body
    try:
        while True:
            piece = inflater.decompress(pending, INFLATE_STEP)
            guard.take(len(piece))
            data += piece
            if len(data) > limit:
                raise HttpError(413, f"the request body inflates to over {limit} bytes (server.max_message_mb)")
            pending = inflater.unconsumed_tail
            if not pending and (not piece or inflater.eof):
                return data
    except zlib.error as exc:
        raise HttpError(400, f"the {encoding} body cannot be inflated: {exc}") from None


class RestApp:
    """The ASGI application of the gateway's HTTP server."""

    def __init__(self, catalog: Catalog, upstream: Upstream, control: Control, max_message_bytes: int,
                 shared_memory: SharedMemory, allowed_hosts: frozenset[str] | None = None) -> None:
        self.catalog = catalog
        self.upstream = upstream
        self.control = control
        self.max_message_bytes = max_message_bytes
        self.shared_memory = shared_memory
        self.allowed_hosts = allowed_hosts  # None: any Host (the server is not bound to loopback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            refusal = scope[BODY].refusal
            if refusal is not None:  # decided from the head alone: the body is never read
                raise refusal
            self._check_host(scope)
            status, body, headers = await self._route(scope, receive)
        except (HttpError, BodyRefused) as exc:
            status, body, headers = exc.status, _encode({"error": exc.message}), exc.headers
        except ConnectionAbortedError:
            return
        except ConnectionError as exc:  # the supervisor did not answer a control command in time
            status, body, headers = 503, _encode({"error": str(exc)}), []
        except Exception:
            log.exception("handling %s %s raised", scope.get("method"), scope.get("path"))
            status, body, headers = 500, _encode({"error": GATEWAY_BUG}), []
        if not any(key == b"content-type" for key, _ in headers):
            headers = [(b"content-type", JSON), *headers]
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(body)).encode()), *headers]})
        await send({"type": "http.response.body", "body": body})

    def _check_host(self, scope: Scope) -> None:
        """Refuse a Host that does not name this machine, where the server listens on loopback only: a web
        page whose name was rebound to 127.0.0.1 sends its own name (DNS rebinding, Ray's CVE-2025-62593)."""
        if self.allowed_hosts is None:
            return
        value = next((v for k, v in scope["headers"] if k.lower() == b"host"), None)
        if value is None:  # HTTP/1.0 without one: no browser sends that
            return
        host = addresses.host_of_header(value.decode("latin-1"))
        if not addresses.loopback_host(host) and host not in self.allowed_hosts:
            raise HttpError(403, f"Host {quoted(host)} is not a name of this server, which listens on loopback only; "
                                 "add it to server.http_allowed_hosts if clients reach the server by it")

    async def _route(self, scope: Scope, receive: Receive) -> Answer:
        # Readiness answers carry KServe's JSON body; Triton's clients read only the status.
        path = _endpoint(scope["path"])
        _check_method(scope["method"], path)
        if path == "/v2/health/live":
            await self.control.call("status")
            return 200, _encode({"live": True}), []
        if path == "/v2/health/ready":
            ready = (await self.control.call("health"))["healthy"]
            return (200, _encode({"ready": True}), []) if ready else \
                (400, _encode({"ready": False, "error": "the daemon is not ready"}), [])
        if path == "/v2":
            return 200, _encode({"name": "inferd", "version": __version__,
                                 "extensions": server_extensions(self.shared_memory.enabled)}), []
        if path == "/v2/models/stats":
            return 200, _encode(await self.catalog.statistics(None, None)), []
        if path == "/v2/repository/index" or _REPOSITORY_ROUTE.match(path):
            return await self._repository(scope, receive, _REPOSITORY_ROUTE.match(path))
        shm = _SHM_ROUTE.match(path)
        if shm is not None:
            kind, region, action = shm.groups()
            if kind == "cuda":
                return _cuda_shared_memory(region, action)
            return await self._shared_memory(scope, receive, region, action)
        match = _ROUTE.match(path)
        assert match is not None  # _check_method found the endpoint
        name, version, action = match.groups()
        try:
            model = await (self.catalog.for_infer if action == "infer" else self.catalog.model)(name, version)
        except NotFound as exc:
            raise HttpError(404, str(exc)) from None
        except Refused as exc:
            raise HttpError(503, str(exc)) from None
        if action == "infer":
            return await self._infer(scope, receive, model, model.named(version))
        if action is None:
            return 200, _encode(model.metadata()), []
        if action == "ready":
            return (200, _encode({"name": name, "ready": True}), []) if model.ready else \
                (400, _encode({"name": name, "ready": False, "error": f"{name} is not ready"}), [])
        if action == "config":
            return 200, _encode(model.triton_config()), []
        return 200, _encode(await self.catalog.statistics(name, version)), []

    async def _repository(self, scope: Scope, receive: Receive, action: re.Match[str] | None) -> Answer:
        """The model repository extension: the index of the models, and loading or unloading one."""
        if action is None:
            raw = await _read_body(receive, scope, MAX_HEADER_JSON)
            try:
                body = _json_object(raw) if bytes(raw).strip() else {}  # tritonclient sends none
            except InvalidRequest as exc:
                raise HttpError(400, exc.message) from None
            ready = body.get("ready", False)
            if not isinstance(ready, bool):
                raise HttpError(400, f"'ready' must be true or false, not {quoted(ready)}")
            return 200, _encode(await self.catalog.index(ready)), []
        name, verb = action.groups()
        try:
            await (self.catalog.load(name) if verb == "load" else self.catalog.unload(name))
        except Refused as exc:
            raise HttpError(400, str(exc)) from None
        return 200, _encode({}), []

    async def _shared_memory(self, scope: Scope, receive: Receive, region: str | None, action: str) -> Answer:
        """The system shared-memory extension: a region's (or every region's) status, register, unregister."""
        peer = self.shared_memory.http_peer(_peer(scope))
        try:
            if action == "status":
                return 200, _encode(await self.shared_memory.status(peer, region)), []
            if action == "unregister":
                await self.shared_memory.unregister(peer, region)
                return 200, b"", []
            if region is None:
                raise HttpError(404, "register names its region: POST /v2/systemsharedmemory/region/{name}/register")
            body = _json_object(await _read_body(receive, scope, MAX_HEADER_JSON))
            unknown = sorted(set(body) - {"key", "offset", "byte_size"})
            if unknown:
                raise InvalidRequest(f"the register request has unknown field {quoted(unknown[0])}")
            await self.shared_memory.register(peer, region, body.get("key"), body.get("offset", 0),
                                              body.get("byte_size"))
            return 200, b"", []
        except InvalidRequest as exc:
            raise HttpError(400, exc.message) from None

    async def _infer(self, scope: Scope, receive: Receive, model: ModelView, version: str | None) -> Answer:
        parsed = await self._parsed(scope, receive, model)
        try:
            places = parsed.places(model)
        except InvalidRequest as exc:
            raise HttpError(400, exc.message) from None
        requested = parsed.requested
        reply, outputs = await _unless_gone(scope, self.upstream.infer(
            model.name, version, requested.inputs, requested.timeout_ms, places,
            self.shared_memory.http_peer(_peer(scope)) if places or requested.in_regions else None, requested.level,
            model.output_bytes(requested.samples)))
        if reply.status != protocol.OK:
            extra = OVERLOAD_HEADERS if reply.status == protocol.OVERLOADED else []
            raise HttpError(HTTP_STATUS.get(reply.status, 500), reply.error or reply.status, extra)
        try:
            check_placed(model.output_names, places, reply.outputs, outputs)
        except InvalidRequest as exc:
            raise HttpError(400, exc.message) from None
        json_part, binary = parsed.response(model, reply, outputs)
        encoded = _encode(json_part)
        if not binary:
            return 200, encoded, []
        return 200, b"".join([encoded, *binary]), [(b"content-type", BINARY),
                                                   (b"inference-header-content-length", str(len(encoded)).encode())]

    async def _parsed(self, scope: Scope, receive: Receive, model: ModelView) -> JsonRequest:
        """An inference request's body, read, inflated and checked against `model`. What is parsed keeps of the
        body only its binary tensors: once this returns, a body of JSON is freed (its tensors are arrays of
        their own), while the daemon computes."""
        headers = {key.lower(): value for key, value in scope["headers"]}
        body: Buffer = await _read_body(receive, scope, self.max_message_bytes)
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        if encoding not in ("", "identity"):
            body = _inflate(body, encoding, self.max_message_bytes, scope[BODY])
        json_length = headers.get(b"inference-header-content-length")
        if json_length is not None:
            if not json_length.isdigit() or int(json_length) > len(body) or int(json_length) > MAX_HEADER_JSON:
                raise HttpError(400, f"Inference-Header-Content-Length {quoted(json_length.decode('latin-1'))} is "
                                     f"not a length within the body's {len(body)} bytes")
            split = int(json_length)
        else:
            split = len(body)
        try:
            request = _raw_request(model, len(body)) if split == 0 else _decode_request(memoryview(body)[:split])
            return JsonRequest.parse(request, memoryview(body)[split:], model)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise HttpError(400, _not_json(exc, memoryview(body)[:split])) from None
        except InvalidRequest as exc:
            raise HttpError(400, exc.message) from None


def _not_json(exc: Exception, text: memoryview) -> str:
    """Why a request's JSON was refused, in one sentence: msgspec's words, and where they point at NaN or
    Infinity (which Python's json writes), that JSON has no such numbers; where it holds a lone surrogate
    escape, that."""
    if "truncated" in str(exc) and (lone := LONE_SURROGATE.search(text)) is not None:
        return (f"the request's JSON holds the escape {lone[0].decode()} outside a surrogate pair, which names no "
                "character; send byte strings that are not text as binary data (the binary tensor extension)")
    where = re.search(r"\(byte (\d+)\)", str(exc))
    at = bytes(text[int(where[1]):int(where[1]) + 9]) if where else b""
    if at.lstrip(b"-").startswith((b"NaN", b"Infinity")):
        return (f"the request is not JSON: {cut(str(exc))}; NaN and Infinity are not JSON numbers, so no tensor may "
                "hold them as JSON data (send finite numbers, or the tensor's bytes with the binary tensor extension)")
    return f"the request is not JSON: {cut(str(exc))}"


def _raw_request(model: ModelView, size: int) -> dict[str, Any]:
    """The request a raw binary body stands for (Inference-Header-Content-Length 0: the body is the one
    input's bytes, as many samples as they hold), in the JSON form JsonRequest parses: every output is
    answered in binary, as Triton's binary tensor extension says."""
    if len(model.inputs) != 1:
        raise InvalidRequest(f"a raw binary request (Inference-Header-Content-Length 0) is for a model of one "
                             f"input; {model.name} takes {', '.join(model.inputs)}: send JSON naming each")
    spec = model.config.inputs[0]
    if spec.variable or spec.dtype == protocol.BYTES:
        raise InvalidRequest(f"a raw binary request cannot say the shape of {model.inputs[0]!r}, which takes "
                             f"{tensors.WIRE_TO_DATATYPE[spec.dtype]} {list(spec.shape)} per sample: send JSON "
                             "with its shape")
    sample = protocol.tensor_bytes(spec.dtype, spec.shape)
    if size == 0 or size % sample:
        raise InvalidRequest(f"a raw binary request's {size} bytes are not a whole number of samples of "
                             f"{model.inputs[0]!r} ({tensors.WIRE_TO_DATATYPE[spec.dtype]} {list(spec.shape)}, "
                             f"{sample} bytes each)")
    return {"inputs": [{"name": model.inputs[0], "datatype": tensors.WIRE_TO_DATATYPE[spec.dtype],
                        "shape": [size // sample, *spec.shape], "parameters": {"binary_data_size": size}}],
            "parameters": {"binary_data_output": True}}


def _endpoint(path: str) -> str:
    """The endpoint a request's path names: a trailing slash is no part of it (`/v2/` is `/v2`)."""
    return path.rstrip("/") or "/"


def _method_of(path: str) -> str | None:
    """The one method the endpoint at `path` takes; None where there is no such endpoint."""
    if path in _GET_ENDPOINTS:
        return "GET"
    if path == "/v2/repository/index" or _REPOSITORY_ROUTE.match(path):
        return "POST"
    action = _SHM_ROUTE.match(path) or _ROUTE.match(path)
    if action is None:
        return None
    return "POST" if action.group(3) in ("register", "unregister", "infer") else "GET"


def _check_method(method: str, path: str) -> None:
    """404 for a path that names no endpoint; 405, with the method it takes in Allow, for a wrong method."""
    allowed = _method_of(path)
    if allowed is None:
        raise HttpError(404, f"no such endpoint: {method} {quoted(path)}")
    if method != allowed:
        raise HttpError(405, f"{quoted(path)} takes {allowed}, not {method}", [(b"allow", allowed.encode())])


def _cuda_shared_memory(region: str | None, action: str) -> Answer:
    """Triton's CUDA shared-memory extension, as a server that has no CUDA region."""
    if action == "register":
        raise HttpError(400, CUDA_REFUSED)
    if action == "status" and region is not None:
        raise HttpError(400, cuda_region_missing(region))
    return 200, _encode([]) if action == "status" else b"", []


async def _unless_gone(scope: Scope, answer: Coroutine[Any, Any, T]) -> T:
    """Await `answer`, unless the client's connection ends first: then cancel it (the upstream tells
    the supervisor) and raise ConnectionAbortedError (nobody is left to answer)."""
    watch: Watch | None = scope.get(WATCH)
    task = asyncio.current_task()
    if watch is None or task is None:
        return await answer
    cancel = task.cancel
    if not watch.add(cancel):
        answer.close()
        raise ConnectionAbortedError
    try:
        return await answer
    except asyncio.CancelledError:
        if not watch.lost:
            raise
        task.uncancel()  # the cancel was the watch's, not the server's: this request ends here
        raise ConnectionAbortedError from None
    finally:
        watch.discard(cancel)


def _peer(scope: Scope) -> str:
    return scope.get(CONNECTION, "")  # the server's name for the connection: its client's address and number


def _json_object(body: Buffer) -> dict[str, Any]:
    try:
        value = _json.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidRequest(f"the request is not JSON: {cut(str(exc))}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("the request is not a JSON object")
    return value


def _parameters(entry: dict[str, Any], what: str) -> dict[str, Any]:
    parameters = entry.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{what} has parameters that are not an object")
    return parameters


class JsonRequest(NamedTuple):
    """An inference request of the REST API, checked: what goes upstream, and how the response is wanted."""

    requested: Requested
    request_id: str | None
    outputs: dict[str, bool] | None  # requested output name -> as binary; None: all, as `binary`
    binary: bool
    regions: dict[str, InRegion]  # requested output name -> the region to write it in

    def places(self, model: ModelView) -> list[protocol.OutputPlace | None]:
        """Where each of the model's outputs goes: a region, or (None) the response."""
        if not self.regions:
            return []
        samples = self.requested.samples
        return [model.place(name, self.regions[name], samples) if name in self.regions else None
                for name in model.output_names]

    @classmethod
    def parse(cls, request: Any, binary: memoryview, model: ModelView) -> JsonRequest:
        """The request's JSON (and the binary data after it), checked against `model`."""
        # Fields the protocol does not name are left alone, as the spec's schema and KServe's server
        # allow (KServe's client sends model_name).
        if not isinstance(request, dict):
            raise InvalidRequest("the request is not a JSON object")
        request_id = request.get("id")
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidRequest("the request's id must be a string")
        parameters = _parameters(request, "the request")
        given = request.get("inputs")
        if not isinstance(given, list):
            raise InvalidRequest(f"the request has no inputs; {model.name} takes {', '.join(model.inputs)}")
        inputs = []
        offset = 0
        for entry in given:
            if not isinstance(entry, dict):
                raise InvalidRequest("each input is an object with a name")
            what = f"input {quoted(entry.get('name'))}"
            given_parameters = _parameters(entry, what)
            size = given_parameters.get("binary_data_size")
            region = region_parameters(given_parameters, what)
            raw = None
            if region is not None:
                if "data" in entry or size is not None:
                    raise InvalidRequest(f"{what} is in a shared-memory region and also has data")
            elif size is not None:
                if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                    raise InvalidRequest(f"{what} has binary_data_size {quoted(size)}, but {len(binary) - offset} "
                                         "bytes of binary data are left")
                if "data" in entry:
                    raise InvalidRequest(f"{what} has both data and binary_data_size")
                raw = binary[offset:offset + size]
                offset += size
            elif "data" not in entry:
                raise InvalidRequest(f"{what} has neither data nor parameters.binary_data_size")
            inputs.append(GivenInput(entry.get("name"), entry.get("datatype"), entry.get("shape"), raw,
                                     region=region, json=entry.get("data")))
        requested = model.request(inputs, parameters.get("timeout"), parameters.get("priority"))
        if offset != len(binary):
            raise InvalidRequest(f"{len(binary) - offset} bytes of binary data follow that no input claims")
        binary_default = parameters.get("binary_data_output", False) is True
        wanted, regions = _wanted(request.get("outputs"), model, binary_default)
        return cls(requested, request_id, wanted, binary_default, regions)

    def response(self, model: ModelView, reply: ReplyHeader,
                 outputs: list[memoryview]) -> tuple[dict[str, Any], list[memoryview]]:
        """The response's JSON and the binary parts that follow it, in order."""
        entries = []
        binary: list[memoryview] = []
        frames = iter(outputs)
        for name, meta in zip(model.output_names, reply.outputs):
            data = next(frames) if meta.region is None else None
            as_binary = self.binary if self.outputs is None else self.outputs.get(name)
            if as_binary is None:
                continue
            entry: dict[str, Any] = {"name": name, "datatype": tensors.WIRE_TO_DATATYPE[meta.dtype],
                                     "shape": list(meta.shape)}
            # One in a region has neither data nor parameters, as Triton answers: Triton's C++ client
            # takes an output's parameters for binary_data_size. BYTES that are not UTF-8 go as binary data:
            # JSON cannot carry them.
            values = tensors.to_json(data, meta.dtype, math.prod(meta.shape)) if data is not None and not as_binary \
                else None
            if values is not None:
                entry["data"] = values
            elif data is not None:
                entry["parameters"] = {"binary_data_size": len(data)}
                binary.append(data)
            entries.append(entry)
        response: dict[str, Any] = {"model_name": model.name, "model_version": reply.version, "outputs": entries}
        if model.pipeline:
            response["parameters"] = {"step_versions": reply.version}
        if self.request_id is not None:
            response["id"] = self.request_id
        return response, binary


def _wanted(outputs: Any, model: ModelView,
            binary_default: bool) -> tuple[dict[str, bool] | None, dict[str, InRegion]]:
    if outputs is None or outputs == []:  # an empty list asks for every output too, as in Triton and KServe
        return None, {}
    if not isinstance(outputs, list):
        raise InvalidRequest("the request's outputs are not a list")
    wanted: dict[str, bool] = {}
    regions: dict[str, InRegion] = {}
    for entry in outputs:
        if not isinstance(entry, dict):
            raise InvalidRequest("each requested output is an object with a name")
        parameters = _parameters(entry, f"output {quoted(entry.get('name'))}")
        name = model.check_output(entry.get("name"), parameters)
        if name in wanted:
            raise InvalidRequest(f"output {name!r} is requested twice")
        wanted[name] = parameters.get("binary_data", binary_default) is True
        region = region_parameters(parameters, f"output {name!r}")
        if region is not None:
            regions[name] = region
    return wanted, regions
