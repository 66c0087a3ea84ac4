"""Who is calling, and what that caller may do.

The gateway asks an Authenticator (supervisor.host.keycheck.Verifier) for the caller of a
presented key; `allowed` decides by role: the inference role may call /v1 only, the owner also
the host API. `/metrics` needs no key: it holds counts and model names, never a key or a text.
The operator's page (/page/) takes no bearer key: its own sign-in and session guard it.
"""

from __future__ import annotations

from typing import Final, Literal, Protocol

from supervisor.host.gateway.metrics import METRICS_PATH

Role = Literal["owner", "inference"]
BEARER: Final = "bearer "
V1: Final = "/v1/"
HOST_API: Final = "/api/host/"
PAGE: Final = "/page"


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


class Authenticator(Protocol):
    def verify(self, presented: str) -> Caller | None:
        """The caller of a presented key, or None when it is no valid key."""
        ...


Access = Literal["open", "allowed", "forbidden"]


def allowed(path: str, role: Role | None) -> Access:
    """Pure: whether a caller of this role (None: no valid key yet) may call this path."""
    if path in {METRICS_PATH, PAGE} or path.startswith(PAGE + "/"):
        return "open"
    if role == "owner":
        return "allowed"
    return "allowed" if role == "inference" and path.startswith(V1) else "forbidden"


def presented_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, or None."""
    if authorization is None or authorization[: len(BEARER)].lower() != BEARER:
        return None
    key = authorization[len(BEARER) :].strip()
    return key or None
