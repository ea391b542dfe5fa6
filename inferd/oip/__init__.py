"""The Open Inference Protocol (KServe v2, as Triton serves it) in front of inferd.

A gateway process (gateway.py), spawned and supervised by the supervisor like a
worker, serves the protocol over HTTP (rest.py); each request becomes one
request of inferd's own wire protocol on an ipc:// socket of the supervisor's
(upstream.py), so it goes through the same queue, batcher, deadlines, stats and
version rules as a ZeroMQ request, and the supervisor's loop does not parse HTTP.
"""
