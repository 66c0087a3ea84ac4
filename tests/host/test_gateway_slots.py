"""Admission follows the engine: the running bound is the slots an engine's status.json
publishes unless the operator set one, and a gate takes a changed bound as it comes: a higher
one admits waiters at once, a lower one starts nothing new until fewer run than it allows.
The gate on its own, then the gateway end to end against the fast local upstream."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from supervisor.host.proxy.admission import Admission, Gate
from tests.host.gateway_world import AUTH, OWNER, SETTINGS, Upstream, World, world, write_status

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
FOLLOW = SETTINGS.replace("running = 2\n", "")  # [limits] running unset: the engine's slots


def limits(running: int) -> Admission:
    return Admission(running=running, waiting=10, max_wait_s=30, deadline_s=60, per_key_waiting=10)


async def until(check: Callable[[], bool]) -> None:
    """Wait for a state the gate reaches by itself; bounded only as a safety net."""
    async with asyncio.timeout(30):
        while not check():
            await asyncio.sleep(0.01)


class Held:
    """Requests through one gate, each held inside its slot until the test lets it go."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.inside: list[int] = []
        self.go: dict[int, asyncio.Event] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def arrive(self) -> int:
        index = len(self.tasks)
        self.go[index] = asyncio.Event()

        async def one() -> None:
            async with self.gate.slot():
                self.inside.append(index)
                await self.go[index].wait()

        self.tasks.append(asyncio.create_task(one()))
        return index


def test_what_a_start_gives_comes_with_its_slot_and_a_start_waits_as_a_waiter() -> None:
    async def main() -> None:
        gate = Gate("e", limits(1))
        seen: list[int] = []

        async def start() -> str:
            seen.append(gate.waiting)  # the start is a waiter, not a running request
            return "http://127.0.0.1:9"

        async with gate.slot(start) as admitted:
            assert admitted.before == "http://127.0.0.1:9"
            assert gate.running == 1
        async with gate.slot() as plain:
            assert plain.before is None
        assert seen == [1]

    asyncio.run(main())


def test_a_higher_bound_hands_its_new_slots_to_the_first_waiters_at_once() -> None:
    async def main() -> None:
        gate = Gate("e", limits(1))
        held = Held(gate)
        for _ in range(4):
            held.arrive()
        await until(lambda: held.inside == [0] and gate.waiting == 3)
        gate.follow(limits(3))  # the engine published its slots
        assert gate.running == 3, "handed over at once, not as requests finish"
        await until(lambda: len(held.inside) == 3)
        assert held.inside == [0, 1, 2] and gate.waiting == 1, "in arrival order"
        for event in held.go.values():
            event.set()
        await asyncio.gather(*held.tasks)
        assert (gate.running, gate.waiting) == (0, 0)

    asyncio.run(main())


def test_a_lower_bound_lets_the_running_finish_and_starts_none_beyond_it() -> None:
    async def main() -> None:
        gate = Gate("e", limits(3))
        held = Held(gate)
        for _ in range(3):
            held.arrive()
        await until(lambda: len(held.inside) == 3)
        gate.follow(limits(1))
        assert gate.running == 3, "nothing running is cut off"
        late = held.arrive()  # over the bound: it waits
        await until(lambda: gate.waiting == 1)
        held.go[0].set()
        await until(lambda: gate.running == 2)  # the slot came free: it passed to nobody
        held.go[1].set()
        await until(lambda: gate.running == 1)
        assert late not in held.inside and gate.waiting == 1
        held.go[2].set()  # one runs now, as the bound allows: the waiter's turn
        await until(lambda: late in held.inside)
        assert (gate.running, gate.waiting) == (1, 0)
        held.go[late].set()
        await asyncio.gather(*held.tasks)
        assert gate.running == 0

    asyncio.run(main())


def run(
    tmp_path: Path, settings: str, scenario: Callable[[World], Awaitable[None]], hold: asyncio.Event
) -> None:
    async def main() -> None:
        async with world(tmp_path, settings, Upstream(hold=hold)) as w:
            await scenario(w)

    asyncio.run(main())


def test_waiters_for_an_engine_started_on_demand_get_the_slots_it_publishes(
    tmp_path: Path,
) -> None:
    """Stopped, then started for three callers: the worker's first `running` says 1 slot, so
    one request reaches the engine and two wait; a model loaded since raises it to 3 and the
    two are sent at once, with no new request to look."""
    hold = asyncio.Event()

    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        async with aiohttp.ClientSession(headers=AUTH) as s:
            sent = [
                asyncio.ensure_future(
                    s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
                )
                for _ in range(3)
            ]
            await until(lambda: w.desired() is not None)
            write_status(
                w.data, "small", "running", url=w.upstream.url, generation=1, slots={"tiny": 1}
            )
            gate = w.app.gate("small")
            await until(lambda: len(w.upstream.bodies) == 1 and gate.waiting == 2)
            assert gate.running == 1
            async with s.get(f"{w.base.removesuffix('/v1')}/api/host/engines", headers=OWNER) as r:
                (row,) = (await r.json())["engines"]
            assert (row["running"], row["waiting"], row["bound"]) == (1, 2, 1)
            write_status(
                w.data,
                "small",
                "running",
                url=w.upstream.url,
                generation=1,
                slots={"tiny": 1, "other": 2},
            )
            await until(lambda: len(w.upstream.bodies) == 3)
            assert (gate.running, gate.waiting, gate.limits.running) == (3, 0, 3)
            hold.set()
            for response in await asyncio.gather(*sent):
                assert response.status == 200
                assert (await response.read()).endswith(b"data: [DONE]\n\n")

    run(tmp_path, FOLLOW, scenario, hold)


def test_the_operators_running_bound_stands_whatever_the_engine_publishes(
    tmp_path: Path,
) -> None:
    hold = asyncio.Event()

    async def scenario(w: World) -> None:
        write_status(
            w.data, "small", "running", url=w.upstream.url, generation=1, slots={"tiny": 1}
        )
        async with aiohttp.ClientSession(headers=AUTH) as s:
            sent = [
                asyncio.ensure_future(
                    s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
                )
                for _ in range(3)
            ]
            gate = w.app.gate("small")
            await until(lambda: len(w.upstream.bodies) == 2 and gate.waiting == 1)
            assert gate.limits.running == 2  # [limits] running = 2
            hold.set()
            for response in await asyncio.gather(*sent):
                assert response.status == 200
                await response.read()

    run(tmp_path, SETTINGS, scenario, hold)
