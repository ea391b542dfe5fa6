"""Python clients of inferd: `Client` (threads) and `AsyncClient` (asyncio).

A client keeps many requests in flight and matches replies by id. It takes one
endpoint, several, or a host name that resolves to several (endpoints.py
spreads the requests and tracks each daemon's health). `timeout` is a call's
whole deadline (finite seconds above zero), retries included; each attempt sends the time left as the
header's `timeout_ms`. Retries happen on `overloaded`, `unavailable` and on a
reply lost because a connection dropped, with exponential backoff and jitter,
on another endpoint where there is one, and never once the deadline cannot be
met. A retry reuses the request id, so whichever reply arrives first wins.
A call's `priority` (the client's by default) orders it in the daemon's queue.
Cancelling a call's future (or an asyncio task awaiting it) sends the daemon a
cancel, which takes the request out of its queue or drops its result.
"""

from inferd.client.async_client import AsyncClient
from inferd.client.call import Reply
from inferd.client.client import Client
from inferd.client.retry import RetryPolicy

__all__ = ["AsyncClient", "Client", "Reply", "RetryPolicy"]
