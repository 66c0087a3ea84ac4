"""The deadline, the metrics and idle stop, end to end against the fast local upstream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.host.protocol import request
from supervisor.host.proxy.idle import IdleLook, should_stop
from supervisor.host.proxy.metrics import publish_target, target
from supervisor.protocol.documents import DesiredFile, Status, utc_now
from tests.host.gateway_world import AUTH, OWNER, SETTINGS, Upstream, World, world, write_status

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
SHORT = SETTINGS.replace("max_wait_s = 30", "max_wait_s = 30\ndeadline_s = 0.3")


def run(
    tmp_path: Path, scenario: Callable[[World], Awaitable[None]], settings: str, **up: Any
) -> None:
    async def main() -> None:
        async with world(tmp_path, settings, Upstream(**up)) as w:
            await scenario(w)

    asyncio.run(main())


def serving(w: World, generation: int = 1) -> None:
    write_status(w.data, "small", "running", url=w.upstream.url, generation=generation)


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(30):
        while not check():
            await asyncio.sleep(0.01)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


async def scrape(w: World) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with aiohttp.ClientSession() as s, s.get(str(w.gateway.make_url("/metrics"))) as r:
        assert r.status == 200  # no key: counts and names only
        return samples(await r.text())


def one(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


# -- the deadline ----------------------------------------------------------------------------


def test_a_stream_past_its_deadline_ends_with_an_error_event(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        serving(w)
        async with (
            aiohttp.ClientSession(headers=AUTH) as s,
            s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True}) as r,
        ):
            assert r.status == 200
            text = await r.read()  # the upstream holds after its first chunk: never a hang
        events = [part for part in text.split(b"\n\n") if part]
        assert b'"content": "tok"' in events[0]
        error = json.loads(events[-1].removeprefix(b"data: "))["error"]
        assert error["code"] == "timeout" and "deadline of 0.3 s" in error["message"]
        await asyncio.wait_for(w.upstream.ended.wait(), 30)  # the upstream request ended
        found = await scrape(w)
        labels = {"model": "tiny", "engine": "small", "outcome": "timed_out"}
        assert one(found, "lucia_gateway_requests_total", **labels) == 1

    run(tmp_path, scenario, SHORT, hold=asyncio.Event())


def test_a_plain_request_past_its_deadline_gets_504(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        serving(w)
        async with (
            aiohttp.ClientSession(headers=AUTH) as s,
            s.post(f"{w.base}/chat/completions", json=CHAT) as r,
        ):
            assert r.status == 504
            assert (await r.json())["error"]["code"] == "timeout"
        found = await scrape(w)
        assert one(found, "lucia_gateway_refusals_total", reason="timeout") == 1
        assert w.app.gate("small").running == 0

    run(tmp_path, scenario, SHORT, answer_after=asyncio.Event())


def test_a_plain_answer_cut_by_its_deadline_is_short_never_whole_looking(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        serving(w)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            r = await s.post(f"{w.base}/chat/completions", json=CHAT)
            assert r.status == 200  # the answer began: passed on as it came
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
            r.close()

    run(tmp_path, scenario, SHORT, hold=asyncio.Event())


# -- metrics ---------------------------------------------------------------------------------


def test_metrics_count_requests_tokens_refusals_and_times(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        serving(w)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            for body in (CHAT, {**CHAT, "stream": True}, {**CHAT, "model": "fast"}):
                async with s.post(f"{w.base}/chat/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
            async with s.post(f"{w.base}/chat/completions", json={"model": "none"}) as r:
                assert r.status == 404
        async with aiohttp.ClientSession() as s, s.get(f"{w.base}/models") as r:
            assert r.status == 401
        found = await scrape(w)
        ok = {"model": "tiny", "engine": "small", "outcome": "ok"}
        assert one(found, "lucia_gateway_requests_total", **ok) == 3  # the tier resolved
        # the engine's own usage: 5 prompt and 3 completion tokens each, plain and streamed,
        # by the caller's key id (never its key)
        used = {"model": "tiny", "engine": "small", "key": "inference"}
        assert one(found, "lucia_gateway_prompt_tokens_total", **used) == 15
        assert one(found, "lucia_gateway_completion_tokens_total", **used) == 9
        assert one(found, "lucia_gateway_refusals_total", reason="model_not_found") == 1
        assert one(found, "lucia_gateway_refusals_total", reason="invalid_api_key") == 1
        for name in ("wait", "duration"):
            assert one(found, f"lucia_gateway_{name}_seconds_count", engine="small") == 3
        # the first token by model and build: a status that names no build is `unknown`
        built = {"engine": "small", "model": "tiny", "build": "unknown"}
        assert one(found, "lucia_gateway_ttft_seconds_count", **built) == 3
        assert one(found, "lucia_gateway_running", engine="small") == 0
        assert ("lucia_gateway_waiting", frozenset({("engine", "small")})) in found

    run(tmp_path, scenario, SETTINGS)


def test_running_and_waiting_are_read_at_the_scrape(tmp_path: Path) -> None:
    hold = asyncio.Event()
    busy = SETTINGS.replace("running = 2", "running = 1")

    async def scenario(w: World) -> None:
        serving(w)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            first = await s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            await first.content.readuntil(b"\n\n")
            second = asyncio.ensure_future(
                s.post(f"{w.base}/chat/completions", json={**CHAT, "stream": True})
            )
            await until(lambda: w.app.gate("small").waiting == 1)
            found = await scrape(w)
            hold.set()
            await (await second).read()
            await first.read()
        assert one(found, "lucia_gateway_running", engine="small") == 1
        assert one(found, "lucia_gateway_waiting", engine="small") == 1

    run(tmp_path, scenario, busy, hold=hold)


@pytest.mark.parametrize(
    ("address", "port", "tls", "where", "scheme"),
    [
        ("127.0.0.1", 8400, False, "127.0.0.1:8400", "http"),
        ("0.0.0.0", 8400, True, "127.0.0.1:8400", "https"),
        ("192.168.1.5", 9000, True, "192.168.1.5:9000", "https"),
        ("::", 8400, False, "[::1]:8400", "http"),
    ],
)
def test_the_gateways_own_target(
    tmp_path: Path, address: str, port: int, tls: bool, where: str, scheme: str
) -> None:
    group = target(address, port, tls)
    assert group.targets == [where] and group.labels["__scheme__"] == scheme
    path = publish_target(tmp_path, group)
    assert path == tmp_path / "telemetry" / "_gateway.json"
    written = json.loads(path.read_text())
    assert written == [{"targets": [where], "labels": group.labels}]
    assert path.stat().st_mode & 0o777 == 0o644
    before = path.stat().st_ino
    publish_target(tmp_path, group)
    assert path.stat().st_ino == before  # unchanged: not written again


# -- idle stop -------------------------------------------------------------------------------

NOW = utc_now()


def _look(
    ours: int = 2,
    desired: tuple[int, str] | None = (2, "running"),
    state: str = "running",
    busy: bool = False,
    idle_s: float = 10,
) -> IdleLook:
    wanted = (
        DesiredFile.model_validate(
            {"schemaVersion": 1, "generation": desired[0], "desired": desired[1]}
        )
        if desired
        else None
    )
    status = Status(generation=2, state=state, since=NOW, message="", checked_at=NOW)  # type: ignore[arg-type]
    return IdleLook(ours, wanted, status, busy, idle_s)


@pytest.mark.parametrize(
    ("look", "after", "stop"),
    [
        (_look(), 5, True),
        (_look(), 0, False),  # off
        (_look(idle_s=4), 5, False),
        (_look(busy=True), 5, False),  # in flight: finishes first
        (_look(desired=(3, "running")), 5, False),  # an operator asked since
        (_look(desired=(2, "stopped")), 5, False),
        (_look(desired=None), 5, False),
        (_look(state="starting"), 5, False),
    ],
)
def test_idle_stop_decides(look: IdleLook, after: float, stop: bool) -> None:
    assert should_stop(look, after) is stop


IDLE = SETTINGS + "[idle]\nstop_after_s = 0.2\n"


def test_an_engine_the_gateway_started_is_stopped_when_idle(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        async with aiohttp.ClientSession(headers=AUTH) as s:
            pending = asyncio.ensure_future(s.post(f"{w.base}/chat/completions", json=CHAT))
            await until(lambda: w.desired() is not None)
            serving(w, generation=1)  # the worker answers the gateway's generation 1
            async with await pending as r:
                assert r.status == 200
            await until(lambda: w.desired().desired == "stopped")
            assert w.desired().generation == 2
            write_status(w.data, "small", "stopped", generation=2)
            # a new request starts it again, once, and it is the gateway's again
            pending = asyncio.ensure_future(s.post(f"{w.base}/chat/completions", json=CHAT))
            await until(lambda: w.desired().generation == 3)
            assert w.desired().desired == "running"
            serving(w, generation=3)
            async with await pending as r:
                assert r.status == 200
            await until(lambda: w.desired().generation == 4)  # idle again: stopped again
            assert w.desired().desired == "stopped" and w.app.idle.stopped == 2

    run(tmp_path, scenario, IDLE)


def test_an_engine_an_operator_started_is_never_stopped_for_idling(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        write_status(w.data, "small", "stopped")
        generation = request(w.data, "small", "running")  # the operator's request
        serving(w, generation=generation)
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.post(f"{w.base}/chat/completions", json=CHAT) as r:
                assert r.status == 200
            # and one the gateway started, then the owner asked for through the host API
            write_status(w.data, "other", "stopped", models=("other-m",))
            pending = asyncio.ensure_future(
                s.post(f"{w.base}/chat/completions", json={**CHAT, "model": "other-m"})
            )
            await until(lambda: w.desired("other") is not None)
            write_status(
                w.data, "other", "running", url=w.upstream.url, generation=1, models=("other-m",)
            )
            async with await pending as r:
                assert r.status == 200
            url = str(w.gateway.make_url("/api/host/engines/other"))
            async with s.post(url, json={"desired": "running"}, headers=OWNER) as r:
                assert r.status == 202
            write_status(
                w.data, "other", "running", url=w.upstream.url, generation=2, models=("other-m",)
            )
        checks = w.app.idle.checks
        await until(lambda: w.app.idle.checks >= checks + 20)  # many looks past the idle time
        assert (w.desired().generation, w.desired().desired) == (generation, "running")
        assert (w.desired("other").generation, w.desired("other").desired) == (2, "running")
        assert w.app.idle.stopped == 0

    run(tmp_path, scenario, IDLE)
