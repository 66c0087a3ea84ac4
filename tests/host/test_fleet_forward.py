"""The forwarding client, from a small origin app, against a real peer gateway process: answers
pass through as they come, refusals as they are; a client that leaves closes the peer's stream
(recorded there as client_gone); a peer killed mid-stream, unreachable, silent or past the
deadline ends the answer with an error, never a hang."""

from __future__ import annotations

import asyncio
import json
import signal
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from supervisor.host.fleet.forward import Peer
from supervisor.host.keycheck import Identity
from tests.host.fleet_world import (
    CHAT,
    Fleet,
    fleet,
    fresh,
    machine_gateway,
    new_key_id,
    origin,
    peer_headers,
    post,
)
from tests.standin import free_port

CHATS = "/v1/chat/completions"


__all__ = ["fleet", "fresh"]  # the fixtures, imported: machines a and b


def to_b(fleet: Fleet) -> Peer:
    return Peer("b", fleet.gateways["b"].url)


def caller(key_id: str | None = None, *, exempt: bool = False) -> Identity:
    return Identity(key_id or new_key_id(), "inference", "someone", None, exempt)


def events(raw: bytes) -> list[str]:
    return [line for line in raw.decode().split("\n\n") if line.strip()]


async def wait_for(check: Any, what: str) -> None:
    async with asyncio.timeout(30):
        while not check():
            await asyncio.sleep(0.01)


def test_an_answer_passes_through_as_it_comes_and_is_recorded_by_the_peer(fleet: Fleet) -> None:
    who = caller()

    async def main() -> None:
        async with (
            origin(fleet.peers_file, to_b(fleet), who) as url,
            aiohttp.ClientSession() as session,
        ):
            stream = {**CHAT, "stream": True}
            async with session.post(url + CHATS, json=stream) as answer:
                assert answer.status == 200
                assert answer.headers["Content-Type"].startswith("text/event-stream")
                got = events(await answer.read())
            assert got[-1] == "data: [DONE]" and len(got) == 4
            assert all('"usage"' not in event for event in got), "none was asked for"
            async with session.post(url + CHATS, json=CHAT) as answer:
                assert answer.status == 200 and answer.content_type == "application/json"
                assert (await answer.json())["choices"][0]["message"]["content"] == "toktoktok"

    asyncio.run(main())
    assert fleet.recorded(who.key_id, 2) == [("b", "ok", "small", "tiny")] * 2


def test_the_peers_refusals_pass_through_as_they_are(fleet: Fleet) -> None:
    over = new_key_id()
    today = datetime.now(UTC).date().isoformat()
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO daily_totals (day, key_id, tokens, requests) VALUES (%s, %s, 5000, 1)",
            (today, over),
        )
    direct = peer_headers(fleet.keys["a"], "a", over)

    async def main() -> None:
        absent = {**CHAT, "model": "absent"}
        async with (
            origin(fleet.peers_file, to_b(fleet), caller(over)) as url,
            aiohttp.ClientSession() as s,
        ):
            async with s.post(url + CHATS, json=absent) as answer:
                assert answer.status == 404
                status, there = post(fleet.gateways["b"].url, "/fleet" + CHATS, direct, absent)
                assert status == 404 and await answer.json() == there
                assert there["error"]["machine"] == "b"

            async def refused() -> bool:
                async with s.post(url + CHATS, json=CHAT) as answer:
                    return answer.status == 429

            async with asyncio.timeout(30):
                while not await refused():  # b reads the totals again each second
                    await asyncio.sleep(0.05)
            async with s.post(url + CHATS, json=CHAT) as answer:
                body = await answer.json()
                assert body["error"]["code"] == "budget_exceeded"
                assert body["error"]["machine"] == "b"
                assert int(answer.headers["Retry-After"]) >= 1

    asyncio.run(main())


def test_a_client_that_leaves_closes_the_peers_stream(fleet: Fleet) -> None:
    who = caller()
    upstream = fleet.upstreams["b"]
    upstream.hold = asyncio.Event()

    async def main() -> None:
        async with (
            origin(fleet.peers_file, to_b(fleet), who) as url,
            aiohttp.ClientSession() as session,
        ):
            answer = await session.post(url + CHATS, json={**CHAT, "stream": True})
            assert answer.status == 200
            first = await answer.content.readuntil(b"\n\n")
            assert first.startswith(b"data: {")
            answer.close()  # the client leaves mid-stream
            await wait_for(upstream.ended.is_set, "b's engine request closed")

    asyncio.run(main())
    assert fleet.recorded(who.key_id) == [("b", "client_gone", "small", "tiny")]


def test_a_peer_killed_mid_stream_ends_the_stream_with_an_error_event(
    fleet: Fleet, tmp_path: Path
) -> None:
    upstream = fleet.upstreams["b"]
    upstream.hold = asyncio.Event()
    with machine_gateway(tmp_path, "b", fleet.dsn, fleet.peers_file, upstream) as doomed:

        async def main() -> list[str]:
            peer = Peer("b", doomed.url)
            async with (
                origin(fleet.peers_file, peer, caller()) as url,
                aiohttp.ClientSession() as session,
                session.post(url + CHATS, json={**CHAT, "stream": True}) as answer,
            ):
                first = await answer.content.readuntil(b"\n\n")
                assert first.startswith(b"data: {")
                doomed.proc.send_signal(signal.SIGKILL)
                async with asyncio.timeout(30):
                    return events(await answer.read())

        rest = asyncio.run(main())
    assert len(rest) == 1, rest
    error = json.loads(rest[0].removeprefix("data: "))["error"]
    assert error["code"] == "engine_failed" and error["machine"] == "b"
    assert "machine b broke off" in error["message"]


def test_a_peer_that_cannot_be_reached_or_answers_nothing_is_503_naming_it(
    fleet: Fleet,
) -> None:
    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)  # reads nothing, answers nothing
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        gone = Peer("z", f"http://127.0.0.1:{free_port()}")
        mute = Peer("y", f"http://127.0.0.1:{port}")
        try:
            async with aiohttp.ClientSession() as session:
                for peer, says in ((gone, "did not answer: "), (mute, "no answer within 0.5 s")):
                    async with (
                        origin(fleet.peers_file, peer, caller(), deadline_s=0.5) as url,
                        session.post(url + CHATS, json=CHAT) as answer,
                    ):
                        assert answer.status == 503
                        error = (await answer.json())["error"]
                        assert error["code"] == "model_not_loaded"
                        assert error["machine"] == peer.machine and says in error["message"]
        finally:
            server.close()

    asyncio.run(main())


def test_the_deadline_ends_a_stream_begun_with_an_error_event(fleet: Fleet) -> None:
    who = caller()
    upstream = fleet.upstreams["b"]
    upstream.hold = asyncio.Event()

    async def main() -> list[str]:
        async with (
            origin(fleet.peers_file, to_b(fleet), who, deadline_s=1.0) as url,
            aiohttp.ClientSession() as session,
            session.post(url + CHATS, json={**CHAT, "stream": True}) as answer,
        ):
            return events(await answer.read())

    got = asyncio.run(main())
    assert got[0].startswith("data: {") and len(got) == 2
    error = json.loads(got[-1].removeprefix("data: "))["error"]
    assert error["code"] == "timeout" and error["machine"] == "b"
    assert fleet.recorded(who.key_id) == [("b", "client_gone", "small", "tiny")]
