"""The bytes of request bodies the gateway holds at once (listen.bodies_bytes, bodies.py), and
where large bodies are parsed: bodies past the bound refused with 429 while most of them is
still unsent, their bytes given back however a request ends, and the event loop answering
while a 16 MiB body is parsed. Over raw sockets, so that a body can be held back; ordering
only, never a clock: waits are on the gateway's own count, bounded only as a safety net."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from supervisor.host.gateway.app import Gateway
from supervisor.host.gateway.sections import DEFAULT_BODIES_BYTES
from supervisor.host.gateway.settings import SettingsError, parse
from supervisor.host.proxy import body
from supervisor.host.proxy.bodies import PARSE_INLINE, Bodies, decide, room
from supervisor.host.proxy.bounds import Bounds
from supervisor.host.web.refusal import Refusal
from tests.host.gateway_world import AUTH, SETTINGS, World, world, write_status

MIB = 1024 * 1024
CHAT = "/v1/chat/completions"
HI = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
BOUNDS = parse("", "test").limits.bounds
Answer = tuple[int, dict[str, str], bytes]
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
SENT = 1024  # what a held-back client sends of its body at first


def chat_of(size: int, model: str = "tiny") -> bytes:
    """A chat body of exactly `size` bytes: JSON, then whitespace."""
    start = json.dumps({**HI, "model": model}).encode()
    return start + b" " * (size - len(start))


def bound(size: int, extra: str = "") -> str:
    return f"{SETTINGS}[listen]\nbodies_bytes = {size}\n{extra}"


def serving(w: World) -> None:
    write_status(w.data, "small", "running", url=w.upstream.url, generation=1)


def head(path: str, length: int | None) -> bytes:
    sized = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: gw",
        "Content-Type: application/json",
        sized,
        "Connection: close",
        *(f"{k}: {v}" for k, v in AUTH.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def begin(w: World, data: bytes, sent: int = SENT, path: str = CHAT) -> Connection:
    """A client that sends its head and the first `sent` bytes of its body, and holds on."""
    reader, writer = await asyncio.open_connection("127.0.0.1", w.gateway.port)
    writer.write(head(path, len(data)) + data[:sent])
    await writer.drain()
    return reader, writer


async def answer(connection: Connection, rest: bytes = b"") -> Answer:
    """Send `rest`, then all the gateway sends until it closes; 30 s is only a safety net."""
    reader, writer = connection
    writer.write(rest)
    await writer.drain()
    got = b""
    async with asyncio.timeout(30):
        while chunk := await reader.read(65536):
            got += chunk
    writer.close()
    top, _, content = got.partition(b"\r\n\r\n")
    status, *lines = top.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in lines)}
    return int(status.split()[1]), headers, content


async def whole(w: World, data: bytes, path: str = CHAT) -> Answer:
    return await answer(await begin(w, data, len(data), path))


async def until_held(gateway: Gateway, size: int) -> None:
    async with asyncio.timeout(30):
        while gateway.bodies.held != size:
            await asyncio.sleep(0.005)


def code(content: bytes) -> str:
    error: str = json.loads(content)["error"]["code"]
    return error


def test_bodies_past_the_bound_are_refused_unread_and_the_others_served(tmp_path: Path) -> None:
    """Two clients hold 1.5 MiB bodies each, 1 KiB sent, against a 3 MiB bound: a third's
    1 MiB is refused with 429 and Retry-After, its connection closed, while it has sent 1 KiB
    of it; the two are served once their bodies come, and then the third is admitted. The
    gateway before held every body as it came, and the third waited for its own to be sent."""

    async def main() -> None:
        async with world(tmp_path, bound(3 * MIB)) as w:
            serving(w)
            half = chat_of(3 * MIB // 2)
            first, second = await begin(w, half), await begin(w, half)
            await until_held(w.app, 3 * MIB)
            status, headers, content = await answer(await begin(w, chat_of(MIB)))
            assert (status, code(content)) == (429, "bodies_busy")
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            refused = json.loads(content)
            assert refused["held_bytes"] == 3 * MIB and refused["body_bytes"] == MIB
            assert "listen.bodies_bytes" in refused["error"]["message"]
            assert w.upstream.bodies == []  # nothing was forwarded yet
            served = await asyncio.gather(answer(first, half[SENT:]), answer(second, half[SENT:]))
            assert [status for status, _, _ in served] == [200, 200]
            await until_held(w.app, 0)
            assert (await whole(w, chat_of(MIB)))[0] == 200
            assert len(w.upstream.bodies) == 3 and w.app.bodies.held == 0
            assert b"bodies_busy" in w.app.metrics.render()  # counted among the refusals

    asyncio.run(main())


async def gone(w: World, connection: Connection, data: bytes) -> None:
    connection[1].close()  # mid-body
    await until_held(w.app, 0)


async def malformed(w: World, connection: Connection, data: bytes) -> None:
    status, _, content = await answer(connection, data[SENT:])
    assert (status, code(content)) == (400, "invalid_request")


async def too_slow(w: World, connection: Connection, data: bytes) -> None:
    status, _, content = await answer(connection)  # the rest never comes
    assert (status, code(content)) == (408, "request_timeout")


async def past_its_limit(w: World, connection: Connection, data: bytes) -> None:
    chunk = b" " * (body.TEXT_LIMIT + 1)
    rest = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n"
    status, _, content = await answer(connection, rest)
    assert (status, code(content)) == (413, "request_too_large")


Ending = Callable[[World, Connection, bytes], Any]


@pytest.mark.parametrize(
    ("first", "timeout_s", "chunked", "ends"),
    [
        (chat_of(2 * MIB), 60, False, gone),
        (b"{" + b" " * (2 * MIB - 1), 60, False, malformed),
        (chat_of(2 * MIB), 2, False, too_slow),
        (b'{"model": "tiny"', 60, True, past_its_limit),  # no length: its route's 2 MiB held
    ],
    ids=["client-gone", "malformed-400", "too-slow-408", "chunked-past-its-limit-413"],
)
def test_a_body_gives_its_bytes_back_however_its_request_ends(
    tmp_path: Path, first: bytes, timeout_s: float, chunked: bool, ends: Ending
) -> None:
    """A body that holds the whole 2 MiB bound (another is refused meanwhile) ends as
    `ends` says; then its bytes are free again: a body of the whole bound is served."""

    async def main() -> None:
        async with world(tmp_path, bound(2 * MIB, f"body_timeout_s = {timeout_s}\n")) as w:
            serving(w)
            if chunked:
                reader, writer = await asyncio.open_connection("127.0.0.1", w.gateway.port)
                opening = f"{len(first):x}\r\n".encode() + first + b"\r\n"
                writer.write(head(CHAT, None) + opening)
                connection: Connection = (reader, writer)
            else:
                connection = await begin(w, first)
            await until_held(w.app, 2 * MIB)
            assert (await whole(w, chat_of(1000)))[0] == 429
            await ends(w, connection, first)
            assert w.app.bodies.held == 0
            assert (await whole(w, chat_of(2 * MIB)))[0] == 200
            assert len(w.upstream.bodies) == 1

    asyncio.run(main())


@pytest.mark.parametrize(
    ("declared", "most", "limit", "held", "expected"),
    [
        (1000, 2 * MIB, 3 * MIB, 0, ("hold", 1000)),
        (None, 2 * MIB, 3 * MIB, 0, ("hold", 2 * MIB)),  # chunked: the most it may be
        (MIB, 2 * MIB, 3 * MIB, 2 * MIB, ("hold", MIB)),  # exactly to the bound
        (MIB + 1, 2 * MIB, 3 * MIB, 2 * MIB, ("busy", MIB + 1)),
        (None, 2 * MIB, 3 * MIB, MIB + 1, ("busy", 2 * MIB)),
        (2 * MIB + 1, 2 * MIB, 3 * MIB, 0, ("too_large", 0)),  # never fits: not busy
        (0, 2 * MIB, 3 * MIB, 3 * MIB, ("hold", 0)),  # an empty body always fits
    ],
)
def test_what_a_body_gets(
    declared: int | None, most: int, limit: int, held: int, expected: tuple[str, int]
) -> None:
    assert decide(declared, most, limit, held) == expected


@pytest.mark.parametrize(
    ("route_limit", "limit", "most"),
    [
        (2 * MIB, DEFAULT_BODIES_BYTES, 2 * MIB),
        (16 * MIB, 3 * MIB, 3 * MIB),
        (16 * MIB, 16 * MIB, 16 * MIB),
    ],
)
def test_the_most_one_body_may_be(route_limit: int, limit: int, most: int) -> None:
    assert room(route_limit, limit) == most


@pytest.mark.parametrize(
    ("path", "declared", "limit", "held", "status", "words", "close"),
    [
        ("/v1/embeddings", 16 * MIB + 1, DEFAULT_BODIES_BYTES, 0, 413, "limited to 16 MiB", False),
        (
            "/v1/embeddings",
            3 * MIB + 1,
            3 * MIB,
            0,
            413,
            "3145728 bytes, the bytes of request",
            False,
        ),
        (CHAT, None, 3 * MIB, MIB + 1, 429, "holds 1048577 bytes", True),
        (CHAT, MIB, 3 * MIB, 2 * MIB + 1, 429, f"the {MIB} of this {CHAT} would pass", True),
    ],
)
def test_a_body_that_cannot_be_held_is_refused_and_holds_nothing(
    path: str, declared: int | None, limit: int, held: int, status: int, words: str, close: bool
) -> None:
    bodies = Bodies(limit, 60, BOUNDS)
    bodies.held = held
    with pytest.raises(Refusal) as refused:
        bodies.hold(path, declared)
    assert refused.value.status == status and words in refused.value.message
    assert refused.value.close is close
    assert refused.value.headers == ({"Retry-After": "1"} if status == 429 else {})
    assert bodies.held == held


def test_the_bound_is_a_setting_that_passes_the_largest_bodies() -> None:
    assert parse("", "gw.toml").listen.bodies_bytes == DEFAULT_BODIES_BYTES >= 16 * body.ANY_LIMIT
    assert parse("[listen]\nbodies_bytes = 1048576", "gw.toml").listen.bodies_bytes == MIB
    with pytest.raises(SettingsError, match=r"listen\.bodies_bytes"):
        parse("[listen]\nbodies_bytes = 65536", "gw.toml")


def test_the_loop_answers_while_a_large_body_parses(tmp_path: Path, monkeypatch: Any) -> None:
    """A 16 MiB embeddings body's parse is held until `/v1/models` has answered: the models
    come first, then the parse ends and the body is served. The gateway before parsed on the
    event loop, which answered nothing until the parse gave up waiting."""
    parsing, models_answered = asyncio.Event(), threading.Event()
    order: list[str] = []
    loops: list[asyncio.AbstractEventLoop] = []
    prepare = body.prepare

    def held_prepare(
        path: str, raw: bytes, limits: Bounds, room: int | None, default: str | None = None
    ) -> body.Prepared:
        loops[0].call_soon_threadsafe(parsing.set)
        models_answered.wait(10)  # a safety net: on the loop it would never be set
        order.append("parsed")
        return prepare(path, raw, limits, room, default)

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        async with world(tmp_path) as w, aiohttp.ClientSession(headers=AUTH) as s:
            serving(w)
            large = json.dumps({"model": "tiny", "input": "embed me"}).encode()
            large += b" " * (body.ANY_LIMIT - len(large))
            url = str(w.gateway.make_url("/v1/embeddings"))
            post = asyncio.ensure_future(s.post(url, data=large))
            async with asyncio.timeout(60):  # a parse that never began fails, never hangs
                await parsing.wait()
            async with s.get(str(w.gateway.make_url("/v1/models"))) as models:
                assert models.status == 200
                order.append("models")
            models_answered.set()
            async with await post as served:
                assert served.status == 200
            assert w.upstream.bodies[0]["input"] == "embed me"

    monkeypatch.setattr(body, "prepare", held_prepare)
    asyncio.run(main())
    assert order == ["models", "parsed"]


@pytest.mark.parametrize(
    ("size", "model", "on_the_loop"),
    [
        (PARSE_INLINE, "tiny", True),
        (PARSE_INLINE + 1, "tiny", False),
        (PARSE_INLINE + 1, "fast", False),
    ],
)
def test_small_bodies_parse_on_the_loop_and_large_ones_beside_it(
    tmp_path: Path, monkeypatch: Any, size: int, model: str, on_the_loop: bool
) -> None:
    """Each parse (the body's, and a tier alias's, which parses it again) on the loop's thread
    up to PARSE_INLINE bytes, in another above it."""
    threads: list[tuple[str, bool]] = []

    def noting(name: str, work: Callable[..., body.Prepared]) -> Callable[..., body.Prepared]:
        def noted(*args: Any) -> body.Prepared:
            threads.append((name, threading.current_thread() is threading.main_thread()))
            return work(*args)

        return noted

    monkeypatch.setattr(body, "prepare", noting("prepare", body.prepare))
    monkeypatch.setattr(body, "with_model", noting("with_model", body.with_model))

    async def main() -> None:
        async with world(tmp_path) as w:
            serving(w)
            assert (await whole(w, chat_of(size, model)))[0] == 200
            assert w.upstream.bodies[0]["model"] == "tiny"

    asyncio.run(main())
    renamed = [("with_model", on_the_loop)] if model == "fast" else []
    assert threads == [("prepare", on_the_loop), *renamed]


def test_a_request_gone_mid_parse_holds_its_bytes_until_the_parse_ends() -> None:
    """Cancelled mid-parse, a request gives its bytes back only once the thread is done with
    them; a parse not begun yet is dropped at once, and never runs."""
    began, go = threading.Event(), threading.Event()
    ran: list[int] = []

    def parse(which: int) -> int:
        began.set()
        go.wait(10)  # a safety net
        ran.append(which)
        return which

    async def main() -> None:
        bodies = Bodies(3 * MIB, 60, BOUNDS)

        async def handler(_: web.Request) -> web.StreamResponse:
            await bodies.off_loop(parse, 1)
            return web.Response()

        sized = {"Content-Length": str(MIB)}
        request = make_mocked_request("POST", "/v1/embeddings", headers=sized)
        first = asyncio.ensure_future(bodies.holding(handler)(request))
        await asyncio.to_thread(began.wait, 10)
        queued = asyncio.create_task(bodies.off_loop(parse, 2))
        await asyncio.sleep(0)
        first.cancel()
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued  # dropped while the first parse still runs
        assert not first.done() and bodies.held == MIB
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert bodies.held == 0

    asyncio.run(main())
    assert ran == [1]
