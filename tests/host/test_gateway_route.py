"""A model served by several engines: a request goes to the one best able to serve it now,
never to an engine whose worker is gone while another can serve. End to end against the fast
local upstream; the test writes the workers' side."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp

from supervisor.host.protocol import request
from supervisor.protocol.documents import utc_now
from tests.host.gateway_world import (
    AUTH,
    SETTINGS,
    Upstream,
    World,
    run,
    until,
    write_status,
)

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
ONE_AT_ONCE = SETTINGS.replace("running = 2", "running = 1")
WORKER_GONE_S = 126  # the heartbeat age measured on the demo


async def chat(w: World, s: aiohttp.ClientSession, **extra: Any) -> tuple[int, dict[str, Any]]:
    async with s.post(f"{w.base}/chat/completions", json={**CHAT, **extra}) as r:
        return r.status, await r.json()


def gone(w: World, engine: str) -> None:
    """A running engine whose worker stopped writing its heartbeat long ago."""
    write_status(
        w.data,
        engine,
        "running",
        url="http://127.0.0.1:9",
        generation=1,
        checked_at=utc_now() - timedelta(seconds=WORKER_GONE_S),
    )


def test_a_worker_gone_silent_never_takes_a_request_another_engine_can_serve(
    tmp_path: Path,
) -> None:
    async def scenario(w: World) -> None:
        gone(w, "a-gone")  # first by name: the engine the gateway used to pick
        write_status(w.data, "b-router", "running", url=w.upstream.url, generation=1)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            answers = [await chat(w, s) for _ in range(5)]
        assert [code for code, _ in answers] == [200] * 5, answers
        assert len(w.upstream.bodies) == 5
        assert w.desired("a-gone") is None and w.desired("b-router") is None

    run(tmp_path, scenario)


def test_an_engine_that_may_be_started_is_started_rather_than_one_whose_worker_is_gone(
    tmp_path: Path,
) -> None:
    async def scenario(w: World) -> None:
        gone(w, "a-gone")
        write_status(w.data, "b-router", "stopped")
        async with aiohttp.ClientSession(headers=AUTH) as s:
            pending = asyncio.ensure_future(chat(w, s))
            await until(lambda: w.desired("b-router") is not None)
            write_status(w.data, "b-router", "running", url=w.upstream.url, generation=1)
            code, _ = await pending
        assert code == 200
        assert w.desired("a-gone") is None
        assert w.desired("b-router").requested_by == "gateway"

    run(tmp_path, scenario)


def test_an_engine_an_operator_stopped_is_passed_over_for_one_that_may_be_started(
    tmp_path: Path,
) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "a-stopped", "stopped")
        stop = request(w.data, "a-stopped", "stopped")
        write_status(w.data, "a-stopped", "stopped", generation=stop)
        write_status(w.data, "b-router", "stopped")
        async with aiohttp.ClientSession(headers=AUTH) as s:
            pending = asyncio.ensure_future(chat(w, s))
            await until(lambda: w.desired("b-router") is not None)
            write_status(w.data, "b-router", "running", url=w.upstream.url, generation=1)
            code, _ = await pending
        assert code == 200
        assert (w.desired("a-stopped").generation, w.desired("a-stopped").desired) == (
            stop,
            "stopped",
        )

    run(tmp_path, scenario)


def test_a_request_goes_to_the_engine_with_a_free_slot(tmp_path: Path) -> None:
    hold = asyncio.Event()

    async def scenario(w: World) -> None:
        for engine in ("a", "b"):
            write_status(w.data, engine, "running", url=w.upstream.url, generation=1)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            first = await s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            await first.content.readuntil(b"\n\n")
            assert (w.app.gates["a"].running, w.app.gates.get("b")) == (1, None)
            second = asyncio.ensure_future(chat(w, s))
            await until(lambda: "b" in w.app.gates and w.app.gates["b"].running == 1)
            assert (w.app.gates["a"].running, w.app.gates["a"].waiting) == (1, 0)
            hold.set()
            assert (await second)[0] == 200
            await first.read()
            first.close()

    run(tmp_path, scenario, ONE_AT_ONCE, Upstream(hold=hold))
