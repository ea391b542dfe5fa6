"""The Open Inference Protocol (KServe v2, as Triton serves it) in front of inferd.

A gateway process per protocol (gateway.py), spawned and supervised by the
supervisor like a worker, serves it over HTTP (http/: rest.py on server.py) or
gRPC (rpc.py, messages from inference.proto); each request becomes one request
of inferd's own wire protocol on an ipc:// socket of the supervisor's
(upstream.py), so it goes through the same queue, batcher, deadlines, stats and
version rules as a ZeroMQ request, and the supervisor's loop parses neither
HTTP nor protobuf. What both protocols know of the models is catalog.py's.
"""
