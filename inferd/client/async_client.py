"""The asyncio client: Client's engine, awaited from an event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from inferd import protocol
from inferd.client.call import Outputs
from inferd.client.client import Client
from inferd.client.inputs import Array, Out
from inferd.client.retry import RetryPolicy
from inferd.ipc.curve import KeyFile


class AsyncClient:
    """The asyncio client: the engine of Client (one I/O thread), awaited from an event loop.

    Its arguments are those of Client.
    """

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 10.0,
                 retry: RetryPolicy | None = None, server_key: KeyFile | None = None,
                 client_key: KeyFile | None = None, resolve_interval: float = 30.0,
                 priority: int | None = None, max_message_mb: float = protocol.DEFAULT_MAX_MESSAGE_MB,
                 group: bool = True) -> None:
        self._client = Client(endpoints, timeout, retry, server_key, client_key, resolve_interval, priority,
                              max_message_mb, group)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def infer(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
                    version: str | None = None, out: Out = None,
                    priority: int | None = None) -> Outputs:
        """Run `model` on `inputs` and return its outputs (`out`, `priority`: see Client.submit); a task
        cancelled while it awaits this cancels the request in the daemon."""
        return await self.submit(model, inputs, timeout=timeout, version=version, out=out, priority=priority)

    def submit(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
               version: str | None = None, out: Out = None,
               priority: int | None = None, details: bool = False) -> asyncio.Future:
        """Send a request and return the future of its outputs (with `details`, of its Reply: see
        Client.submit); cancelling it cancels the request."""
        return asyncio.wrap_future(self._client.submit(model, inputs, timeout=timeout, version=version, out=out,
                                                       priority=priority, details=details))

    @property
    def client(self) -> Client:
        """The Client underneath, for what is set up once and blocks briefly: its shared-memory regions."""
        return self._client

    async def close(self) -> None:
        """Close the client; calls still in flight fail with Unavailable."""
        self._client.close()
