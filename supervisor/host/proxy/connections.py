"""Pooled connections upstream, and one more try on a new connection when a pooled one was closed.

An upstream may close a connection it announced it would keep (llama-server does so after every
streamed answer, though its head says keep-alive; an aiohttp server once its keep-alive time
runs out), and the pool then hands out a closed connection: a request that fails so, before
any answer came, never reached the upstream's handler, and is sent once more on a new
connection of its own (`retried` counts them). Answers are read as they came: never
decompressed. A connection is dialled within CONNECT_S; what it answers is not bounded here.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Final

import aiohttp
from aiohttp import web

CONNECT_S: Final = 10.0
# what an upstream that breaks off raises while it is read
BROKEN: Final = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError)
# a pooled connection the upstream had closed: the request was not written, or no answer began
STALE: Final = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


def client(force_close: bool, tls: ssl.SSLContext | None = None) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=force_close, ssl=tls or True),
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S),
    )


class Connections:
    """One pool of connections, and one that opens a connection per request for the retries;
    `tls`: the context of an https upstream (None: the default's, for https)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self._pooled: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self.retried = 0

    async def session(self, _: web.Application) -> AsyncIterator[None]:
        """The app's cleanup context: the sessions live as long as the app."""
        self._pooled, self._fresh = client(False, self.tls), client(True, self.tls)
        try:
            yield
        finally:
            await self._pooled.close()
            await self._fresh.close()

    async def post(
        self, url: str, data: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        assert self._pooled is not None and self._fresh is not None
        try:
            return await self._pooled.post(url, data=data, headers=headers)
        except STALE:  # closed under us before any answer: never reached the handler
            self.retried += 1
        return await self._fresh.post(url, data=data, headers=headers)
