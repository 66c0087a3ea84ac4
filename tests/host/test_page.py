"""The operator's page in process: sign-in, sessions, CSRF, its headers and its JSON API (the
browser drives the real gateway in tests/integration/test_page_browser.py)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from supervisor import paths
from supervisor.host import keys
from supervisor.host.gateway.app import PAGE_OF
from supervisor.host.gateway.service import Service
from supervisor.host.gateway.settings import parse
from supervisor.host.page import memory
from supervisor.host.page.routes import COOKIE, CSRF_HEADER
from supervisor.host.page.sessions import Sessions, SignInLimit
from supervisor.host.record import batch
from supervisor.host.record.database import open_sqlite
from supervisor.host.web.auth import allowed
from supervisor.protocol.claims import held_claims
from tests.host.gateway_world import (
    INFERENCE_KEY,
    KEYS,
    OWNER,
    OWNER_KEY,
    SETTINGS,
    World,
    world,
    write_status,
)
from tests.record_world import row


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(
    tmp_path: Path,
    scenario: Callable[[World, aiohttp.ClientSession], Awaitable[None]],
) -> None:
    async def main() -> None:
        async with (
            world(tmp_path, SETTINGS) as w,
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http,
        ):
            await scenario(w, http)

    asyncio.run(main())


def url(w: World, path: str) -> str:
    return str(w.gateway.make_url("/page" + path))


async def sign_in(
    w: World,
    http: aiohttp.ClientSession,
    key: str = OWNER_KEY,
) -> tuple[int, dict[str, Any]]:
    async with http.post(url(w, "/api/signin"), json={"key": key}) as answer:
        return answer.status, await answer.json()


def test_the_page_path_takes_no_bearer_key() -> None:
    assert allowed("/page/", None) == "open"
    assert allowed("/page/api/overview", "inference") == "open"
    assert allowed("/pages", None) == "forbidden"
    assert allowed("/api/host/engines", "inference") == "forbidden"


def test_the_page_and_its_files_carry_the_policy(tmp_path: Path) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        for path, kind in (
            ("/", "text/html"),
            ("/page.js", "text/javascript"),
            ("/page.css", "text/css"),
        ):
            async with http.get(url(w, path)) as answer:
                assert answer.status == 200 and answer.content_type == kind
                policy = answer.headers["Content-Security-Policy"]
                assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
                assert "unsafe-inline" not in policy
                assert answer.headers["X-Content-Type-Options"] == "nosniff"
                text = await answer.text()
                if kind == "text/html":
                    assert "<script>" not in text and "<style" not in text
                    assert re.search(r"\son[a-z]+=", text) is None and "style=" not in text
        async with http.get(url(w, ""), allow_redirects=False) as answer:
            assert answer.status == 302 and answer.headers["Location"] == "/page/"

    run(tmp_path, scenario)


def test_the_owner_signs_in_polls_and_signs_out(tmp_path: Path) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        write_status(w.data, "small", "stopped", message="<img src=x onerror=alert(1)>")
        async with http.post(url(w, "/api/signin"), json={"key": OWNER_KEY}) as answer:
            assert answer.status == 200
            body = await answer.json()
            cookie = answer.headers["Set-Cookie"]
        assert len(body["csrf"]) >= 40
        assert cookie.startswith(COOKIE + "=") and OWNER_KEY not in cookie
        for part in ("HttpOnly", "SameSite=Strict", "Path=/page/"):
            assert part in cookie
        assert "Secure" not in cookie, "Secure only over TLS"
        async with http.get(url(w, "/api/overview")) as answer:
            assert answer.status == 200
            served_as_json(answer)
            data = await answer.json()
        engine = data["engines"][0]
        assert engine["name"] == "small" and engine["status"]["state"] == "stopped"
        # the markup arrives as JSON text, which the page's script sets as text only (the
        # static scan below; the browser shows it as these characters in test_page_browser.py)
        assert engine["status"]["message"] == "<img src=x onerror=alert(1)>"
        for path in ("/api/session", "/api/nothing-here"):
            async with http.get(url(w, path)) as answer:
                served_as_json(answer)
        assert data["models"] == {"available": False} and data["traffic"] == {"available": False}
        headers = {CSRF_HEADER: body["csrf"]}
        async with http.post(url(w, "/api/signout"), json={}, headers=headers) as answer:
            assert answer.status == 200
        async with http.get(url(w, "/api/overview")) as answer:
            assert answer.status == 401
            served_as_json(answer)

    run(tmp_path, scenario)


def served_as_json(answer: aiohttp.ClientResponse) -> None:
    """JSON the browser may never sniff as markup: its type said, nosniff, the page's policy."""
    assert answer.headers["Content-Type"].split(";")[0] == "application/json", answer.headers
    assert answer.headers["X-Content-Type-Options"] == "nosniff"
    assert "default-src 'self'" in answer.headers["Content-Security-Policy"]


PAGE_JS = Path(__file__).resolve().parents[2] / "supervisor/host/page/static/page.js"
# what may take text that came from an engine, a worker or the hub: never markup, a URL or code
MARKUP = re.compile(
    r"innerHTML|outerHTML|insertAdjacent(HTML|Element)|createContextualFragment|DOMParser|"
    r"srcdoc|\.write(ln)?\s*\(|\beval\s*\(|\bFunction\s*\(|set(Timeout|Interval)\s*\(\s*[\"'`]|"
    r"javascript:|cssText|\.(href|src|action|formAction|location)\b|\blocation\s*=|"
    r"\.html\s*\(|append\s*\(\s*[\"'`]|<[a-z]+[\s>]"
)
PROPERTIES = {"textContent", "className", "hidden", "disabled", "title", "type", "value"}
SVG_ATTRIBUTES = {
    "viewBox",
    "role",
    "class",
    "x",
    "y",
    "x1",
    "y1",
    "x2",
    "y2",
    "points",
    "cx",
    "cy",
    "r",
}


def test_the_pages_script_sets_what_it_was_sent_as_text_only() -> None:
    """A static scan of page.js: no API that parses markup or runs code; every property it
    sets is a text one (textContent, title, value...), a class, a flag, a data- attribute or a
    bar's width; the one setAttribute (the chart's SVG) takes only fixed, harmless names."""
    code = PAGE_JS.read_text()
    code = re.sub(r"^\s*//.*$", "", code, flags=re.MULTILINE)  # comments say what it avoids
    assert MARKUP.search(code) is None, MARKUP.search(code)
    assigned = re.findall(r"(?:\.([A-Za-z_$][\w$]*))?\.([A-Za-z_$][\w$]*)\s*\+?=(?!=)", code)
    assert assigned, "the scan found the page's assignments"
    for parent, name in assigned:
        assert name in PROPERTIES or parent == "dataset" or (parent, name) == ("style", "width"), (
            f"page.js sets .{parent + '.' if parent else ''}{name}"
        )
    for target in re.findall(r"([\w$.]+)\[[^\]]+\]\s*=(?!=)", code):
        assert target in {"drawn", "headers", "buttons"}, target  # plain objects, no node
    assert code.count("setAttribute(") == 1
    assert "node.setAttribute(name, String(value))" in code  # in svg(), from its attrs' keys
    calls = re.findall(r"svg\(\"\w+\",\s*\{([^}]*)\}", code)
    assert calls, "the scan found the chart's elements"
    for attrs in calls:
        names = set(re.findall(r"([A-Za-z_$][\w$]*)\s*:", attrs))
        assert names <= SVG_ATTRIBUTES, names - SVG_ATTRIBUTES


def test_a_change_without_the_csrf_token_is_refused(tmp_path: Path) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        write_status(w.data, "small", "stopped")
        _, body = await sign_in(w, http)
        for headers in ({}, {CSRF_HEADER: "x" * len(body["csrf"])}):
            async with http.post(
                url(w, "/api/engines/small"), json={"desired": "running"}, headers=headers
            ) as answer:
                assert answer.status == 403
                assert (await answer.json())["error"]["code"] == "csrf_refused"
        assert not (w.data / "small" / "desired.json").exists()
        async with http.post(
            url(w, "/api/engines/small"),
            json={"desired": "running"},
            headers={CSRF_HEADER: body["csrf"]},
        ) as answer:
            assert answer.status == 202
        assert (w.data / "small" / "desired.json").exists()

    run(tmp_path, scenario)


def test_a_stop_from_the_page_is_an_operators_and_the_page_says_who_asked(
    tmp_path: Path,
) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        write_status(w.data, "small", "running", url=w.upstream.url, generation=1)
        _, body = await sign_in(w, http)
        async with http.post(
            url(w, "/api/engines/small"),
            json={"desired": "stopped"},
            headers={CSRF_HEADER: body["csrf"]},
        ) as answer:
            assert answer.status == 202
            generation = (await answer.json())["generation"]
        async with http.get(url(w, "/api/overview")) as answer:
            (engine,) = (await answer.json())["engines"]
        asked = engine["desired"]
        assert (asked["desired"], asked["generation"], asked["requestedBy"]) == (
            "stopped",
            generation,
            "operator",
        )
        assert asked["requestedAt"].endswith("Z")
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {INFERENCE_KEY}"}) as s,
            s.post(
                str(w.gateway.make_url("/v1/chat/completions")),
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            ) as r,
        ):
            assert r.status == 503
            error = (await r.json())["error"]
        assert "stopped by an operator" in error["message"]
        assert w.desired().generation == generation

    run(tmp_path, scenario)


def test_an_inference_key_cannot_open_the_page(tmp_path: Path) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        status, body = await sign_in(w, http, INFERENCE_KEY)
        assert status == 403 and "the page is the owner's" in body["error"]["message"]
        assert COOKIE not in http.cookie_jar.filter_cookies(w.gateway.make_url("/page/"))
        async with http.get(
            url(w, "/api/overview"), headers={"Authorization": f"Bearer {INFERENCE_KEY}"}
        ) as answer:
            assert answer.status == 401
        async with http.get(url(w, "/api/overview"), headers=OWNER) as answer:
            assert answer.status == 401, "the page takes its session, never a bearer key"

    run(tmp_path, scenario)


def test_an_expired_session_is_signed_out(tmp_path: Path) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        clock = Clock()
        w.gateway.app[PAGE_OF].sessions = Sessions(lifetime_s=3600, clock=clock)
        _, body = await sign_in(w, http)
        async with http.get(url(w, "/api/session")) as answer:
            assert answer.status == 200 and (await answer.json())["csrf"] == body["csrf"]
        clock.now += 3600
        async with http.get(url(w, "/api/overview")) as answer:
            assert answer.status == 401
            assert (await answer.json())["error"]["code"] == "signed_out"

    run(tmp_path, scenario)


def test_failed_sign_ins_are_limited(tmp_path: Path) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        clock = Clock()
        w.gateway.app[PAGE_OF].limit = SignInLimit(allowed=3, window_s=60, clock=clock)
        for _ in range(3):
            assert (await sign_in(w, http, "wrong" * 10))[0] == 401
        status, body = await sign_in(w, http)
        assert status == 429 and body["error"]["code"] == "too_many_sign_ins"
        clock.now += 61
        assert (await sign_in(w, http))[0] == 200

    run(tmp_path, scenario)


def test_a_key_is_created_shown_once_and_revoked(tmp_path: Path) -> None:
    async def scenario(w: World, http: aiohttp.ClientSession) -> None:
        _, body = await sign_in(w, http)
        headers = {CSRF_HEADER: body["csrf"]}
        async with http.post(
            url(w, "/api/keys"), json={"name": "laptop"}, headers=headers
        ) as answer:
            assert answer.status == 201
            made = await answer.json()
        assert made["secret"].startswith("lucia_inf_")
        async with http.get(url(w, "/api/overview")) as answer:
            text = await answer.text()
        assert made["id"] in text and made["secret"] not in text
        async with http.post(
            url(w, "/api/keys"), json={"name": "laptop"}, headers=headers
        ) as answer:
            assert answer.status == 400, "a name in use"
        async with http.post(
            url(w, f"/api/keys/{made['id']}/revoke"), json={}, headers=headers
        ) as answer:
            assert answer.status == 200 and (await answer.json())["state"] == "revoked"
        async with http.get(url(w, "/api/overview")) as answer:
            assert made["id"] not in await answer.text()

    run(tmp_path, scenario)


def test_sessions_keep_no_token_and_drop_the_oldest() -> None:
    clock = Clock()
    sessions = Sessions(lifetime_s=10, clock=clock, limit=2)
    first, _ = sessions.open()
    clock.now += 1
    second, _ = sessions.open()
    third, _ = sessions.open()
    assert sessions.find(first) is None and sessions.find(second) and sessions.find(third)
    assert first not in repr(sessions.__dict__) and second not in repr(sessions.__dict__)
    clock.now += 10
    assert sessions.find(third) is None and sessions.find(None) is None


@pytest.mark.parametrize(
    ("text", "found"),
    [
        (
            '{"claims": [{"name": "a", "bytes": 5}, {"name": 3}, {"bytes": true, "name": "b"}]}',
            [("a", 5)],
        ),
        ("not json", []),
        ('{"claims": {}}', []),
    ],
)
def test_the_ledger_is_read_loosely(text: str, found: list[tuple[str, int]]) -> None:
    assert [(held.name, held.bytes) for held in held_claims(text)] == found


def test_memory_shows_the_claims_of_engines_that_hold(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "memory").mkdir(parents=True)
    (data / "memory" / "claims.json").write_text(
        '{"claims": [{"name": "small", "bytes": 1024}, {"name": "gone", "bytes": 2048}]}'
    )
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4 kB\nMemFree: 1 kB\nMemAvailable: 2 kB\n")
    write_status(data, "small", "running", url="http://127.0.0.1:1")
    write_status(data, "gone", "stopped")
    shown = memory.LedgerMemory(data, meminfo).read()
    assert shown is not None
    assert shown["held"] == [{"name": "small", "bytes": 1024}]
    assert (shown["limit"], shown["availableNow"], shown["free"]) == (4096, 2048, 3072)


def test_the_pages_files_ship_in_the_package() -> None:
    """install.sh installs the package, not the tree: package data must name every file."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["supervisor"]
    static = root / "supervisor" / "host" / "page" / "static"
    names = sorted(p.relative_to(root / "supervisor").as_posix() for p in static.iterdir())
    assert names == [
        "host/page/static/index.html",
        "host/page/static/page.css",
        "host/page/static/page.js",
    ]
    for name in names:
        assert any(fnmatch.fnmatch(name, glob) for glob in globs), name


def test_traffic_and_key_use_come_from_the_record(tmp_path: Path) -> None:
    """The service gives the page the record: the traffic section and each key's use."""
    data = tmp_path / "data"
    data.mkdir()
    settings = parse("[listen]\nport = 0\n[budget]\ndaily_tokens = 1000\n", "gw.toml")

    async def main() -> None:
        service = Service(settings, data, KEYS)
        running = asyncio.create_task(service.run())
        await asyncio.wait_for(service.listening.wait(), 30)
        base = f"http://127.0.0.1:{service.port}/page/api/"
        try:
            async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
                async with http.post(base + "signin", json={"key": OWNER_KEY}) as answer:
                    headers = {CSRF_HEADER: (await answer.json())["csrf"]}
                async with http.post(base + "keys", json={"name": "alice"}, headers=headers) as a:
                    alice = (await a.json())["id"]
                async with http.post(base + "keys", json={"name": "radar"}, headers=headers) as a:
                    radar = (await a.json())["id"]
                keys.set_exempt(paths.keys_file(data), radar, True)
                db = open_sqlite(settings.record.target(data).path)  # type: ignore[arg-type]
                batch.write(
                    db,
                    [
                        row(key_id=alice, ttft_s=0.25),
                        row(key_id=alice, ttft_s=None, outcome="refused:rate_limited"),
                    ],
                )
                db.close()
                async with http.get(base + "overview") as answer:
                    found = await answer.json()
        finally:
            service.stop.set()
            await running
        traffic = found["traffic"]["data"]
        assert traffic["hour"]["requests"] == 2 and traffic["day"]["requests"] == 2
        assert traffic["hour"]["refusals"] == {"rate_limited": 1}
        assert traffic["hour"]["byModel"][0]["ttftSeconds"]["p50"] == 0.25
        assert [len(b["points"]) for b in traffic["chart"]["builds"]] == [1]
        use = found["keys"]["use"]["data"][alice]
        assert use["lastUse"] is not None and use["lastUseKnown"] and use["budget"] == 1000
        exempt = {key["name"]: key["exempt"] for key in found["keys"]["keys"]}
        assert exempt == {"alice": False, "radar": True}
        radar_use = found["keys"]["use"]["data"][radar]
        assert (radar_use["budget"], radar_use["exempt"]) == (None, True)

    asyncio.run(main())
