"""One key's share of an engine's waiting places (`per_key_waiting`): the decision in a table,
the settings that resolve it, the gate with two keys at once and a client that leaves, and the
gateway end to end against the fast local upstream (the record faked at its own boundary)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from supervisor.host.gateway.sections import DEFAULT_PER_KEY_WAITING
from supervisor.host.gateway.settings import SettingsError, parse
from supervisor.host.proxy.admission import Admission, Gate, decide
from supervisor.host.record.row import Row
from supervisor.host.web.refusal import Refusal
from tests.host.gateway_world import AUTH, OWNER, SETTINGS, Upstream, World, world, write_status

LIMITS = Admission(running=2, waiting=4, max_wait_s=30, deadline_s=60, per_key_waiting=2)


@pytest.mark.parametrize(
    ("running", "waiting", "mine", "verdict"),
    [
        (0, 0, 0, "run"),
        (1, 0, 0, "run"),  # what runs is not counted: a key may take every free slot
        (2, 0, 0, "wait"),
        (2, 1, 1, "wait"),  # its second waiting place
        (2, 2, 2, "key_busy"),  # its share taken
        (2, 3, 2, "key_busy"),
        (2, 3, 0, "wait"),  # another key's requests fill three places: this one has room
        (2, 3, 1, "wait"),
        (1, 2, 2, "key_busy"),  # a free slot, but others first in line: it would wait
        (2, 4, 0, "refuse"),  # the engine's own waiting bound holds, whatever the keys
        (2, 4, 1, "refuse"),
        (2, 4, 2, "key_busy"),  # both: the key's own share is named, what it can change
    ],
)
def test_a_key_waits_only_within_its_share_and_the_queues_bound(
    running: int, waiting: int, mine: int, verdict: str
) -> None:
    assert decide(running, waiting, mine, LIMITS) == verdict


@pytest.mark.parametrize(
    ("text", "big", "small"),
    [
        ("", DEFAULT_PER_KEY_WAITING, DEFAULT_PER_KEY_WAITING),
        ("[limits]\nper_key_waiting = 4", 4, 4),
        ("[engines.big]\nper_key_waiting = 1", 1, DEFAULT_PER_KEY_WAITING),
        ("[limits]\nper_key_waiting = 4\n[engines.big]\nper_key_waiting = 100", 100, 4),
        ("[engines.big]\nwaiting = 2", DEFAULT_PER_KEY_WAITING, DEFAULT_PER_KEY_WAITING),
    ],
)
def test_the_share_is_the_engines_own_else_the_limits(text: str, big: int, small: int) -> None:
    settings = parse(text, "gw.toml")
    assert settings.admission("big").per_key_waiting == big
    assert settings.admission("small").per_key_waiting == small


def test_the_default_share_leaves_most_of_the_default_queue_to_the_others() -> None:
    limits = parse("", "gw.toml").admission("any")
    assert 1 <= limits.per_key_waiting <= limits.waiting // 4


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[limits]\nper_key_waiting = 0", "limits.per_key_waiting"),
        ("[limits]\nper_key_waiting = -1", "limits.per_key_waiting"),
        ('[limits]\nper_key_waiting = "lots"', "limits.per_key_waiting"),
        ("[engines.big]\nper_key_waiting = 0", "engines.big.per_key_waiting"),
        ("[limits]\nper_key = 2", "limits.per_key: unknown setting"),
    ],
)
def test_a_bad_share_names_the_setting(text: str, words: str) -> None:
    with pytest.raises(SettingsError, match=r"^gw\.toml: ") as caught:
        parse(text, "gw.toml")
    assert words in str(caught.value)


# -- the gate --------------------------------------------------------------------------------


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(30):
        while not check():
            await asyncio.sleep(0.01)


class Callers:
    """Requests of several keys through one gate, each held in its slot until let go."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.inside: list[str] = []
        self.refused: list[str] = []
        self.go = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def arrive(
        self, name: str, key: str, before: Callable[[], Awaitable[str]] | None = None
    ) -> None:
        async def one() -> None:
            try:
                async with self.gate.slot(before, key=key):
                    self.inside.append(name)
                    await self.go.wait()
            except Refusal as refusal:
                self.refused.append(f"{name}:{refusal.code}")

        self.tasks[name] = asyncio.create_task(one())

    async def settled(self, inside: int, waiting: int) -> None:
        await until(lambda: len(self.inside) == inside and self.gate.waiting == waiting)


def test_two_keys_at_once_each_within_its_share_and_the_queue_within_its_bound() -> None:
    async def main() -> None:
        gate = Gate("e", Admission(1, 4, max_wait_s=30, deadline_s=60, per_key_waiting=2))
        c = Callers(gate)
        for n in range(3):  # a backfill: one runs, two wait
            c.arrive(f"fill{n}", "backfill")
        await c.settled(1, 2)
        c.arrive("fill3", "backfill")  # its share is taken
        await until(lambda: c.refused == ["fill3:key_busy"])
        c.arrive("person", "person")  # another key: room
        await c.settled(1, 3)
        assert (gate.key_waiting("backfill"), gate.key_waiting("person")) == (2, 1)
        c.arrive("person2", "person")
        await c.settled(1, 4)
        c.arrive("third", "third")  # each key within its share, the queue full: its bound holds
        await until(lambda: "third:engine_busy" in c.refused)
        c.go.set()
        await asyncio.gather(*c.tasks.values())
        assert c.inside == ["fill0", "fill1", "fill2", "person", "person2"], "arrival order"
        assert (gate.running, gate.waiting, gate.key_waiting("backfill")) == (0, 0, 0)

    asyncio.run(main())


def test_a_waiter_that_leaves_gives_its_keys_place_back() -> None:
    async def main() -> None:
        gate = Gate("e", Admission(1, 8, max_wait_s=30, deadline_s=60, per_key_waiting=1))
        c = Callers(gate)
        c.arrive("running", "k")
        c.arrive("waiting", "k")
        await c.settled(1, 1)
        c.tasks["waiting"].cancel()  # its client went away
        await until(lambda: gate.key_waiting("k") == 0 and gate.waiting == 0)
        c.arrive("again", "k")  # the place is the key's again
        await c.settled(1, 1)
        c.arrive("over", "k")
        await until(lambda: c.refused == ["over:key_busy"])
        c.go.set()
        await asyncio.gather(*c.tasks.values(), return_exceptions=True)
        assert c.inside == ["running", "again"]
        assert gate.key_waiting("k") == 0

    asyncio.run(main())


def test_a_wait_that_runs_out_gives_its_keys_place_back() -> None:
    async def main() -> None:
        gate = Gate("e", Admission(1, 8, max_wait_s=0.05, deadline_s=60, per_key_waiting=1))
        c = Callers(gate)
        c.arrive("running", "k")
        await c.settled(1, 0)
        c.arrive("late", "k")
        await until(lambda: c.refused == ["late:engine_busy"])  # waited too long
        assert gate.key_waiting("k") == 0
        c.go.set()
        await asyncio.gather(*c.tasks.values())

    asyncio.run(main())


def test_requests_held_for_a_start_on_demand_count_in_their_keys_share() -> None:
    async def main() -> None:
        gate = Gate("e", Admission(4, 8, max_wait_s=30, deadline_s=60, per_key_waiting=2))
        started = asyncio.Event()

        async def start() -> str:
            await started.wait()
            return "http://127.0.0.1:9"

        c = Callers(gate)
        c.arrive("a", "k", start)
        c.arrive("b", "k", start)
        await until(lambda: gate.key_waiting("k") == 2)
        c.arrive("c", "k", start)
        await until(lambda: c.refused == ["c:key_busy"])
        c.arrive("other", "other", start)
        await until(lambda: gate.waiting == 3)
        started.set()
        await c.settled(3, 0)
        c.go.set()
        await asyncio.gather(*c.tasks.values())

    asyncio.run(main())


# -- the gateway -----------------------------------------------------------------------------

SHARED = SETTINGS.replace("running = 2", "running = 1").replace(
    "waiting = 4", "waiting = 4\nper_key_waiting = 2"
)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


class Rows:
    """The record at its boundary: the rows the gateway hands it."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def record(self, row: Row) -> bool:
        self.rows.append(row)
        return True


def run(tmp_path: Path, scenario: Callable[[World], Awaitable[None]], recorder: Rows) -> None:
    async def main() -> None:
        hold = asyncio.Event()
        async with world(tmp_path, SHARED, Upstream(hold=hold), recorder=recorder) as w:
            write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
            await scenario(w)

    asyncio.run(main())


def test_one_key_past_its_share_is_refused_key_busy_while_others_are_admitted(
    tmp_path: Path,
) -> None:
    """The inference key holds the one slot and its two waiting places; its next request is
    429 key_busy, at once and before the engine, while the owner's (a key of its own, bounded
    the same) waits and is served. A waiter whose client leaves gives its place back."""
    recorder = Rows()

    async def scenario(w: World) -> None:
        gate = w.app.gate("small")
        stream = {**CHAT, "stream": True}
        async with aiohttp.ClientSession() as s:

            def send(headers: dict[str, str]) -> asyncio.Task[Any]:
                return asyncio.ensure_future(
                    s.post(f"{w.base}/chat/completions", json=stream, headers=headers)
                )

            first = await send(AUTH)
            await first.content.readuntil(b"\n\n")  # it holds the only slot
            waiting = [send(AUTH), send(AUTH)]
            await until(lambda: gate.key_waiting("inference") == 2)
            async with s.post(f"{w.base}/chat/completions", json=CHAT, headers=AUTH) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                busy = await r.json()
            assert busy["error"]["code"] == "key_busy"
            assert (
                "key inference already has 2 requests waiting for engine small"
                in (busy["error"]["message"])
            )
            assert {k: busy[k] for k in ("engine", "key_id", "key_waiting", "per_key_waiting")} == {
                "engine": "small",
                "key_id": "inference",
                "key_waiting": 2,
                "per_key_waiting": 2,
            }
            owners = [send(OWNER), send(OWNER)]  # the owner's key: its own share
            await until(lambda: gate.key_waiting("owner") == 2 and gate.waiting == 4)
            async with s.post(f"{w.base}/chat/completions", json=CHAT, headers=OWNER) as r:
                assert r.status == 429
                assert (await r.json())["error"]["code"] == "key_busy", "the owner is bounded too"
            # a client that leaves while it waits: its key's place is given back
            waiting[0].cancel()
            await until(lambda: gate.key_waiting("inference") == 1)
            waiting.append(send(AUTH))
            await until(lambda: gate.key_waiting("inference") == 2)
            assert len(w.upstream.bodies) == 1, "nothing refused or waiting reached the engine"
            w.upstream.hold.set()  # type: ignore[union-attr]
            assert (await first.read()).endswith(b"data: [DONE]\n\n")
            for task in [*waiting[1:], *owners]:
                answer = await task
                assert answer.status == 200
                assert (await answer.read()).endswith(b"data: [DONE]\n\n")
            await until(lambda: len(recorder.rows) == 8)
            metrics = await (await s.get(str(w.gateway.make_url("/metrics")))).text()
        assert 'lucia_gateway_refusals_total{reason="key_busy"} 2.0' in metrics
        outcomes = sorted((row.key_id, row.outcome) for row in recorder.rows)
        assert outcomes == sorted(
            [("inference", "ok")] * 3
            + [("inference", "client_gone"), ("inference", "refused:key_busy")]
            + [("owner", "ok")] * 2
            + [("owner", "refused:key_busy")]
        )
        assert gate.waiting == 0 and gate.key_waiting("inference") == 0

    run(tmp_path, scenario, recorder)
