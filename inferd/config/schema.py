"""Every option of inferd, declared once: type, default, check and documentation.

The structs below are the declaration; `CHECKS` adds what a type cannot say (an
endpoint's form, a file that must exist). `_doc` notes each key's meaning and
whether a SIGHUP applies it, which `live_keys` and the config reference (docs/reference/config.md) read back.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from inferd.protocol import BYTES, DEFAULT_MAX_MESSAGE_MB, WIRE_DTYPES
from inferd.system.shm_names import ARENA_PREFIX, CLIENT_PREFIX

MODEL_TOML = "model.toml"  # what makes a folder of server.model_root a model
MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
DEVICE = re.compile(r"^(cpu|cuda:\d+)$")
HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")
TENSOR_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
UNPAD_DIMS = re.compile(r"^[0-9]+(,[0-9]+)*$")
# A version's outputs count as the expected ones within these: its canary file's, checked at load, and
# the live version's, when it runs as a shadow; by default, a padded sample's answer and its own too.
CANARY_RTOL, CANARY_ATOL = 1e-3, 1e-5


def _doc(text: str, default_doc: str | None = None, live: bool | str = False) -> Meta:
    """A key's documentation; `live`: a SIGHUP applies a new value at once (else it waits for a restart), or
    what it does where that depends on the value (the reference's words; the reconfigure code applies it)."""
    extra: dict[str, Any] = {"live": live}
    if default_doc:
        extra["default_doc"] = default_doc
    return Meta(description=text, extra=extra)


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """[server]: endpoints, limits and the drain."""

    listen: Annotated[
        tuple[str, ...], Meta(min_length=1),
        _doc("Data endpoints clients connect to: tcp://HOST:PORT or ipc://PATH. With port 0 the system picks a "
             "free one; `inferctl status --json` lists the endpoints as bound."),
    ] = ("tcp://127.0.0.1:5555",)
    control: Annotated[
        str | None,
        _doc(
            "Endpoint for inferctl; an ipc:// socket is created mode 0660. A tcp:// one needs CURVE "
            "(curve_secret_key): anyone who reaches it could reload models; inferctl then takes --server-key and "
            "--client-key.",
            "ipc:///run/inferd/control.sock (a user who cannot write /run/inferd: "
            "$XDG_RUNTIME_DIR/inferd/control.sock, else /tmp/inferd-$UID/control.sock)",
        ),
    ] = None
    metrics: Annotated[
        str, _doc('HOST:PORT of the Prometheus endpoint (text format at /metrics); "" turns it off.')
    ] = "127.0.0.1:9464"
    http: Annotated[
        str, _doc('HOST:PORT of the Open Inference Protocol over HTTP (KServe v2, Triton\'s REST); "" turns it off.')
    ] = "127.0.0.1:8000"
    grpc: Annotated[
        str, _doc('HOST:PORT of the Open Inference Protocol over gRPC (inference.GRPCInferenceService); '
                  '"" turns it off.')
    ] = "127.0.0.1:8001"
    http_allowed_hosts: Annotated[
        tuple[str, ...],
        _doc("With server.http on a loopback address: Host names a request may carry besides loopback ones "
             "(localhost and names under .localhost, IP addresses in 127.0.0.0/8, ::1); any other is answered "
             "403, so a web page cannot reach the daemon by DNS rebinding."),
    ] = ()
    http_processes: Annotated[
        int, Meta(ge=1, le=64),
        _doc("Gateway processes serving server.http, on one port (SO_REUSEPORT): the kernel spreads new "
             "connections over them, so the HTTP front end uses as many cores.")
    ] = 1
    grpc_processes: Annotated[
        int, Meta(ge=1, le=64), _doc("Gateway processes serving server.grpc, on one port (SO_REUSEPORT).")
    ] = 1
    tls_cert: Annotated[
        str, _doc('TLS for the HTTP and gRPC front ends: the certificate chain file (PEM); "" turns TLS off.')
    ] = ""
    tls_key: Annotated[str, _doc("With tls_cert: its private key file (PEM).")] = ""
    allow_client_shm: Annotated[
        bool | tuple[str, ...],
        _doc("Local clients may hand tensors over in shared-memory regions they register: true (every "
             'protocol), false, or a list of "zmq", "http", "grpc". Only ever over ipc:// or a loopback '
             "address; elsewhere it is refused."),
    ] = False
    client_shm_prefix: Annotated[
        str, _doc("Every client region's shared-memory name starts with this (so it can name no other file); "
                  '"" allows any name but the daemon\'s own arenas, as Triton does (perf_analyzer\'s '
                  "`--shared-memory system` names its regions after the tensors).")
    ] = CLIENT_PREFIX
    client_shm_scope: Annotated[
        Literal["connection", "server"],
        _doc('Whose a region registered over HTTP or gRPC is: "connection", the connection it was registered '
             'on (it goes when that closes); "server", every local client\'s, until unregistered, as in '
             "Triton (its clients may register on one connection and infer on another). ZeroMQ clients' "
             "regions are always their connection's."),
    ] = "connection"
    state_dir: Annotated[
        str | None,
        _doc(
            "Folder for the live versions and the demo repository (a relative path is relative to the config "
            "file's folder).",
            "/var/lib/inferd (a user who cannot write it: ~/.local/state/inferd)",
        ),
    ] = None
    model_root: Annotated[
        str,
        _doc("A folder of model folders: each folder in it that holds a `model.toml` is a model named after the "
             "folder, its repository that folder, its keys those of a [models.NAME] table (without "
             "`repository`). They serve beside the config's own [models.*]; a SIGHUP reads the folder again. "
             '"" turns it off.', live=True),
    ] = ""
    curve_secret_key: Annotated[
        str,
        _doc('CURVE for tcp endpoints: the server\'s secret key file (made by `inferctl keygen`); "" turns CURVE off.'),
    ] = ""
    curve_authorized_keys: Annotated[
        str,
        _doc("With CURVE: the folder of client public key files allowed to connect; others are refused."),
    ] = ""
    max_message_mb: Annotated[
        float, Meta(gt=0, le=4096),
        _doc("Largest request accepted, in MiB; larger ones are answered `invalid` (the Python client refuses "
             "them before sending: give it the same `max_message_mb`)."),
    ] = DEFAULT_MAX_MESSAGE_MB
    gateway_buffer_mb: Annotated[
        float, Meta(gt=0, le=65536),
        _doc("What the unfinished requests of one HTTP or gRPC gateway process may hold, in MiB: their bodies as "
             "they arrive, inflate and wait for their answers. An HTTP body whose Content-Length does not fit what "
             "is left is answered 503 with Retry-After: 1 before it is read, and a chunked one is cut where it "
             "would pass; a gRPC call waits for room to receive its message (as much as server.max_message_mb), "
             "and is answered UNAVAILABLE if none comes in time. At least server.max_message_mb."),
    ] = 256
    min_body_kib_s: Annotated[
        float, Meta(ge=0),
        _doc("The slowest an HTTP request body may arrive, in KiB/s over any 10 s (unless less is left to "
             "come); a slower one is answered 408 and its connection closed. 0: only a body that sends nothing "
             "for 10 s is cut."),
    ] = 64
    drain_timeout_s: Annotated[
        float, Meta(ge=0),
        _doc("On SIGTERM, how long queued and running work may take to finish, in seconds.", live=True),
    ] = 30
    spin_us: Annotated[
        int,
        Meta(ge=0, le=100_000),
        _doc("After activity, while no request waits for a busy executor, the supervisor polls without "
             "sleeping this long, in microseconds (0: never): lower latency where idle cores wake slowly.",
             live=True),
    ] = 500
    log_level: Annotated[
        str, _doc("debug, info, warning or error; INFERD_LOG_LEVEL in the environment, or `inferd serve "
                  "--log-level`, overrides it (a SIGHUP keeps the override).", live=True)
    ] = "info"


class WorkersConfig(msgspec.Struct, frozen=True, kw_only=True):
    """[workers]: where models run."""

    devices: Annotated[
        str | tuple[str, ...],
        _doc('"auto" (one worker per visible GPU, else one CPU worker) or a list such as ["cuda:0", "cpu"].'),
    ] = "auto"
    streams: Annotated[
        int, Meta(ge=1, le=16), _doc("Batches each worker runs at once (CUDA streams on a GPU, threads on the CPU).")
    ] = 2
    shm_mb: Annotated[
        int, Meta(ge=1, le=65536), _doc("Shared-memory arena per worker, in MiB; it holds every batch in flight.")
    ] = 256
    cpu_threads: Annotated[int, Meta(ge=1, le=1024), _doc("torch intra-op threads in a CPU worker.")] = 1
    model_memory_mb: Annotated[
        float, Meta(ge=0),
        _doc("What the models on one worker may hold, in MiB (0: no budget): device memory on a GPU, measured "
             "after warm-up (its peak included); on the CPU, parameters and buffers and the largest warm-up "
             "batch's inputs and outputs. To load an on-demand model, the least recently used idle on-demand "
             "models of a worker are unloaded first; a model that cannot fit beside the \"always\" models is "
             "refused with a sentence. Before its first load a model is taken to need its file's size.",
             live=True),
    ] = 0
    reload_memory_factor: Annotated[
        float,
        Meta(ge=0),
        _doc("Memory guard: before a new version loads, the device must have this many times its file size free.",
             live=True),
    ] = 2.0
    batch_timeout_s: Annotated[
        float,
        Meta(gt=0),
        _doc("A batch running longer than this means its worker is hung: it is aborted and replaced "
             "(and the systemd watchdog pauses meanwhile).", live=True),
    ] = 60
    max_restarts: Annotated[
        int,
        Meta(ge=0),
        _doc("A worker or gateway that dies more often than this within a minute is given up (shown in "
             "status).", live=True),
    ] = 5
    leak_warn_mb: Annotated[
        float,
        Meta(gt=0),
        _doc("Leak watch, in MiB: warn when one batch grows a worker's memory this much, and once when it has "
             "grown this much over its level after warm-up.", live=True),
    ] = 100
    fragmentation_trim: Annotated[
        float,
        Meta(ge=0, le=1),
        _doc("A GPU worker that sits idle with more than this share of its reserved memory unused returns it, "
             "and again only once what it reserves has grown by 64 MiB (what a trim cannot return, such as CUDA "
             "graphs' memory pools, stays reserved)."),
    ] = 0.25
    trim_request_file: Annotated[
        str,
        _doc("In a Kubernetes pod: the downward-API file of the pod's annotations; each new value of its "
             "inferd.io/trim-requested annotation (set by inferd-fleet) has every worker return its unused "
             'GPU memory, as `inferctl trim` does. "" turns it off.', live=True),
    ] = ""
    start_timeout_s: Annotated[
        float, Meta(gt=0),
        _doc("How long a worker may take to load and warm its models before it counts as failed.", live=True),
    ] = 300
    load_timeout_s: Annotated[
        float, Meta(gt=0),
        _doc("How long a running worker may take to load and warm a new version; past it the reload is "
             "abandoned and the worker replaced (its live versions serve on elsewhere meanwhile).", live=True),
    ] = 300


class QueueConfig(msgspec.Struct, frozen=True, kw_only=True):
    """[queue]: admission and deadlines."""

    max_size: Annotated[
        int, Meta(ge=1, le=1_000_000),
        _doc("Requests waiting at most, over all models; more are answered `overloaded`.", live=True),
    ] = 1024
    max_bytes: Annotated[
        int, Meta(ge=1),
        _doc("Bytes of requests waiting at most, over all models; more are answered `overloaded`.", "1 GiB",
             live=True),
    ] = 1 << 30
    max_per_client: Annotated[
        int,
        Meta(ge=0),
        _doc("Requests one connection may have waiting (0: no cap); more are answered `overloaded`, "
             "so one client flooding cannot starve the others.", live=True),
    ] = 512
    max_bytes_per_client: Annotated[
        int, Meta(ge=1),
        _doc("Bytes of requests one connection may have waiting; more are answered `overloaded`. It also sizes "
             "what ZeroMQ may buffer for one connection (docs/operations/memory.md).", "256 MiB", live=True),
    ] = 256 << 20
    default_timeout_ms: Annotated[
        int, Meta(ge=1), _doc("Deadline of a request whose header gives no timeout_ms, in milliseconds.", live=True)
    ] = 1000
    priority_levels: Annotated[
        int, Meta(ge=1, le=16),
        _doc("Priority levels a request may name, 0 (the most urgent) to priority_levels - 1.", live=True),
    ] = 2
    default_priority: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        _doc("The level of a request that names none (below priority_levels).", "priority_levels - 1", live=True),
    ] = None
    priority_share: Annotated[
        float, Meta(gt=0, le=0.5),
        _doc("The least share of its model's batches a level with requests waiting leads, however much more "
             "urgent work waits: no level starves.", live=True),
    ] = 0.1

    @property
    def default_level(self) -> int:
        """The level of a request that names none: default_priority, else the least urgent."""
        return self.priority_levels - 1 if self.default_priority is None else self.default_priority


class InputSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model input: dtype name, per-sample shape (no batch dim; -1 for a dim of any size up to its
    `max_shape`), and the name the Open Inference Protocol knows it by (default `INPUT__<i>`, Triton's
    PyTorch convention)."""

    dtype: str
    shape: Annotated[tuple[int, ...], Meta(max_length=7)]
    name: str | None = None
    max_shape: Annotated[tuple[int, ...], Meta(max_length=7)] | None = None
    pad_value: float | None = None  # its -1 dims may be padded with this, to batch with requests of other sizes

    @property
    def variable(self) -> bool:
        """Whether a request's sample may have any size in some dim (a -1 in `shape`)."""
        return -1 in self.shape

    @property
    def bound(self) -> tuple[int, ...]:
        """The largest per-sample shape: `shape`, each -1 taken at its `max_shape`."""
        return self.max_shape if self.max_shape is not None else self.shape

    @property
    def padded(self) -> bool:
        """Whether its -1 dims are padded (it has a pad_value)."""
        return self.pad_value is not None

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a sample of `shape` (no batch dim) is one this input takes."""
        return len(shape) == len(self.shape) and all(
            given == dim if dim != -1 else given <= most for given, dim, most in zip(shape, self.shape, self.bound))


class OutputSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model output, as the Open Inference Protocol names it (default `OUTPUT__<i>`); where inputs are
    padded, the input dims its own size follows (`unpad`: "INPUT", or "INPUT:DIM[,DIM]"), cut back to each
    request's size; and its dtype and per-sample shape (a -1 for a dim of any size up to its `max_shape`), which
    a Python model must declare, and a tensor model may (its warm-up must then find them)."""

    name: str | None = None
    unpad: str | None = None
    dtype: str | None = None
    shape: Annotated[tuple[int, ...], Meta(max_length=7)] | None = None
    max_shape: Annotated[tuple[int, ...], Meta(max_length=7)] | None = None

    @property
    def declared(self) -> bool:
        """Whether it gives its dtype and shape."""
        return self.dtype is not None and self.shape is not None

    @property
    def bound(self) -> tuple[int, ...]:
        """The largest per-sample shape: `shape`, each -1 taken at its `max_shape`."""
        return self.max_shape if self.max_shape is not None else self.shape or ()

    def follows(self, inputs: tuple[InputSpec, ...], names: list[str]) -> tuple[int, tuple[int, ...]] | None:
        """The input (its index) and its per-sample dims, in order, that `unpad` names; None without one."""
        if self.unpad is None:
            return None
        name, _, dims = self.unpad.rpartition(":") if UNPAD_DIMS.match(self.unpad.rpartition(":")[2]) \
            else (self.unpad, "", "")
        index = names.index(name)
        spec = inputs[index]
        return index, tuple(map(int, dims.split(","))) if dims else tuple(
            dim for dim, size in enumerate(spec.shape) if size == -1)


class CanaryGuard(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """[models.NAME.canary_guard]: when a canary is taken back by itself (docs/operations/canary.md)."""

    window_s: Annotated[
        float, Meta(gt=0, le=60),
        _doc("The span the candidate is judged over against the live version, in seconds.", live=True),
    ] = 60
    max_error_increase: Annotated[
        float, Meta(ge=0, le=1),
        _doc("How far the candidate's share of `internal` replies may exceed the live version's (0.01: one "
             "point) before it is rolled back.", live=True),
    ] = 0.01
    max_p99_increase: Annotated[
        float, Meta(ge=0),
        _doc("How far the candidate's p99 latency may exceed the live version's, as a fraction (0.5: 50 % "
             "slower) before it is rolled back; judged once each has 100 ok replies in the window.", live=True),
    ] = 0.5
    min_p99_increase_ms: Annotated[
        float, Meta(ge=0),
        _doc("The least p99 increase over the live version's, in milliseconds, that counts as slower (beside "
             "max_p99_increase): 1.6 ms against 1 ms is noise, not a slower version.", live=True),
    ] = 5
    min_requests: Annotated[
        int, Meta(ge=1),
        _doc("Replies of the candidate in the window before it is judged at all (or promoted).", live=True),
    ] = 20


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """[models.NAME]: one model, its repository and its batching knobs."""

    inputs: Annotated[
        tuple[InputSpec, ...],
        Meta(min_length=1),
        _doc('Per-sample inputs, e.g. [{ dtype = "float32", shape = [256] }]. A dim may be -1 (any size) with '
             'max_shape bounding it, e.g. { dtype = "int64", shape = [-1], max_shape = [512] }: requests batch '
             "with requests of the same shape, and arena slots are sized for max_shape. With pad_value (e.g. "
             "pad_value = 0) on every such input, requests of other sizes batch together, padded (shape_buckets)."),
    ]
    repository: Annotated[
        str | None,
        _doc("Folder holding VERSION/model.pt (TorchScript) or VERSION/model.pt2 (torch.export); a relative "
             "path is relative to the config file's folder.", "STATE_DIR/models/NAME"),
    ] = None
    version: Annotated[
        str, _doc('Version served first: a version folder name, or "latest" (a SIGHUP that changes it reloads).',
                  live=True),
    ] = "latest"
    max_batch_size: Annotated[
        int, Meta(ge=1, le=65536),
        _doc("Samples per batch at most; a request with more is `invalid`. Live only while a full batch still "
             "fits an arena slot.", live=True),
    ] = 32
    max_wait_ms: Annotated[
        Annotated[float, Meta(ge=0)] | Literal["auto"],
        _doc('How long a partial batch may wait for company while every executor is busy, in milliseconds; '
             '"auto": until an executor is about to be free, or a deadline in the batch says go '
             '(docs/operations/scheduling.md).', live=True),
    ] = 2
    outputs: Annotated[
        tuple[OutputSpec, ...],
        _doc('Names of the outputs for the Open Inference Protocol, e.g. [{ name = "logits" }]; unnamed ones are '
             "OUTPUT__<i>. Where inputs are padded, an output whose size follows theirs says which input dims it "
             'follows, e.g. { name = "tokens", unpad = "input_ids:0" } ("input_ids": its -1 dims in order), and '
             "is cut back to each request's own size; outputs of fixed size are returned as they are. An output may "
             'give its dtype and per-sample shape, as an input does, e.g. { name = "label", dtype = "int64", '
             'shape = [1] } (a -1 with max_shape where its size varies): a Python model must, in the order it '
             "answers them (inferd cannot learn them by running it); a tensor model's warm-up must find them."),
    ] = ()
    warmup_batch_sizes: Annotated[
        tuple[Annotated[int, Meta(ge=1)], ...] | None,
        _doc("Batch sizes run once before a worker reports ready.", "[1, max_batch_size]", live=True),
    ] = None
    load: Annotated[
        Literal["always", "on_demand"],
        _doc('"always": every worker loads it at start and keeps it. "on_demand": no worker loads it until a '
             "request for it comes; that request waits (within its deadline) while one worker loads and warms it; "
             "`inferctl unload` takes it off again, and workers.model_memory_mb bounds what they hold. A load "
             "that fails is not tried again for a backoff (1 s, doubling to 60 s), during which its requests are "
             "refused with the reason."),
    ] = "always"
    compile: Annotated[
        Literal["none", "inductor"],
        _doc('"inductor": a torch.export version is compiled with torch.compile while it loads and warms up, so no '
             "request waits for it (workers.load_timeout_s covers it); what it compiles is cached in "
             'STATE_DIR/compile-cache for restarts and the other workers. "none": run as exported. TorchScript and '
             "AOTInductor versions are run as they are.", live=True),
    ] = "none"
    shape_buckets: Annotated[
        tuple[Annotated[int, Meta(ge=1)], ...],
        _doc("Sizes a padded -1 dim (an input with pad_value) is padded to, ascending, e.g. [32, 64, 128, 256, 512]: "
             "a request batches with those of its own bucket (the smallest that holds it), and with those of a "
             "bucket at least half as large only while theirs could not fill a batch; a size above the largest is "
             "its own bucket. Warm-up runs each. Empty: a batch is padded to its longest request."),
    ] = ()
    padding_rtol: Annotated[
        float, Meta(ge=0),
        _doc("With pad_value: at load, a sample is computed at its own size and padded, and the version is refused "
             "where the two answers differ by more than this, relative to the answer at its own size (with "
             "padding_atol, as numpy.allclose): padding would change its replies (docs/models.md). A SIGHUP's "
             "value applies from the next load.", live=True),
    ] = CANARY_RTOL
    padding_atol: Annotated[
        float, Meta(ge=0),
        _doc("With pad_value: the absolute difference beside padding_rtol that the padding check allows.",
             live=True),
    ] = CANARY_ATOL
    batch_buckets: Annotated[
        tuple[Annotated[int, Meta(ge=1)], ...],
        _doc("Batch sizes the model is run at, ascending, e.g. [1, 2, 4, 8, 16, 32]: a batch is padded up to the "
             "next one (with copies of its last sample) and its outputs cut back, so the model sees few distinct "
             "shapes; a batch above the largest runs as it is. Warm-up runs each. Empty: every batch as it is."),
    ] = ()
    cuda_graphs: Annotated[
        bool,
        _doc("GPU only, with batch_buckets: each executor captures the model as a CUDA graph at each bucket while "
             "it warms up, and replays it for the batches of that bucket, their inputs copied into the graph's "
             "own buffers; a batch above the largest bucket runs without one. Launching a small model's kernels "
             "one by one can take longer than running them. Refused on a CPU worker."),
    ] = False
    precision: Annotated[
        str,
        _doc('"fp32", "fp16" or "bf16" (GPU only): the model is converted when it loads, floating inputs are cast '
             "on the device, floating outputs come back as float32."),
    ] = "fp32"
    allow_writable: Annotated[
        bool,
        _doc("Serve a version whose model file or folder others than its owner may write. A model file is code the "
             "worker runs (an AOTInductor package holds a shared library; a torch.export archive can hold pickled "
             "parts), so by default such a version is refused.", live=True),
    ] = False
    retry_lost_batches: Annotated[
        bool,
        _doc("A batch lost with its worker (a crash, a hang) is computed again, once, on another executor, and a "
             "batch of several requests that raises is run again one request at a time, so that a bad request "
             "fails alone: inference is a pure function of its inputs. false for a model that is not safe to run "
             "twice (a lost batch's requests are answered `internal`, and a raising batch fails every request in "
             "it).", live=True),
    ] = True
    processes: Annotated[
        int, Meta(ge=1, le=256),
        _doc("A Python model (model.py): the processes that run it, each its own interpreter with one instance of "
             "the model, started, supervised and restarted as workers are (`inferd: step NAME.K`); its CPU work "
             "scales with them.", live="raised: applied (its new processes start); lowered: restart"),
    ] = 1
    python: Annotated[
        str,
        _doc("A Python model: the interpreter its processes run under, e.g. a virtual environment made ahead of "
             "time with the packages the model needs and inferd's step code (the `inferd[step]` extra: "
             'docs/models.md); "" runs them under the daemon\'s own. inferd installs nothing.'),
    ] = ""
    parameters: Annotated[
        dict[str, Any],
        _doc("A Python model: a table handed to its constructor (context.parameters), e.g. "
             '{ top_k = 5, labels = "labels.txt" }.'),
    ] = {}
    canary_guard: Annotated[
        CanaryGuard | None,
        _doc("With this table every canary of the model started from now on is guarded, as with `inferctl reload "
             "--auto-rollback`: rolled back by itself when it fails more often or answers slower than the live "
             "version. A SIGHUP's new margins apply to a running guarded canary at its next check.",
             "none (guarded only with --auto-rollback, by the defaults below)", live=True),
    ] = None

    def input_names(self) -> list[str]:
        """Each input's protocol name: its configured name, else INPUT__<i>."""
        return [spec.name or f"INPUT__{index}" for index, spec in enumerate(self.inputs)]

    def output_name(self, index: int) -> str:
        """Output `index`'s protocol name: the configured one, else OUTPUT__<index>."""
        named = self.outputs[index].name if index < len(self.outputs) else None
        return named or f"OUTPUT__{index}"

    @property
    def on_demand(self) -> bool:
        """Whether workers load it only when a request needs it."""
        return self.load == "on_demand"

    @property
    def variable(self) -> bool:
        """Whether it takes inputs of any size in some dim (a -1)."""
        return any(spec.variable for spec in self.inputs)

    @property
    def padded(self) -> bool:
        """Whether its -1 dims are padded, so that requests of other sizes batch together."""
        return any(spec.padded for spec in self.inputs)

    @property
    def takes_bytes(self) -> bool:
        """Whether an input is BYTES: a batch's size is then its elements', not its shape's."""
        return any(spec.dtype == BYTES for spec in self.inputs)

    @property
    def batches_by_shape(self) -> bool:
        """Whether a request batches only with requests of its own shape (or shape bucket): inputs of any
        size, unpadded or padded to buckets. Padded to each batch's longest, any request joins any batch."""
        return self.variable and (not self.padded or bool(self.shape_buckets))

    def bucket(self, size: int, bound: int) -> int:
        """What a padded dim of `size` (at most `bound`, its max_shape) is padded to: the smallest of
        shape_buckets that holds it, never past the bound; a size above them all, itself."""
        return next((min(bucket, bound) for bucket in self.shape_buckets if bucket >= size), size)


def padding_problem(model: ModelConfig) -> tuple[str, str] | None:
    """Where padding is configured inconsistently: the key and a sentence; None when it is not."""
    padded = [index for index, spec in enumerate(model.inputs) if spec.padded]
    for index, spec in enumerate(model.inputs):
        if spec.padded and not spec.variable:
            return "inputs", f"input {index} has pad_value but no -1 dim: pad_value is for the -1 dims"
        if padded and spec.variable and not spec.padded:
            return "inputs", (f"input {index} has a -1 dim but no pad_value, while input {padded[0]} is padded: "
                              "give every input with a -1 dim a pad_value, or none")
    if model.shape_buckets and not padded:
        return "shape_buckets", "no input has a pad_value, so nothing is padded to a bucket"
    if list(model.shape_buckets) != sorted(set(model.shape_buckets)):
        return "shape_buckets", "list each size once, smallest first (e.g. [32, 64, 128])"
    names = model.input_names()
    for index, output in enumerate(model.outputs):
        try:
            found = output.follows(model.inputs, names)
        except ValueError:
            return "outputs", f"output {index}: unpad {output.unpad!r} names no input; the inputs are {names}"
        if found is None:
            continue
        source, dims = found
        spec = model.inputs[source]
        if not spec.padded or any(dim >= len(spec.shape) or spec.shape[dim] != -1 for dim in dims):
            return "outputs", (f"output {index}: unpad {output.unpad!r} must name -1 dims of an input with "
                               f"pad_value; {names[source]} is {list(spec.shape)}"
                               f"{'' if spec.padded else ' and has no pad_value'}")
    return None


class PipelineInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One input of a pipeline: its name, dtype and per-sample shape (no batch dim; -1 for a dim of any size up
    to its `max_shape`), as a model's input."""

    name: str
    dtype: str
    shape: Annotated[tuple[int, ...], Meta(max_length=7)]
    max_shape: Annotated[tuple[int, ...], Meta(max_length=7)] | None = None

    def as_input(self) -> InputSpec:
        """The same input as a model's, to check requests against."""
        return InputSpec(self.dtype, self.shape, self.name, self.max_shape)


class PipelineStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One step of a pipeline: the model it runs, each of that model's inputs and outputs mapped to the
    pipeline's tensor of that name, and the step's name (default: its model's), which errors and stats use."""

    model: str
    inputs: dict[str, str]
    outputs: dict[str, str]
    name: str | None = None

    @property
    def title(self) -> str:
        """The step's name: the one given, else its model's."""
        return self.name or self.model


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """[pipelines.NAME]: models chained in the daemon, served under the pipeline's own name (docs/pipelines.md)."""

    inputs: Annotated[
        tuple[PipelineInput, ...], Meta(min_length=1),
        _doc('What a request of the pipeline carries, each input named, e.g. [{ name = "image", dtype = "bytes", '
             "shape = [1] }] (a -1 dim needs max_shape, as a model's input).", live=True),
    ]
    outputs: Annotated[
        tuple[str, ...], Meta(min_length=1),
        _doc('The tensors its reply carries, in order, each produced by a step, e.g. ["labels", "scores"].', live=True),
    ]
    steps: Annotated[
        tuple[PipelineStep, ...], Meta(min_length=1),
        _doc('The models it runs, each mapping its model\'s input and output names to the pipeline\'s tensors, e.g. '
             '{ model = "resnet", inputs = { INPUT__0 = "pixels" }, outputs = { OUTPUT__0 = "logits" } }; a step '
             "runs as soon as its inputs exist, its requests batched with the model's others. `name` (default: the "
             "model's) is required where a model is a step twice.", live=True),
    ]
    max_in_flight: Annotated[
        int, Meta(ge=1, le=1_000_000),
        _doc("Requests of the pipeline admitted and not yet answered, at most; more are answered `overloaded`, so "
             "a slow step slows admission instead of holding more in memory.", live=True),
    ] = 256


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """The whole validated configuration, with every default resolved."""

    server: ServerConfig
    workers: WorkersConfig
    queue: QueueConfig
    models: dict[str, ModelConfig]
    source: str | None = None
    pipelines: dict[str, PipelineConfig] = {}


SECTIONS: dict[str, type[msgspec.Struct]] = {
    "server": ServerConfig,
    "workers": WorkersConfig,
    "queue": QueueConfig,
}


def _check_endpoint(value: str) -> str | None:
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return None
    if value.startswith("tcp://") and HOST_PORT.match(value[len("tcp://"):]):
        return None
    return f"{value!r} is not an endpoint; use tcp://HOST:PORT or ipc://PATH"


def _check_listen(value: tuple[str, ...]) -> str | None:
    return next((problem for problem in map(_check_endpoint, value) if problem), None)


def _check_address(value: str) -> str | None:
    if value == "" or HOST_PORT.match(value):
        return None
    return f'{value!r} is not HOST:PORT (or "" to turn it off)'


def _check_names(names: list[str | None], what: str) -> str | None:
    given = [n for n in names if n is not None]
    bad = [n for n in given if not TENSOR_NAME.match(n)]
    if bad:
        return f"{bad[0]!r} is not a {what} name: letters, digits, '_', '.', '-' or ':' (at most 128)"
    twice = sorted({n for n in given if given.count(n) > 1})
    return f"{what} name {twice[0]!r} is given twice" if twice else None


def _check_devices(value: str | tuple[str, ...]) -> str | None:
    if isinstance(value, str):
        return None if value == "auto" else f'{value!r}: use "auto" or a list such as ["cuda:0", "cpu"]'
    if not value:
        return 'the list is empty: use "auto" or name at least one device'
    bad = [device for device in value if not DEVICE.match(device)]
    return f"{bad[0]!r} is not a device; use \"cpu\" or \"cuda:N\"" if bad else None


def _check_inputs(value: tuple[InputSpec, ...]) -> str | None:
    bad = [spec.dtype for spec in value if spec.dtype not in WIRE_DTYPES]
    if bad:
        return f"unknown dtype {bad[0]!r}; known: {', '.join(WIRE_DTYPES)}"
    padded = next((index for index, spec in enumerate(value) if spec.dtype == BYTES and spec.padded), None)
    if padded is not None:
        return (f"input {padded} is bytes and has a pad_value: byte strings are not padded (requests of BYTES "
                "inputs batch by their shape)")
    return next((problem for index, spec in enumerate(value)
                 if (problem := _check_shape(f"input {index}", spec.shape, spec.max_shape))), None) \
        or _check_names([spec.name for spec in value], "input")


def _check_pipeline_inputs(value: tuple[PipelineInput, ...]) -> str | None:
    return _check_inputs(tuple(spec.as_input() for spec in value))


def _check_outputs(value: tuple[OutputSpec, ...]) -> str | None:
    for index, spec in enumerate(value):
        if spec.dtype is not None and spec.dtype not in WIRE_DTYPES:
            return f"output {index}: unknown dtype {spec.dtype!r}; known: {', '.join(WIRE_DTYPES)}"
        if (spec.dtype is None) != (spec.shape is None):
            return (f"output {index} gives its {'dtype' if spec.shape is None else 'shape'} without its "
                    f"{'shape' if spec.shape is None else 'dtype'}: give both, e.g. dtype = \"float32\", shape = [10]")
        if spec.shape is None and spec.max_shape is not None:
            return f"output {index} has max_shape but no shape"
        problem = _check_shape(f"output {index}", spec.shape, spec.max_shape) if spec.shape is not None else None
        if problem:
            return problem
    return _check_names([spec.name for spec in value], "output")


def _check_shape(what: str, dims: tuple[int, ...], bound: tuple[int, ...] | None) -> str | None:
    shape, variable = list(dims), -1 in dims
    if any(dim < 1 and dim != -1 for dim in shape):
        return f"{what} has shape {shape}: each dim is at least 1, or -1 for a dim of any size"
    if bound is None:
        return (f"{what} has shape {shape}, whose -1 needs a bound: add max_shape, the largest sample it "
                f"takes, e.g. max_shape = {[512 if dim == -1 else dim for dim in shape]}") if variable else None
    if not variable:
        return f"{what} has max_shape but no -1 in its shape {shape}: max_shape bounds the -1 dims"
    if len(bound) != len(shape) or any(dim not in (-1, most) or most < 1 for dim, most in zip(shape, bound)):
        return (f"{what} has max_shape {list(bound)}, which does not match its shape {shape}: as many dims, "
                "each fixed dim as it is, a bound of at least 1 for each -1")
    return None


def _check_python(value: str) -> str | None:
    if value == "" or (Path(value).is_file() and os.access(value, os.X_OK)):
        return None
    return f"{value!r} is not an interpreter this user may run; give the path of a python executable"


# A tensor model's keys, and the value a Python model leaves them at.
TENSOR_ONLY: dict[str, object] = {"cuda_graphs": False, "precision": "fp32", "compile": "none", "batch_buckets": (),
                                  "load": "always"}


def kind_problem(model: ModelConfig, python: bool) -> tuple[str, str] | None:
    """Where a model's config does not fit its kind (a Python model's version holds model.py, a tensor model's
    a file torch saved): the key and a sentence; None when it fits."""
    if not python:
        python_only: dict[str, object] = {"processes": 1, "python": "", "parameters": {}}
        for key, default in python_only.items():
            if getattr(model, key) != default:
                return key, (f"{key} is for a Python model (a version folder holding model.py), and this one is a "
                             "tensor model; remove it")
        strings = next((f"{kind}s" for kind, specs in (("input", model.inputs), ("output", model.outputs))
                        if any(spec.dtype == BYTES for spec in specs)), None)
        if strings is not None:
            return strings, ("a tensor model takes and gives tensors, not byte strings (dtype bytes); decode or encode "
                             "them in a Python model (a version folder holding model.py)")
        return None
    if not model.outputs or not all(output.declared for output in model.outputs):
        return "outputs", ("a Python model (model.py) lists its outputs, each with its dtype and per-sample shape, "
                           'in the order it answers them, e.g. outputs = [{ name = "label", dtype = "int64", '
                           "shape = [1] }]: inferd cannot learn them by running it")
    for key, default in TENSOR_ONLY.items():
        if getattr(model, key) != default:
            return key, (f"{key} is for a tensor model; a Python model runs in processes of its own, always "
                         "loaded, as its code says: remove it")
    return None


def _check_file(value: str) -> str | None:
    return None if value == "" or Path(value).is_file() else f"{value!r} is not a file"


def _check_folder(value: str) -> str | None:
    return None if value == "" or Path(value).is_dir() else f"{value!r} is not a folder"


def version_problem(value: str) -> str | None:
    """Why `value` cannot name a version folder (it would be empty or leave the repository); None if it can."""
    if value in ("", ".", "..") or "/" in value or "\\" in value:
        return f"{value!r} is not a version name"
    return None


PRECISIONS = ("fp32", "fp16", "bf16")


LOG_LEVELS = ("debug", "info", "warning", "error")
SHM_PROTOCOLS = ("zmq", "http", "grpc")
SHM_PREFIX = re.compile(r"^[A-Za-z0-9_.-]{0,100}$")


def _check_shm_protocols(value: bool | tuple[str, ...]) -> str | None:
    bad = [name for name in value if name not in SHM_PROTOCOLS] if isinstance(value, tuple) else []
    return f"{bad[0]!r} is not a protocol; use true, false, or a list of {', '.join(SHM_PROTOCOLS)}" if bad else None


def _check_shm_prefix(value: str) -> str | None:
    if not SHM_PREFIX.match(value):
        return f"{value!r} is not a shared-memory name prefix: letters, digits, '_', '.', '-' (at most 100)"
    if re.match(rf"^{ARENA_PREFIX}\d", value):
        return f"{value!r} would let clients name the daemon's own arenas (inferd-PID-...)"
    return None


def client_shm_protocols(server: ServerConfig) -> frozenset[str]:
    """The protocols whose local clients may register shared-memory regions."""
    allowed = server.allow_client_shm
    if isinstance(allowed, bool):
        return frozenset(SHM_PROTOCOLS) if allowed else frozenset()
    return frozenset(allowed)


# Keys that name a file or folder: a relative one is read from the config file's folder, not the
# working folder (which under systemd is /).
PATH_KEYS: frozenset[tuple[type, str]] = frozenset({
    (ServerConfig, "state_dir"), (ServerConfig, "tls_cert"), (ServerConfig, "tls_key"),
    (ServerConfig, "curve_secret_key"), (ServerConfig, "curve_authorized_keys"), (ServerConfig, "model_root"),
    (ModelConfig, "repository"), (ModelConfig, "python"),
})

CHECKS: dict[tuple[type, str], Callable[[Any], str | None]] = {
    (ServerConfig, "log_level"): lambda v: None if v in LOG_LEVELS else f"{v!r}: use one of {', '.join(LOG_LEVELS)}",
    (ServerConfig, "listen"): _check_listen,
    (ServerConfig, "control"): lambda v: None if v is None else _check_endpoint(v),
    (ServerConfig, "metrics"): _check_address,
    (ServerConfig, "http"): _check_address,
    (ServerConfig, "grpc"): _check_address,
    (ServerConfig, "allow_client_shm"): _check_shm_protocols,
    (ServerConfig, "client_shm_prefix"): _check_shm_prefix,
    (ServerConfig, "tls_cert"): _check_file,
    (ServerConfig, "tls_key"): _check_file,
    (ServerConfig, "curve_secret_key"): _check_file,
    (ServerConfig, "curve_authorized_keys"): _check_folder,
    (WorkersConfig, "devices"): _check_devices,
    (ModelConfig, "inputs"): _check_inputs,
    (ModelConfig, "outputs"): _check_outputs,
    (ModelConfig, "python"): _check_python,
    (ModelConfig, "version"): version_problem,
    (PipelineConfig, "inputs"): _check_pipeline_inputs,
    (PipelineConfig, "outputs"): lambda v: _check_names(list(v), "output"),
    (ModelConfig, "precision"): lambda v: None if v in PRECISIONS else f"{v!r}: use one of {', '.join(PRECISIONS)}",
}


def field_doc(field: msgspec.structs.FieldInfo) -> Meta | None:
    """The documentation `_doc` gave a field; None if it has none."""
    metas = [m for m in getattr(field.type, "__metadata__", ()) if isinstance(m, Meta)]
    return next((m for m in metas if m.description), None)


def doc_extra(field: msgspec.structs.FieldInfo) -> dict[str, Any]:
    """What `_doc` noted beside a field's text: `live`, and `default_doc` where the default is put in words."""
    meta = field_doc(field)
    return (meta.extra or {}) if meta else {}


def live_keys(cls: type[msgspec.Struct]) -> frozenset[str]:
    """The keys of a section that a SIGHUP applies at once."""
    return frozenset(f.name for f in msgspec.structs.fields(cls) if doc_extra(f).get("live") is True)
