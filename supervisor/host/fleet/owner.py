"""Start and Stop of one machine's engine, asked from another machine's page in a fleet.

The page of machine a (signed in by its owner, its CSRF and origin rules kept) sends
`POST /fleet/api/host/engines/NAME` with `{"desired": "running"|"stopped"}` to machine b's
gateway, authenticated as the peer route is (door.py: a's peer key as the bearer, `X-Lucia-
Machine: a`), with the caller's key id `owner`. b applies it as its own owner API would
(hostapi.HostApi.apply), and desired.json says `requestedBy: operator@a`. That is all a peer
key opens here: one engine's desired state, on the machine that serves the request, and only
for the owner's key id (any other: 403); the body and the name are checked as the owner API
checks them. Each request b applies is said in its journal, naming the machine that asked.

The sending side (`ask`) bounds the whole exchange by one clock: a machine that cannot be
reached, or answers nothing in time, is 503 `machine_unreachable`; a refusal of the serving
machine passes through, naming it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Final
from urllib.parse import quote

from aiohttp import web

from supervisor import logs
from supervisor.host.fleet.door import KEY_ID, MACHINE, PEER_OF, PREFIX
from supervisor.host.fleet.forward import PeerClient
from supervisor.host.proxy.connections import BROKEN
from supervisor.host.proxy.forward import describe
from supervisor.host.proxy.hostapi import ENGINES, HostApi, too_large, wanted
from supervisor.host.web.intake import read_body
from supervisor.host.web.refusal import Refusal

PATH: Final = PREFIX + ENGINES  # /fleet/api/host/engines, then /NAME
OWNER: Final = "owner"  # the only key id this route takes
ASK_S: Final = 10.0  # the whole exchange with the serving machine
_BODY_LIMIT: Final = 1024
_ANSWER_LIMIT: Final = 64 * 1024
log = logs.get("fleet")


def requester(machine: str) -> str:
    """Pure: who desired.json says asked, for an owner of `machine`."""
    return f"operator@{machine}"


class PeerOwner:
    """The serving side: a peer's owner request applied to this machine's engines."""

    def __init__(self, host_api: HostApi, body_timeout_s: float) -> None:
        self.host_api = host_api
        self.body_timeout_s = body_timeout_s

    def routes(self, app: web.Application) -> None:
        app.router.add_post(PATH + "/{name}", self.set_desired)

    async def set_desired(self, request: web.Request) -> web.Response:
        """The gateway's guard let only a peer's request with a key id in (door.PeerDoor)."""
        machine = request[PEER_OF]
        if request.headers.get(KEY_ID) != OWNER:
            raise Refusal(
                403,
                "permission_denied",
                f"{PATH} takes the owner's request only: a machine's page, signed in by its owner",
            )
        raw = await read_body(request, _BODY_LIMIT, self.body_timeout_s, too_large)
        desired, name = wanted(raw), request.match_info["name"]
        answer = await self.host_api.apply(name, desired, requester(machine))
        log.info("engine requested by a peer", machine=machine, engine=name, desired=desired)
        return web.json_response(answer, status=202)


def unreachable(machine: str, why: str) -> Refusal:
    return Refusal(
        503, "machine_unreachable", f"machine {machine} did not answer: {why}", machine=machine
    )


def passed_on(machine: str, status: int, raw: bytes) -> Refusal:
    """Pure: the serving machine's refusal as this gateway answers it, naming that machine."""
    try:
        error = json.loads(raw)["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "peer_failed", f"machine {machine} answered {status}, not a refusal"
    return Refusal(status if 400 <= status < 600 else 502, code, message, machine=machine)


async def ask(
    client: PeerClient, machine: str, url: str, engine: str, desired: str, *, timeout_s: float
) -> dict[str, Any]:
    """Ask `machine`'s gateway at `url` for its engine `engine` in state `desired`, as this
    machine's owner; its answer (`engine`, `desired`, `generation`), or its refusal."""
    table = client.peers.current()
    if table is None:
        raise unreachable(machine, "this machine's peers file is refused")
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {table.own_key}",
        MACHINE: table.own,
        KEY_ID: OWNER,
    }
    body = json.dumps({"desired": desired}).encode()
    target = f"{url}{PATH}/{quote(engine, safe='')}"
    try:
        async with asyncio.timeout(timeout_s):
            upstream = await client.connections.post(target, body, headers)
            async with upstream:
                raw = await upstream.content.read(_ANSWER_LIMIT)
                status = upstream.status
    except TimeoutError:
        raise unreachable(machine, f"no answer within {timeout_s:g} s") from None
    except BROKEN as exc:
        raise unreachable(machine, describe(exc)) from None
    if status != 202:
        raise passed_on(machine, status, raw)
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise passed_on(machine, 502, b"")
    return {**answer, "machine": machine}
