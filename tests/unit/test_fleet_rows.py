"""What a machine publishes of its engines (fleet.rows.rows_of), and the stored form of a row:
written and read back as it was, and anything another machine stored in another form refused."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from supervisor.host.fleet.rows import (
    MAX_DOCUMENT,
    PeerEngine,
    document,
    engine_key,
    machine_document,
    read_key,
    read_row,
    read_url,
    rows_of,
)
from supervisor.host.proxy.catalog import CatalogEntry
from supervisor.protocol.documents import (
    DesiredFile,
    MemoryPlan,
    Reserves,
    RunningEngine,
    Status,
    utc_now,
)

NOW = utc_now()
URL = "http://gpu-a.example:8400"
RUNS = RunningEngine(
    image="lucia/llama:1",
    image_id="sha256:0123456789abcdef0123",
    container_id="c1",
    model="qwen",
    model_revision="rev-7",
    engine_version="b4567",
)
PLAN = MemoryPlan(
    need=10,
    fits=False,
    message="needs 10 B, 4 B free",
    limit=100,
    limit_source="host",
    reserves=Reserves(os=1, services=1, voice=1, runtime=1),
    planned_at=NOW,
)


def status(state: str, *, age_s: float = 1, **extra: Any) -> Status:
    return Status(
        generation=3,
        state=state,  # type: ignore[arg-type]
        since=NOW,
        message=state,
        url="http://172.17.0.1:9000" if state == "running" else None,
        checked_at=NOW - timedelta(seconds=age_s),
        models=("qwen", "tiny"),
        engine=RUNS if state == "running" else None,
        **extra,
    )


def desired(state: str, by: str | None) -> DesiredFile:
    return DesiredFile(schemaVersion=1, generation=3, desired=state, requestedBy=by)  # type: ignore[arg-type]


ROW = PeerEngine(
    machine="gpu-a", engine="e", url=URL, models=("qwen", "tiny"), state="running", heard=NOW
)


@pytest.mark.parametrize(
    ("entry", "counts", "expected"),
    [
        (
            CatalogEntry(
                "e",
                status(
                    "running",
                    slots={"qwen": 4, "tiny": 2},
                    capabilities={"qwen": ("chat", "completion"), "tiny": ()},
                    memory=PLAN,
                ),
                desired("running", "gateway"),
            ),
            {"e": (3, 5)},
            {
                "state": "running",
                "models": ("qwen", "tiny"),
                "declared": {"qwen": ("chat", "completion"), "tiny": ()},
                "build": "b4567@0123456789ab",
                "weights": "rev-7",
                "running": 3,
                "waiting": 5,
                "slots": 6,
                "fits": False,
                "plan": "needs 10 B, 4 B free",
                "stopped_by_operator": False,
            },
        ),
        (
            CatalogEntry("e", status("stopped"), desired("stopped", "operator")),
            {},
            {
                "state": "stopped",
                "build": None,
                "weights": None,
                "slots": None,
                "fits": None,
                "running": 0,
                "waiting": 0,
                "stopped_by_operator": True,
            },
        ),
        (  # an older host's stop names no requester: an operator's
            CatalogEntry("e", status("stopped"), desired("stopped", None)),
            {},
            {"stopped_by_operator": True},
        ),
        (  # the gateway's own idle stop: it may start it again
            CatalogEntry("e", status("stopped"), desired("stopped", "gateway")),
            {"other": (1, 1)},
            {"state": "stopped", "stopped_by_operator": False, "running": 0},
        ),
        (  # a worker not heard from for over a minute: nothing it said holds
            CatalogEntry("e", status("running", age_s=61), None),
            {},
            {"state": "unavailable", "build": "b4567@0123456789ab", "models": ("qwen", "tiny")},
        ),
        (
            CatalogEntry("e", None, desired("running", "operator")),
            {"e": (0, 2)},
            {"state": "unavailable", "models": (), "declared": {}, "waiting": 2},
        ),
        (
            CatalogEntry("e", status("starting"), desired("running", "gateway")),
            {},
            {"state": "starting", "stopped_by_operator": False},
        ),
    ],
)
def test_rows_of_says_each_engine_as_its_files_and_its_gate_say(
    entry: CatalogEntry, counts: dict[str, tuple[int, int]], expected: dict[str, Any]
) -> None:
    (row,) = rows_of("gpu-a", URL, [entry], counts, NOW)
    assert (row.machine, row.engine, row.url, row.heard) == ("gpu-a", "e", URL, NOW)
    assert {key: getattr(row, key) for key in expected} == expected


def test_rows_of_orders_by_engine_name_and_the_heartbeat_is_no_change() -> None:
    entries = [CatalogEntry(name, status("stopped")) for name in ("b", "c", "a")]
    rows = rows_of("m", URL, entries, {}, NOW)
    assert [row.engine for row in rows] == ["a", "b", "c"]
    later = rows_of("m", URL, entries, {}, NOW + timedelta(seconds=5))
    assert later != rows
    assert [row.published() for row in later] == [row.published() for row in rows]
    busier = rows_of("m", URL, entries, {"b": (1, 0)}, NOW)
    assert [row.published() for row in busier] != [row.published() for row in rows]


HOSTILE = [
    "'; DROP TABLE fleet_engines; --",
    "nul\x00inside",
    "\x1b[31mred\x1b[0m\r\nnext line",
    "ünï€ødé 🚀 \u2028",
    "lone \ud800 surrogate",
    '"quoted" \\back\\slash %s %(x)s {}',
    "",
]


@pytest.mark.parametrize(
    "row",
    [
        ROW,
        PeerEngine(
            machine="gpu-a",
            engine=HOSTILE[0],
            url=URL,
            models=tuple(HOSTILE),
            state="failed",
            heard=NOW,
            declared={HOSTILE[1]: ("chat",), HOSTILE[2]: (), HOSTILE[4]: ("chat", "embedding")},
            build=HOSTILE[2],
            weights=HOSTILE[1],
            running=7,
            waiting=1_000_000,
            slots=0,
            fits=True,
            plan=HOSTILE[3],
            stopped_by_operator=True,
        ),
    ],
)
def test_a_row_reads_back_as_it_was_written_hostile_strings_as_data(row: PeerEngine) -> None:
    stored = document(row)
    assert stored.isascii() and "\x00" not in stored
    assert read_row(row.machine, row.engine, row.url, stored, row.heard) == row


@pytest.mark.parametrize("name", ["small", *HOSTILE])
def test_an_engines_key_is_ascii_and_reads_back_as_its_name(name: str) -> None:
    key = engine_key(name)
    assert key.isascii() and "\x00" not in key
    assert read_key(key) == name


@pytest.mark.parametrize(
    "key", [None, 5, "small", '["small"]', "7", "null", '"a', " " * MAX_DOCUMENT]
)
def test_a_key_in_another_form_is_refused(key: object) -> None:
    assert read_key(key) is None


def good(**change: Any) -> str:
    found = json.loads(document(ROW))
    found.update(change)
    return json.dumps(found)


def without(key: str) -> str:
    found = json.loads(document(ROW))
    del found[key]
    return json.dumps(found)


@pytest.mark.parametrize(
    "stored",
    [
        None,
        17,
        b"{}",
        "",
        "not json",
        "[]",
        '"a string"',
        "{" * 100_000,  # nested past the parser's depth
        " " * MAX_DOCUMENT + "{}",
        good(models="qwen"),
        good(models=["qwen", 7]),
        good(models=["m"] * 1001),
        good(capabilities=["chat"]),
        good(capabilities={"qwen": "chat"}),
        good(state=None),
        good(running=-1),
        good(running=True),
        good(running=1.0),
        good(running=10**12),
        good(waiting="3"),
        good(slots="4"),
        good(fits="yes"),
        good(plan=None),
        good(build=5),
        good(weights=["r"]),
        good(stoppedByOperator=None),
        without("stoppedByOperator"),
        without("models"),
        without("running"),
    ],
)
def test_a_row_in_another_form_is_refused(stored: object) -> None:
    assert read_row("gpu-a", "e", URL, stored, NOW) is None


def test_what_a_newer_gateway_may_say_is_read_as_nothing_routable() -> None:
    row = read_row("m", "e", URL, good(state="hibernating", extra={"x": 1}), NOW)
    assert row is not None and row.state == "unavailable"
    caps = read_row("m", "e", URL, good(capabilities={"qwen": ["chat", "telepathy"]}), NOW)
    assert caps is not None and caps.capabilities("qwen") == ("chat",)
    assert caps.capabilities("tiny") is None  # not declared: not known


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        (machine_document(URL), URL),
        (machine_document("https://[::1]:8443"), "https://[::1]:8443"),
        (machine_document("http://host:1/path"), None),
        (machine_document("ftp://host:1"), None),
        (machine_document("http://a b:1"), None),
        (machine_document("http://nul\x00:1"), None),
        (machine_document("http://esc\x1b[31m:1"), None),
        ('{"url": 5}', None),
        ("{}", None),
        ("nonsense", None),
        (None, None),
    ],
)
def test_a_machines_url_is_read_only_in_the_advertised_form(
    stored: object, expected: str | None
) -> None:
    assert read_url(stored) == expected


@pytest.mark.parametrize(
    ("age_s", "stale_s", "fresh"),
    [(0, 10, True), (10, 10, True), (10.001, 10, False), (-3, 10, True), (3600, 10, False)],
)
def test_a_row_is_fresh_within_the_bound_of_its_heartbeat(
    age_s: float, stale_s: float, fresh: bool
) -> None:
    row = PeerEngine(
        machine="m",
        engine="e",
        url=URL,
        models=(),
        state="running",
        heard=NOW - timedelta(seconds=age_s),
    )
    assert row.fresh(NOW, stale_s) is fresh
