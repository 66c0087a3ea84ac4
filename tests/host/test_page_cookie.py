"""The page's session cookie goes to /page/ only (its name `__Secure-` over TLS), and the page's
API, the CSRF token first, answers no request a browser says came from another site or another
origin on the same host (an engine's web UI or a Grafana on another port)."""

from __future__ import annotations

import asyncio
import ssl
from http.cookies import SimpleCookie
from pathlib import Path

import aiohttp
import pytest
from yarl import URL

from supervisor.host.gateway.service import Service
from supervisor.host.page.origin import foreign, same_origin
from supervisor.host.page.routes import COOKIE, CSRF_HEADER, SECURE_COOKIE
from tests.host.gateway_world import KEYS, OWNER_KEY, World, settings_of, write_status
from tests.host.test_gateway_service import self_signed
from tests.host.test_page import run, sign_in, url


def cookie_of(header: str, name: str) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    jar.load(header)
    morsel = jar[name]
    return {"value": morsel.value, **{k: str(v) for k, v in morsel.items() if v}}


def test_the_cookie_is_sent_to_the_page_only(tmp_path: Path) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        async with http.post(url(w, "/api/signin"), json={"key": OWNER_KEY}) as answer:
            assert answer.status == 200
            cookie = cookie_of(answer.headers["Set-Cookie"], COOKIE)
        assert cookie["path"] == "/page/" and cookie["httponly"] and cookie["samesite"] == "Strict"
        base = w.gateway.make_url("/")
        other_port = URL.build(scheme="http", host=base.host, port=(base.port or 80) + 1)
        for elsewhere in (base / "v1" / "models", base / "grafana" / "", other_port / "x"):
            assert COOKIE not in http.cookie_jar.filter_cookies(elsewhere), elsewhere
        assert COOKIE in http.cookie_jar.filter_cookies(base / "page" / "api" / "overview")
        async with http.get(url(w, "/api/overview")) as answer:
            assert answer.status == 200, "the page's own requests carry it"

    run(tmp_path, scenario)


def test_over_tls_the_cookie_is_secure_by_its_name_and_goes_to_the_page_only(
    tmp_path: Path,
) -> None:
    cert, key = self_signed(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    settings = settings_of(f'[listen]\nport = 0\ntls_cert = "{cert}"\ntls_key = "{key}"\n')

    async def main() -> None:
        service = Service(settings, data, KEYS)
        running = asyncio.create_task(service.run())
        await asyncio.wait_for(service.listening.wait(), 30)
        trusted = ssl.create_default_context(cafile=str(cert))
        base = f"https://127.0.0.1:{service.port}/page/api/"
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(base + "signin", json={"key": OWNER_KEY}, ssl=trusted) as a:
                    assert a.status == 200
                    header = a.headers["Set-Cookie"]
                cookie = cookie_of(header, SECURE_COOKIE)
                assert cookie["secure"] and cookie["httponly"] and cookie["path"] == "/page/"
                assert not header.startswith(COOKIE), header
                sent = {"Cookie": f"{SECURE_COOKIE}={cookie['value']}"}
                async with http.get(base + "session", headers=sent, ssl=trusted) as answer:
                    assert answer.status == 200
                plain = {"Cookie": f"{COOKIE}={cookie['value']}"}
                async with http.get(base + "session", headers=plain, ssl=trusted) as answer:
                    assert answer.status == 401, "over TLS only the __Secure- name is read"
        finally:
            service.stop.set()
            await running

    asyncio.run(main())


def test_an_older_cookie_at_another_path_does_not_hide_the_session(tmp_path: Path) -> None:
    """A browser that still holds a cookie of the same name at Path=/ (set before the cookie
    moved) sends both, the longer path first: whichever names a live session counts."""

    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        async with http.post(url(w, "/api/signin"), json={"key": OWNER_KEY}) as answer:
            token = cookie_of(answer.headers["Set-Cookie"], COOKIE)["value"]
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as bare:
            both = {"Cookie": f"{COOKIE}={token}; {COOKIE}=stale-token-from-before"}
            async with bare.get(url(w, "/api/session"), headers=both) as answer:
                assert answer.status == 200
            for order in ([token, "stale"], ["stale", token]):
                headers = {"Cookie": "; ".join(f"{COOKIE}={v}" for v in order)}
                async with bare.get(url(w, "/api/overview"), headers=headers) as answer:
                    assert answer.status == 200, order

    run(tmp_path, scenario)


FROM_ELSEWHERE = [
    pytest.param({"Sec-Fetch-Site": "cross-site"}, id="another site"),
    pytest.param({"Sec-Fetch-Site": "same-site"}, id="another origin on the same site"),
    pytest.param({"Origin": "http://127.0.0.1:3000"}, id="another port (an engine's web UI)"),
    pytest.param({"Origin": "http://evil.example"}, id="another host"),
    pytest.param({"Origin": "null"}, id="an opaque origin"),
    pytest.param(
        {"Sec-Fetch-Site": "same-site", "Origin": "SELF"}, id="same-site says it, whatever Origin"
    ),
]


@pytest.mark.parametrize("headers", FROM_ELSEWHERE)
def test_the_csrf_token_is_never_served_to_a_request_from_elsewhere(
    tmp_path: Path, headers: dict[str, str]
) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        write_status(w.data, "small", "stopped")
        _, body = await sign_in(w, http)
        own = f"http://{w.gateway.host}:{w.gateway.port}"
        sent = {k: own if v == "SELF" else v for k, v in headers.items()}
        for method, path in (("GET", "/api/session"), ("GET", "/api/overview")):
            async with http.request(method, url(w, path), headers=sent) as answer:
                assert answer.status == 403, path
                text = await answer.text()
                assert (await answer.json())["error"]["code"] == "foreign_origin"
                assert body["csrf"] not in text
        change = {**sent, CSRF_HEADER: body["csrf"]}
        async with http.post(
            url(w, "/api/engines/small"), json={"desired": "running"}, headers=change
        ) as answer:
            assert answer.status == 403
        assert not (w.data / "small" / "desired.json").exists()

    run(tmp_path, scenario)


def test_the_page_itself_and_clients_that_say_nothing_are_answered(tmp_path: Path) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        _, body = await sign_in(w, http)
        own = f"http://{w.gateway.host}:{w.gateway.port}"
        for headers in (
            {},
            {"Sec-Fetch-Site": "same-origin"},
            {"Sec-Fetch-Site": "same-origin", "Origin": own},
            {"Sec-Fetch-Site": "none"},  # typed into the address bar
            {"Origin": own},
        ):
            async with http.get(url(w, "/api/session"), headers=headers) as answer:
                assert answer.status == 200, headers
                assert (await answer.json())["csrf"] == body["csrf"]

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("origin", "host", "same"),
    [
        ("http://127.0.0.1:8400", "127.0.0.1:8400", True),
        ("http://127.0.0.1:3000", "127.0.0.1:8400", False),
        ("https://lucia.example", "lucia.example", True),
        ("https://lucia.example", "lucia.example:443", True),
        ("https://LUCIA.example:443", "lucia.example", True),
        ("http://lucia.example", "lucia.example:443", False),
        ("https://grafana.lucia.example", "lucia.example", False),
        ("http://[::1]:8400", "[::1]:8400", True),
        ("http://[::1]:8401", "[::1]:8400", False),
        ("null", "127.0.0.1:8400", False),
        ("file://", "127.0.0.1:8400", False),
        ("http://127.0.0.1:8400/page/", "127.0.0.1:8400", False),
        ("http://127.0.0.1:99999", "127.0.0.1:8400", False),
        ("http://[::1", "127.0.0.1:8400", False),
    ],
)
def test_same_origin(origin: str, host: str, same: bool) -> None:
    assert same_origin(origin, host) is same


def test_foreign_says_why() -> None:
    assert foreign(None, None, "h:1") is None
    assert foreign("same-origin", "http://h:1", "h:1") is None
    assert foreign("cross-site", None, "h:1") == "Sec-Fetch-Site says 'cross-site'"
    assert foreign(None, "http://h:2", "h:1") == "its Origin 'http://h:2' is not this page's"
