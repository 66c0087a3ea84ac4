"""Callers exempt from the daily budget: the rule in tables, then the gateway end to end with
keys from a real keys.json (read by keycheck's Verifier, as the service reads them) recording
into a real SQLite record, in front of the fast local upstream: an exempt key past its budget is
served, counted and recorded as any; made budgeted again, it is refused."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from supervisor.host import keys
from supervisor.host.keycheck import INFERENCE, OWNER, Identity, Verifier
from supervisor.host.page.traffic import KeyUse
from supervisor.host.proxy.budget import exempt_of, limit_of, standing
from supervisor.host.record.database import Target
from supervisor.host.record.ledger import Spent
from supervisor.host.record.store import Store
from supervisor.protocol.documents import utc_now
from tests.host.gateway_world import (
    INFERENCE_KEY,
    OWNER_KEY,
    SETTINGS,
    Upstream,
    World,
    world,
    write_status,
)

NOON = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
RADAR = Identity("key_000000000001", "inference", "radar", budget=7, exempt=True)


@pytest.mark.parametrize(
    ("identity", "default", "exempt", "limit"),
    [
        (INFERENCE, 100, False, 100),
        (INFERENCE, 0, False, None),  # no budget set, but one would apply: not exempt
        (OWNER, 100, True, None),  # the owner key has none, whatever the settings
        (Identity("key_1", "inference", "a", budget=7), 100, False, 7),
        (RADAR, 100, True, None),  # exempt: its own budget is kept, and applies to nothing
        (Identity("key_1", "inference", "a", exempt=True), 100, True, None),
    ],
)
def test_an_exempt_caller_has_no_budget_whatever_the_settings(
    identity: Identity, default: int, exempt: bool, limit: int | None
) -> None:
    assert exempt_of(identity) is exempt
    assert limit_of(identity, default) == limit


class Record:
    def __init__(self, spent: int, available: bool = True) -> None:
        self.available = available
        self.tokens = spent

    def spent(self, key_id: str, day: object) -> int:
        return self.tokens


@pytest.mark.parametrize("available", [True, False])
def test_an_exempt_keys_standing_shows_its_spending_and_enforces_nothing(available: bool) -> None:
    stand = standing(RADAR, 100, Record(10**6, available), NOON)
    assert not stand.over
    body = stand.body()
    assert (body["enforced"], body["exempt"], body["budget_tokens"]) == (False, True, None)
    assert body["remaining_tokens"] is None
    assert body["spent_tokens"] == (10**6 if available else None), "counted where it can be"


def test_the_page_shows_an_exempt_keys_spending_with_no_budget(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    radar = keys.create(keys_file, "radar", NOON, budget=5, exempt=True).entry.id
    laptop = keys.create(keys_file, "laptop", NOON).entry.id

    class Spending:
        def spending(self, key_id: str) -> Spent | None:
            return Spent(9000, 40)

    use = KeyUse(Target(path=tmp_path / "none.sqlite3"), Spending(), keys_file, 100).read()
    assert use is not None
    assert (use[radar]["budget"], use[radar]["exempt"], use[radar]["spentTokens"]) == (
        None,
        True,
        9000,
    )
    assert (use[laptop]["budget"], use[laptop]["exempt"]) == (100, False)


# -- the gateway -----------------------------------------------------------------------------

BUDGETED = SETTINGS + "[budget]\ndaily_tokens = 20\n"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def rows(path: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(path) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM generations ORDER BY at_us")]


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(30):
        while not check():
            await asyncio.sleep(0.01)


def run(tmp_path: Path, scenario: Callable[[World, Store, Path], Awaitable[None]]) -> Path:
    """The scenario against a gateway whose keys are read from keys.json (rechecked at once)
    and whose record is a real SQLite file; the record's path."""
    path = tmp_path / "record.sqlite3"
    keys_file = tmp_path / "keys.json"
    for name, secret in (("owner.key", OWNER_KEY), ("inference.key", INFERENCE_KEY)):
        (tmp_path / name).write_text(secret)
    verifier = Verifier.open(
        keys_file, tmp_path / "owner.key", tmp_path / "inference.key", recheck=0.0
    )

    async def main() -> None:
        store = await asyncio.to_thread(Store.open, Target(path=path), 30)
        assert store.available, store.reason
        try:
            where = BUDGETED + f'[record]\npath = "{path}"\n'
            async with world(tmp_path, where, Upstream(), verifier, store, store) as w:
                write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
                await scenario(w, store, keys_file)
        finally:
            await asyncio.to_thread(store.close)

    asyncio.run(main())
    return path


def test_an_exempt_key_past_its_budget_is_served_counted_and_recorded(tmp_path: Path) -> None:
    """Each chat costs 8 tokens (the stand-in's usage: 5 + 3). The default budget is 20 and
    the radar's own 1; exempt, its five chats are served, each bounded by the settings'
    max_tokens, not by what a budget has left, and counted as any. Made budgeted again, it is
    refused with what it spent."""
    made: dict[str, str] = {}

    async def scenario(w: World, store: Store, keys_file: Path) -> None:
        now = utc_now()
        radar = keys.create(keys_file, "radar", now, budget=1, exempt=True)
        laptop = keys.create(keys_file, "laptop", now)
        made.update(radar=radar.entry.id, laptop=laptop.entry.id)
        as_radar = {"Authorization": f"Bearer {radar.secret}"}
        as_laptop = {"Authorization": f"Bearer {laptop.secret}"}
        url = f"{w.base}/chat/completions"
        async with aiohttp.ClientSession() as s:
            for _ in range(4):  # 32 tokens: past its own budget and the default
                async with s.post(url, json=CHAT, headers=as_radar) as r:
                    assert r.status == 200, await r.text()
                assert w.upstream.bodies[-1]["n_predict"] == 1000, "no budget's rest bounds it"
            async with s.post(url, json={**CHAT, "stream": True}, headers=as_radar) as r:
                assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
            await until(lambda: store.spent(radar.entry.id) == 40)
            async with s.get(f"{w.base}/budget", headers=as_radar) as r:
                stood = await r.json()
            assert {k: stood[k] for k in ("spent_tokens", "budget_tokens", "enforced")} == {
                "spent_tokens": 40,
                "budget_tokens": None,
                "enforced": False,
            }
            assert (stood["exempt"], stood["reserved_tokens"]) == (True, 0)
            async with s.get(f"{w.base}/budget", headers=as_laptop) as r:
                assert (await r.json())["exempt"] is False
            keys.set_exempt(keys_file, "radar", False)  # held to its own budget (1) again
            async with s.post(url, json=CHAT, headers=as_radar) as r:
                assert r.status == 429
                refused = await r.json()
            assert refused["error"]["code"] == "budget_exceeded"
            assert refused["budget"]["budget_tokens"] == 1
            assert refused["budget"]["exempt"] is False
            await until(lambda: store.committed >= 6)

    path = run(tmp_path, scenario)
    found = [
        (r["key_id"], r["outcome"], r["prompt_tokens"], r["completion_tokens"]) for r in rows(path)
    ]
    assert found == [
        *[(made["radar"], "ok", 5, 3)] * 5,
        (made["radar"], "refused:budget_exceeded", None, None),
    ]
