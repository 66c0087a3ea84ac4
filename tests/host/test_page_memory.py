"""The page's memory section: the workers' plans and the ledger's claims against the limit, as a
pure table, from files, and in the overview the page polls (the browser draws it in
tests/integration/test_page_browser.py)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from supervisor.host.page.memory import LedgerMemory, newest_plan, outdated_by, overview
from supervisor.protocol.documents import MemoryPlan, Reserves, Status, utc_now
from tests.host.gateway_world import OWNER_KEY, SETTINGS, world, write_status

GiB = 1024**3
AT = datetime(2026, 12, 2, 12, 0, tzinfo=utc_now().tzinfo)
HOSTILE = "<img src=x onerror=alert(1)>"
RESERVES = {"os": 4 * GiB, "services": 3 * GiB, "voice": 8 * GiB, "runtime": 3 * GiB}
MACHINE = (100 * GiB, 60 * GiB)


def plan(
    need: int | None = 10 * GiB,
    fits: bool = True,
    message: str = "",
    limit: int = 128 * GiB,
    source: str = "host",
    age_s: int = 0,
) -> MemoryPlan:
    return MemoryPlan(
        need=need,
        fits=fits,
        message=message,
        limit=limit,
        limit_source=source,  # type: ignore[arg-type]
        reserves=Reserves(**RESERVES),
        planned_at=AT - timedelta(seconds=age_s),
    )


def status(state: str, memory: MemoryPlan | None = None) -> Status:
    return Status(
        generation=1,
        state=state,
        since=AT,
        message=state,
        checked_at=AT,  # type: ignore[arg-type]
        url="http://127.0.0.1:1" if state == "running" else None,
        memory=memory,
    )


def test_no_plan_and_no_meminfo_is_not_available() -> None:
    assert overview({"a": status("stopped")}, [("a", GiB)], None) is None


def test_without_a_plan_the_limit_is_memtotal_and_the_reserves_unknown() -> None:
    shown = overview(
        {"big": status("running"), "small": status("stopped")},
        [("big", 30 * GiB), ("small", 5 * GiB)],
        MACHINE,
    )
    assert shown == {
        "limit": 100 * GiB,
        "limitSource": "meminfo",
        "plan": None,
        "reserves": None,
        "held": [{"name": "big", "bytes": 30 * GiB}],
        "free": 70 * GiB,
        "needs": [],
        "unplanned": ["small"],
        "availableNow": 60 * GiB,
    }


@pytest.mark.parametrize(
    ("statuses", "claims", "held", "free"),
    [
        # a stopped engine's plan gives the limit and reserves; its need counts against nothing
        ({"s": status("stopped", plan())}, [], [], 128 - 18),
        # what holds (starting, running, stopping) counts with its claim, nothing else does
        (
            {
                "r": status("running"),
                "up": status("starting"),
                "down": status("stopping"),
                "s": status("stopped", plan()),
                "f": status("failed"),
            },
            [
                ("r", 20 * GiB),
                ("up", 5 * GiB),
                ("down", 1 * GiB),
                ("s", 9 * GiB),
                ("f", GiB),
                ("gone", 7 * GiB),
            ],
            ["r", "up", "down"],
            128 - 18 - 26,
        ),
        # the reserves and what is held over the limit: free is negative (the page says over)
        ({"r": status("running", plan(limit=20 * GiB))}, [("r", 10 * GiB)], ["r"], 20 - 18 - 10),
    ],
)
def test_free_is_the_limit_less_the_reserves_and_what_holds(
    statuses: dict[str, Status], claims: list[tuple[str, int]], held: list[str], free: int
) -> None:
    shown = overview(statuses, claims, MACHINE)
    assert shown is not None
    assert [h["name"] for h in shown["held"]] == held
    assert shown["free"] == free * GiB
    assert shown["reserves"] == RESERVES and shown["limitSource"] == "host"


def test_the_newest_plan_gives_the_limit_and_each_idle_engine_its_need() -> None:
    statuses = {
        "old": status("stopped", plan(need=4 * GiB, limit=64 * GiB, source="fixed", age_s=60)),
        "new": status("failed", plan(need=None, fits=False, message=HOSTILE, source="gpu")),
        "run": status("running", plan(limit=32 * GiB, age_s=30)),
        "bare": status("stopped"),
    }
    shown = overview(statuses, [], None)
    assert shown is not None
    assert (shown["limit"], shown["limitSource"]) == (128 * GiB, "gpu")
    assert shown["plan"] == {"engine": "new", "plannedAt": "2026-12-02T12:00:00.000Z"}
    assert shown["availableNow"] is None, "no /proc/meminfo: the plan's limit still shows"
    assert shown["needs"] == [
        {
            "name": "new",
            "state": "failed",
            "need": None,
            "fits": False,
            "message": HOSTILE,
            "plannedAt": "2026-12-02T12:00:00.000Z",
            "outdatedBy": None,
        },
        {
            "name": "old",
            "state": "stopped",
            "need": 4 * GiB,
            "fits": True,
            "message": "",
            "plannedAt": "2026-12-02T11:59:00.000Z",
            "outdatedBy": "run",
        },
    ]
    assert shown["unplanned"] == ["bare"], "a running engine's plan is no need: it holds"


@pytest.mark.parametrize(
    ("ages", "newest"),
    [({"a": 5, "b": 1}, "b"), ({"a": 1, "b": 5}, "a"), ({"b": 3, "a": 3}, "a"), ({}, None)],
)
def test_the_newest_plan(ages: dict[str, int], newest: str | None) -> None:
    statuses: dict[str, Status | None] = {
        n: status("stopped", plan(age_s=s)) for n, s in ages.items()
    }
    statuses["none"] = None
    found = newest_plan(statuses)
    assert (found[0] if found else None) == newest


@pytest.mark.parametrize(
    ("planned_s", "changes", "outdated"),
    [
        (0, {}, None),  # alone: nothing changed since
        (10, {"b": 20}, None),  # b changed before the plan was made
        (10, {"b": 10}, None),  # ...or at the same moment
        (20, {"b": 10}, "b"),  # b started or stopped after it: the verdict may be old
        (30, {"b": 10, "c": 20}, "b"),  # the last change names the engine
        (30, {"b": 25, "c": 20}, "c"),
    ],
)
def test_a_plan_made_before_another_engine_changed_is_outdated(
    planned_s: int, changes: dict[str, int], outdated: str | None
) -> None:
    """planned_s and changes: seconds before AT that the plan was made and each other engine's
    state began (its status's since)."""
    statuses: dict[str, Status | None] = {
        "a": status("stopped", plan(fits=False, message="no", age_s=planned_s)),
        "gone": None,
    }
    for name, age in changes.items():
        statuses[name] = status("running").model_copy(update={"since": AT - timedelta(seconds=age)})
    assert outdated_by(statuses, "a") == outdated
    assert outdated_by(statuses, "gone") is None and outdated_by(statuses, "nobody") is None


def test_the_section_is_read_from_the_status_files_and_the_ledger(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "memory").mkdir(parents=True)
    (data / "memory" / "claims.json").write_text(
        '{"claims": [{"name": "small", "bytes": 1024}, {"name": "big", "bytes": 2048}]}'
    )
    write_status(data, "small", "running", url="http://127.0.0.1:1")
    write_status(data, "big", "stopped", memory=plan(need=3 * GiB, fits=False, message="no"))
    shown = LedgerMemory(data, tmp_path / "no-meminfo").read()
    assert shown is not None
    assert shown["held"] == [{"name": "small", "bytes": 1024}]
    assert shown["free"] == (128 - 18) * GiB - 1024
    assert [(n["name"], n["fits"], n["message"]) for n in shown["needs"]] == [("big", False, "no")]


def test_the_overview_carries_the_plans(tmp_path: Path) -> None:
    """What the page polls: the memory section, and each engine's plan in its status."""

    async def main() -> None:
        async with (
            world(tmp_path, SETTINGS) as w,
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http,
        ):
            unfit = plan(need=200 * GiB, fits=False, message=HOSTILE)
            write_status(w.data, "small", "stopped", memory=unfit)
            write_status(w.data, "other", "stopped")
            base = str(w.gateway.make_url("/page/api/"))
            async with http.post(base + "signin", json={"key": OWNER_KEY}) as answer:
                assert answer.status == 200
            async with http.get(base + "overview") as answer:
                found: dict[str, Any] = await answer.json()
        section = found["memory"]
        assert section["available"]
        shown = section["data"]
        assert shown["reserves"] == RESERVES and shown["limit"] == 128 * GiB
        assert shown["needs"][0]["message"] == HOSTILE and shown["needs"][0]["fits"] is False
        assert shown["unplanned"] == ["other"]
        engines = {row["name"]: row["status"]["memory"] for row in found["engines"]}
        assert engines["other"] is None
        assert engines["small"] == {
            "need": 200 * GiB,
            "fits": False,
            "message": HOSTILE,
            "limit": 128 * GiB,
            "limitSource": "host",
            "reserves": RESERVES,
            "plannedAt": "2026-12-02T12:00:00.000Z",
        }

    asyncio.run(main())
