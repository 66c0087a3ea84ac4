"""The request bodies the gateway holds: how many bytes at once, and where they are parsed.

Every forwarded request holds its body's bytes from before the body is read to the request's
end: its `Content-Length`, or, for a body sent in chunks with no length, the most it may be
(its route's limit, or the bound if that is smaller). The bytes live that long: the body is
read whole, and it, or what goes upstream in its place, is kept until the answer is over. A
body that would take the bytes held past `listen.bodies_bytes` is refused at once, unread,
with 429 `bodies_busy` and Retry-After, and its connection closed once the answer is out (what
the client sends on is not read); one larger than the bound itself could never pass, and gets
413. Nothing is held for a body refused before (no key: 401), and what a body holds is given
back however its request ends: answered, refused, or its client gone.

A body larger than PARSE_INLINE is parsed in a thread of its own, one body at a time, off the
event loop. CPython's JSON decoder holds the interpreter's lock while it runs, so the thread
does not make a parse free for the loop: it keeps the loop's longest wait to one body's decode
(16 MiB of token ids: about 0.23 s) however many come at once, where inline they run one after
another with no turn for the loop between them (8 at once: 1.9 s; in asyncio.to_thread's
several threads: 1.6 s; bench/body_parse_bench.py). Smaller bodies are parsed inline, in 2 ms
at most (256 KiB of token ids; 0.3 ms of chat), where a thread would add its 0.1 ms round trip
and a wait behind the large ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, Literal, ParamSpec, TypeVar

from aiohttp import web

from supervisor.host.proxy import body
from supervisor.host.proxy.bounds import Bounds
from supervisor.host.web.intake import read_body
from supervisor.host.web.refusal import Refusal

PARSE_INLINE: Final = 256 * 1024  # at most this many bytes are parsed on the event loop
RETRY_AFTER_S: Final = 1
Verdict = Literal["hold", "busy", "too_large"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
P = ParamSpec("P")
T = TypeVar("T")


def room(route_limit: int, bound: int) -> int:
    """Pure: the most one body may be: its route's limit, or the whole bound if smaller."""
    return min(route_limit, bound)


def decide(declared: int | None, most: int, bound: int, held: int) -> tuple[Verdict, int]:
    """Pure: what a body gets, and the bytes it holds: its declared length, else `most`.

    `held` bytes are held already. A body larger than `most` never fits: too_large, holding
    nothing; one that would take `held` past `bound` is busy."""
    size = most if declared is None else declared
    if size > most:
        return "too_large", 0
    if held + size > bound:
        return "busy", size
    return "hold", size


def busy(path: str, size: int, held: int, bound: int) -> Refusal:
    return Refusal(
        429,
        "bodies_busy",
        f"the gateway holds {held} bytes of request bodies now; the {size} of this {path} "
        f"would pass its bound of {bound} (listen.bodies_bytes): retry; the body was not read",
        headers={"Retry-After": str(RETRY_AFTER_S)},
        details={"held_bytes": held, "body_bytes": size, "bound_bytes": bound},
        close=True,
    )


def past_bound(path: str, bound: int) -> Refusal:
    return Refusal(
        413,
        "request_too_large",
        f"the body of {path} is limited to {bound} bytes, the bytes of request bodies the "
        "gateway holds at once (listen.bodies_bytes)",
    )


class Bodies:
    """The bytes of bodies held now, within `bound`; each body's reading and parsing."""

    def __init__(
        self, bound: int, timeout_s: float, limits: Bounds, default: str | None = None
    ) -> None:
        self.bound = bound
        self.held = 0
        self.timeout_s = timeout_s
        self.limits = limits
        self.default = default  # the tier a body that names no model goes to (body.prepare)
        self._parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-parse")

    def too_large(self, path: str) -> Refusal:
        limit = body.limit(path)
        return body.too_large(path) if limit <= self.bound else past_bound(path, self.bound)

    def holding(self, handler: Handler) -> Handler:
        """`handler` with its request's body bytes held from before it runs to its end."""

        async def held(request: web.Request) -> web.StreamResponse:
            size = self.hold(request.path, request.content_length)
            try:
                return await handler(request)
            finally:
                self.held -= size

        return held

    def hold(self, path: str, declared: int | None) -> int:
        """Hold the bytes of a body about to be read; how many (raises the refusal)."""
        verdict, size = decide(declared, room(body.limit(path), self.bound), self.bound, self.held)
        if verdict == "too_large":
            raise self.too_large(path)
        if verdict == "busy":
            raise busy(path, size, self.held, self.bound)
        self.held += size
        return size

    async def take(self, request: web.Request, tokens: int | None = None) -> body.Prepared:
        """The request's body read whole, checked, and what goes upstream (body.prepare);
        `tokens`: what the caller's budget has room for, None for no budget."""
        path = request.path
        most = room(body.limit(path), self.bound)
        raw = await read_body(request, most, self.timeout_s, lambda: self.too_large(path))
        if len(raw) <= PARSE_INLINE:
            return body.prepare(path, raw, self.limits, tokens, self.default)
        return await self.off_loop(body.prepare, path, raw, self.limits, tokens, self.default)

    async def renamed(self, prepared: body.Prepared, model: str) -> body.Prepared:
        """body.with_model (a tier alias resolved), which parses the body again."""
        if len(prepared.body) <= PARSE_INLINE:
            return body.with_model(prepared, model)
        return await self.off_loop(body.with_model, prepared, model)

    async def as_sent(self, prepared: body.Prepared, model: str) -> bytes:
        """body.as_sent: the client's body for a peer gateway, parsed again off the loop when
        it is large."""
        if len(prepared.raw) <= PARSE_INLINE:
            return body.as_sent(prepared, model)
        return await self.off_loop(body.as_sent, prepared, model)

    async def off_loop(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`work` in the parse thread. A request that ends meanwhile waits for a parse that
        has begun (its bytes are held until it ends); one not begun is dropped."""
        running = self._parser.submit(work, *args, **kwargs)
        done = asyncio.wrap_future(running)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            running.cancel()
            await asyncio.wait({done})
            if not done.cancelled():
                done.exception()  # its refusal, if any, has no one to answer
            raise

    async def parsing(self, _: web.Application) -> AsyncIterator[None]:
        """The app's cleanup context: the parse thread ends with the app."""
        try:
            yield
        finally:
            self._parser.shutdown(wait=False, cancel_futures=True)
