"""One request to its engine and the answer back: SSE chunk by chunk, errors with their status.

Only the body and its content type go upstream: never the client's Authorization or any other
header. A stream the engine breaks off ends with an error event, never a hang.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final

import aiohttp
from aiohttp import web

from supervisor.host.gateway.body import Prepared
from supervisor.host.gateway.refusal import Refusal
from supervisor.host.gateway.usage import UsageFilter

SSE: Final = "text/event-stream"
_CONNECT_S: Final = 10.0
_BROKEN: Final = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError)


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def unreachable(engine: str, exc: BaseException) -> Refusal:
    return Refusal(502, "engine_unreachable", f"engine {engine} did not answer: {describe(exc)}")


class Forwarder:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def session(self, _: web.Application) -> AsyncIterator[None]:
        """The app's cleanup context: one client session, one pool of connections."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_S),
        )
        try:
            yield
        finally:
            await self._session.close()

    async def send(
        self,
        request: web.Request,
        *,
        url: str,
        path: str,
        prepared: Prepared,
        engine: str,
        sse: web.StreamResponse | None,
    ) -> web.StreamResponse:
        """Forward; `sse` is the client's stream when it was opened already (a start)."""
        assert self._session is not None
        try:
            upstream = await self._session.post(
                url + path, data=prepared.body, headers={"Content-Type": "application/json"}
            )
        except _BROKEN as exc:
            raise unreachable(engine, exc) from None
        async with upstream:
            streams = upstream.headers.get("Content-Type", "").startswith(SSE)
            if upstream.status != 200 or not streams:
                try:
                    content = await upstream.read()
                except _BROKEN as exc:
                    raise unreachable(engine, exc) from None
                if sse is not None:  # the client's stream is open: the answer becomes an event
                    await sse.write(b"data: " + content + b"\n\n")
                    await sse.write_eof()
                    return sse
                return web.Response(
                    status=upstream.status,
                    body=content,
                    headers={"Content-Type": upstream.headers.get("Content-Type", "")},
                )
            if sse is None:
                sse = web.StreamResponse(
                    status=upstream.status,
                    headers={"Content-Type": SSE, "Cache-Control": "no-cache"},
                )
                await sse.prepare(request)
            await self._relay(upstream, sse, UsageFilter(prepared.hide_usage), engine)
            return sse

    async def _relay(
        self,
        upstream: aiohttp.ClientResponse,
        sse: web.StreamResponse,
        usage: UsageFilter,
        engine: str,
    ) -> None:
        chunks = upstream.content.iter_any().__aiter__()
        while True:
            try:
                data = await anext(chunks)
            except StopAsyncIteration:
                break
            except _BROKEN as exc:  # the engine's side: the client's errors propagate
                error = Refusal(
                    502, "engine_failed", f"engine {engine} broke off the stream: {describe(exc)}"
                )
                await sse.write(usage.close() + b"data: " + error.encoded() + b"\n\n")
                await sse.write_eof()
                return
            out = usage.feed(data)
            if out:
                await sse.write(out)  # waits while the client's buffer is full
        await sse.write(usage.close())
        await sse.write_eof()
