"""Failed attempts per client address in a sliding window: the page's sign-ins, the bearer keys.

An address is the connection's peer, never a header a client writes. At most `allowed`
failures in `window_s` from one address; beyond, that address is refused until its window moves
on, while every other address goes on as before. The keys are not guessable, so the limit
bounds work and noise, not guessing: it must never let one caller lock the owner out. At most
`addresses` are tracked, the least recently failed forgotten first, so an address-rotating flood
holds bounded memory (about 1 KiB an address at most).

An attempt that awaits anything (a body) is counted before it does (`failed`), and taken back
when it succeeds (`forgive`): so attempts at once cannot all pass the check together.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Final

ALLOWED: Final = 10
WINDOW_S: Final = 60.0
MAX_ADDRESSES: Final = 4096

Clock = Callable[[], float]


class FailureLimit:
    """Failures per client address in a sliding window: `blocked` says how long until that
    address may try again."""

    def __init__(
        self,
        allowed: int = ALLOWED,
        window_s: float = WINDOW_S,
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
        """Seconds until `address` may try again; 0 when it may now."""
        now = self.clock()
        failures = self._recent(address, now)
        if failures is None or len(failures) < self.allowed:
            return 0.0
        return failures[0] + self.window_s - now

    def failed(self, address: str) -> float:
        """Count a failure (or an attempt not yet decided) of `address`; its stamp, for
        `forgive`."""
        now = self.clock()
        failures = self._recent(address, now)
        if failures is None:
            failures = self._failures[address] = deque(maxlen=self.allowed)
        else:
            self._failures.move_to_end(address)
        failures.append(now)
        while len(self._failures) > self.addresses:
            self._failures.popitem(last=False)
        return now

    def forgive(self, address: str, stamp: float) -> None:
        """Take back the attempt `failed` counted at `stamp`: it succeeded."""
        failures = self._failures.get(address)
        if failures is None:
            return  # forgotten meanwhile
        with contextlib.suppress(ValueError):
            failures.remove(stamp)
        if not failures:
            del self._failures[address]

    def __len__(self) -> int:
        """How many addresses are tracked."""
        return len(self._failures)
