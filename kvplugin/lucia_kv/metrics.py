"""The store's counters, per tier, and their Prometheus text exposition."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Final

# name -> help; every counter but the untiered ones carries a tier label, some a reason
HELP: Final = {
    "hits": "Block reads served by this tier.",
    "misses": "Block reads this tier could not serve (not there, or did not open).",
    "read_bytes": "Bytes of block files read from this tier.",
    "written_bytes": "Bytes of block files written to this tier.",
    "writes": "Block files written to this tier.",
    "evictions": "Least recently used blocks removed to make room.",
    "corrupt": (
        "Blocks that failed to open (reason: auth, short, missing, size, error); a miss, removed."
    ),
    "stale_key": "Blocks sealed under a rotated-out cache key; a miss, removed.",
    "skipped_writes": ("Writes not made (reason: pinned, too_big, queue_full, off, no_space)."),
    "tier_off": (
        "Times this tier was switched off after a fault (reason: the errno's name, such as "
        "erofs or eio, or unsafe); the engine serves on, the tier is tried again later."
    ),
    "tier_on": "Times this tier opened again after a fault, rebuilt from its directory.",
    "promotions": "Blocks copied into this faster tier after a read from a slower one.",
    "requests_unkeyable": (
        "Requests the tiers skipped (no lookup, no save): what shapes their KV has no name "
        "that lasts a restart."
    ),
    "requests_read_skipped": (
        "Requests given nothing from the tiers because vLLM has them skip reading cached KV "
        "(prompt logprobs, some pooling requests); their blocks are still saved."
    ),
}
# the counters with a reason label
REASONED: Final = frozenset({"corrupt", "skipped_writes", "tier_off"})
# counted per engine, not per tier
UNTIERED: Final = frozenset({"requests_unkeyable", "requests_read_skipped"})
PREFIX: Final = "lucia_kv_"
Labels = tuple[tuple[str, str], ...]


def exposed(name: str) -> str:
    """A counter's name as Prometheus shows it: lucia_kv_<name>_total."""
    return f"{PREFIX}{name}_total"


def label_names(name: str) -> tuple[str, ...]:
    """The store's own labels of a counter, in order: tier (none for an untiered one), and
    reason where it has one."""
    if name not in HELP:
        raise KeyError(name)
    if name in UNTIERED:
        return ()
    return ("tier", "reason") if name in REASONED else ("tier",)


class Metrics:
    """Thread-safe counters keyed by (name, labels)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, Labels]] = Counter()

    def add(self, name: str, tier: str | None, amount: int = 1, reason: str | None = None) -> None:
        """Count; tier is None exactly for the untiered counters."""
        if name not in HELP:
            raise KeyError(name)
        if (tier is None) != (name in UNTIERED):
            raise ValueError(f"counter {name} {'has no' if name in UNTIERED else 'needs a'} tier")
        if (reason is not None) != (name in REASONED):
            # a Prometheus metric has one label set: a reason where it has one, none elsewhere
            raise ValueError(f"counter {name} {'needs' if name in REASONED else 'has no'} reason")
        labels: Labels = ()
        if tier is not None:
            labels = (("tier", tier),) if reason is None else (("tier", tier), ("reason", reason))
        with self._lock:
            self._counts[(name, labels)] += amount

    def get(self, name: str, tier: str | None = None, reason: str | None = None) -> int:
        """The sum of a counter over the labels not given."""
        with self._lock:
            items = list(self._counts.items())
        total = 0
        for (key, labels), value in items:
            found = dict(labels)
            if key != name or (tier is not None and found.get("tier") != tier):
                continue
            if reason is not None and found.get("reason") != reason:
                continue
            total += value
        return total

    def snapshot(self) -> dict[tuple[str, Labels], int]:
        with self._lock:
            return dict(self._counts)

    def render(self) -> str:
        """The counters in the Prometheus text format (lucia_kv_<name>_total)."""
        counts = self.snapshot()
        lines = []
        for name, text in HELP.items():
            metric = exposed(name)
            lines += [f"# HELP {metric} {text}", f"# TYPE {metric} counter"]
            for (key, labels), value in sorted(counts.items()):
                if key == name:
                    inner = ",".join(f'{label}="{value_}"' for label, value_ in labels)
                    lines.append(f"{metric}{{{inner}}} {value}" if inner else f"{metric} {value}")
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> None:
        """Replace a textfile-collector file with the counters, atomically (mode 0600)."""
        fd, temp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(self.render())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
