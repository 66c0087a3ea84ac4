"""Swap: a start the worker says waits for memory first stops an unused engine the gateway
started, end to end against the fast local upstream (the test writes the workers' side)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from supervisor.host.protocol import request
from supervisor.host.proxy.idle import IdleLook, victim
from supervisor.protocol.documents import DesiredFile, Status, utc_now
from tests.host.gateway_world import (
    AUTH,
    SETTINGS,
    World,
    run,
    until,
    write_status,
)

SWAP = SETTINGS + "[idle]\nswap = true\n"
NOW = utc_now()
SMALL = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
BIG = {**SMALL, "model": "huge"}


def look(
    engine: str, idle_s: float, busy: bool = False, ours: bool = True, state: str = "running"
) -> IdleLook:
    desired = DesiredFile.model_validate(
        {"schemaVersion": 1, "generation": 2 if ours else 3, "desired": "running"}
    )
    status = Status(generation=2, state=state, since=NOW, message="", checked_at=NOW)  # type: ignore[arg-type]
    return IdleLook(2, desired, status, busy, idle_s, engine)


@pytest.mark.parametrize(
    ("looks", "chosen"),
    [
        ([], None),
        ([look("a", 5)], "a"),
        ([look("a", 5), look("b", 50)], "b"),  # unused longest
        ([look("a", 5), look("b", 50, busy=True)], "a"),  # in flight: never stopped
        ([look("a", 5, ours=False)], None),  # an operator asked since: not the gateway's
        ([look("a", 5, state="starting")], None),
        ([look("big", 99)], None),  # never the engine the start is for
    ],
)
def test_the_swap_victim(looks: list[IdleLook], chosen: str | None) -> None:
    found = victim(looks, "big")
    assert (found.engine if found else None) == chosen


async def started_small(w: World, s: aiohttp.ClientSession) -> None:
    """small, started by the gateway on a first request, and answered: now unused."""
    write_status(w.data, "small", "stopped")
    write_status(w.data, "big", "stopped", models=("huge",))
    pending = asyncio.ensure_future(s.post(f"{w.base}/chat/completions", json=SMALL))
    await until(lambda: w.desired() is not None)
    write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
    async with await pending as r:
        assert r.status == 200


def blocked(w: World, generation: int) -> None:
    write_status(
        w.data,
        "big",
        "failed",
        models=("huge",),
        generation=generation,
        retrying=True,
        waiting_for="memory",
        message="needs 9.0 GiB; 2.0 GiB left: does not fit",
    )


def test_a_start_waiting_for_memory_stops_the_unused_engine_the_gateway_started(
    tmp_path: Path,
) -> None:
    async def scenario(w: World) -> None:
        async with aiohttp.ClientSession(headers=AUTH) as s:
            await started_small(w, s)
            pending = asyncio.ensure_future(s.post(f"{w.base}/chat/completions", json=BIG))
            await until(lambda: w.desired("big") is not None)
            blocked(w, w.desired("big").generation)
            await until(lambda: w.desired().desired == "stopped")  # small is stopped first
            assert w.desired("big").generation == 1, "big is asked for again only once it stops"
            write_status(w.data, "small", "stopped", generation=w.desired().generation)
            await until(lambda: w.desired("big").generation == 2)  # asked for again at once
            write_status(
                w.data, "big", "running", url=w.upstream.url, generation=2, models=("huge",)
            )
            async with await pending as r:
                assert r.status == 200
            assert w.app.idle.swapped == 1

    run(tmp_path, scenario, SWAP)


def test_without_swap_a_start_waiting_for_memory_is_refused_and_nothing_is_stopped(
    tmp_path: Path,
) -> None:
    async def scenario(w: World) -> None:
        async with aiohttp.ClientSession(headers=AUTH) as s:
            await started_small(w, s)
            pending = asyncio.ensure_future(s.post(f"{w.base}/chat/completions", json=BIG))
            await until(lambda: w.desired("big") is not None)
            blocked(w, 1)
            async with await pending as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "model_not_loaded"
                assert "does not fit" in (await r.json())["error"]["message"]
            assert w.desired().desired == "running"

    run(tmp_path, scenario, SETTINGS)


def test_an_engine_with_a_request_in_flight_is_never_swapped_out(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        async with aiohttp.ClientSession(headers=AUTH) as s:
            await started_small(w, s)
            w.upstream.hold = asyncio.Event()
            stream = await s.post(f"{w.base}/chat/completions", json={**SMALL, "stream": True})
            await stream.content.readline()  # a stream in flight on small
            pending = asyncio.ensure_future(s.post(f"{w.base}/chat/completions", json=BIG))
            await until(lambda: w.desired("big") is not None)
            blocked(w, w.desired("big").generation)
            async with await pending as r:
                assert r.status == 503
            assert w.desired().desired == "running" and w.app.idle.swapped == 0
            w.upstream.hold.set()
            await stream.read()
            stream.release()

    run(tmp_path, scenario, SWAP)


def test_an_engine_an_operator_started_is_never_swapped_out(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        async with aiohttp.ClientSession(headers=AUTH) as s:
            await started_small(w, s)
            generation = request(w.data, "small", "running")  # the operator asks since
            write_status(w.data, "small", "running", url=w.upstream.url, generation=generation)
            pending = asyncio.ensure_future(s.post(f"{w.base}/chat/completions", json=BIG))
            await until(lambda: w.desired("big") is not None)
            blocked(w, w.desired("big").generation)
            async with await pending as r:
                assert r.status == 503
            assert (w.desired().generation, w.desired().desired) == (generation, "running")
            assert w.app.idle.swapped == 0

    run(tmp_path, scenario, SWAP)
