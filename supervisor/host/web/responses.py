"""What the gateway writes itself, whatever the route.

A refusal's JSON answer, an event stream opened before its first event, and the error event
that ends one.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web

from supervisor.host.web.refusal import Refusal


def refusal_response(refusal: Refusal) -> web.Response:
    """The refusal as its JSON answer, with its status and headers."""
    return web.Response(
        status=refusal.status,
        body=refusal.encoded(),
        content_type="application/json",
        headers=refusal.headers,
    )


async def open_sse(request: web.Request) -> web.StreamResponse:
    """An event stream, its head sent before its first event."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response


async def send_error_event(response: web.StreamResponse, error: dict[str, Any]) -> None:
    """The error event that ends a stream, unless its client has gone."""
    try:
        await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        await response.write_eof()
    except (ConnectionError, aiohttp.ClientConnectionResetError):
        pass
