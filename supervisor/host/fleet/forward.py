"""A caller's request to a peer gateway's `/fleet/v1/...`, and its answer back as it comes.

The gateway that first took the request (the origin) has read and checked its body and verified
its caller; the peer admits it, starts its engine on demand, applies its deadline and records
it (door.py), so the origin records nothing of it. What goes: the body the origin was given,
its content type, the W3C trace context when there is one, and the peer headers: this
machine's peer key as the bearer, its name, and the caller's key id, whether it is exempt from
a daily budget and its own budget. Never the client's Authorization or any other header.

The answer passes on as it comes: the peer's status, content type, length and Retry-After,
then its body chunk by chunk, each written once the client took the one before (back-pressure).
A stream passes event by event: a half-sent event is held until its end comes, so an error
event never lands inside one. The peer's refusals pass through as they are (they name its
machine). Cancel travels both ways: a client that leaves ends its handler, which closes the
peer connection (the peer's handler is cancelled, and its engine's request with it); a peer
that breaks off ends a stream with an error event naming the machine, and cuts a plain answer
short. One clock covers the dial, the peer's admission and start, and the whole answer: a peer
that cannot be reached, or answers nothing within it, is 503 `model_not_loaded` naming the
machine; once the answer began, a stream ends with an error event and a plain answer is cut off.
A machine that goes silent (its network cut: no reset, no end) is not waited for on that clock:
`gone` says when the fleet's catalog has not heard from it within [fleet] stale_s, and what it
was sending ends then, with a `machine_gone` error event (a request not yet answered: 503).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web

from supervisor.host.fleet.door import BUDGET, EXEMPT, KEY_ID, MACHINE, PREFIX
from supervisor.host.fleet.peers import Peers
from supervisor.host.proxy.budget import exempt_of
from supervisor.host.proxy.connections import BROKEN, Connections
from supervisor.host.proxy.forward import SSE, Broke, describe, from_engine
from supervisor.host.proxy.usage import last_end
from supervisor.host.web.auth import Caller
from supervisor.host.web.refusal import Refusal
from supervisor.host.web.responses import send_error_event

PASSED: Final = ("Content-Type", "Content-Length", "Retry-After", "Cache-Control")


@dataclass(frozen=True)
class Peer:
    """A machine of the fleet, where its gateway is reached ([fleet] advertise)."""

    machine: str
    url: str  # http(s)://host:port


def went_silent(machine: str) -> Refusal:
    return Refusal(
        503,
        "machine_gone",
        f"machine {machine} is no longer heard from (the fleet's catalog has it stale): "
        "what it was sending is cut off",
        machine=machine,
    )


def not_reached(machine: str, why: str) -> Refusal:
    return Refusal(
        503,
        "model_not_loaded",
        f"machine {machine}, which serves this model, did not answer: {why}",
        machine=machine,
    )


def broke_off(machine: str, exc: BaseException) -> Refusal:
    return Refusal(
        502,
        "engine_failed",
        f"machine {machine} broke off the answer: {describe(exc)}",
        machine=machine,
    )


def ran_out(machine: str, deadline_s: float) -> Refusal:
    return Refusal(
        504,
        "timeout",
        f"machine {machine} did not finish within the deadline of {deadline_s:g} s",
        machine=machine,
    )


def peer_headers(own: str, key: str, caller: Caller) -> dict[str, str]:
    """Pure: what a peer request says of who sends it and for whom."""
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {key}",
        MACHINE: own,
        KEY_ID: caller.key_id,
    }
    if exempt_of(caller):
        headers[EXEMPT] = "1"
    if caller.budget is not None:
        headers[BUDGET] = str(caller.budget)
    return headers


class PeerClient:
    """This gateway's requests to its peers: its own name and key from the peers file (as it
    is now), its TLS context for https peers (tls.client_context: this gateway's certificate
    presented, the peer's verified against the fleet's CA)."""

    def __init__(self, peers: Peers, tls: ssl.SSLContext | None = None) -> None:
        self.peers = peers
        self.connections = Connections(tls)
        self.session = self.connections.session  # the app's cleanup context

    async def send(
        self,
        request: web.Request,
        body: bytes,
        *,
        peer: Peer,
        caller: Caller,
        deadline_s: float,
        context: dict[str, str] | None = None,
        gone: Callable[[], bool] | None = None,
        check_s: float = 1.0,
    ) -> web.StreamResponse:
        """Send the request to `peer` as `caller`'s and pass its answer on. `body`: what the
        client sent, the model named as the peer knows it (never body.Prepared.body, which
        the peer prepares again); `context`: the W3C trace context to pass on, if any;
        `gone`: whether the machine went silent, asked every `check_s`."""
        table = self.peers.current()
        if table is None:
            raise not_reached(peer.machine, "this machine's peers file is refused")
        headers = peer_headers(table.own, table.own_key, caller)
        headers.update(context or {})
        answer = _Answer(request, peer.machine)
        silent: asyncio.Task[bool] | None = None
        try:
            async with asyncio.timeout(deadline_s) as clock:
                if gone is not None:
                    silent = asyncio.create_task(_until_gone(clock, gone, check_s))
                try:
                    url = f"{peer.url}{PREFIX}{request.path}"
                    await self._exchange(answer, url, body, headers)
                finally:
                    if silent is not None:
                        silent.cancel()
        except TimeoutError:
            lost = silent is not None and silent.done() and not silent.cancelled()
            refusal = went_silent(peer.machine) if lost else ran_out(peer.machine, deadline_s)
            if answer.response is None:  # nothing came: as if it could not be reached
                if lost:
                    raise refusal from None
                raise not_reached(peer.machine, f"no answer within {deadline_s:g} s") from None
            await answer.end(refusal)
        assert answer.response is not None
        return answer.response

    async def _exchange(
        self, answer: _Answer, url: str, body: bytes, headers: dict[str, str]
    ) -> None:
        try:
            upstream = await self.connections.post(url, body, headers)
        except BROKEN as exc:
            raise not_reached(answer.machine, describe(exc)) from None
        async with upstream:
            try:
                await answer.relay(upstream)
            except BaseException:  # the client left, the deadline: the peer sees it at once
                upstream.close()  # not read to its end: never pooled again
                raise


class _Answer:
    """The client's side of one peer answer."""

    def __init__(self, request: web.Request, machine: str) -> None:
        self.request = request
        self.machine = machine
        self.response: web.StreamResponse | None = None
        self.streams = False

    async def relay(self, upstream: aiohttp.ClientResponse) -> None:
        passed = {name: upstream.headers[name] for name in PASSED if name in upstream.headers}
        self.streams = passed.get("Content-Type", "").startswith(SSE)
        if self.streams:
            passed.pop("Content-Length", None)
        response = web.StreamResponse(status=upstream.status, headers=passed)
        self.response = response
        await response.prepare(self.request)
        async for data in _events(upstream) if self.streams else from_engine(upstream):
            if isinstance(data, Broke):
                await self.end(broke_off(self.machine, data.error))
                return
            await response.write(data)  # waits while the client's buffer is full
        await response.write_eof()

    async def end(self, refusal: Refusal) -> None:
        """The answer begun ends early: a stream with its error event, else cut off."""
        assert self.response is not None
        if self.streams:
            await send_error_event(self.response, refusal.body())
        elif self.request.transport is not None:
            self.request.transport.close()  # a short body tells the client


async def _until_gone(clock: asyncio.Timeout, gone: Callable[[], bool], check_s: float) -> bool:
    """Wait for the machine to go silent, then end the exchange now (its clock runs out)."""
    while not gone():
        await asyncio.sleep(check_s)
    clock.reschedule(asyncio.get_running_loop().time())
    return True


async def _events(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes | Broke]:
    """A stream's whole events as they come, then a Broke if it broke off (a half-sent event
    is dropped then); an unfinished tail at a clean end is passed as it is."""
    held = b""
    async for data in from_engine(upstream):
        if isinstance(data, Broke):
            yield data
            return
        held += data
        end = last_end(held)
        if end:
            whole, held = held[:end], held[end:]
            yield whole
    if held:
        yield held
