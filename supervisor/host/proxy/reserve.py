"""Budget reservations: what requests in flight may still cost, held against their key's day.

The record counts a request once its row is written, so a check of what was spent alone lets
a burst through: a key with one token left that sends 68 requests at once would have all 68
admitted. Each request of a key with a budget holds its bound here (body.Prepared.reserve: the
prompt's estimate and the tokens it may generate) from before it is admitted until its row is
written, when what it cost is in the spent total instead. A request whose bound the budget
cannot hold beside what is spent and held is refused (`budget_exceeded`, with
`reserved_tokens`). The reservations are this gateway process's: several gateways behind one
balancer each hold their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime

from supervisor.host.proxy import budget as budgets


@dataclass(frozen=True)
class Hold:
    """One request's reservation: release it once its row is written."""

    key: tuple[str, date]
    tokens: int


class Reservations:
    def __init__(self) -> None:
        self._held: dict[tuple[str, date], int] = {}

    def held(self, key_id: str, day: date) -> int:
        """Tokens held for the key's requests in flight on that UTC day."""
        return self._held.get((key_id, day), 0)

    def room(self, stand: budgets.Standing) -> int | None:
        """What the caller's budget has left beside what is held; None: no budget."""
        if not stand.enforced or stand.budget is None:
            return None
        return stand.budget - stand.spent - self.held(stand.key_id, stand.day)

    def hold(self, stand: budgets.Standing, tokens: int, now: datetime) -> Hold | None:
        """Hold `tokens` for one request, or raise budget_exceeded; None: nothing to hold."""
        room = self.room(stand)
        if room is None:
            return None
        key = (stand.key_id, stand.day)
        if tokens > room:
            raise budgets.refusal(stand, now, reserved=self._held.get(key, 0), asked=tokens)
        self._held[key] = self._held.get(key, 0) + tokens
        return Hold(key, tokens)

    def release(self, hold: Hold | None) -> None:
        if hold is None:
            return
        left = self._held.get(hold.key, 0) - hold.tokens
        if left > 0:
            self._held[hold.key] = left
        else:
            self._held.pop(hold.key, None)
