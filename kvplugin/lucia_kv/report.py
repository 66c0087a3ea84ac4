"""The store's counter deltas since the last report, as plain data vLLM's connector stats carry.

vLLM ships a connector's stats with each model step, from the worker to the API server's
Prometheus logger, through its IPC serializers: so a report is nested dicts of str keys and int
amounts only, `{name: {tier: {reason: amount}}}` (reason "" for a counter without one, tier ""
for an untiered one), and holds no zero. This module has no vLLM in it; lucia_kv.connector
wraps it in vLLM's types.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping

from .metrics import HELP, REASONED, UNTIERED, Labels, Metrics

Counts = dict[str, dict[str, dict[str, int]]]
NO_REASON = ""
NO_TIER = ""


class ReportError(ValueError):
    """A report that is not the store's counters; str() says what is wrong with it."""


class Reporter:
    """What a Metrics counted since the previous take(); the first take() counts from 0."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._lock = threading.Lock()
        self._reported: Counter[tuple[str, Labels]] = Counter()

    def take(self) -> Counts:
        """The deltas since the last take (empty when nothing was counted), now reported."""
        with self._lock:
            now = self._metrics.snapshot()
            counts: Counts = {}
            for (name, labels), value in sorted(now.items()):
                delta = value - self._reported[(name, labels)]
                if delta <= 0:
                    continue
                found = dict(labels)
                tier = counts.setdefault(name, {}).setdefault(found.get("tier", NO_TIER), {})
                tier[found.get("reason", NO_REASON)] = delta
                self._reported[(name, labels)] = value
            return counts


def parse(data: Mapping[str, object]) -> Counts:
    """A report checked and copied: known counter names, a reason exactly where the counter
    has one, and amounts that are positive integers."""
    counts: Counts = {}
    for name, tiers in data.items():
        if name not in HELP:
            raise ReportError(f"unknown counter {name!r}")
        if not isinstance(tiers, Mapping):
            raise ReportError(f"counter {name}: tiers must be a mapping, got {tiers!r}")
        for tier, reasons in tiers.items():
            if name in UNTIERED and tier != NO_TIER:
                raise ReportError(f"counter {name} has no tier, got {tier!r}")
            if name not in UNTIERED and (not isinstance(tier, str) or not tier):
                raise ReportError(f"counter {name}: tier {tier!r} is not a name")
            if not isinstance(reasons, Mapping):
                raise ReportError(f"counter {name}{{tier={tier}}}: not a mapping of reasons")
            for reason, amount in reasons.items():
                if not isinstance(reason, str) or (reason != NO_REASON) != (name in REASONED):
                    what = "needs a reason" if name in REASONED else "has no reason"
                    raise ReportError(f"counter {name} {what}, got {reason!r}")
                if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
                    raise ReportError(
                        f"counter {name}{{tier={tier}}}: amount {amount!r} is not a positive int"
                    )
                counts.setdefault(name, {}).setdefault(tier, {})[reason] = amount
    return counts


def merge(into: Counts, other: Counts) -> Counts:
    """Add other's amounts to into (in place; the sums of two workers or two steps)."""
    for name, tiers in other.items():
        for tier, reasons in tiers.items():
            target = into.setdefault(name, {}).setdefault(tier, {})
            for reason, amount in reasons.items():
                target[reason] = target.get(reason, 0) + amount
    return into


def series(counts: Counts) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """(counter name, its label values in label_names order, amount) for each entry."""
    for name, tiers in counts.items():
        for tier, reasons in tiers.items():
            for reason, amount in reasons.items():
                tiered = () if tier == NO_TIER else (tier,)
                yield name, (tiered if reason == NO_REASON else (*tiered, reason)), amount


def reduce(counts: Counts) -> dict[str, int | float]:
    """One line's worth for vLLM's periodic log: `name.tier[.reason]` -> amount."""
    return {".".join((name, *values)): amount for name, values, amount in series(counts)}
