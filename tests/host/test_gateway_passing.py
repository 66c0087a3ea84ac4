"""How a stream passes through however its bytes are cut: a usage chunk or an event split
between two reads, and a whole stream, its end with it, in one read, are passed and charged as
a stream that came event by event."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor.host.gateway.app import create_app
from supervisor.host.proxy.usage import UsageFilter
from tests.host.gateway_world import AUTH, KEYS, SETTINGS, settings_of, write_status


def events(tokens: int, usage: bool) -> list[bytes]:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "t"}}],
    }
    out = [b"data: " + json.dumps(chunk).encode() + b"\n\n" for _ in range(tokens)]
    if usage:
        counts = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
        out.append(b"data: " + json.dumps({"choices": [], "usage": counts}).encode() + b"\n\n")
    return [*out, b"data: [DONE]\n\n"]


@pytest.mark.parametrize("cut", [1, 7, 64, 10_000])
def test_the_usage_filter_passes_any_cut_of_a_stream_as_it_passes_it_whole(cut: int) -> None:
    """Reads of any size, an event or the usage chunk split between two: the client gets the
    same bytes and the row the same counts."""
    stream = b"".join(events(5, usage=True))
    whole, pieces = UsageFilter(hide=True), UsageFilter(hide=True)
    expected = whole.feed(stream) + whole.close()
    got = b"".join(pieces.feed(stream[at : at + cut]) for at in range(0, len(stream), cut))
    assert got + pieces.close() == expected == b"".join(events(5, usage=False))
    assert pieces.charged(10, whole=True) == whole.charged(10, whole=True)
    assert pieces.charged(10, whole=True)[1] == "engine"


class OneWrite:
    """An engine that sends its whole stream, the terminating chunk with it, in one write
    (`split`: its last bytes in a write of their own, after a pause)."""

    def __init__(self, split: bool) -> None:
        self.split = split

    async def handle(self, request: web.Request) -> web.StreamResponse:
        document: dict[str, Any] = json.loads(await request.read())
        assert document["stream_options"]["include_usage"]
        stream = b"".join(events(8, usage=True))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.split:
            await response.write(stream[:-20])
            await asyncio.sleep(0.05)
            await response.write_eof(stream[-20:])
        else:
            await response.write_eof(stream)
        return response


class Rows:
    def __init__(self) -> None:
        self.rows: list[Any] = []

    def record(self, row: Any) -> bool:
        self.rows.append(row)
        return True


@pytest.mark.parametrize("split", [False, True])
def test_a_stream_read_in_one_go_is_passed_whole_and_charged_the_engines_usage(
    tmp_path: Path, split: bool
) -> None:
    async def main() -> None:
        engine = web.Application()
        engine.router.add_post("/v1/chat/completions", OneWrite(split).handle)
        upstream = TestServer(engine)
        await upstream.start_server()
        data = tmp_path / "data"
        data.mkdir()
        write_status(data, "small", "running", url=str(upstream.make_url("")).rstrip("/"))
        rows = Rows()
        app = create_app(settings_of(SETTINGS), data, KEYS, recorder=rows)
        gateway = TestServer(app, handler_cancellation=True)
        await gateway.start_server()
        try:
            async with (
                aiohttp.ClientSession() as client,
                client.post(
                    gateway.make_url("/v1/chat/completions"),
                    json={"model": "tiny", "stream": True, "messages": []},
                    headers=AUTH,
                ) as answer,
            ):
                got = await answer.read()
            assert got == b"".join(events(8, usage=False))
            async with asyncio.timeout(10):
                while not rows.rows:
                    await asyncio.sleep(0.01)
            (row,) = rows.rows
            assert (row.outcome, row.usage_source) == ("ok", "engine")
            assert (row.prompt_tokens, row.completion_tokens) == (5, 8)
        finally:
            await gateway.close()
            await upstream.close()

    asyncio.run(main())
