"""Daily token budgets and the record's absence, end to end against the fast local upstream;
the record is faked at the gateway's own boundary (`BudgetSpending`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from supervisor.host.keycheck import INFERENCE, Identity, KeyRing
from supervisor.host.keycheck import OWNER as OWNER_IDENTITY
from supervisor.host.keys import generate
from supervisor.host.proxy.budget import (
    HEADER,
    NOT_RECORDING,
    limit_of,
    refusal,
    resets_at,
    standing,
)
from tests.host.gateway_world import (
    AUTH,
    INFERENCE_KEY,
    OWNER_KEY,
    SETTINGS,
    Upstream,
    World,
    world,
    write_status,
)

OWNER_ID = OWNER_IDENTITY
BUDGETED = SETTINGS + "[budget]\ndaily_tokens = 100\n"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
NOON = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


class Spent:
    """The record as budgets read it: tokens by (key id, day)."""

    def __init__(self, available: bool = True) -> None:
        self.available = available
        self.tokens: dict[tuple[str, date], int] = {}

    def spent(self, key_id: str, day: date) -> int:
        return self.tokens.get((key_id, day), 0)


ISSUED = generate("alice", NOON, None, budget=10)


class Keys:
    def __init__(self) -> None:
        self._ring = KeyRing.build(OWNER_KEY, INFERENCE_KEY, (ISSUED.entry,))

    def verify(self, presented: str) -> Identity | None:
        return self._ring.verify(presented, time.time())


@pytest.mark.parametrize(
    ("identity", "default", "limit"),
    [
        (INFERENCE, 100, 100),
        (INFERENCE, 0, None),  # 0: no budget
        (OWNER_ID, 100, None),
        (Identity("key_1", "inference", "a", budget=7), 100, 7),  # its own wins
        (Identity("key_1", "inference", "a", budget=7), 0, 7),
    ],
)
def test_a_callers_limit(identity: Identity, default: int, limit: int | None) -> None:
    assert limit_of(identity, default) == limit


@pytest.mark.parametrize(
    ("now", "reset"),
    [
        (NOON, datetime(2026, 12, 3, tzinfo=UTC)),
        (datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)),
        (datetime(2026, 12, 2, 0, 0, tzinfo=UTC), datetime(2026, 12, 3, tzinfo=UTC)),
    ],
)
def test_a_day_resets_at_the_next_utc_midnight(now: datetime, reset: datetime) -> None:
    assert resets_at(now) == reset


@pytest.mark.parametrize(
    ("spent", "available", "over"),
    [(99, True, False), (100, True, True), (500, True, True), (500, False, False)],
)
def test_over_only_when_the_record_counts(spent: int, available: bool, over: bool) -> None:
    record = Spent(available)
    record.tokens[("inference", NOON.date())] = spent
    assert standing(INFERENCE, 100, record, NOON).over is over


def test_the_refusal_names_the_count_the_budget_and_the_reset() -> None:
    record = Spent()
    record.tokens[("inference", NOON.date())] = 120
    refused = refusal(standing(INFERENCE, 100, record, NOON), NOON)
    assert refused.status == 429 and refused.code == "budget_exceeded"
    assert "used 120 tokens today" in refused.message and "budget is 100" in refused.message
    assert "2026-12-03T00:00:00Z" in refused.message
    assert refused.headers["Retry-After"] == str(12 * 3600 + 1)
    assert refused.body()["budget"]["remaining_tokens"] == 0


def run(
    tmp_path: Path,
    scenario: Callable[[World], Awaitable[None]],
    settings: str,
    spending: Any,
    upstream: Upstream | None = None,
) -> None:
    async def main() -> None:
        async with world(tmp_path, settings, upstream or Upstream(), Keys(), spending) as w:
            write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
            await scenario(w)

    asyncio.run(main())


def today() -> date:
    return datetime.now(UTC).date()


def test_over_budget_is_refused_before_the_engine_and_under_it_is_served(tmp_path: Path) -> None:
    record = Spent()

    async def scenario(w: World) -> None:
        async with aiohttp.ClientSession(headers=AUTH) as s:
            # what is left holds the prompt's estimate and what it may generate: the bound set
            record.tokens[("inference", today())] = 50
            async with s.post(f"{w.base}/chat/completions", json=CHAT) as r:
                assert r.status == 200 and HEADER not in r.headers  # a record: nothing said
            assert w.upstream.bodies[-1]["n_predict"] == 50 - estimate(CHAT), "what is left"
            assert not w.app.reservations.held("inference", today()), "released at its row"
            record.tokens[("inference", today())] = 100
            async with s.post(f"{w.base}/chat/completions", json=CHAT) as r:
                assert r.status == 429
                body = await r.json()
                assert body["error"]["code"] == "budget_exceeded"
                assert body["budget"]["spent_tokens"] == 100
                assert int(r.headers["Retry-After"]) > 0
            assert len(w.upstream.bodies) == 1, "a refused request never reaches the engine"
            async with s.get(f"{w.base}/budget") as r:
                assert await r.json() == {
                    "object": "budget",
                    "key_id": "inference",
                    "day": today().isoformat(),
                    "spent_tokens": 100,
                    "budget_tokens": 100,
                    "remaining_tokens": 0,
                    "resets_at": resets_at(datetime.now(UTC)).isoformat().replace("+00:00", "Z"),
                    "enforced": True,
                    "exempt": False,
                    "reserved_tokens": 0,
                }
            # the owner has no budget; a key's own budget wins over the default
            owner = {"Authorization": f"Bearer {OWNER_KEY}"}
            async with s.post(f"{w.base}/chat/completions", json=CHAT, headers=owner) as r:
                assert r.status == 200
            alice = {"Authorization": f"Bearer {ISSUED.secret}"}
            record.tokens[(ISSUED.entry.id, today())] = 10
            async with s.post(f"{w.base}/chat/completions", json=CHAT, headers=alice) as r:
                assert r.status == 429
                assert (await r.json())["budget"]["budget_tokens"] == 10

    run(tmp_path, scenario, BUDGETED, record)


def test_without_a_store_every_response_says_so_and_nothing_is_enforced(tmp_path: Path) -> None:
    record = Spent(available=False)
    record.tokens[("inference", today())] = 10_000

    async def scenario(w: World) -> None:
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.post(f"{w.base}/chat/completions", json=CHAT) as r:
                assert r.status == 200 and r.headers[HEADER] == NOT_RECORDING
            stream = {**CHAT, "stream": True}
            async with s.post(f"{w.base}/chat/completions", json=stream) as r:
                assert r.status == 200 and r.headers[HEADER] == NOT_RECORDING
                await r.read()
            async with s.post(f"{w.base}/chat/completions", json={**CHAT, "model": "nope"}) as r:
                assert r.status == 404 and r.headers[HEADER] == NOT_RECORDING
            async with s.get(f"{w.base}/budget") as r:
                body = await r.json()
                assert r.headers[HEADER] == NOT_RECORDING
                assert body["enforced"] is False and body["spent_tokens"] is None

    run(tmp_path, scenario, BUDGETED, record)


def test_a_burst_cannot_spend_past_the_budget_what_is_in_flight_is_held(tmp_path: Path) -> None:
    """68 requests at once from a key with room for one: one is admitted and holds its bound
    until its row; the other 67 are refused before the engine, naming what is held."""
    record = Spent()
    held = asyncio.Event()
    upstream = Upstream(hold=held)
    asked = {**CHAT, "max_tokens": 40, "stream": True}
    bound = estimate(asked) + 40

    async def scenario(w: World) -> None:
        async with aiohttp.ClientSession(headers=AUTH) as s:

            async def one() -> tuple[int, dict[str, Any] | None]:
                async with s.post(f"{w.base}/chat/completions", json=asked) as r:
                    if r.status != 200:
                        return r.status, await r.json()
                    await r.read()
                    return r.status, None

            tasks = [asyncio.create_task(one()) for _ in range(68)]
            await w.upstream.started.wait()
            refused = [await t for t in tasks if await _done_soon(t)]
            assert len(refused) == 67 and {status for status, _ in refused} == {429}
            for _, body in refused:
                assert body is not None and body["error"]["code"] == "budget_exceeded"
                assert body["reserved_tokens"] == bound and body["request_tokens"] == bound
            async with s.get(f"{w.base}/budget") as r:
                assert (await r.json())["reserved_tokens"] == bound
            held.set()
            assert [await t for t in tasks if not t.done() or (await t)[0] == 200] == [(200, None)]
            assert len(w.upstream.bodies) == 1
            async with s.get(f"{w.base}/budget") as r:
                assert (await r.json())["reserved_tokens"] == 0, "released once its row is written"

    run(tmp_path, scenario, BUDGETED, record, upstream)


def estimate(body: dict[str, Any]) -> int:
    """body.estimate_prompt of the bytes aiohttp sends for `json=body`."""
    return len(json.dumps(body)) // 4 + 16


async def _done_soon(task: asyncio.Task[Any]) -> bool:
    """Whether the task ends while the admitted request is held (a refusal is immediate)."""
    done, _ = await asyncio.wait({task}, timeout=5)
    return bool(done)


@pytest.mark.parametrize(("over", "status"), [(0, 200), (1, 429)])
def test_a_request_whose_own_bound_the_budget_cannot_hold_is_refused(
    tmp_path: Path, over: int, status: int
) -> None:
    record = Spent()

    async def scenario(w: World) -> None:
        async with aiohttp.ClientSession(headers=AUTH) as s:
            body = {**CHAT, "max_tokens": 10}
            body["max_tokens"] = 100 - estimate(body) + over
            async with s.post(f"{w.base}/chat/completions", json=body) as r:
                assert r.status == status, await r.text()
            assert len(w.upstream.bodies) == (1 if status == 200 else 0)

    run(tmp_path, scenario, BUDGETED, record)
