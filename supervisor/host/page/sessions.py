"""Sign-in sessions: a random cookie token and a CSRF token, kept in memory until they expire.

A session never holds the key that opened it: only the SHA-256 digest of its cookie token
(a lookup by digest tells a timing observer nothing), its CSRF token and when it expires. A
restart of the gateway signs everybody out. Failed sign-ins are limited per client address (the
connection's peer, never a header a client writes): at most FAILURES_ALLOWED in
FAILURE_WINDOW_S from one address; more from it are refused until its window moves on, while
every other address may still sign in. The owner key is not guessable, so the limit bounds
work and noise, not guessing: it must never let one caller lock the owner out. At most
MAX_ADDRESSES are tracked, the least recently failed forgotten first, so an address-rotating
flood holds bounded memory.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

MAX_SESSIONS: Final = 64  # the oldest is signed out when a 65th signs in
FAILURES_ALLOWED: Final = 10
FAILURE_WINDOW_S: Final = 60.0
MAX_ADDRESSES: Final = 4096  # about 1 KiB each at most
_TOKEN_BYTES: Final = 32  # 256 bits

Clock = Callable[[], float]


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


class SignInLimit:
    """Failed sign-ins per client address in a sliding window: `blocked` says how long until
    that address may try again."""

    def __init__(
        self,
        allowed: int = FAILURES_ALLOWED,
        window_s: float = FAILURE_WINDOW_S,
        clock: Clock = time.monotonic,
        addresses: int = MAX_ADDRESSES,
    ) -> None:
        self.allowed = allowed
        self.window_s = window_s
        self.clock = clock
        self.addresses = addresses
        # address -> its failures in the window; the least recently failed first
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, address: str, now: float) -> deque[float] | None:
        """The address's failures still in the window (an address with none is forgotten)."""
        failures = self._failures.get(address)
        if failures is None:
            return None
        while failures and failures[0] <= now - self.window_s:
            failures.popleft()
        if not failures:
            del self._failures[address]
            return None
        return failures

    def blocked(self, address: str) -> float:
        """Seconds until `address` may try to sign in again; 0 when it may now."""
        now = self.clock()
        failures = self._recent(address, now)
        if failures is None or len(failures) < self.allowed:
            return 0.0
        return failures[0] + self.window_s - now

    def failed(self, address: str) -> None:
        now = self.clock()
        failures = self._recent(address, now)
        if failures is None:
            failures = self._failures[address] = deque(maxlen=self.allowed)
        else:
            self._failures.move_to_end(address)
        failures.append(now)
        while len(self._failures) > self.addresses:
            self._failures.popitem(last=False)

    def __len__(self) -> int:
        """How many addresses are tracked."""
        return len(self._failures)
