"""The Open Inference Protocol over HTTP: the ASGI app (rest), the uvicorn server with its guards (server),
and what a request body may take (body_guard)."""
