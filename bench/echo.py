"""The transport reference: a bare pyzmq ROUTER that echoes each request's buffers back.

It answers in the wire format (so the same load generator drives it), passing
the received frames back without copying them: what is left is ZeroMQ and
Python, the least any daemon on this transport can cost.

    python -m bench.echo tcp://127.0.0.1:5600
"""

from __future__ import annotations

import sys

import msgspec
import zmq

from inferd import protocol


def serve(endpoint: str) -> None:
    """Echo until killed."""
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.bind(endpoint)
    decoder = msgspec.json.Decoder(protocol.RequestHeader)
    while True:
        identity, header, *buffers = socket.recv_multipart(copy=False)
        request = decoder.decode(header.buffer)
        reply = protocol.ReplyHeader(id=request.id, status=protocol.OK, model=request.model, version="echo",
                                     outputs=request.inputs)
        socket.send_multipart([identity, protocol.encode_reply(reply), *buffers], copy=False)


if __name__ == "__main__":
    serve(sys.argv[1])
