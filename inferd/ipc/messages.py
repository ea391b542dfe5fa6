"""Messages between the supervisor and its workers: small msgpack descriptors.

Payloads never travel here; a batch is described by where its tensors lie in
the worker's arena. Each message is one frame, tagged with its type.
"""

from __future__ import annotations

import msgspec

from inferd.config.schema import ModelConfig
from inferd.protocol import BYTES, tensor_bytes


class TensorRef(msgspec.Struct, frozen=True, array_like=True):
    """A tensor in an arena: dtype name, full shape, byte offset from the arena's start; of a BYTES tensor, where
    its elements end, in bytes from `offset`: an output's, after each sample (its replies split it by sample); an
    input's, after the last (its elements' lengths say the rest)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    ends: tuple[int, ...] = ()

    def nbytes(self) -> int:
        """The bytes the tensor takes (a BYTES one: as far as its last sample's end)."""
        return (self.ends[-1] if self.ends else 0) if self.dtype == BYTES else tensor_bytes(self.dtype, self.shape)

    def rows(self, first: int, count: int) -> tuple[int, int]:
        """Where samples `first` to `first + count` lie: (start, end) in bytes from the arena's start."""
        if self.dtype == BYTES:
            return (self.offset + (self.ends[first - 1] if first else 0), self.offset + self.ends[first + count - 1])
        row = tensor_bytes(self.dtype, self.shape[1:])
        return self.offset + first * row, self.offset + (first + count) * row


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """A per-sample signature: dtype name and shape without the batch dim; of an output of a model that takes
    inputs of any size, the dims whose size follows theirs (`varies`), at their size for inputs at max_shape."""

    dtype: str
    shape: tuple[int, ...]
    varies: tuple[int, ...] = ()

    def public_shape(self) -> list[int]:
        """The shape as a client reads it: -1 for each dim whose size varies."""
        return [-1 if dim in self.varies else size for dim, size in enumerate(self.shape)]


class LoadedModel(msgspec.Struct, frozen=True, array_like=True):
    """A model version a worker has loaded and warmed, with its output signature, the memory it holds
    (runner.model_memory), and how many of its executors may run it (0: every one)."""

    version: str
    outputs: tuple[TensorSpec, ...]
    memory: int = 0
    lanes: int = 0


class Hello(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """First message on each of a worker's sockets; it binds the socket's identity to a role."""

    worker: int
    generation: int
    executor: int | None  # None: the worker's control socket


class Ready(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The worker has loaded and warmed every model and its executors are listening."""

    pid: int
    device: str
    models: dict[str, LoadedModel]


class BootFailed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The worker could not start; `error` says why in one sentence."""

    error: str


class RunBatch(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Run `model` at `version` on the inputs, which lie in the slot [slot_offset, slot_offset + slot_size)
    as ipc/slots.py lays them out; the outputs go after them in the same slot.

    `samples` and `deadlines` are per request, in row order: a request whose deadline
    (time.monotonic(), one clock for every process of the machine) has passed when the
    compute would start is not computed. With `retry_alone` (the model's retry_lost_batches),
    a batch of several requests that raises is run again one request at a time, so that a
    bad request fails alone.
    """

    batch_id: int
    model: str
    version: str
    slot_offset: int
    slot_size: int
    inputs: tuple[TensorRef, ...]
    samples: tuple[int, ...]
    deadlines: tuple[float, ...]
    retry_alone: bool = True


class RequestFailed(msgspec.Struct, frozen=True, array_like=True):
    """Request `index` of a batch raised when it was run alone: its reply's `status` (invalid or internal) and
    `error` (the sentence naming the model, the version and the exception)."""

    index: int
    status: str
    error: str


class BatchDone(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The batch ran; its outputs lie where the refs say, the rows of every request that was computed.

    `expired`: indices of the requests whose deadline had passed before the compute; they
    were not computed and have no rows. `memory`: the worker's memory after the batch
    (allocated device bytes on a GPU, resident host bytes on the CPU); `reserved`: the GPU
    allocator's reserved bytes (0 on the CPU); `growth`: what this batch alone grew the
    memory by, where that can be told apart from other executors' batches (else 0).
    `phases_us`: how `compute_us` divides into taking the inputs to the device, the model's
    forward, and writing the outputs to the arena (what Triton's statistics call
    compute_input, compute_infer and compute_output).

    A batch that raised and was run again one request at a time (RunBatch.retry_alone)
    has no `outputs`: `each` holds, per request in row order, the refs of its own outputs
    (none for an expired or failed one), and `failed` the requests that raised alone.
    """

    batch_id: int
    outputs: tuple[TensorRef, ...]
    compute_us: int
    memory: int
    reserved: int
    growth: int
    expired: tuple[int, ...]
    phases_us: tuple[int, int, int] = (0, 0, 0)
    failed: tuple[RequestFailed, ...] = ()
    each: tuple[tuple[TensorRef, ...], ...] = ()


class BatchFailed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The batch could not run; `error` says why, and `status` (internal, or invalid where the model refused
    the input) is its requests' reply status."""

    batch_id: int
    error: str
    status: str = "internal"


class Shutdown(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Finish what is running, then exit."""


class LoadVersion(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Load and warm `version` of `model` beside what is loaded.

    `config`: the model's config now (a model added by a config reload is new to the worker).
    `expect`: the output signature the version must have (None: any).
    `memory_factor`: the room to find before loading, as a multiple of the file's size.
    """

    model: str
    version: str
    config: ModelConfig
    expect: tuple[TensorSpec, ...] | None
    memory_factor: float


class VersionLoaded(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """`version` of `model` is loaded and warmed; how long each step took."""

    model: str
    loaded: LoadedModel
    load_s: float
    warm_s: float


class VersionFailed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """`version` of `model` could not be loaded; whatever was loaded of it is freed."""

    model: str
    version: str
    error: str


class UnloadVersion(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Free `version` of `model`; no batch of it will come again."""

    model: str
    version: str


class SetLogLevel(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Log at `level` from now on."""

    level: str


class TrimMemory(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Return the GPU allocator's unused cached memory to the device now, busy or not."""


class Trimmed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A GPU worker trimmed (asked, or idle): its allocator's bytes in use and reserved now.

    Batches report these too, but an idle worker runs none, and its metrics
    would show the memory it just returned.
    """

    memory: int
    reserved: int


class Ping(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Answer at once with Pong(`sent`): an idle worker shows it is alive (its main thread answers)."""

    sent: float


class Pong(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The answer to Ping(`sent`)."""

    sent: float


Message = (
    Hello | Ready | BootFailed | RunBatch | BatchDone | BatchFailed | Shutdown
    | LoadVersion | VersionLoaded | VersionFailed | UnloadVersion | SetLogLevel | TrimMemory | Trimmed | Ping | Pong
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """One frame holding `message`."""
    return _encoder.encode(message)


def decode(frame: bytes | memoryview) -> Message:
    """The message in `frame`; raises msgspec.DecodeError on a malformed one."""
    return _decoder.decode(frame)
