"""The operator's word stands: an engine an operator stopped (the CLI, the host API, the page,
or an older host's request naming no requester) is not started on demand, also while its stop
is still in progress, and a chat for it is answered 503 naming who stopped it and when; an
engine the gateway stopped itself is started again. End to end against the fast local
upstream; the test writes the worker's side."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from supervisor import cli
from supervisor.host.protocol import request
from supervisor.protocol.files import write_atomic
from supervisor.protocol.layout import DESIRED
from tests.host.gateway_world import (
    AUTH,
    OWNER,
    SETTINGS,
    World,
    run,
    until,
    write_status,
)

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
IDLE = SETTINGS + "[idle]\nstop_after_s = 0.2\n"


async def chat(w: World, s: aiohttp.ClientSession) -> tuple[int, dict[str, Any]]:
    async with s.post(f"{w.base}/chat/completions", json=CHAT) as r:
        return r.status, await r.json()


async def stop_as_operator(w: World, how: str) -> int:
    """`stopped` for small, as an operator says it: the generation written."""
    if how == "cli":
        code = await asyncio.to_thread(
            cli.main, ["request", "small", "stopped", "--create", "--data-dir", str(w.data)]
        )
        assert code == 0
    elif how == "host-api":
        async with (
            aiohttp.ClientSession(headers=OWNER) as s,
            s.post(
                str(w.gateway.make_url("/api/host/engines/small")), json={"desired": "stopped"}
            ) as r,
        ):
            assert r.status == 202
    else:  # an older host: no requestedBy, no requestedAt
        previous = w.desired()
        number = previous.generation + 1 if previous is not None else 1
        text = json.dumps({"schemaVersion": 1, "generation": number, "desired": "stopped"})
        write_atomic(w.data / "small" / DESIRED, text.encode())
    generation: int = w.desired().generation
    return generation


def assert_operators_stop(error: dict[str, Any], generation: int, when: bool = True) -> None:
    message = error["error"]["message"]
    assert error["error"]["code"] == "model_not_loaded"
    assert message.startswith("engine small is not loaded: stopped by an operator"), message
    assert f"(generation {generation})" in message
    assert "lucia-supervisor request small running" in message
    said = error["stoppedBy"]
    assert (said["requestedBy"], said["generation"]) == ("operator", generation)
    assert (said["requestedAt"] is not None) is when
    if when:
        assert f"at {said['requestedAt']}" in message


@pytest.mark.parametrize("how", ["cli", "host-api", "older-host"])
def test_an_engine_an_operator_stopped_is_not_started_on_demand(tmp_path: Path, how: str) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        generation = await stop_as_operator(w, how)
        write_status(w.data, "small", "stopped", generation=generation)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            for _ in range(3):
                code, error = await chat(w, s)
                assert code == 503
                assert_operators_stop(error, generation, when=how != "older-host")
            async with s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True}) as r:
                last = (await r.read()).strip().split(b"\n\n")[-1]
            assert_operators_stop(
                json.loads(last.removeprefix(b"data: ")), generation, when=how != "older-host"
            )
        assert (w.desired().generation, w.desired().desired) == (generation, "stopped")
        assert w.app.starter.requests_written == 0 and w.upstream.bodies == []

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    "answer",
    ["not yet acknowledged (running)", "stopping"],
)
def test_a_stop_still_in_progress_is_neither_undone_nor_served(tmp_path: Path, answer: str) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            assert (await chat(w, s))[0] == 200
            generation = await stop_as_operator(w, "cli")
            if answer == "stopping":
                write_status(w.data, "small", "stopping", generation=generation)
            code, error = await chat(w, s)
        assert code == 503
        assert_operators_stop(error, generation)
        assert (w.desired().generation, w.desired().desired) == (generation, "stopped")
        assert len(w.upstream.bodies) == 1, "the chat after the stop reached the engine"

    run(tmp_path, scenario)


def test_an_engine_the_gateway_started_stays_stopped_once_an_operator_stops_it(
    tmp_path: Path,
) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        async with aiohttp.ClientSession(headers=AUTH) as s:
            pending = asyncio.ensure_future(chat(w, s))
            await until(lambda: w.desired() is not None)
            assert w.desired().requested_by == "gateway"
            write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
            assert (await pending)[0] == 200
            assert "small" in w.app.starter.started
            generation = await stop_as_operator(w, "cli")
            write_status(w.data, "small", "stopped", generation=generation)
            code, error = await chat(w, s)
        assert code == 503
        assert_operators_stop(error, generation)
        assert (w.desired().generation, w.desired().desired) == (generation, "stopped")
        assert w.app.starter.requests_written == 1

    run(tmp_path, scenario)


def test_an_operators_stop_while_a_start_is_waited_for_ends_the_wait_and_stands(
    tmp_path: Path,
) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        async with aiohttp.ClientSession(headers=AUTH) as s:
            pending = asyncio.ensure_future(chat(w, s))
            await until(lambda: w.desired() is not None)
            write_status(w.data, "small", "starting", generation=1)
            generation = await stop_as_operator(w, "host-api")
            write_status(w.data, "small", "stopping", generation=generation)
            code, error = await pending
        assert code == 503
        assert_operators_stop(error, generation)
        assert (w.desired().generation, w.desired().desired) == (generation, "stopped")
        assert w.app.starter.requests_written == 1 and w.upstream.bodies == []

    run(tmp_path, scenario)


def test_an_operators_start_is_served(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        generation = await stop_as_operator(w, "cli")
        write_status(w.data, "small", "stopped", generation=generation)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            assert (await chat(w, s))[0] == 503
            started = request(w.data, "small", "running")
            write_status(w.data, "small", "running", url=w.upstream.url, generation=started)
            code, answer = await chat(w, s)
        assert code == 200 and answer["choices"][0]["message"]["content"] == "toktoktok"
        assert w.desired().requested_by == "operator"

    run(tmp_path, scenario)


def test_an_engine_the_gateway_stopped_for_idling_is_started_again(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        async with aiohttp.ClientSession(headers=AUTH) as s:
            pending = asyncio.ensure_future(chat(w, s))
            await until(lambda: w.desired() is not None)
            write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
            assert (await pending)[0] == 200
            await until(lambda: w.desired().desired == "stopped")
            stop = w.desired()
            assert (stop.generation, stop.requested_by) == (2, "gateway")
            assert not stop.operator_stop
            # the next chat comes while the idle stop is still under way: it starts it again
            write_status(w.data, "small", "stopping", generation=2)
            pending = asyncio.ensure_future(chat(w, s))
            await until(lambda: w.desired().generation == 3)
            assert (w.desired().desired, w.desired().requested_by) == ("running", "gateway")
            write_status(w.data, "small", "running", url=w.upstream.url, generation=3)
            assert (await pending)[0] == 200

    run(tmp_path, scenario, IDLE)
