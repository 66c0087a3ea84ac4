"""The soak checker's rules, as tables: which fault excuses which invariant, for which engine
and for how long; which faults touch which request, the liveness bound, what excuses a failed.
The checker is the soak's oracle, so its own rules are tested too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.soak.checker import caused, desired_document, excused
from tests.soak.frontdoor_check import (
    COMMIT_S,
    WRITER_BACK_S,
    Lives,
    Row,
    all_charged,
    one_row,
    started_by_traffic,
    windows,
    within_budget,
)
from tests.soak.liveness import (
    BOUND,
    DELAYS,
    FAILS,
    Request,
    late,
    reached_counts,
    unexplained_failure,
)

DISK_FULL = {"kind": "disk-full", "engine": "*", "start": 100.0, "end": 104.0}
KILL = {"kind": "worker-kill", "engine": "a", "start": 100.0, "end": 101.0}
STALL = {"kind": "dockerd-stall", "engine": "*", "start": 100.0, "end": 130.0}


@pytest.mark.parametrize(
    ("event", "engine", "invariant", "now", "expected"),
    [
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
    ],
)
def test_excused(
    event: dict[str, Any], engine: str, invariant: str, now: float, expected: bool
) -> None:
    assert excused([event], engine, invariant, now) is expected


def test_a_fault_under_way_excuses_until_it_ends() -> None:
    under_way = {"kind": "worker-stop", "engine": "a", "start": 100.0}  # no end yet
    assert excused([under_way], "a", "stale", 500.0)


@pytest.mark.parametrize(
    ("event", "engine", "since", "expected"),
    [
        ({"kind": "recipe-edit", "engine": "a", "start": 100.0}, "a", 90.0, True),
        ({"kind": "engine-oom", "engine": "a", "start": 100.0}, "b", 90.0, False),  # another's
        ({"kind": "dockerd-restart", "engine": "*", "start": 100.0}, "b", 90.0, True),
        ({"kind": "recipe-edit", "engine": "a", "start": 80.0}, "a", 90.0, False),  # before it
        # an operator who stops and starts the engine: a new container, stopped state or not
        ({"kind": "operator-stop", "engine": "a", "start": 100.0, "stops": True}, "a", 90.0, True),
        ({"kind": "request", "engine": "a", "start": 100.0, "stops": True}, "a", 90.0, True),
        ({"kind": "request", "engine": "a", "start": 100.0, "stops": False}, "a", 90.0, False),
        ({"kind": "disk-full", "engine": "*", "start": 100.0}, "a", 90.0, False),  # no reason
        ({"kind": "gateway-kill", "engine": "*", "start": 100.0, "stops": False}, "a", 90.0, False),
    ],
)
def test_caused(event: dict[str, Any], engine: str, since: float, expected: bool) -> None:
    assert caused([event], engine, since) is expected


# -- liveness: which faults touch which request, the bound, what excuses a failed --------------


def _request(
    desired: str = "running", seen: float = 100.0, superseded: float | None = None, **reached: float
) -> Request:
    return Request("a", 7, desired, seen, superseded, reached)


def _fault(kind: str, start: float, end: float | None, engine: str = "a") -> dict[str, Any]:
    fault: dict[str, Any] = {"kind": kind, "engine": engine, "start": start}
    if end is not None:
        fault["end"] = end
    return fault


AFTER = 100.0 + BOUND  # the moment the bound has passed


@pytest.mark.parametrize(
    ("request_", "events", "now", "is_late"),
    [
        (_request(), [], AFTER, True),  # every engine failing is no longer a pass
        (_request(), [], AFTER - 0.1, False),  # not before the bound
        (_request(running=130.0), [], AFTER + 100, False),  # reached in time
        (_request(failed=110.0), [], AFTER, True),  # a failure is no answer to running
        (_request("stopped"), [], AFTER, False),  # only requests for running
        (_request(superseded=150.0), [], AFTER, False),  # a newer request came within the bound
        (_request(superseded=AFTER + 1), [], AFTER + 2, True),  # ...but not after it
        (_request(), [_fault("engine-kill", 120.0, 120.5)], AFTER, False),
        (_request(), [_fault("engine-kill", 120.0, 120.5, engine="b")], AFTER, True),
        (_request(), [_fault("dockerd-stall", 140.0, 170.0, engine="*")], AFTER, False),
        (_request(), [_fault("worker-stop", 10.0, 50.0)], AFTER, True),  # long over when written
        (_request(), [_fault("worker-stop", 70.0, 86.0)], AFTER, False),  # worker back after 101
        (_request(), [_fault("worker-kill", 70.0, 80.0)], AFTER, True),  # back at 95, before it
        (_request(), [_fault("recipe-edit", AFTER + 3.5, AFTER + 4)], AFTER, True),  # after it
        (_request(), [_fault("recipe-edit", AFTER + 2.9, AFTER + 3)], AFTER, False),  # sampling
        (_request(), [_fault("disk-full", 150.0, None, engine="*")], AFTER, False),  # under way
        (_request(), [_fault("request", 120.0, 120.1)], AFTER, True),  # a host request: no fault
    ],
)
def test_late(request_: Request, events: list[dict[str, Any]], now: float, is_late: bool) -> None:
    assert (late(request_, events, now) is not None) is is_late


@pytest.mark.parametrize(
    ("request_", "events", "unexplained"),
    [
        (_request(failed=110.0), [], True),  # a failed needs a cause in the schedule
        (_request("stopped", failed=110.0), [], True),  # whatever was asked for
        (_request(running=105.0), [], False),  # no failure: nothing to explain
        (_request(running=105.0, failed=300.0), [_fault("engine-kill", 299.0, 299.1)], False),
        (_request(running=105.0, failed=300.0), [_fault("engine-oom", 301.0, 301.1)], False),
        (_request(running=105.0, failed=300.0), [_fault("engine-oom", 303.5, 304.0)], True),
        (_request(failed=110.0), [_fault("dockerd-restart", 90.0, 95.0, engine="*")], False),
        (_request(failed=110.0), [_fault("dockerd-restart", 60.0, 84.0, engine="*")], True),
        (_request(failed=110.0), [_fault("engine-kill", 105.0, 105.1, engine="b")], True),
        # faults that delay but never fail a request
        (_request(failed=110.0), [_fault("worker-kill", 105.0, 106.0)], True),
        (_request(failed=110.0), [_fault("worker-reload", 105.0, 105.1)], True),
        (_request(failed=110.0), [_fault("recipe-edit", 105.0, 105.1)], True),
        (_request(failed=110.0), [_fault("bad-desired", 105.0, 107.0)], True),
    ],
)
def test_unexplained_failure(
    request_: Request, events: list[dict[str, Any]], unexplained: bool
) -> None:
    assert (unexplained_failure(request_, events) is not None) is unexplained


def test_every_delaying_fault_may_fail_a_request_only_if_listed() -> None:
    assert FAILS < DELAYS  # a fault that may fail a request may also make it late


def test_reached_counts() -> None:
    requests = [
        _request(running=1.0),
        _request(running=1.0, failed=2.0),
        _request("stopped", starting=1.0),
        _request("stopped", stopping=1.0, stopped=2.0),
    ]
    assert reached_counts(requests) == {
        "requests": 4,
        "starting": 1,
        "running": 2,
        "stopping": 1,
        "stopped": 1,
        "failed": 1,
        "unanswered": 1,
    }


@pytest.mark.parametrize(
    ("text", "read"),
    [
        ('{"schemaVersion": 1, "generation": 3, "desired": "running"}', True),  # older hosts
        (
            '{"schemaVersion": 1, "generation": 3, "desired": "stopped", "requestedBy": "operator",'
            ' "requestedAt": "2026-11-30T17:14:35.239Z"}',
            True,
        ),
        ('{"schemaVersion": 1, "generation": 3, "desired": "running", "image": "x"}', False),
        ('{"schemaVersion": 1, "desired": "running", "requestedBy": "gateway"}', False),
        ("[]", False),
        ("{", False),
    ],
)
def test_the_checker_reads_desired_json_as_hosts_write_it(
    tmp_path: Path, text: str, read: bool
) -> None:
    path = tmp_path / "desired.json"
    path.write_text(text)
    assert (desired_document(path) is not None) is read


# -- the front door (tests/soak/frontdoor_check.py): each invariant fails on a table that breaks it

GATEWAY_KILL = {"kind": "gateway-kill", "engine": "*", "start": 200.0, "end": 203.0}
RECORD_DOWN = {"kind": "record-down", "engine": "*", "start": 300.0, "end": 305.0}
KEY = {"budget": 100, "prompt_estimate": 30, "max_tokens": 10}


def _call(
    start: float, status: int | None = 200, key: str = "k", code: str = "", end: float | None = None
) -> dict[str, Any]:
    return {
        "key": key,
        "start": start,
        "end": start + 1 if end is None else end,
        "status": status,
        "code": code,
        "max_tokens": 8,
        "left": False,
    }


def _row(
    at: float,
    key: str = "k",
    prompt: int = 0,
    completion: int = 0,
    outcome: str = "ok",
    duration: float = 1.0,
    engine: str = "r",
) -> Row:
    return Row(at, key, engine, outcome, "engine", prompt, completion, duration)


CALLS = [
    _call(10),
    _call(20),
    _call(30, 404),
    _call(40, None),
    _call(50, 429, code="bodies_busy"),
    _call(60, 429, code="budget_exceeded"),
]
KILLED = [*CALLS, _call(199.5)]  # in flight when the gateway was killed


@pytest.mark.parametrize(
    ("calls", "rows", "events", "fails"),
    [
        (CALLS, [10, 20, 60], [], False),  # unrouted calls owe no row; a budget refusal does
        (CALLS, [10, 20], [], True),  # a generation with no row
        (CALLS, [10, 20, 60, 60], [], True),  # a generation with two rows
        (KILLED, [10, 20, 60], [GATEWAY_KILL], False),  # the kill may have lost its row
        (KILLED, [10, 20, 60, 199.5], [GATEWAY_KILL], False),  # or not
        (KILLED, [10, 20, 60, 199.5, 199.5], [GATEWAY_KILL], True),  # but not written twice
        (KILLED, [10, 20], [GATEWAY_KILL], True),  # and a sure one is still owed
        (KILLED, [10, 20, 60], [], True),  # no kill: its row is owed
    ],
)
def test_every_generation_has_exactly_one_row(
    calls: list[dict[str, Any]], rows: list[float], events: list[dict[str, Any]], fails: bool
) -> None:
    problems = one_row(calls, [_row(at) for at in rows], windows(events))
    assert bool(problems) is fails, problems


@pytest.mark.parametrize(
    ("generated", "rows", "calls", "events", "fails"),
    [
        (100, [_row(1, completion=60), _row(2, completion=40)], [], [], False),
        (101, [_row(1, completion=60), _row(2, completion=40)], [], [], True),  # a token uncharged
        (100, [_row(1, completion=60), _row(2, completion=40, engine="other")], [], [], True),
        (108, [_row(1, completion=100)], [_call(301)], [RECORD_DOWN], False),  # its row lost
        (109, [_row(1, completion=100)], [_call(301)], [RECORD_DOWN], True),  # past its bound
        (108, [_row(1, completion=100)], [_call(301)], [], True),  # no fault to lose it
    ],
)
def test_every_token_generated_is_charged(
    generated: int,
    rows: list[Row],
    calls: list[dict[str, Any]],
    events: list[dict[str, Any]],
    fails: bool,
) -> None:
    problem, _ = all_charged(generated, rows, "r", calls, windows(events))
    assert (problem is not None) is fails, problem


UNKNOWN = [(300.0 - COMMIT_S, 305.0 + WRITER_BACK_S)]


TWO = [_row(1, prompt=20, completion=10)] * 2  # 60 of the budget of 100, ended at 2


@pytest.mark.parametrize(
    ("rows", "unknown", "fails"),
    [
        ([*TWO, _row(5, prompt=30, completion=10)], [], False),  # spent all of it
        # two within their bounds, in flight at once: a burst spent past the budget
        ([*TWO, _row(4, prompt=30, completion=10), _row(5, prompt=30, completion=10)], [], True),
        # the last request in flight cost past its bound: a longer prompt, a stream left early
        ([*TWO, _row(5, prompt=35, completion=26)], [], False),
        ([*TWO, _row(4, prompt=10, completion=10), _row(5, prompt=35, completion=26)], [], True),
        # an excess that ended before the last admission was in the total it was admitted beside
        (
            [
                _row(1, prompt=40, completion=10),
                _row(2, prompt=30, completion=10),
                _row(5, prompt=10, completion=10),
            ],
            [],
            True,
        ),
        (
            [
                _row(1, prompt=40, completion=10, duration=5),
                _row(2, prompt=30, completion=10),
                _row(5, prompt=10, completion=10),
            ],
            [],
            False,
        ),
        # refusals are no admission
        (
            [*TWO, _row(5, prompt=30, completion=10), _row(9, outcome="refused:budget_exceeded")],
            [],
            False,
        ),
        # admitted while no budget was known: all it cost may pass the budget
        (
            [*TWO, _row(301, prompt=30, completion=10), _row(302, prompt=30, completion=10)],
            UNKNOWN,
            False,
        ),
        (
            [*TWO, _row(301, prompt=30, completion=10), _row(302, prompt=30, completion=10)],
            [],
            True,
        ),
    ],
)
def test_no_key_spends_past_its_budget_and_reservations(
    rows: list[Row], unknown: list[tuple[float, float]], fails: bool
) -> None:
    problems = within_budget(rows, {"k": KEY}, unknown)
    assert bool(problems) is fails, problems


def _doc(generation: int, desired: str, by: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"generation": generation, "desired": desired}
    if by is not None:
        doc["requestedBy"] = by
    return doc


@pytest.mark.parametrize(
    ("seen", "fails"),
    [
        ([_doc(1, "stopped", "operator"), _doc(2, "running", "gateway")], True),
        ([_doc(1, "stopped", None), _doc(2, "running", "gateway")], True),  # an older host's stop
        (
            [
                _doc(1, "stopped", "operator"),
                _doc(2, "running", "operator"),
                _doc(3, "running", "gateway"),
            ],
            False,
        ),
        ([_doc(1, "stopped", "gateway"), _doc(2, "running", "gateway")], False),  # its own stop
        ([_doc(3, "running", "gateway"), _doc(1, "stopped", "operator")], False),  # by generation
        # a generation missed between: whoever wrote it is unknown, so the next is not judged
        ([_doc(1, "stopped", "operator"), _doc(3, "running", "gateway")], False),
        (
            [
                _doc(1, "stopped", "operator"),
                _doc(2, "stopped", "gateway"),
                _doc(3, "running", "gateway"),
            ],
            True,
        ),  # the gateway's word is no operator's start
    ],
)
def test_no_engine_an_operator_stopped_is_started_by_traffic(
    seen: list[dict[str, Any]], fails: bool
) -> None:
    assert bool(started_by_traffic(seen)) is fails


def test_an_engines_counts_are_summed_over_its_lives() -> None:
    lives = Lives()
    for prompt, generated in ((10, 5), (30, 20), (4, 2), (8, 7)):  # killed after (30, 20)
        lives.add(prompt, generated)
    assert lives.total_generated == 27
