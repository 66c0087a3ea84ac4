"""Who is calling, and what that caller may do.

The gateway asks an Authenticator (supervisor.host.keycheck.Verifier) for the caller of a
presented key; `allowed` decides by role: the inference role may call /v1 only, the owner also
the host API. `/metrics` needs no key: it holds counts and model names, never a key or a text;
nor does `/healthz`, a load balancer's health check, which says only whether the gateway serves.
The operator's page (/page/) takes no bearer key: its own sign-in and session guard it.
`/fleet/` is the peer route between the gateways of a fleet (host/fleet): no caller's key
opens it, and it checks its peer keys itself.

A presented key that is no valid key is a failure of the connection's address (a FailureLimit,
as the page's sign-in has): past the limit, that address's invalid keys get 429 with
Retry-After instead of 401 until its window moves on. A valid key is never refused by the
limit, from any address: callers share addresses (every local client is 127.0.0.1, everyone
behind a NAT or a proxy one address), and one of them with a stale key must not lock the
others out. A request with no key at all is not counted: a web page elsewhere can send one
from the owner's browser, but never one with an Authorization header (that needs a preflight
the gateway never grants).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Literal, Protocol

from supervisor.host.failures import FailureLimit
from supervisor.host.web.refusal import Refusal

Role = Literal["owner", "inference"]
BEARER: Final = "bearer "
V1: Final = "/v1/"
HOST_API: Final = "/api/host/"
PAGE: Final = "/page"
METRICS_PATH: Final = "/metrics"
HEALTH_PATH: Final = "/healthz"
FLEET: Final = "/fleet/"


class Caller(Protocol):
    """A verified caller: what the gateway reads of an identity."""

    @property
    def role(self) -> Role: ...

    @property
    def name(self) -> str: ...

    @property
    def key_id(self) -> str: ...

    @property
    def budget(self) -> int | None: ...

    @property
    def exempt(self) -> bool: ...


class Authenticator(Protocol):
    def verify(self, presented: str) -> Caller | None:
        """The caller of a presented key, or None when it is no valid key."""
        ...


Access = Literal["open", "peer", "allowed", "forbidden"]


def allowed(path: str, role: Role | None) -> Access:
    """Pure: whether a caller of this role (None: no valid key yet) may call this path."""
    if path in {METRICS_PATH, HEALTH_PATH, PAGE} or path.startswith(PAGE + "/"):
        return "open"
    if path.startswith(FLEET):
        return "peer"
    if role == "owner":
        return "allowed"
    return "allowed" if role == "inference" and path.startswith(V1) else "forbidden"


def presented_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, or None."""
    if authorization is None or authorization[: len(BEARER)].lower() != BEARER:
        return None
    key = authorization[len(BEARER) :].strip()
    return key or None


def check_bearer(
    auth: Authenticator,
    failures: FailureLimit,
    path: str,
    authorization: str | None,
    address: str,
    *,
    elsewhere: Callable[[str], Refusal | None] | None = None,
) -> Caller:
    """The verified caller, allowed this path: else 401 (no valid key), 429 (invalid keys from
    an address past its limit) or 403 (its role). `elsewhere` says whether a key that is no
    caller's is a key of another door (a peer key: 403), before it counts as a failure."""
    key = presented_key(authorization)
    caller = auth.verify(key) if key is not None else None
    if caller is None:
        misplaced = elsewhere(key) if elsewhere is not None and key is not None else None
        if misplaced is not None:
            raise misplaced
        wait = failures.blocked(address) if key is not None else 0.0
        if wait > 0:
            raise Refusal(
                429,
                "too_many_failures",
                f"too many invalid keys from this address: try again in {wait:.0f} s",
                headers={"Retry-After": str(max(1, round(wait)))},
            )
        if key is not None:
            failures.failed(address)
        raise Refusal(401, "invalid_api_key", "a valid API key is required (Bearer)")
    if allowed(path, caller.role) == "forbidden":
        raise Refusal(
            403,
            "permission_denied",
            f"{path} needs the owner key; this key's role is {caller.role}, which may call "
            "/v1 only",
        )
    return caller
