"""Sign-in sessions: a random cookie token and a CSRF token, kept in memory until they expire.

A session never holds the key that opened it: only the SHA-256 digest of its cookie token
(a lookup by digest tells a timing observer nothing), its CSRF token and when it expires. A
restart of the gateway signs everybody out. Failed sign-ins are limited per client address by
a FailureLimit (supervisor.host.failures): SignInLimit is its name here.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Final

from supervisor.host.failures import Clock, FailureLimit

MAX_SESSIONS: Final = 64  # the oldest is signed out when a 65th signs in
_TOKEN_BYTES: Final = 32  # 256 bits

SignInLimit = FailureLimit


@dataclass(frozen=True)
class Session:
    csrf: str
    expires: float  # on the monotonic clock


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class Sessions:
    """The signed-in sessions, by the digest of their cookie token."""

    def __init__(
        self,
        lifetime_s: float,
        clock: Clock = time.monotonic,
        limit: int = MAX_SESSIONS,
    ) -> None:
        self.lifetime_s = lifetime_s
        self.clock = clock
        self.limit = limit
        self._held: dict[bytes, Session] = {}

    def open(self) -> tuple[str, Session]:
        """A new session: its cookie token (given to the browser, kept nowhere) and the session."""
        self._prune()
        while len(self._held) >= self.limit:
            oldest = min(self._held, key=lambda digest: self._held[digest].expires)
            del self._held[oldest]
        token = secrets.token_urlsafe(_TOKEN_BYTES)
        session = Session(secrets.token_urlsafe(_TOKEN_BYTES), self.clock() + self.lifetime_s)
        self._held[_digest(token)] = session
        return token, session

    def find(self, token: str | None) -> Session | None:
        """The live session of a cookie token, or None (none, unknown or expired)."""
        if not token or len(token) > 256:
            return None
        digest = _digest(token)
        session = self._held.get(digest)
        if session is None:
            return None
        if session.expires <= self.clock():
            del self._held[digest]
            return None
        return session

    def close(self, token: str | None) -> None:
        if token:
            self._held.pop(_digest(token), None)

    def _prune(self) -> None:
        now = self.clock()
        for digest in [d for d, s in self._held.items() if s.expires <= now]:
            del self._held[digest]

    def __len__(self) -> int:
        return len(self._held)


def csrf_matches(session: Session, presented: str | None) -> bool:
    """Whether a request's CSRF header is its session's token, compared in constant time."""
    if presented is None:
        return False
    return hmac.compare_digest(session.csrf.encode(), presented.encode("utf-8", "surrogateescape"))
