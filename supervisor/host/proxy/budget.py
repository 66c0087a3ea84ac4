"""Daily token budgets: a caller's limit, where it stands today, and the refusal once over.

A day is a UTC day. The limit is the key's own (`keys create --budget`, `keys budget`), else
[budget] daily_tokens from the settings; 0 there means no budget. The owner key has none, nor
has a key made exempt (`keys exempt ID on`): their spending is counted and shown, never
refused (`exempt` in `GET /v1/budget`). The
day's spending is read from the record's per-key, per-day total (one lookup at any size of the
record). A stream that crosses the budget finishes; the next request is refused with 429, the
count, the budget and when it resets. Without a store nothing is enforced, and every response
says so (`HEADER`): unlimited is never mistaken for under budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Final, Protocol

from supervisor.host.web.auth import Caller
from supervisor.host.web.refusal import Refusal

HEADER: Final = "X-Lucia-Record"
NOT_RECORDING: Final = "off; nothing is recorded and no budget is enforced"


class BudgetSpending(Protocol):
    """What budgets read of the record."""

    @property
    def available(self) -> bool: ...

    def spent(self, key_id: str, day: date) -> int:
        """Tokens the key used on that UTC day, the committed total and what is queued."""
        ...


class NoRecord:
    """No store: nothing is counted, nothing is enforced."""

    available: Final = False

    def spent(self, key_id: str, day: date) -> int:
        return 0


def exempt_of(identity: Caller) -> bool:
    """Pure: whether no daily budget applies to the caller, whatever the settings say: the
    owner key, and an issued key made exempt."""
    return identity.role == "owner" or identity.exempt


def limit_of(identity: Caller, default: int) -> int | None:
    """Pure: the caller's daily token budget; None: no budget."""
    if exempt_of(identity):
        return None
    if identity.budget is not None:
        return identity.budget
    return default or None


def resets_at(now: datetime) -> datetime:
    """Pure: the start of the next UTC day."""
    return datetime.combine(now.astimezone(UTC).date() + timedelta(days=1), time(), UTC)


@dataclass(frozen=True)
class Standing:
    """Where one caller stands today."""

    key_id: str
    day: date
    spent: int
    budget: int | None  # None: no budget
    enforced: bool  # False without a store: nothing is counted
    resets: datetime
    exempt: bool = False  # no budget applies whatever the settings say (exempt_of)

    @property
    def over(self) -> bool:
        return self.enforced and self.budget is not None and self.spent >= self.budget

    def body(self) -> dict[str, Any]:
        """`GET /v1/budget`'s answer."""
        remaining = (
            max(self.budget - self.spent, 0) if self.budget is not None and self.enforced else None
        )
        return {
            "object": "budget",
            "key_id": self.key_id,
            "day": self.day.isoformat(),
            "spent_tokens": self.spent if self.enforced else None,
            "budget_tokens": self.budget,
            "remaining_tokens": remaining,
            "resets_at": _iso(self.resets),
            "enforced": self.enforced and self.budget is not None,
            "exempt": self.exempt,
        }


def standing(identity: Caller, default: int, spending: BudgetSpending, now: datetime) -> Standing:
    day = now.astimezone(UTC).date()
    budget = limit_of(identity, default)
    enforced = spending.available
    spent = spending.spent(identity.key_id, day) if enforced else 0
    return Standing(
        identity.key_id, day, spent, budget, enforced, resets_at(now), exempt_of(identity)
    )


def refusal(
    stand: Standing, now: datetime, *, reserved: int = 0, asked: int | None = None
) -> Refusal:
    """429 for a caller over its budget: the count, the budget and when it resets; with
    `asked`, a request whose bound the budget cannot hold beside what is spent and `reserved`
    for requests in flight (reserve.py)."""
    assert stand.budget is not None
    wait = max(int((stand.resets - now).total_seconds()) + 1, 1)
    message = f"key {stand.key_id} has used {stand.spent} tokens today"
    if asked is not None:
        message += (
            f" and {reserved} are reserved for its requests in flight; this request may use "
            f"up to {asked} (its prompt's estimate and its token bound: lower max_tokens)"
        )
    details: dict[str, Any] = {"budget": stand.body()}
    if asked is not None:
        details["reserved_tokens"] = reserved
        details["request_tokens"] = asked
    return Refusal(
        429,
        "budget_exceeded",
        f"{message}; its daily budget is {stand.budget}; it resets at {_iso(stand.resets)}",
        headers={"Retry-After": str(wait)},
        details=details,
    )


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
