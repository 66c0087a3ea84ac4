"""The peer route: `/fleet/v1/...`, where one gateway of a fleet sends another a caller's request.

A peer request carries the sending machine's peer key as its bearer (`Authorization: Bearer
KEY`), that machine's name (`X-Lucia-Machine`), and the caller the sending gateway verified:
its key id (`X-Lucia-Key-Id`: owner, inference or an issued key's `key_` id), whether no daily
budget applies to it (`X-Lucia-Key-Exempt: 1`) and its own daily budget when it has one
(`X-Lucia-Key-Budget`; absent: this gateway's [budget] daily_tokens). The key must be the key
the peers file gives that machine now (peers.py); with `[listen] tls_cert` set, the connection
must also have presented a client certificate the fleet's CA signed (tls.py). Then the request
is the caller's, and goes on as a /v1 request of it would: admitted, held to its budget and
deadline, its engine started on demand, recorded here. It is served by this machine's own
engines only: `PEER_OF` marks it, and nothing marked is forwarded again.

Anything else is 401 `peer_unauthorized`, and one journal line names the machine claimed and
why, never the key. A presented key that fails counts against its address as a bad bearer
key does (auth.check_bearer: past the limit, 429). A caller's client that presents a peer key
on /v1 (or any route a caller's key opens) gets 403 `peer_key_on_v1`, also said in the journal.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from supervisor import logs
from supervisor.host.failures import FailureLimit
from supervisor.host.fleet.peers import NAME, Peers, PeerTable
from supervisor.host.keys import ID_PATTERN, MAX_BUDGET
from supervisor.host.proxy import body
from supervisor.host.web.auth import Role, presented_key
from supervisor.host.web.intake import peer
from supervisor.host.web.refusal import Refusal

PREFIX: Final = "/fleet"  # then the /v1 path as it is
MACHINE: Final = "X-Lucia-Machine"
KEY_ID: Final = "X-Lucia-Key-Id"
EXEMPT: Final = "X-Lucia-Key-Exempt"
BUDGET: Final = "X-Lucia-Key-Budget"
CALLER_ID: Final = re.compile(rf"owner|inference|{ID_PATTERN.pattern}")
PEER_OF: Final = web.RequestKey("peer_of", str)  # the machine that sent a peer request
log = logs.get("fleet")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class PeerCaller:
    """The caller a peer vouches for (auth.Caller): its key id, never a key."""

    key_id: str
    exempt: bool
    budget: int | None
    machine: str  # the machine that sent it
    role: Role = "inference"

    @property
    def name(self) -> str:
        return self.key_id


@dataclass(frozen=True)
class Denial:
    """Why a peer request is refused; `counted` when a key was presented and failed."""

    reason: str
    counted: bool = False


@dataclass(frozen=True)
class PeerClaim:
    """What a peer request's headers say, as they came."""

    key: str | None  # the bearer
    machine: str | None
    key_id: str | None
    exempt: str | None
    budget: str | None
    certified: bool = True  # a client certificate came, where one is asked for


def judge(table: PeerTable | None, problem: str | None, claim: PeerClaim) -> PeerCaller | Denial:
    """Pure: the caller a peer request carries, or why it is refused."""
    if table is None:
        return Denial(f"the peers file is refused: {problem}")
    if claim.key is None:
        return Denial("no peer key (Authorization: Bearer)")
    owner = table.which(claim.key)  # every entry compared, whatever the claim
    if claim.machine is None:
        return Denial(f"no {MACHINE}", counted=True)
    if claim.machine not in table.machines:
        return Denial("a machine the peers file does not name (unknown, or revoked)", True)
    if owner != claim.machine:
        return Denial("not this machine's peer key", counted=True)
    if not claim.certified:
        return Denial("no client certificate (mutual TLS: [fleet] ca_file)")
    if claim.key_id is None or not CALLER_ID.fullmatch(claim.key_id):
        return Denial(f"{KEY_ID} is not a key id (owner, inference or key_ and 12 hex digits)")
    if claim.exempt not in (None, "0", "1"):
        return Denial(f"{EXEMPT} is 1 or 0")
    budget = None
    if claim.budget is not None:
        if not claim.budget.isascii() or not claim.budget.isdigit():
            return Denial(f"{BUDGET} is a whole number of tokens")
        budget = int(claim.budget)
        if not 1 <= budget <= MAX_BUDGET:
            return Denial(f"{BUDGET} is 1 to {MAX_BUDGET} tokens")
    return PeerCaller(claim.key_id, claim.exempt == "1", budget, claim.machine)


def shown(machine: str | None) -> str:
    """A claimed machine as the journal may show it: a header is anyone's text."""
    if machine is None:
        return "(none)"
    return machine if NAME.fullmatch(machine) else "(not a machine name)"


def unauthorized() -> Refusal:
    return Refusal(
        401,
        "peer_unauthorized",
        f"{PREFIX}/v1 takes a peer gateway's request: the peer key of the machine named in "
        f"{MACHINE}, and the caller's key id",
    )


class PeerDoor:
    """This gateway's side of the peer route: who may send, and the routes it serves."""

    def __init__(self, peers: Peers, *, certified: bool = False) -> None:
        self.peers = peers
        self.certified = certified  # [listen] tls_cert: a client certificate is asked for

    @property
    def machine(self) -> str:
        return self.peers.own

    def claim(self, request: web.Request) -> PeerClaim:
        headers = request.headers
        certificate = True
        if self.certified:
            transport = request.transport
            certificate = bool(transport and transport.get_extra_info("peercert"))
        return PeerClaim(
            presented_key(headers.get("Authorization")),
            headers.get(MACHINE),
            headers.get(KEY_ID),
            headers.get(EXEMPT),
            headers.get(BUDGET),
            certificate,
        )

    def caller(self, request: web.Request, failures: FailureLimit) -> PeerCaller:
        """The caller of a peer request (the request marked PEER_OF); else 401, or 429 for an
        address past its limit of failed keys."""
        claim = self.claim(request)
        verdict = judge(self.peers.current(), self.peers.problem, claim)
        if isinstance(verdict, PeerCaller):
            request[PEER_OF] = verdict.machine
            return verdict
        address = peer(request)
        wait = failures.blocked(address) if verdict.counted else 0.0
        if wait > 0:
            raise Refusal(
                429,
                "too_many_failures",
                f"too many invalid keys from this address: try again in {wait:.0f} s",
                headers={"Retry-After": str(max(1, round(wait)))},
            )
        if verdict.counted:
            failures.failed(address)
        log.warning(
            "peer refused",
            machine=shown(claim.machine),
            reason=verdict.reason,
            address=address,
            path=request.path,
        )
        raise unauthorized()

    def on_v1(self, path: str, address: str) -> Callable[[str], Refusal | None]:
        """For auth.check_bearer: 403 for a peer key presented where a caller's key goes."""

        def misplaced(key: str) -> Refusal | None:
            machine = self.peers.which(key)
            if machine is None:
                return None
            log.warning("peer key presented on /v1", machine=machine, address=address, path=path)
            return Refusal(
                403,
                "peer_key_on_v1",
                f"this is a peer key, which opens {PREFIX}/v1 between the gateways of a fleet "
                f"only: {path} takes a caller's own key",
            )

        return misplaced

    def routes(self, app: web.Application, handler: Handler) -> None:
        """`/fleet` + each forwarded /v1 path, served by `handler` as that /v1 path."""
        for path in body.FORWARDED:
            app.router.add_post(PREFIX + path, self.serve(handler))

    @staticmethod
    def serve(handler: Handler) -> Handler:
        async def served(request: web.Request) -> web.StreamResponse:
            inner = request.clone(rel_url=request.rel_url.with_path(request.path[len(PREFIX) :]))
            return await handler(inner)  # its state (the caller, PEER_OF) comes with it

        return served
