"""The soak checker's excuses, as a table: which fault excuses which invariant, for which
engine and for how long. The checker is the soak's oracle, so its own rules are tested too."""

from __future__ import annotations

from typing import Any

import pytest

from tests.soak.checker import excused

DISK_FULL = {"kind": "disk-full", "engine": "*", "start": 100.0, "end": 104.0}
KILL = {"kind": "worker-kill", "engine": "a", "start": 100.0, "end": 101.0}
STALL = {"kind": "dockerd-stall", "engine": "*", "start": 100.0, "end": 130.0}


@pytest.mark.parametrize(("event", "engine", "invariant", "now", "expected"), [
    (DISK_FULL, "a", "ack 41", 106.0, True),  # one generation's ack, excused as "ack" is
    (DISK_FULL, "a", "ack", 106.0, True),
    (DISK_FULL, "a", "stale", 118.9, True),  # until the worker's return after the fault ends
    (DISK_FULL, "a", "stale", 119.1, False),
    (DISK_FULL, "a", "stale", 96.9, False),  # not before it (less the sampling tolerance)
    (DISK_FULL, "a", "running", 102.0, False),  # a full disk excuses no claim of serving
    (KILL, "a", "ack 7", 105.0, True),
    (KILL, "b", "ack 7", 105.0, False),  # another engine's worker
    (STALL, "a", "running", 120.0, True),
    (STALL, "a", "ack 3", 120.0, False),  # a stalled dockerd is no reason to leave a request
    ({**KILL, "kind": "worker-stop"}, "a", "stale", 500.0, False),  # long over
])
def test_excused(event: dict[str, Any], engine: str, invariant: str, now: float,
                 expected: bool) -> None:
    assert excused([event], engine, invariant, now) is expected


def test_a_fault_under_way_excuses_until_it_ends() -> None:
    under_way = {"kind": "worker-stop", "engine": "a", "start": 100.0}  # no end yet
    assert excused([under_way], "a", "stale", 500.0)
