"""One request to its engine and the answer back, within the request's deadline.

Only the body, its content type and the W3C trace context (`traceparent`, `tracestate`, when
the gateway set them: its own span's, or a caller's passed on) go upstream: never the client's
Authorization or any other header. Answers pass on as they come: SSE event by event
(usage.py), a plain answer chunk by chunk with the engine's status and content type. A stream
the engine breaks off ends with an error event, never a hang. One clock from admission covers
the dial and the whole answer: when it runs out, a stream ends with an error event, a request
not yet answered gets 504, and a plain answer already begun is cut off (its client sees a
short body, never a whole-looking one).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import aiohttp
from aiohttp import web

from supervisor.host.proxy.body import Prepared
from supervisor.host.proxy.connections import BROKEN, Connections
from supervisor.host.proxy.metrics import Outcome
from supervisor.host.proxy.usage import AnswerScan, Counts, Source, UsageFilter
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import Status, utc_now

SSE: Final = "text/event-stream"
DONE: Final = b"data: [DONE]"  # an OpenAI stream's last event
_PASSED_HEADERS: Final = ("Content-Type", "Content-Length")
_JSON: Final = {"Content-Type": "application/json"}
# a stream ended early: its engine's events read on, to count them, until it ends the stream
DRAIN_S: Final = 5.0


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def unreachable(engine: str, exc: BaseException) -> Refusal:
    return Refusal(502, "engine_unreachable", f"engine {engine} did not answer: {describe(exc)}")


def timed_out(engine: str, deadline_s: float) -> Refusal:
    return Refusal(
        504, "timeout", f"engine {engine} did not finish within the deadline of {deadline_s:g} s"
    )


@dataclass
class Trace:
    """What one request did, for the metrics, the record and its span: filled in as it goes.
    Every time is the loop's clock."""

    arrived: float
    at: datetime = field(default_factory=utc_now)  # the wall clock, for the record
    outcome: Outcome | None = None
    code: str | None = None  # a refusal's code
    queued: float | None = None  # when it asked its engine's gate for a slot
    starting: float | None = None  # when it began to wait for a start on demand
    started: float | None = None  # when that start was done
    admitted: float | None = None  # once admitted (after a start, if any)
    served_by: Status | None = field(default=None, repr=False)  # the engine's, when admitted
    first_byte: float | None = None
    usage: dict[str, Any] | None = None
    usage_source: Source = "none"  # where `usage` came from (usage.py)
    posted: bool = False  # the request went to the engine, which may have generated for it
    sent: float | None = None  # when it went
    answered: float | None = None  # when the engine's answer's head came
    # the W3C trace context the engine gets (traceparent, tracestate), or None: none
    context: dict[str, str] | None = field(default=None, repr=False)
    # the client's response once its headers went out: from then on the answer has begun, and
    # whatever goes wrong is told inside it (an error event, a short body), never as a refusal
    answer: web.StreamResponse | None = field(default=None, repr=False)
    # the client has the whole answer: a stream's [DONE], or every byte of a plain answer; a
    # client that goes away after it (as clients do at [DONE]) is served, not gone
    delivered: bool = False

    def wrote(self) -> None:
        if self.first_byte is None:
            self.first_byte = asyncio.get_running_loop().time()

    @property
    def begun(self) -> bool:
        """Whether the client has the answer's headers: a refusal of its own is too late."""
        return self.answer is not None

    def began(self, response: web.StreamResponse) -> None:
        """The answer began with this response, its headers sent already (a start's stream)."""
        self.answer = response

    async def begin(self, request: web.Request, response: web.StreamResponse) -> None:
        """Send this response's headers: the answer begins."""
        self.answer = response
        await response.prepare(request)


@dataclass(frozen=True)
class Broke:
    """The engine broke off its answer: what it raised."""

    error: BaseException


async def from_engine(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes | Broke]:
    """The engine's bytes as they come, then a Broke if it broke off. Only the engine's side
    is caught here: an error of the client's (a write to a closed client) happens in the
    caller's loop body and propagates."""
    chunks = upstream.content.iter_any().__aiter__()
    while True:
        try:
            data = await anext(chunks)
        except StopAsyncIteration:
            return
        except BROKEN as exc:
            yield Broke(exc)
            return
        yield data


class Forwarder:
    """Requests go on pooled connections (connections.py: a request that finds its pooled
    connection closed by the engine is sent once more on a new one). In a fleet, `machine` is
    named in the error events it writes, as in every refusal."""

    def __init__(self, machine: str | None = None) -> None:
        self.machine = machine
        self.connections = Connections()
        self.session = self.connections.session  # the app's cleanup context

    async def _post(
        self, url: str, data: bytes, context: dict[str, str] | None
    ) -> aiohttp.ClientResponse:
        headers = _JSON if context is None else {**_JSON, **context}
        return await self.connections.post(url, data, headers)

    async def send(
        self,
        request: web.Request,
        *,
        url: str,
        prepared: Prepared,
        engine: str,
        deadline_s: float,
        trace: Trace,
    ) -> web.StreamResponse:
        """Forward; the trace's answer has begun already when a start opened the client's
        stream.

        A plain request sent whose whole answer was never read (a client that left, the
        deadline, an engine that broke off) costs its bound: what the engine generated for it
        is unknown. So does a stream whose answer never began, unless its engine broke off: an
        engine may notice late that a connection closed before its answer's first event, and
        generates on until then (tests/integration/test_gateway_charges_llama.py saw
        llama-server generate 1,823 tokens on a loaded machine after the deadline closed one).
        A stream its engine broke off before it began costs its prompt's estimate and a token
        a sequence: both engines begin a stream's answer with its first token, and a broken
        engine generates no more."""
        try:
            async with asyncio.timeout(deadline_s):
                return await self._send(request, url, prepared, engine, trace)
        except TimeoutError:
            trace.outcome = "timed_out"
            refusal = timed_out(engine, deadline_s)
            refusal.machine = self.machine
            response = trace.answer
            if response is None:  # not begun: the refusal is the answer
                raise refusal from None
            if response.content_type == SSE:
                await response.write(b"data: " + refusal.encoded() + b"\n\n")
                await response.write_eof()
            elif request.transport is not None:
                request.transport.close()  # cut off: a short body tells the client
            return response
        finally:
            if trace.posted and trace.usage_source == "none" and not trace.delivered:
                if prepared.stream and trace.outcome == "engine_failed":
                    counts = Counts(prepared.prompt_estimate, prepared.sequences)
                    trace.usage, trace.usage_source = counts.usage(), "counted"
                else:
                    counts = Counts(prepared.prompt_estimate, prepared.generation_bound)
                    trace.usage, trace.usage_source = counts.usage(), "bound"

    async def _send(
        self, request: web.Request, url: str, prepared: Prepared, engine: str, trace: Trace
    ) -> web.StreamResponse:
        trace.posted, trace.sent = True, asyncio.get_running_loop().time()
        try:
            upstream = await self._post(url + request.path, prepared.body, trace.context)
        except BROKEN as exc:
            trace.outcome = "engine_failed"
            trace.posted = not isinstance(exc, aiohttp.ClientConnectorError)  # never connected
            raise unreachable(engine, exc) from None
        trace.answered = asyncio.get_running_loop().time()
        async with upstream:
            trace.outcome = "ok" if upstream.status < 400 else "engine_error"
            streams = upstream.headers.get("Content-Type", "").startswith(SSE)
            sse = trace.answer
            if sse is not None and not streams:
                # the client's stream is open (a start): the answer becomes an event
                try:
                    content = await upstream.read()
                except BROKEN as exc:
                    trace.outcome = "engine_failed"
                    raise unreachable(engine, exc) from None
                scan = AnswerScan()
                scan.feed(content)
                trace.usage = scan.usage
                trace.usage_source = "engine" if scan.usage is not None else "none"
                trace.wrote()
                await sse.write(b"data: " + content + b"\n\n")
                trace.delivered = True
                await sse.write_eof()
                return sse
            if sse is None:
                headers = {k: upstream.headers[k] for k in _PASSED_HEADERS if k in upstream.headers}
                if streams:
                    headers = {"Content-Type": SSE, "Cache-Control": "no-cache"}
                sse = web.StreamResponse(status=upstream.status, headers=headers)
            if streams:
                await self._relay(
                    request,
                    upstream=upstream,
                    sse=sse,
                    prepared=prepared,
                    engine=engine,
                    trace=trace,
                )
            else:
                await self._pass(request, upstream, sse, engine, trace)
            return sse

    async def _pass(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        engine: str,
        trace: Trace,
    ) -> None:
        """A plain answer, chunk by chunk; its usage found as it passes (usage.AnswerScan)."""
        scan = AnswerScan()
        async for data in from_engine(upstream):
            if isinstance(data, Broke):
                trace.outcome = "engine_failed"
                if not trace.begun:
                    raise unreachable(engine, data.error) from None
                if request.transport is not None:
                    request.transport.close()  # cut off: a short body tells the client
                return
            if not trace.begun:
                await trace.begin(request, response)
            trace.wrote()
            scan.feed(data)
            await response.write(data)
        if not trace.begun:  # an empty answer
            await trace.begin(request, response)
        trace.usage = scan.usage  # the engine's, for its whole answer
        trace.usage_source = "engine" if scan.usage is not None else "none"
        trace.delivered = True
        await response.write_eof()

    async def _relay(
        self,
        request: web.Request,
        *,
        upstream: aiohttp.ClientResponse,
        sse: web.StreamResponse,
        prepared: Prepared,
        engine: str,
        trace: Trace,
    ) -> None:
        """A stream, event by event; whatever ends it, its row is charged what the engine's
        events said (usage.py), also the events read but never passed on."""
        usage = UsageFilter(prepared.hide_usage, prepared.strip_usage)
        whole = False
        try:
            if not trace.begun:
                await trace.begin(request, sse)
            async for data in from_engine(upstream):
                if isinstance(data, Broke):
                    trace.outcome = "engine_failed"
                    error = Refusal(
                        502,
                        "engine_failed",
                        f"engine {engine} broke off the stream: {describe(data.error)}",
                        machine=self.machine,
                    )
                    await sse.write(usage.close() + b"data: " + error.encoded() + b"\n\n")
                    await sse.write_eof()
                    return
                out = usage.feed(data)
                if out:
                    trace.wrote()
                    await sse.write(out)  # waits while the client's buffer is full
                    trace.delivered = trace.delivered or out.rstrip().endswith(DONE)
            whole = True
            await sse.write(usage.close())
            trace.delivered = True
            await sse.write_eof()
        finally:
            many = prepared.sequences
            trace.usage, trace.usage_source = usage.charged(prepared.prompt_estimate, whole, many)
            if not whole:
                try:  # a client that left may be seen to leave again: its handler cancelled
                    await _drain(upstream, usage)
                finally:
                    sent = trace.sent if trace.sent is not None else trace.arrived
                    trace.usage, trace.usage_source = usage.charged(
                        prepared.prompt_estimate,
                        False,
                        many,
                        elapsed_s=asyncio.get_running_loop().time() - sent,
                        bound=prepared.generation_bound,
                    )


async def _drain(upstream: aiohttp.ClientResponse, usage: UsageFilter) -> None:
    """Count what the engine sent that was not passed on (its client left, the deadline ran
    out). The gateway half-closes its side first: the engine sees its client gone at once
    (llama-server's HTTP thread peeks the FIN between events; uvicorn closes on it) and stops,
    and every event it sent until then still arrives and is counted, until it ends the stream,
    at most DRAIN_S. The connection is closed after it, never pooled again."""
    connection = upstream.connection
    transport = None if connection is None else connection.transport
    try:
        if transport is not None and transport.can_write_eof():
            transport.write_eof()
        content = upstream.content
        async with asyncio.timeout(DRAIN_S):
            while data := await content.readany():
                usage.drain(data)
    except (TimeoutError, RuntimeError, OSError, *BROKEN):
        return
    finally:
        upstream.close()
