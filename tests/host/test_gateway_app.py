"""The gateway end to end: a real aiohttp server in front of a fast local upstream, with the
worker's side of the file protocol written by the test."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.host.gateway_world import (
    AUTH,
    INFERENCE_KEY,
    SETTINGS,
    Upstream,
    World,
    stale,
    world,
    write_status,
)

Scenario = Callable[[World], Awaitable[None]]


def run(tmp_path: Path, scenario: Scenario, settings: str = SETTINGS, **upstream: Any) -> None:
    async def main() -> None:
        async with world(tmp_path, settings, Upstream(**upstream)) as w:
            await scenario(w)

    asyncio.run(main())


def serving(w: World, engine: str = "small", models: tuple[str, ...] = ("tiny",)) -> None:
    write_status(w.data, engine, "running", url=w.upstream.url, models=models, generation=1)


async def until(check: Callable[[], bool]) -> None:
    """Event-based waiting on the file protocol: poll, bounded only as a safety net."""
    async with asyncio.timeout(30):
        while not check():
            await asyncio.sleep(0.01)


async def events(response: aiohttp.ClientResponse) -> list[bytes]:
    text = await response.read()
    return [part for part in text.split(b"\n\n") if part]


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_the_openai_client_gets_answers_and_streams_through_the_gateway(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        serving(w)
        client = openai.AsyncOpenAI(base_url=w.base, api_key=INFERENCE_KEY)
        answer = await client.chat.completions.create(model="tiny", messages=CHAT["messages"])
        assert answer.choices[0].message.content == "toktoktok"
        stream = await client.chat.completions.create(
            model="fast", messages=CHAT["messages"], stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert [c.choices[0].delta.content for c in chunks] == ["tok"] * 3  # no usage chunk
        # upstream: the tier resolved, usage asked for, and the client's key never arrived
        assert w.upstream.bodies[1]["model"] == "tiny"
        assert w.upstream.bodies[1]["stream_options"] == {
            "include_usage": True,
            "continuous_usage_stats": True,
        }
        assert all(
            INFERENCE_KEY not in json.dumps(h) and "Authorization" not in h
            for h in w.upstream.headers
        )
        await client.close()

    run(tmp_path, scenario)


def test_a_client_that_asked_for_usage_gets_it(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        serving(w)
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        async with (
            aiohttp.ClientSession(headers=AUTH) as s,
            s.post(f"{w.base}/chat/completions", json=body) as r,
        ):
            got = await events(r)
        assert b'"choices": [], "usage"' in got[-2]
        assert got[-1] == b"data: [DONE]"

    run(tmp_path, scenario)


def test_a_stream_passes_chunk_by_chunk_and_a_disconnect_ends_the_upstream(
    tmp_path: Path,
) -> None:
    hold = asyncio.Event()

    async def scenario(w: World) -> None:
        serving(w)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            r = await s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            first = await r.content.readuntil(b"\n\n")  # while the upstream holds the rest
            assert b'"content": "tok"' in first
            r.close()  # the client goes away
        await asyncio.wait_for(w.upstream.ended.wait(), 30)
        assert w.app.gate("small").running == 0
        gone = w.app.metrics.requests.labels(model="tiny", engine="small", outcome="client_gone")
        await until(lambda: gone._value.get() == 1)  # counted once the handler has ended

    run(tmp_path, scenario, hold=hold)


def test_a_client_that_goes_away_after_done_was_served(tmp_path: Path) -> None:
    """An engine may end its stream a while after [DONE]; a client that closes at [DONE], as the
    openai client does, had the whole answer: counted ok, not client_gone."""
    linger = asyncio.Event()

    async def scenario(w: World) -> None:
        serving(w)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            r = await s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            while not (await r.content.readuntil(b"\n\n")).startswith(b"data: [DONE]"):
                pass
            r.close()  # while the engine has not yet ended its stream
        await asyncio.wait_for(w.upstream.ended.wait(), 30)
        requests = w.app.metrics.requests
        await until(lambda: w.app.gate("small").running == 0)
        ok = requests.labels(model="tiny", engine="small", outcome="ok")
        gone = requests.labels(model="tiny", engine="small", outcome="client_gone")
        await until(lambda: ok._value.get() + gone._value.get() == 1)
        assert (ok._value.get(), gone._value.get()) == (1, 0)

    run(tmp_path, scenario, linger=linger)


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "words"),
    [
        ("/chat/completions", b"x" * (2 * 1024 * 1024 + 1), 413, "request_too_large", "2 MiB"),
        ("/embeddings", b"x" * (16 * 1024 * 1024 + 1), 413, "request_too_large", "16 MiB"),
        ("/chat/completions", b'{"model": "tiny",', 400, "invalid_request", "line 1 column 18"),
        ("/chat/completions", b"\xff{}", 400, "invalid_request", "byte 0"),
        ("/chat/completions", b"[1]", 400, "invalid_request", "JSON object"),
        (
            "/responses",
            b'{"model": "tiny", "max_output_tokens": 0}',
            400,
            "invalid_request",
            "max_output_tokens must be an integer from 1 to 1000",
        ),
        (
            "/chat/completions",
            b'{"model": "tiny", "max_tokens": 1001}',
            400,
            "invalid_request",
            "max_tokens",
        ),
        (
            "/completions",
            b'{"model": "tiny", "max_completion_tokens": "5"}',
            400,
            "invalid_request",
            "max_completion_tokens",
        ),
        (
            "/chat/completions",
            b'{"model": "huge"}',
            404,
            "model_not_found",
            "Models: fast, other-a, tiny",
        ),
    ],
)
def test_bad_requests_get_their_status_and_nothing_reaches_the_engine(
    tmp_path: Path, path: str, body: bytes, status: int, code: str, words: str
) -> None:
    async def scenario(w: World) -> None:
        serving(w)
        write_status(w.data, "other", "stopped", models=("other-a",))
        async with (
            aiohttp.ClientSession(headers=AUTH) as s,
            s.post(w.base + path, data=body) as r,
        ):
            assert r.status == status
            error = (await r.json())["error"]
        assert error["code"] == code
        assert words in error["message"]
        assert w.upstream.bodies == []

    run(tmp_path, scenario)


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {INFERENCE_KEY}", "Bearer "])
def test_without_a_valid_key_nothing_is_served(tmp_path: Path, header: str | None) -> None:
    async def scenario(w: World) -> None:
        serving(w)
        headers = {"Authorization": header} if header else {}
        async with aiohttp.ClientSession(headers=headers) as s:
            for method, path in (("GET", "/models"), ("POST", "/chat/completions")):
                async with s.request(method, w.base + path, json=CHAT) as r:
                    assert r.status == 401
                    assert (await r.json())["error"]["code"] == "invalid_api_key"
        assert w.upstream.bodies == []

    run(tmp_path, scenario)


def test_engine_errors_pass_through_with_their_status(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        serving(w)
        async with (
            aiohttp.ClientSession(headers=AUTH) as s,
            s.post(f"{w.base}/chat/completions", json=CHAT) as r,
        ):
            assert r.status == 422
            assert (await r.json())["error"]["code"] == "engine_says_no"

    run(tmp_path, scenario, status=422)


def test_models_lists_each_model_with_its_engine_state_and_counts(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        serving(w, models=("tiny", "tiny-2"))
        write_status(w.data, "other", "stopped", models=("other-a",))
        write_status(w.data, "old", "stopped", models=())  # an older worker: nothing to route
        async with aiohttp.ClientSession(headers=AUTH) as s, s.get(f"{w.base}/models") as r:
            data = (await r.json())["data"]
        rows = {(m["id"], m["engine"], m["state"], m["running"], m["waiting"]) for m in data}
        assert rows == {
            ("tiny", "small", "running", 0, 0),
            ("tiny-2", "small", "running", 0, 0),
            ("other-a", "other", "stopped", 0, 0),
        }
        assert next(m for m in data if m["id"] == "tiny")["tiers"] == ["fast"]

    run(tmp_path, scenario)


BUSY = SETTINGS.replace("running = 2", "running = 1").replace("waiting = 4", "waiting = 0")


def test_beyond_the_running_and_waiting_bounds_a_request_is_refused_at_once(
    tmp_path: Path,
) -> None:
    hold = asyncio.Event()

    async def scenario(w: World) -> None:
        serving(w)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            first = await s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            await first.content.readuntil(b"\n\n")  # it holds the only slot
            async with s.post(f"{w.base}/chat/completions", json=CHAT) as r:
                assert r.status == 429
                assert r.headers["Retry-After"] == "1"
                body = await r.json()
            hold.set()
            assert (await first.read()).endswith(b"data: [DONE]\n\n")
            first.close()
        assert body["engine"] == "small"
        assert (body["running"], body["waiting"], body["waited_s"]) == (1, 0, 0.0)
        assert body["error"]["code"] == "engine_busy"
        assert len(w.upstream.bodies) == 1

    run(tmp_path, scenario, BUSY, hold=hold)


SHORT_WAIT = BUSY.replace("waiting = 0", "waiting = 1").replace(
    "max_wait_s = 30", "max_wait_s = 0.2"
)


def test_a_wait_that_runs_out_is_refused_the_same_way(tmp_path: Path) -> None:
    hold = asyncio.Event()

    async def scenario(w: World) -> None:
        serving(w)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            first = await s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            await first.content.readuntil(b"\n\n")
            async with s.post(f"{w.base}/chat/completions", json=CHAT) as r:
                assert r.status == 429
                body = await r.json()
            hold.set()
            first.close()
        assert "waited too long" in body["error"]["message"]
        assert body["waited_s"] >= 0.2

    run(tmp_path, scenario, SHORT_WAIT, hold=hold)


def test_a_stopped_engine_is_started_once_for_every_waiting_caller(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        async with aiohttp.ClientSession(headers=AUTH) as s:
            plain = [
                asyncio.ensure_future(s.post(f"{w.base}/chat/completions", json=CHAT))
                for _ in range(3)
            ]
            streaming = await s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            assert await streaming.content.readuntil(b"\n\n") == b": starting engine small\n\n"
            await until(lambda: w.desired() is not None)  # written by a thread: may come later
            desired = w.desired()
            assert (desired.generation, desired.desired) == (1, "running")
            assert not any(task.done() for task in plain)
            serving(w)  # the worker answers generation 1: running
            for response in await asyncio.gather(*plain):
                assert response.status == 200
                assert (await response.json())["choices"][0]["message"]["content"] == "toktoktok"
            rest = await streaming.read()
            assert rest.endswith(b"data: [DONE]\n\n") and b'"content": "tok"' in rest
        assert w.desired().generation == 1
        assert w.app.starter.requests_written == 1

    run(tmp_path, scenario)


def test_a_client_that_disconnects_never_cancels_a_start(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        async with aiohttp.ClientSession(headers=AUTH) as s:
            gone = await s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            await gone.content.readuntil(b"\n\n")
            gone.close()
            await until(lambda: w.app.gate("small").waiting == 0)
            assert w.app.starter._starts  # still waiting for the worker
            serving(w)
            async with s.post(f"{w.base}/chat/completions", json=CHAT) as r:
                assert r.status == 200
        assert w.app.starter.requests_written == 1

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("state", "message", "retrying", "words"),
    [
        ("failed", "no room: 40 GiB needed, 12 GiB free", True, "no room: 40 GiB needed"),
        ("failed", "the engine's check refused --bad-flag", False, "--bad-flag"),
        ("stopped", "stopped by the operator", False, "stopped"),
    ],
)
def test_a_start_the_worker_refuses_answers_503_with_its_message(
    tmp_path: Path, state: str, message: str, retrying: bool, words: str
) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        async with aiohttp.ClientSession(headers=AUTH) as s:
            plain = asyncio.ensure_future(s.post(f"{w.base}/chat/completions", json=CHAT))
            streaming = await s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            await streaming.content.readuntil(b"\n\n")
            write_status(w.data, "small", state, generation=1, message=message, retrying=retrying)
            response = await plain
            assert response.status == 503
            error = (await response.json())["error"]
            last = (await events(streaming))[-1]
        assert error["code"] == "model_not_loaded" and words in error["message"]
        assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == "model_not_loaded"
        assert w.upstream.bodies == []

    run(tmp_path, scenario)


def test_a_worker_without_a_fresh_heartbeat_gets_no_start(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped", checked_at=stale())
        async with (
            aiohttp.ClientSession(headers=AUTH) as s,
            s.post(f"{w.base}/chat/completions", json=CHAT) as r,
        ):
            assert r.status == 503
            error = (await r.json())["error"]
        assert "worker unavailable" in error["message"]
        assert w.desired() is None

    run(tmp_path, scenario)
