"""A gateway behind a load balancer: `GET /healthz` (open, cheap, 503 from the stop on), the
drain at a stop on the real gateway process, and the client's address from a trusted proxy's
X-Forwarded-For (for the bearer key's failure limit and the page's sign-in), with their
settings. HAProxy itself in front of three gateways: tests/host/test_haproxy.py."""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor.host.failures import FailureLimit
from supervisor.host.gateway import health
from supervisor.host.gateway.app import GATEWAY, PAGE_OF
from supervisor.host.gateway.health import HEALTH
from supervisor.host.gateway.settings import SettingsError, parse
from supervisor.host.page.sessions import SignInLimit
from supervisor.host.web.intake import client
from tests.gateway_proc import running_gateway
from tests.host.gateway_world import INFERENCE_KEY, SETTINGS, world
from tests.host.test_page import Clock
from tests.host.test_page_signin import session_from, sign_in
from tests.system.harness import wait_for

WRONG = "wrong-key-" + "w" * 32
PROXY = ["10.0.0.5/32"]


@pytest.mark.parametrize(
    ("remote", "forwarded", "trusted", "found"),
    [
        pytest.param("10.0.0.5", ["1.2.3.4"], [], "10.0.0.5", id="no proxy trusted: the socket"),
        pytest.param("10.0.0.9", ["1.2.3.4"], PROXY, "10.0.0.9", id="not from a trusted proxy"),
        pytest.param("10.0.0.5", ["1.2.3.4"], PROXY, "1.2.3.4", id="the client it names"),
        pytest.param("10.0.0.5", [], PROXY, "10.0.0.5", id="no header: the proxy itself"),
        pytest.param("10.0.0.5", ["9.9.9.9, 1.2.3.4"], PROXY, "1.2.3.4", id="a client's own"),
        pytest.param("10.0.0.5", ["9.9.9.9", "1.2.3.4"], PROXY, "1.2.3.4", id="two headers"),
        pytest.param(
            "10.0.0.5", ["1.2.3.4, 10.0.0.6"], ["10.0.0.0/24"], "1.2.3.4", id="proxies in a row"
        ),
        pytest.param(
            "10.0.0.5", ["10.0.0.7,10.0.0.6"], ["10.0.0.0/24"], "10.0.0.7", id="only proxies"
        ),
        pytest.param("10.0.0.5", ["1.2.3.4, nonsense"], PROXY, "10.0.0.5", id="malformed last"),
        pytest.param("10.0.0.5", ["nonsense, 1.2.3.4"], PROXY, "1.2.3.4", id="malformed before"),
        pytest.param("10.0.0.5", ["1.2.3.4:5678"], PROXY, "10.0.0.5", id="a port is malformed"),
        pytest.param("10.0.0.5", [" 2001:db8::1 "], PROXY, "2001:db8::1", id="an IPv6 client"),
        pytest.param("::ffff:10.0.0.5", ["1.2.3.4"], PROXY, "1.2.3.4", id="a dual-stack socket"),
        pytest.param("", ["1.2.3.4"], PROXY, "", id="no socket address"),
    ],
)
def test_the_client_behind_trusted_proxies(
    remote: str, forwarded: list[str], trusted: list[str], found: str
) -> None:
    networks = [ipaddress.ip_network(item) for item in trusted]
    assert client(remote, forwarded, networks) == found


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[listen]\ntrusted_proxies = ["localhost"]', "listen.trusted_proxies"),
        ('[listen]\ntrusted_proxies = ["0.0.0.0/0"]', "any client name its own"),
        ('[listen]\ntrusted_proxies = ["::/0"]', "any client name its own"),
        ('[listen]\ntrusted_proxies = "10.0.0.5"', "listen.trusted_proxies"),
        ("[listen]\ndrain_s = 6", "listen.drain_s"),
        ("[listen]\ndrain_s = -1", "listen.drain_s"),
    ],
)
def test_bad_balancer_settings_name_the_setting(text: str, words: str) -> None:
    with pytest.raises(SettingsError, match=r"^gw\.toml: ") as caught:
        parse(text, "gw.toml")
    assert words in str(caught.value)


def test_the_balancer_settings_default_to_none_and_read_networks() -> None:
    assert (parse("", "t").listen.trusted_proxies, parse("", "t").listen.drain_s) == ((), 0)
    listen = parse(
        '[listen]\ntrusted_proxies = ["10.0.0.5", "10.1.2.3/16", "2001:db8::/32"]\ndrain_s = 3\n',
        "t",
    ).listen
    assert listen.trusted_proxies == ("10.0.0.5/32", "10.1.0.0/16", "2001:db8::/32")
    assert ipaddress.ip_address("10.1.9.9") in listen.proxies[1]
    assert listen.drain_s == 3


def test_healthz_is_open_cheap_and_turns_503_at_the_stop(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path, SETTINGS) as w, aiohttp.ClientSession() as http:
            where = str(w.gateway.make_url("/healthz"))
            wrong = {"Authorization": f"Bearer {WRONG}"}
            for headers in ({}, wrong, wrong, {"Authorization": f"Bearer {INFERENCE_KEY}"}):
                async with http.get(where, headers=headers) as answer:
                    assert answer.status == 200
                    assert answer.headers["Cache-Control"] == "no-store"
                    assert await answer.json() == {"status": "ok", "machine": None}
            assert w.app.failures.blocked("127.0.0.1") == 0, "no key is checked there"
            w.gateway.app[HEALTH].stop()  # the service's stop, before its drain
            async with http.get(where) as answer:
                assert (answer.status, await answer.json()) == (503, {"status": "stopping"})
            async with http.get(str(w.gateway.make_url("/v1/models")), headers=wrong) as answer:
                assert answer.status == 401, "the rest is as before: it still serves"

    asyncio.run(main())


def test_healthz_names_the_machine_and_turns_503_when_the_app_shuts_down() -> None:
    async def main() -> None:
        app = web.Application()
        health.routes(app, "spark")
        server = TestServer(app)
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(str(server.make_url("/healthz"))) as answer:
                    assert await answer.json() == {"status": "ok", "machine": "spark"}
                await app.shutdown()  # as aiohttp's own stop runs it
                async with http.get(str(server.make_url("/healthz"))) as answer:
                    assert (answer.status, await answer.json()) == (503, {"status": "stopping"})
        finally:
            await server.close()

    asyncio.run(main())


BEHIND = SETTINGS + '[listen]\ntrusted_proxies = ["127.0.0.1"]\n'


def test_behind_a_trusted_proxy_each_client_has_its_own_key_limit(tmp_path: Path) -> None:
    """From the trusted proxy (127.0.0.1), the client its header names counts; from any other
    address (127.0.0.2), the header is the client's own word and the socket counts."""

    async def main() -> None:
        async with (
            world(tmp_path, BEHIND) as w,
            session_from("127.0.0.1") as proxy,
            session_from("127.0.0.2") as direct,
        ):
            failures = w.gateway.app[GATEWAY].failures = FailureLimit(allowed=2, clock=Clock())
            models = str(w.gateway.make_url("/v1/models"))

            async def status(http: aiohttp.ClientSession, key: str, named: str) -> int:
                headers = {"Authorization": f"Bearer {key}", "X-Forwarded-For": named}
                async with http.get(models, headers=headers) as answer:
                    return answer.status

            assert [await status(proxy, WRONG, "10.1.2.3") for _ in range(3)] == [401, 401, 429]
            assert await status(proxy, WRONG, "10.1.2.4") == 401, "another client counts its own"
            assert await status(proxy, INFERENCE_KEY, "10.1.2.3") == 200
            assert [await status(direct, WRONG, "10.1.2.5") for _ in range(3)] == [401, 401, 429]
            assert failures.blocked("10.1.2.3") > 0 and failures.blocked("127.0.0.2") > 0
            assert failures.blocked("127.0.0.1") == failures.blocked("10.1.2.5") == 0

    asyncio.run(main())


def test_behind_a_trusted_proxy_the_page_counts_each_clients_sign_ins(tmp_path: Path) -> None:
    async def main() -> None:
        async with world(tmp_path, BEHIND) as w, session_from("127.0.0.1") as proxy:
            limit = w.gateway.app[PAGE_OF].limit = SignInLimit(clock=Clock())
            for _ in range(limit.allowed):
                assert await sign_in(w, proxy, WRONG, **{"X-Forwarded-For": "10.1.2.3"}) == 401
            assert await sign_in(w, proxy, WRONG, **{"X-Forwarded-For": "10.1.2.3"}) == 429
            assert limit.blocked("10.1.2.3") > 0 and limit.blocked("127.0.0.1") == 0
            assert await sign_in(w, proxy, WRONG, **{"X-Forwarded-For": "10.1.2.4"}) == 401

    asyncio.run(main())


def test_the_real_gateway_drains_at_a_stop(tmp_path: Path) -> None:
    """SIGTERM: /healthz answers 503 at once while the gateway still serves, for drain_s; then
    it stops, and says so."""
    data = tmp_path / "data"
    data.mkdir()
    with running_gateway(tmp_path / "gateway", data, listen="drain_s = 5\n") as gw:
        assert gw.get("/healthz") == (200, {"status": "ok", "machine": None})
        gw.proc.terminate()
        wait_for(lambda: gw.get("/healthz")[0] == 503, 30, "/healthz answering 503")
        assert gw.get("/healthz") == (503, {"status": "stopping"})
        assert gw.get("/v1/models", gw.issued)[0] == 200, "it serves while it drains"
        assert gw.proc.wait(60) == 0
    assert "gateway draining" in gw.log_text()
