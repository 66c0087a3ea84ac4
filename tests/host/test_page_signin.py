"""The page's sign-in: the failed sign-in limit, per client address and bounded (in process
and on the real gateway process, from 127.0.0.1 and 127.0.0.2), counted before the body is
awaited (attempts at once cannot all pass), for JSON sign-ins from the page only (a text/plain
or cross-site post is refused and not counted), and the session's lifetime from the settings
(Chromium sees a session run out in tests/integration/test_page_browser.py)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
from pathlib import Path

import aiohttp
import pytest

from supervisor.host.gateway.app import PAGE_OF
from supervisor.host.page.routes import COOKIE
from supervisor.host.page.sessions import SignInLimit
from tests.gateway_proc import running_gateway
from tests.host.gateway_world import OWNER_KEY, SETTINGS, World, world
from tests.host.test_page import Clock, url

WRONG = "wrong-key-" + "z" * 32
JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(
    ("addresses", "steps"),
    [
        # each step: seconds since the start, the address, then "fail" (a failed sign-in) or
        # what `blocked` says then; 3 failures in 60 s are allowed
        pytest.param(8, "0 a fail, 1 a fail, 2 a 0, 2 b 0", id="under the limit"),
        pytest.param(
            8, "0 a fail, 1 a fail, 2 a fail, 3 a 57, 3 b 0", id="the limit blocks that address"
        ),
        pytest.param(
            8,
            "0 a fail, 1 a fail, 2 a fail, 59 a 1, 60 a 0, 60 a fail, 61 a 0",
            id="the window moves on",
        ),
        pytest.param(
            8,
            "0 a fail, 0 b fail, 0 b fail, 0 b fail, 0 a fail, 0 a fail, 1 a 59, 1 b 59",
            id="each address counts its own",
        ),
        pytest.param(
            2,
            "0 a fail, 0 a fail, 0 a fail, 1 b fail, 2 c fail, 3 a 0, 3 b 0",
            id="past the bound the least recently failed is forgotten",
        ),
        pytest.param(
            2,
            "0 a fail, 0 a fail, 1 b fail, 2 a fail, 3 c fail, 4 a 56, 4 b 0",
            id="a new failure renews an address's place",
        ),
    ],
)
def test_the_sign_in_limit(addresses: int, steps: str) -> None:
    clock = Clock()
    start = clock.now
    limit = SignInLimit(allowed=3, window_s=60, clock=clock, addresses=addresses)
    for step in steps.split(", "):
        at, address, what = step.split()
        clock.now = start + float(at)
        if what == "fail":
            limit.failed(address)
        else:
            assert limit.blocked(address) == float(what), step
        assert len(limit) <= addresses


def test_an_address_rotating_flood_holds_bounded_memory() -> None:
    clock = Clock()
    limit = SignInLimit(clock=clock, addresses=4096)
    for n in range(3 * 4096):
        for _ in range(limit.allowed + 2):
            limit.failed(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}")
    assert len(limit) == 4096
    assert limit.blocked(f"10.0.{(3 * 4096 - 1) >> 8 & 255}.{(3 * 4096 - 1) & 255}") > 0
    assert limit.blocked("10.0.0.0") == 0, "the first address was forgotten"


def session_from(address: str) -> aiohttp.ClientSession:
    """A client whose connections come from `address` (all of 127.0.0.0/8 is loopback)."""
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.CookieJar(unsafe=True))


async def sign_in(w: World, http: aiohttp.ClientSession, key: str, **headers: str) -> int:
    async with http.post(url(w, "/api/signin"), json={"key": key}, headers=headers) as answer:
        return answer.status


def test_failures_from_one_address_do_not_block_another(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            world(tmp_path, SETTINGS) as w,
            session_from("127.0.0.2") as intruder,
            session_from("127.0.0.1") as owner,
        ):
            limit = SignInLimit(clock=Clock())  # the default limit, on a clock that stands
            w.gateway.app[PAGE_OF].limit = limit
            forwarded = {"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1"}
            for _ in range(limit.allowed):
                assert await sign_in(w, intruder, WRONG, **forwarded) == 401
            assert await sign_in(w, intruder, OWNER_KEY) == 429
            assert await sign_in(w, intruder, OWNER_KEY, **{"X-Forwarded-For": "10.9.9.9"}) == 429
            assert limit.blocked("127.0.0.2") > 0 and limit.blocked("127.0.0.1") == 0
            assert await sign_in(w, owner, OWNER_KEY) == 200
            async with owner.get(url(w, "/api/overview")) as answer:
                assert answer.status == 200

    asyncio.run(main())


@pytest.mark.parametrize(("page", "max_age"), [("", "43200"), ("[page]\nsession_s = 5\n", "5")])
def test_the_cookie_lasts_as_the_settings_say(tmp_path: Path, page: str, max_age: str) -> None:
    async def main() -> None:
        async with world(tmp_path, SETTINGS + page) as w, session_from("127.0.0.1") as http:
            assert w.gateway.app[PAGE_OF].sessions.lifetime_s == float(max_age)
            async with http.post(url(w, "/api/signin"), json={"key": OWNER_KEY}) as answer:
                assert answer.status == 200
                cookie = answer.cookies[COOKIE]
            assert cookie["max-age"] == max_age

    asyncio.run(main())


def sign_in_from(address: str, port: int, key: str, **headers: str) -> tuple[int, str | None]:
    """A sign-in over a connection from `address`: the status and its Retry-After."""
    connection = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=30, source_address=(address, 0)
    )
    try:
        connection.request(
            "POST",
            "/page/api/signin",
            body=json.dumps({"key": key}),
            headers={"Content-Type": "application/json", **headers},
        )
        answer = connection.getresponse()
        answer.read()
        return answer.status, answer.getheader("Retry-After")
    finally:
        connection.close()


def test_the_real_gateway_limits_each_address_alone(tmp_path: Path) -> None:
    """The proof through real sockets: the gateway process, its default limit (10 a minute)."""
    data = tmp_path / "data"
    data.mkdir()
    with running_gateway(tmp_path / "gateway", data) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        claims_owner, claims_other = {"X-Forwarded-For": "127.0.0.1"}, {"X-Real-IP": "127.0.0.3"}
        for _ in range(10):
            assert sign_in_from("127.0.0.2", port, WRONG, **claims_owner)[0] == 401
        status, wait = sign_in_from("127.0.0.2", port, gw.owner)
        assert status == 429 and wait is not None and int(wait) >= 1
        assert sign_in_from("127.0.0.1", port, gw.owner) == (200, None)
        assert sign_in_from("127.0.0.2", port, gw.owner, **claims_other)[0] == 429
        assert gw.owner not in gw.log_text() and WRONG not in gw.log_text()


def test_a_success_takes_its_attempt_back() -> None:
    clock = Clock()
    limit = SignInLimit(allowed=2, window_s=60, clock=clock)
    for _ in range(5):
        stamp = limit.failed("a")
        limit.forgive("a", stamp)
    assert limit.blocked("a") == 0 and len(limit) == 0
    limit.failed("a")
    limit.forgive("a", limit.failed("a"))
    limit.forgive("gone", 1.0)
    assert limit.blocked("a") == 0 and len(limit) == 1


async def held_sign_in(
    w: World, key: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A sign-in whose headers are sent and whose body is held back (returned, to send)."""
    body = json.dumps({"key": key}).encode()
    reader, writer = await asyncio.open_connection(w.gateway.host, w.gateway.port)
    writer.write(
        f"POST /page/api/signin HTTP/1.1\r\nHost: {w.gateway.host}:{w.gateway.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
    )
    await writer.drain()
    return reader, writer, body


async def status_of(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    line = await asyncio.wait_for(reader.readline(), 30)
    writer.close()
    return int(line.split()[1])


def test_sign_ins_at_once_cannot_all_pass_the_limit(tmp_path: Path) -> None:
    """Eight wrong sign-ins whose bodies are all still coming when the limit (3) is asked:
    each is counted before its body is awaited, so the fourth and later are refused at once."""

    async def main() -> None:
        async with world(tmp_path, SETTINGS) as w:
            limit = SignInLimit(allowed=3, window_s=60, clock=Clock())
            w.gateway.app[PAGE_OF].limit = limit
            held = [await held_sign_in(w, WRONG) for _ in range(8)]
            await asyncio.sleep(0.3)  # every handler has read its headers and waits for a body
            for _, writer, body in held:
                with contextlib.suppress(ConnectionError):
                    writer.write(body)
                    await writer.drain()
            statuses = [await status_of(reader, writer) for reader, writer, _ in held]
            assert sorted(statuses) == [401] * 3 + [429] * 5, statuses
            assert limit.blocked("127.0.0.1") > 0

    asyncio.run(main())


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        pytest.param({"Content-Type": "text/plain"}, 415, id="text/plain, as another site posts"),
        pytest.param({"Content-Type": "application/x-www-form-urlencoded"}, 415, id="a form"),
        pytest.param({}, 415, id="no Content-Type"),
        pytest.param({**JSON, "Origin": "http://evil.example"}, 403, id="a cross-site Origin"),
        pytest.param({**JSON, "Sec-Fetch-Site": "cross-site"}, 403, id="said cross-site"),
    ],
)
def test_a_sign_in_from_a_web_page_elsewhere_is_refused_and_not_counted(
    tmp_path: Path, headers: dict[str, str], status: int
) -> None:
    """A page in the owner's browser posting wrong keys to the gateway must not lock out
    127.0.0.1: none of its posts is read, and none counts."""

    async def main() -> None:
        async with world(tmp_path, SETTINGS) as w, session_from("127.0.0.1") as http:
            limit = SignInLimit(allowed=3, window_s=60, clock=Clock())
            w.gateway.app[PAGE_OF].limit = limit
            body = json.dumps({"key": WRONG}).encode()
            for _ in range(3 * limit.allowed):
                async with http.post(url(w, "/api/signin"), data=body, headers=headers) as a:
                    assert a.status == status
            assert limit.blocked("127.0.0.1") == 0 and len(limit) == 0
            assert await sign_in(w, http, OWNER_KEY) == 200

    asyncio.run(main())
