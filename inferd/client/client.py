"""The thread-safe client: any thread may call, one I/O thread (engine.py) owns the sockets."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import zmq

from inferd import protocol
from inferd.client.call import Call, Outputs, call_timeout, outputs_of, reply_of
from inferd.client.endpoints import EndpointPool, Resolver
from inferd.client.engine import IOLoop
from inferd.client.inputs import Array, Out, as_inputs
from inferd.client.mailbox import Cancel, Mailbox
from inferd.client.outputs import OutputTargets
from inferd.client.retry import RetryPolicy
from inferd.client.shared_memory import SharedMemoryRegion
from inferd.errors import InvalidRequest, Unavailable
from inferd.ipc import curve
from inferd.ipc.curve import KeyFile
from inferd.system.shm_names import CLIENT_PREFIX


def _curve(server_key: KeyFile | None, client_key: KeyFile | None) -> Callable[[zmq.Socket], None]:
    """What to do to each new socket so that it speaks CURVE (nothing, without keys)."""
    if (server_key is None) != (client_key is None):
        raise ValueError("CURVE needs both server_key (the server's public key file) and client_key "
                         "(this client's secret key file)")
    if server_key is None or client_key is None:
        return lambda socket: None
    server_public, pair = curve.load_public(server_key), curve.load_pair(client_key)
    return lambda socket: curve.secure_client(socket, server_public, pair)


class Client:
    """A thread-safe client; one I/O thread owns the sockets, any thread may call.

    `endpoints` is one endpoint, a list of them, or a tcp:// host name that
    resolves to several addresses (looked up again every `resolve_interval`
    seconds, so daemons that come and go are followed). Requests go to the
    connected endpoint with the fewest requests outstanding; endpoints.py says
    how failing or overloaded daemons are rested and probed.

    For daemons with CURVE on their tcp endpoints, give `server_key` (the
    server's public key file) and `client_key` (this client's secret key file,
    whose public half is in the server's authorized folder). `priority` is the
    level of every call that names none (None: the daemon's queue.default_priority).
    `max_message_mb` is the daemon's server.max_message_mb: a request with more bytes
    to send is refused here, before it is sent (a message far over the daemon's limit
    would make ZeroMQ drop the connection rather than carry an answer). With `group`, the
    calls submitted while the I/O thread was busy go to a daemon together, as one message
    (a group, within max_message_mb), and their replies come back the same way where they
    finish in one batch: fewer messages for both sides to handle under load.
    """

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 10.0,
                 retry: RetryPolicy | None = None, server_key: KeyFile | None = None,
                 client_key: KeyFile | None = None, resolve_interval: float = 30.0,
                 priority: int | None = None, max_message_mb: float = protocol.DEFAULT_MAX_MESSAGE_MB,
                 group: bool = True) -> None:
        self.timeout = call_timeout(timeout)
        self.priority = priority
        self.max_message_mb = max_message_mb
        self.retry = retry or RetryPolicy()
        self._ids = itertools.count(1)
        self._mailbox = Mailbox()
        self._context = zmq.Context()
        addresses = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self._pool = EndpointPool(self._context, addresses, _curve(server_key, client_key))
        self._resolver = None
        if self._pool.names:
            self._resolver = Resolver(self._pool.names, resolve_interval, self._resolved)
            self._resolver.start()
        self._closed = False
        self._regions: dict[str, SharedMemoryRegion] = {}  # registered, by name; re-registered on reconnect
        group_bytes = int(max_message_mb * (1 << 20)) if group else 0
        self._thread = threading.Thread(target=IOLoop(self._pool, self._mailbox, self._regions,
                                                      self._from_region, self._ids, group_bytes).run,
                                        name="inferd-client", daemon=True)
        self._thread.start()

    def _resolved(self, name: str, addresses: list[str]) -> None:
        # From the resolver's thread: the I/O thread updates the pool. Once closed, nobody needs it.
        self._mailbox.post((name, addresses))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def infer(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
              version: str | None = None, out: Out = None,
              priority: int | None = None) -> Outputs:
        """Run `model` on `inputs` (batch dim first; a list for several inputs) and wait for its outputs
        (`out`, `priority`: see `submit`)."""
        return self.submit(model, inputs, timeout=timeout, version=version, out=out, priority=priority).result()

    def submit(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
               version: str | None = None, out: Out = None,
               priority: int | None = None, details: bool = False) -> concurrent.futures.Future:
        """Send a request and return a future of its outputs; do not change `inputs` until it is done.
        With `details`, the future gives a Reply: the outputs, the version that computed them and the
        daemon's timing.

        An input that lies in a region registered by this client travels as a reference to it, not as
        bytes (of BYTES: the description `SharedMemoryRegion.put_bytes` gives); `out` (one array, or one per
        output, None for those sent back in the reply; or an `OutputPlace` in a region, where a BYTES output
        goes) asks outputs written into views of registered regions, and those views are what the future gives.
        Each array of `out` must be of its output's dtype and shape: one that the output would not fit is left
        as it is (the output comes in the reply) and the call fails with InvalidRequest, as it does for another
        dtype or shape (whose bytes were written into the array).
        `priority`: its level in the daemon's queue, 0 the most urgent (default: the client's).
        Cancelling the future cancels the request in the daemon.
        """
        call_id = next(self._ids)
        arrays = [self._in_region(array) for array in as_inputs(inputs)]
        inline = sum(protocol.wire_size(array) for array in arrays if isinstance(array, np.ndarray))
        if inline > self.max_message_mb * (1 << 20):
            raise InvalidRequest(f"the request holds {inline / 2**20:.1f} MiB of inputs, over the daemon's limit of "
                                 f"{self.max_message_mb:g} MiB (server.max_message_mb); send fewer samples per "
                                 "request, put the inputs in shared memory, or raise the limit on both sides "
                                 "(Client(max_message_mb=...))")
        targets = OutputTargets(out, self._regions.values())
        level = self.priority if priority is None else priority

        def encode(left_ms: int) -> list[protocol.Buffer]:
            return protocol.encode_request(call_id, model, arrays, version, left_ms, targets.places, level)

        future = self._post(Call(call_id, encode, self.timeout if timeout is None else timeout, self.retry,
                                 targets.deliver(reply_of if details else outputs_of)))

        def tell_if_cancelled(done: concurrent.futures.Future) -> None:
            if done.cancelled():
                self._mailbox.post(Cancel(call_id))

        future.add_done_callback(tell_if_cancelled)
        return future

    def shared_memory(self, byte_size: int, name: str | None = None,
                      prefix: str = CLIENT_PREFIX) -> contextlib.AbstractContextManager[SharedMemoryRegion]:
        """A context manager: a new shared-memory region of `byte_size` bytes, registered with the daemon
        as `name`; on exit it is unregistered, unmapped and unlinked. Fill inputs and read outputs
        through its `array` views."""

        @contextlib.contextmanager
        def region_context() -> Iterator[SharedMemoryRegion]:
            region = SharedMemoryRegion.create(byte_size, name, prefix)
            try:
                self._register(region)
                yield region
            finally:
                if self._regions.pop(region.name, None) is not None and not self._closed:
                    self._region_call(protocol.UnregisterRegion(id=next(self._ids), name=region.name))
                region.close()

        return region_context()

    def register_region(self, name: str, key: str, byte_size: int, offset: int = 0) -> SharedMemoryRegion:
        """Register `byte_size` bytes from `offset` on of the existing shared memory `key` as region `name`,
        and map it here: its `array` views read and write what the daemon sees."""
        region = SharedMemoryRegion(name, key, byte_size, offset)
        try:
            self._register(region)
        except BaseException:
            region.close()
            raise
        return region

    def unregister_region(self, name: str | None = None) -> None:
        """Unregister region `name` (None: every region of this client) and unmap it here."""
        self._region_call(protocol.UnregisterRegion(id=next(self._ids), name=name))
        for each in [name] if name is not None else list(self._regions):
            region = self._regions.pop(each, None)
            if region is not None:
                region.close()

    def regions(self) -> list[protocol.RegionInfo]:
        """The regions the daemon has registered for this client's connection."""
        return list(self._region_call(protocol.RegionStatus(id=next(self._ids))))

    def _register(self, region: SharedMemoryRegion) -> None:
        if len(self._pool.endpoints) != 1 or self._pool.names:
            raise ValueError("shared memory needs a client of one daemon on this machine (one ipc:// or loopback "
                             "endpoint)")
        if region.name in self._regions:
            raise ValueError(f"this client has a region named {region.name!r} already")
        self._region_call(protocol.RegisterRegion(id=next(self._ids), name=region.name, key=region.key,
                                                  byte_size=region.byte_size, offset=region.offset))
        self._regions[region.name] = region

    def _region_call(self, op: protocol.RegionOp) -> tuple[protocol.RegionInfo, ...]:
        """Send a region message and wait for its answer: never retried (a register is not idempotent)."""
        message: list[protocol.Buffer] = [protocol.encode_op(op)]
        call = Call(int(op.id), lambda left_ms: message, self.timeout, RetryPolicy(max_attempts=1),
                    lambda header, outputs: header.regions or ())
        return self._post(call).result()

    def _in_region(self, array: np.ndarray | protocol.TensorMeta) -> np.ndarray | protocol.TensorMeta:
        """`array`, or its place in a registered region if it lies in one."""
        # A description is placed already; byte strings lie in a region only as put_bytes lays them out.
        if isinstance(array, protocol.TensorMeta) or array.dtype.kind == "O":
            return array
        for region in self._regions.values():
            meta = region.describe(array)
            if meta is not None:
                return meta
        return array

    def _from_region(self, meta: protocol.TensorMeta) -> np.ndarray:
        region = self._regions.get(meta.region or "")
        if region is None:
            raise ValueError(f"the reply places an output in region {meta.region!r}, which this client has not")
        if meta.dtype == protocol.BYTES:
            return region.bytes_at(meta.shape, meta.offset, meta.byte_size or 0)
        return region.array(meta.dtype, meta.shape, meta.offset)

    def _post(self, call: Call) -> concurrent.futures.Future:
        if self._closed or not self._mailbox.post(call):
            raise Unavailable("the client is closed")
        return call.future

    def close(self) -> None:
        """Stop the I/O thread; calls still in flight fail with Unavailable."""
        if self._closed:
            return
        self._closed = True
        if self._resolver is not None:
            self._resolver.stop()
        self._mailbox.post(None)
        self._thread.join()
        self._mailbox.close()
        self._context.term()
        for region in self._regions.values():  # the daemon forgets them with the connection
            region.close()
        self._regions.clear()
