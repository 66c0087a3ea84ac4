"""One address for the fleet: Debian's haproxy, with the shipped haproxy/lucia-fleet.cfg, in front
of three real gateway processes, each with its own data directory and a fast engine of its own
(gateway_world's Upstream, on an event loop in a thread of the test).

Requests through HAProxy's address reach all three (leastconn: a stream held on each, then the
next on the one that has none); a stream passes as it comes; each client keeps its own
invalid-key limit behind HAProxy (the gateways trust its X-Forwarded-For, never a client's); a
killed gateway's request in flight is answered 502 and never sent again, those sent to it dead
go elsewhere, and it is marked down; a stopping one answers /healthz 503, is marked down for it,
and finishes its stream; with none up, HAProxy answers 503 in the gateways' error shape. And the
shipped file is a valid configuration as it ships, its commented TLS lines too. Every wait is
on HAProxy's stats socket or an answer, never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp.test_utils import TestServer

from tests import haproxy
from tests.gateway_proc import Gateway, metric, running_gateway
from tests.haproxy import HAProxy, state
from tests.host.gateway_world import SETTINGS, Upstream, serve_upstream, write_status
from tests.host.test_gateway_service import self_signed
from tests.standin import free_port

T = TypeVar("T")
NAMES = ("alpha", "beta", "gamma")
OWNER = "owner-key-" + "o" * 32
INFERENCE = "inference-key-" + "i" * 32
WRONG = "wrong-key-" + "w" * 32
TRUSTED = 'trusted_proxies = ["127.0.0.1"]\n'  # HAProxy reaches the gateways from 127.0.0.1
CHECKS = "250ms"  # the shipped 1 s, shortened: the waits below end sooner, nothing else changes
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


async def made_event() -> asyncio.Event:
    return asyncio.Event()  # made on the engines' loop, where it is awaited


class Engines:
    """One fast engine per gateway, on an event loop in a thread of their own, each status.json
    written again every few seconds as a worker's heartbeat is."""

    def __init__(self, count: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.upstreams = [Upstream() for _ in range(count)]
        self.servers: list[TestServer] = [self.call(serve_upstream(up)) for up in self.upstreams]
        self.gate: asyncio.Event | None = None
        self.beating: asyncio.Future[None] | None = None

    def call(self, job: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(job, self.loop).result(60)

    def beat(self, data_dirs: list[Path]) -> None:
        async def heartbeat() -> None:
            while True:
                for data, up in zip(data_dirs, self.upstreams, strict=True):
                    write_status(data, "small", "running", url=up.url, generation=1)
                await asyncio.sleep(5)

        self.beating = asyncio.run_coroutine_threadsafe(heartbeat(), self.loop)  # type: ignore[assignment]

    def hold(self) -> None:
        """Each engine holds every answer after its first chunk from now until `release` (one
        release for all held since the last)."""
        if self.gate is None or self.gate.is_set():
            self.gate = self.call(made_event())
        for up in self.upstreams:
            up.hold = self.gate

    def unheld(self) -> None:
        """New answers are not held; those held already wait on for `release`."""
        for up in self.upstreams:
            up.hold = None

    def release(self) -> None:
        if self.gate is not None:
            self.loop.call_soon_threadsafe(self.gate.set)

    def served(self) -> list[int]:
        return [len(up.bodies) for up in self.upstreams]

    def wait(self, check: Callable[[], bool]) -> None:
        """Until `check` holds (what the engines got), at most 60 s: a bound on a hang."""
        deadline = time.monotonic() + 60
        while not check():
            assert time.monotonic() < deadline, self.served()
            time.sleep(0.01)

    def close(self) -> None:
        self.release()
        if self.beating is not None:
            self.beating.cancel()
        for server in self.servers:
            self.call(server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@dataclass
class Fleet:
    engines: Engines
    gateways: list[Gateway]
    proxy: HAProxy


@contextlib.contextmanager
def fleet(work: Path, drain: tuple[float, ...] = (0, 0, 0)) -> Iterator[Fleet]:
    """Three gateways (NAMES, each `drain[i]` s of [listen] drain_s) sharing their clients'
    keys, an engine behind each, and HAProxy in front of them, every server up."""
    haproxy.binary()  # skipped before anything starts where the machine has no haproxy
    with ExitStack() as stack:
        engines = Engines(len(NAMES))
        stack.callback(engines.close)
        gateways, dirs = [], []
        for name, up, drain_s in zip(NAMES, engines.upstreams, drain, strict=True):
            data = work / name / "data"
            data.mkdir(parents=True)
            write_status(data, "small", "running", url=up.url, generation=1)
            dirs.append(data)
            listen = TRUSTED + f"drain_s = {drain_s}\n"
            gateways.append(
                stack.enter_context(
                    running_gateway(work / name, data, SETTINGS, listen, (OWNER, INFERENCE))
                )
            )
        engines.beat(dirs)
        servers = [
            (n, gw.url.removeprefix("http://")) for n, gw in zip(NAMES, gateways, strict=True)
        ]
        proxy = stack.enter_context(haproxy.running(work / "haproxy", servers, CHECKS))
        yield Fleet(engines, gateways, proxy)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A fleet the tests that harm no part of it share."""
    with fleet(tmp_path_factory.mktemp("fleet")) as made:
        yield made


# -- talking to HAProxy ---------------------------------------------------------------------


def connect(url: str, source: str = "127.0.0.1") -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0))


def post(
    url: str,
    document: dict[str, Any],
    key: str = INFERENCE,
    source: str = "127.0.0.1",
    path: str = "/v1/chat/completions",
    **extra: str,
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    connection = connect(url, source)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **extra}
    connection.request("POST", path, json.dumps(document), headers)
    return connection, connection.getresponse()


def chat_answer(url: str, key: str = INFERENCE, source: str = "127.0.0.1", **extra: str) -> Any:
    """A plain chat through `url`: its status and its JSON."""
    connection, answer = post(url, CHAT, key, source, **extra)
    try:
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def chat(url: str, key: str = INFERENCE, source: str = "127.0.0.1", **extra: str) -> int:
    """A plain chat through `url`: its status (its answer read whole)."""
    return int(chat_answer(url, key, source, **extra)[0])


@dataclass
class Stream:
    connection: http.client.HTTPConnection
    answer: http.client.HTTPResponse

    def event(self) -> str:
        """The next event's data (comments and blank lines skipped); "" at the end."""
        while line := self.answer.readline():
            text = line.decode().strip()
            if text.startswith("data: "):
                return text.removeprefix("data: ")
        return ""

    def rest(self) -> list[str]:
        events = []
        while event := self.event():
            events.append(event)
        self.connection.close()
        return events


def stream(url: str) -> Stream:
    """A streamed chat through `url`, once its first token has come."""
    connection, answer = post(url, {**CHAT, "stream": True})
    assert answer.status == 200, answer.read()
    opened = Stream(connection, answer)
    first = json.loads(opened.event())
    assert first["choices"][0]["delta"]["content"] == "tok"
    return opened


def ok_requests(gateway: Gateway) -> float:
    return metric(gateway.metrics(), "lucia_gateway_requests_total", outcome="ok")


def down(row: dict[str, str]) -> bool:
    return state(row)[0] == "DOWN"


# -- the shipped file -----------------------------------------------------------------------


def test_the_shipped_file_is_valid_as_it_ships(tmp_path: Path) -> None:
    """Its placeholders are documentation addresses (192.0.2.x): valid, and nowhere."""
    done = haproxy.check(haproxy.SHIPPED)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr
    rendered = tmp_path / "rendered.cfg"
    servers = [("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")]
    rendered.write_text(
        haproxy.render(haproxy.SHIPPED.read_text(), "127.0.0.1:3", servers, tmp_path / "s", "1s")
    )
    done = haproxy.check(rendered)
    assert done.returncode == 0 and "WARNING" not in done.stdout + done.stderr, done


def test_the_render_fails_on_a_file_without_the_lines_it_renders(tmp_path: Path) -> None:
    text = haproxy.SHIPPED.read_text()
    for line in ("    balance leastconn\n", "    default-server inter 1s fall 2 rise 2\n"):
        assert line in text, "the shipped file says what docs/fleet.md says it does"
    without = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("server "))
    with pytest.raises(AssertionError, match="server"):
        haproxy.render(without, "127.0.0.1:3", [("a", "127.0.0.1:1")], tmp_path / "s")


def haproxy_pem(where: Path) -> tuple[Path, Path]:
    """A certificate with its key in one PEM (as HAProxy's crt takes it), and the certificate
    alone (as a ca-file)."""
    cert, key = self_signed(where)
    (where / "lucia.pem").write_bytes(cert.read_bytes() + key.read_bytes())
    return where / "lucia.pem", cert


COMMENTED = ("bind", "http-request", "server", "frontend", "backend", "mode", "balance", "option")
COMMENTED += ("default-server", "default_backend")


def uncommented(text: str, pem: Path, ca: Path) -> str:
    """Pure: the file with each commented directive in force (the TLS bind, the re-encrypting
    server in place of the plain ones, the passed-through frontend and backend), its files the
    test's own."""
    files = {"/etc/haproxy/lucia.pem": str(pem), "/etc/haproxy/lucia-ca.pem": str(ca)}
    out = []
    for line in text.splitlines():
        body = line.lstrip()
        words = body.removeprefix("#").split()
        if body.startswith("server "):
            continue  # a plain server line: the re-encrypting one takes its place
        if body.startswith("# ") and words and words[0] in COMMENTED:
            out.append(re.sub("|".join(files), lambda m: files[m[0]], line.replace("# ", "", 1)))
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def in_force(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def test_the_commented_tls_lines_are_valid_in_force(tmp_path: Path) -> None:
    """Terminated at HAProxy, re-encrypted to the gateways, or passed through: each commented
    line, once in force (with a certificate of the test's), is a valid configuration."""
    pem, ca = haproxy_pem(tmp_path)
    text = uncommented(haproxy.SHIPPED.read_text(), pem, ca)
    for wanted in ("ssl crt", "ssl verify required", "frontend lucia-tls", "mode tcp"):
        assert wanted in in_force(text), wanted
    path = tmp_path / "tls.cfg"
    path.write_text(text)
    done = haproxy.check(path)
    assert done.returncode == 0, done.stdout + done.stderr + text


# -- through HAProxy ------------------------------------------------------------------------


def test_with_no_gateway_up_haproxy_answers_503_in_the_gateways_shape(tmp_path: Path) -> None:
    servers = [(name, f"127.0.0.1:{free_port()}") for name in NAMES[:2]]  # nothing listens
    with haproxy.running(tmp_path, servers, CHECKS, up=False) as proxy:
        for name, _ in servers:
            assert state(proxy.wait_server(name, down, "down"))[1] == "L4CON"
        status, body = chat_answer(proxy.url)
        connection, answer = post(proxy.url, CHAT, path="/fleet/v1/chat/completions")
        try:  # the peer route is never carried, gateways up or not
            peer_route = answer.status, json.loads(answer.read())["error"]["code"]
        finally:
            connection.close()
    assert (status, body["error"]["code"], body["error"]["type"]) == (
        503,
        "no_gateway",
        "server_error",
    )
    assert peer_route == (404, "not_found")


def test_requests_reach_every_gateway_and_leastconn_spreads_them(shared: Fleet) -> None:
    """A gateway holding a stream gets no new request while the others hold none (round robin
    would send it every third); each new stream goes to a gateway holding none; and every
    gateway serves some of what comes after."""
    before, base = [ok_requests(gw) for gw in shared.gateways], shared.engines.served()

    def new_since() -> list[int]:
        return [n - b for n, b in zip(shared.engines.served(), base, strict=True)]

    shared.engines.hold()
    held = []
    try:
        held.append(stream(shared.proxy.url))
        holding = new_since().index(1)
        shared.engines.unheld()
        assert [chat(shared.proxy.url) for _ in range(6)] == [200] * 6
        assert new_since()[holding] == 1 and sum(new_since()) == 7, new_since()
        base = shared.engines.served()
        shared.engines.hold()
        for count in (1, 2):  # each goes to a gateway holding no stream
            held.append(stream(shared.proxy.url))
            assert (
                new_since()[holding] == 0 and sorted(new_since()) == [0] * (3 - count) + [1] * count
            ), new_since()
        shared.engines.unheld()
    finally:
        shared.engines.release()
    for opened in held:
        assert opened.rest()[-1] == "[DONE]"
    assert [chat(shared.proxy.url) for _ in range(12)] == [200] * 12
    served = [ok_requests(gw) - was for gw, was in zip(shared.gateways, before, strict=True)]
    assert sum(served) == 21 and min(served) >= 2, served


def test_a_stream_passes_through_as_it_comes(shared: Fleet) -> None:
    """The first token reaches the client while its engine holds the rest (it sends them only
    once released, below): HAProxy and the gateway pass the answer on as it comes. One that
    kept it whole would keep `stream` waiting for its first token until its socket's timeout."""
    shared.engines.hold()
    try:
        opened = stream(shared.proxy.url)
        shared.engines.unheld()
    finally:
        shared.engines.release()
    events = opened.rest()
    assert events[-1] == "[DONE]" and len(events) == 3  # two more tokens, then [DONE]


def test_each_client_keeps_its_own_invalid_key_limit_behind_haproxy(shared: Fleet) -> None:
    """Every client reaches the gateways from HAProxy's address: trusted, its X-Forwarded-For
    names each. One client (127.0.0.2, naming 127.0.0.3 in a header of its own) past its limit
    on every gateway is refused 429; 127.0.0.3 is not, nor a valid key from 127.0.0.2."""
    url, forged = shared.proxy.url, {"X-Forwarded-For": "127.0.0.3"}
    statuses = []
    for _ in range(100):
        statuses.append(chat(url, WRONG, "127.0.0.2", **forged))
        blocked = [
            metric(gw.metrics(), "lucia_gateway_refusals_total", reason="too_many_failures")
            for gw in shared.gateways
        ]
        if min(blocked) >= 1:
            break
    assert min(blocked) >= 1, (statuses, blocked)
    assert set(statuses) == {401, 429}
    assert [chat(url, WRONG, "127.0.0.2") for _ in range(3)] == [429] * 3
    assert [chat(url, WRONG, "127.0.0.3") for _ in range(3)] == [401] * 3
    assert [chat(url, INFERENCE, "127.0.0.2") for _ in range(3)] == [200] * 3


def test_a_killed_gateway_is_marked_down_and_requests_go_on(tmp_path: Path) -> None:
    """A request that reached the gateway when it dies is answered 502 and never sent again
    (a generation may have begun there); one sent to it dead is refused at the connection, and
    sent to another (retry-on conn-failure, redispatch); its check marks it down."""
    with fleet(tmp_path) as f, ThreadPoolExecutor(1) as pool:
        answer_after = f.engines.call(made_event())
        for up in f.engines.upstreams:
            up.answer_after = answer_after  # its headers wait: the request is under way
        pending = pool.submit(chat_answer, f.proxy.url)
        f.engines.wait(lambda: sum(f.engines.served()) == 1)
        for up in f.engines.upstreams:
            up.answer_after = None
        index = f.engines.served().index(1)
        victim, name = f.gateways[index], NAMES[index]
        others = [gw for gw in f.gateways if gw is not victim]
        before = [ok_requests(gw) for gw in others]
        # its checks paused, HAProxy goes on sending it requests until it learns otherwise
        haproxy.command(f.proxy.stats, f"disable health {haproxy.BACKEND}/{name}")
        victim.proc.kill()
        victim.proc.wait()
        status, body = pending.result(60)
        assert (status, body["error"]["code"]) == (502, "gateway_failed"), body
        assert sum(f.engines.served()) == 1, "the request that reached it was sent again"
        assert [chat(f.proxy.url) for _ in range(9)] == [200] * 9
        assert int(f.proxy.server(name)["wredis"]) >= 1, "none was sent to it, and sent on"
        haproxy.command(f.proxy.stats, f"enable health {haproxy.BACKEND}/{name}")
        row = f.proxy.wait_server(name, down, "down")
        assert state(row)[1] == "L4CON", row  # its port refuses
        assert [chat(f.proxy.url) for _ in range(9)] == [200] * 9
        served = [ok_requests(gw) - was for gw, was in zip(others, before, strict=True)]
        assert sum(served) == 18 and min(served) >= 1, served
        assert all(state(f.proxy.server(n)) == ("UP", "L7OK") for n in NAMES if n != name)
        f.engines.loop.call_soon_threadsafe(answer_after.set)


def test_a_stopping_gateway_answers_503_is_drained_and_finishes_its_stream(
    tmp_path: Path,
) -> None:
    with fleet(tmp_path, drain=(5, 0, 0)) as f:
        victim = f.gateways[0]
        f.engines.hold()
        try:
            held = [stream(f.proxy.url) for _ in NAMES]  # one on each gateway (leastconn)
            f.engines.unheld()
            assert f.engines.served() == [1, 1, 1]
            victim.proc.terminate()
            row = f.proxy.wait_server(NAMES[0], down, "down")
            assert (state(row)[1], row["check_code"]) == ("L7STS", "503"), row
            before = f.engines.served()
            assert [chat(f.proxy.url) for _ in range(6)] == [200] * 6
            after = f.engines.served()
            assert after[0] == before[0] and sum(after) == sum(before) + 6, (before, after)
        finally:
            f.engines.release()
        for opened in held:  # the stopping gateway's too: it went on to its end
            events = opened.rest()
            assert events[-1] == "[DONE]" and len(events) == 3, events
        assert victim.proc.wait(60) == 0
        assert "gateway draining" in victim.log_text()
