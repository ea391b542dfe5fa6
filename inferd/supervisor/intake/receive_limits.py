"""What ZeroMQ may hold of a client connection's requests before the loop reads them, bounded in bytes.

ZeroMQ bounds what it receives for a connection by messages (the receive high-water mark), not by
bytes: it holds up to the mark, plus the one message its I/O thread decoded and could not hand on. So the
mark is the connection's receive budget over the largest request the models take: deep (64) where they
take small ones, which the loop then reads in bursts while the I/O thread reads on (a mark of 16 or 32
cost the loop 2 to 5 us more per request, docs/operations/memory.md), shallow where they take large ones,
beside whose own cost the I/O thread's waits for the loop are little.

The mark is set before a socket binds, for good. A connection takes it from the listening socket as it
is accepted, so a later one misses the connections to come; and libzmq 4.3.5 hands a later one to the
connections a socket has in a way that can stall one for good: a connection's I/O thread, once it holds
a mark's worth of unread messages, waits for the reader's report of messages read, which the reader
sends every half mark, and a changed mark moves those points (tried: a mark lowered from 64 to 1, or
raised from 1 to 64, under traffic left a connection stalled).
"""

from __future__ import annotations

from inferd.config.schema import Config
from inferd.protocol import tensor_bytes

DEEPEST = 64  # the depth the Client and the benchmark pipeline to on one connection: never deeper
BUDGET_SHARE = 4  # a connection's receive budget: this fraction of the bytes it may have waiting in the queue
HEADER_BYTES = 4096  # a request's header, at most as the models' requests need it


def largest_message(config: Config) -> int:
    """The largest message ZeroMQ receives (zmq.MAXMSGSIZE): server.max_message_mb plus a quarter (at least
    1 MiB). Between the two a request is received and answered `invalid` with its size; a larger one makes
    ZeroMQ drop the connection."""
    limit = int(config.server.max_message_mb * (1 << 20))
    return limit + max(1 << 20, limit // 4)


def largest_request(config: Config) -> int:
    """The bytes of the largest request a model takes: a full batch of its inputs at their largest shape,
    and a header (a model of BYTES inputs, whose size their elements say: the largest message); at most
    largest_message()."""
    inputs = max((largest_message(config) if model.takes_bytes else
                  model.max_batch_size * sum(tensor_bytes(spec.dtype, spec.bound) for spec in model.inputs)
                  for model in config.models.values()), default=0)
    return min(largest_message(config), inputs + HEADER_BYTES)


def receive_budget(config: Config) -> int:
    """The bytes ZeroMQ may hold for one connection, beside one message more: a quarter of what the
    connection may have waiting in the queue. The queue is where requests wait; ZeroMQ's buffer only
    keeps the loop fed, which 64 requests of up to 1/256 of the share do (1 MiB at the defaults)."""
    return min(config.queue.max_bytes, config.queue.max_bytes_per_client) // BUDGET_SHARE


def receive_mark(config: Config) -> int:
    """A client socket's receive high-water mark: the budget over the largest request the models take, at
    least 1 (0 would mean no bound) and at most DEEPEST."""
    return max(1, min(DEEPEST, receive_budget(config) // largest_request(config)))
