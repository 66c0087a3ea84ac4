"""The bound on reading a request's body (listen.body_timeout_s), on the gateway as its service
runs it, over a raw socket: a body that stops coming, or comes a byte at a time, gets 408 and
its connection closed, and nothing reaches the engine; a slow body within the bound is served,
and an answer that takes longer than the bound is not cut."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from supervisor.host.gateway.service import Service
from tests.host.gateway_world import (
    AUTH,
    KEYS,
    OWNER,
    Upstream,
    serve_upstream,
    settings_of,
    write_status,
)

HI = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
CHAT = json.dumps(HI).encode()
Answer = tuple[int, dict[str, str], bytes]


@asynccontextmanager
async def gateway(tmp_path: Path, body_timeout_s: float, upstream: Upstream) -> AsyncIterator[int]:
    """The gateway's service in front of `upstream`, serving `tiny` as engine `small`; its port."""
    data = tmp_path / "data"
    data.mkdir()
    engine = await serve_upstream(upstream)
    write_status(data, "small", "running", url=upstream.url, generation=1)
    settings = settings_of(f"[listen]\nport = 0\nbody_timeout_s = {body_timeout_s}\n")
    service = Service(settings, data, KEYS)
    running = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(service.listening.wait(), 30)
        assert service.port is not None
        yield service.port
    finally:
        service.stop.set()
        await running
        await engine.close()


def head(path: str, length: int, key: dict[str, str], *extra: str) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: gw",
        "Content-Type: application/json",
        f"Content-Length: {length}",
        *(f"{name}: {value}" for name, value in key.items()),
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """All the gateway sends until it closes the connection; 30 s is only a safety net."""
    got = b""
    async with asyncio.timeout(30):
        while chunk := await reader.read(65536):
            got += chunk
    return got


def answer(raw: bytes) -> Answer:
    top, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = top.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in lines)}
    return int(status.split()[1]), headers, body


def refused_for_time(raw: bytes, expected: int) -> int:
    """The 408's checks; how many bytes of the body it says came."""
    status, headers, body = answer(raw)
    assert status == 408 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    said = re.fullmatch(
        r"the body of /v1/chat/completions did not all come within 0\.5 s of its headers "
        rf"\((\d+) of {expected} bytes came\); the connection is closed",
        error["message"],
    )
    assert said is not None, error["message"]
    return int(said[1])


def test_a_body_that_stops_coming_gets_408_and_the_connection_is_closed(tmp_path: Path) -> None:
    upstream = Upstream()

    async def main() -> bytes:
        async with gateway(tmp_path, 0.5, upstream) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head("/v1/chat/completions", len(CHAT), AUTH) + CHAT[:10])  # no more
            raw = await until_closed(reader)  # the old gateway held it: the 30 s ran out
            writer.close()
            assert upstream.bodies == []  # nothing was forwarded
            async with aiohttp.ClientSession(headers=AUTH) as s:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                async with s.post(url, json=HI) as r:
                    assert r.status == 200  # the engine is still served
            return raw

    assert refused_for_time(asyncio.run(main()), len(CHAT)) == 10
    assert len(upstream.bodies) == 1


def test_a_body_sent_a_byte_at_a_time_is_bounded_as_a_whole(tmp_path: Path) -> None:
    """However often it sends, a client whose body is not all there at the bound gets 408."""
    upstream = Upstream()
    length = 1_000_000

    async def main() -> tuple[bytes, int]:
        async with gateway(tmp_path, 0.5, upstream) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head("/v1/chat/completions", length, AUTH))
            first = asyncio.ensure_future(reader.read(65536))
            sent = 0
            async with asyncio.timeout(30):
                while not first.done():
                    try:
                        writer.write(b" ")  # JSON's whitespace, a byte at a time
                        await writer.drain()
                    except ConnectionError:  # closed under the write: the answer came
                        break
                    sent += 1
                    await asyncio.wait([first], timeout=0.05)
            raw = first.result() + await until_closed(reader)
            writer.close()
            return raw, sent

    raw, sent = asyncio.run(main())
    assert 1 < refused_for_time(raw, length) <= sent  # each byte came, and no more
    assert upstream.bodies == []


async def in_pieces(port: int, path: str, body: bytes, key: dict[str, str]) -> Answer:
    """The body in pieces of 8 bytes, a pause before each (each its own segment)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head(path, len(body), key, "Connection: close"))
    for start in range(0, len(body), 8):
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(body[start : start + 8])
    await writer.drain()
    raw = await until_closed(reader)
    writer.close()
    return answer(raw)


def test_a_slow_body_within_the_bound_is_served(tmp_path: Path) -> None:
    """A chat and a host API request, each body over a dozen pauses, well within the bound:
    both answered (the host API read only the first piece before, and refused it as JSON)."""
    upstream = Upstream()
    desired = b'{"desired": "stopped"}'

    async def main() -> tuple[Answer, Answer]:
        async with gateway(tmp_path, 60, upstream) as port:
            chat = await in_pieces(port, "/v1/chat/completions", CHAT, AUTH)
            host = await in_pieces(port, "/api/host/engines/small", desired, OWNER)
            return chat, host

    chat, host = asyncio.run(main())
    assert chat[0] == 200 and upstream.bodies == [{**HI, "n_predict": 32768}]  # the bound set
    assert host[0] == 202 and json.loads(host[2])["desired"] == "stopped"


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_longer_than_the_bound_is_not_cut(tmp_path: Path, stream: bool) -> None:
    """The bound is on reading the body: an answer the engine holds for four times as long as
    the bound, after its first bytes, still comes whole."""

    async def main() -> tuple[int, bytes]:
        upstream = Upstream(hold=asyncio.Event())
        async with (
            gateway(tmp_path, 0.25, upstream) as port,
            aiohttp.ClientSession(headers=AUTH) as s,
        ):
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            async with s.post(url, json={**HI, "stream": stream}) as r:
                first = await r.content.readany()  # the first bytes; the engine holds on
                await asyncio.sleep(1)
                assert upstream.hold is not None
                upstream.hold.set()
                return r.status, first + await r.read()

    status, body = asyncio.run(main())
    assert status == 200
    if stream:
        assert body.endswith(b"data: [DONE]\n\n") and body.count(b'"content": "tok"') == 3
    else:
        assert json.loads(body)["choices"][0]["message"]["content"] == "tok" * 3
