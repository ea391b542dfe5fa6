"""A request's way in: the client-facing sockets and what ZeroMQ may hold of each connection
(receive_limits), their connections and the descriptors they take (connections, descriptors), decoding and
admission (frontend), clients' shared-memory regions named in requests (client_regions), and the finish
estimate admission refuses by (forecast)."""
