"""Python clients of inferd: `Client` (threads) and `AsyncClient` (asyncio)."""

from inferd.client.client import AsyncClient, Client, RetryPolicy

__all__ = ["AsyncClient", "Client", "RetryPolicy"]
