"""Reading a request's body, within its size limit and within listen.body_timeout_s.

A body past its limit is refused with 413 as soon as it passes it. A body not all come within
body_timeout_s of its headers, whether the client stalls or sends a byte at a time, is refused
with 408, and the connection is closed as soon as that answer is out: what the client sends on
is not read (aiohttp would read and drop it for up to its lingering time). Only reading the
body is bounded; the answer, however long it streams, is not. `peer` is who sent it: the
connection's address, or, on a connection from a trusted proxy ([listen] trusted_proxies), the
client that proxy names in X-Forwarded-For.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Sequence
from typing import Final

from aiohttp import web

from supervisor.host.web.refusal import Refusal

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# the load balancers whose X-Forwarded-For is believed ([listen] trusted_proxies), on the app
TRUSTED: Final = web.AppKey("trusted_proxies", tuple[Network, ...])


def too_slow(request: web.Request, timeout_s: float, came: int) -> Refusal:
    expected = request.content_length
    of = f" of {expected}" if expected is not None else ""
    return Refusal(
        408,
        "request_timeout",
        f"the body of {request.path} did not all come within {timeout_s:g} s of its headers "
        f"({came}{of} bytes came); the connection is closed",
        close=True,
    )


async def read_body(
    request: web.Request, limit: int, timeout_s: float, too_large: Callable[[], Refusal]
) -> bytes:
    """The whole body; `too_large()` once it passes `limit`, 408 past `timeout_s`."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large()
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for data in request.content.iter_any():
                size += len(data)
                if size > limit:
                    raise too_large()
                chunks.append(data)
    except TimeoutError:
        raise too_slow(request, timeout_s, size) from None
    return b"".join(chunks)


async def answer_and_close(request: web.Request, response: web.StreamResponse) -> None:
    """Send the whole answer, then close the connection without reading what comes after.

    The transport sends what it holds before it closes. Nothing is awaited after the close, so
    the handler has returned before the connection's loss reaches it."""
    response.force_close()  # `Connection: close`
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        pass  # the client left first: there is no one to answer
    request.protocol.force_close()


def peer(request: web.Request) -> str:
    """Who sent the request: the address of the connection's other end, as the socket says;
    when that is a trusted proxy, the client its X-Forwarded-For names (`client`)."""
    remote = request.remote or ""
    trusted = request.config_dict.get(TRUSTED, ())
    if not trusted:
        return remote
    return client(remote, request.headers.getall("X-Forwarded-For", ()), trusted)


def client(remote: str, forwarded: Sequence[str], trusted: Sequence[Network]) -> str:
    """Pure: the client of a connection from `remote`. A forwarding header is believed only
    from a trusted proxy, and only as far as trusted proxies wrote it: read from its right end
    (each proxy adds the address it saw there), the first address no trusted proxy holds is
    the client; what a client wrote itself stands left of that and is never reached. A
    malformed entry ends the reading: the last address read stands."""
    hops = [hop.strip() for line in forwarded for hop in line.split(",")]
    found = remote
    while hops and _within(found, trusted):
        try:
            found = str(_address(hops.pop()))
        except ValueError:
            break
    return found


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address; an IPv4 one a dual-stack socket shows as ::ffff:a.b.c.d as itself."""
    address = ipaddress.ip_address(text)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _within(text: str, trusted: Sequence[Network]) -> bool:
    try:
        address = _address(text)
    except ValueError:
        return False
    return any(address in network for network in trusted)
