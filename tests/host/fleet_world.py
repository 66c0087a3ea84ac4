"""Two machines of a fleet on loopback: gateways `a` and `b` as real processes, each with its own
data directory and the host tests' fast engine behind it, one PostgreSQL record, one peers file.

The engines (gateway_world.Upstream) are served from an event loop in a thread of their own, so
that a test may block on a gateway while the gateway's engine answers. A test that holds an
engine's stream sets its `hold` and lets it go through `Fleet.engines.call`.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import secrets
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor.host.fleet.forward import Peer, PeerClient
from supervisor.host.fleet.peers import Peers
from supervisor.host.keycheck import Identity
from supervisor.host.proxy.body import FORWARDED
from supervisor.host.web.refusal import Refusal
from supervisor.host.web.responses import refusal_response
from tests.gateway_proc import Gateway, running_gateway
from tests.host.gateway_world import Upstream, serve_upstream, write_status
from tests.postgres import Cluster
from tests.record_world import until
from tests.standin import free_port

MACHINES = ("a", "b", "c")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


class EngineLoop:
    """Engines served from a thread's event loop of their own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[TestServer] = []

    def serve(self, upstream: Upstream) -> Upstream:
        future = asyncio.run_coroutine_threadsafe(serve_upstream(upstream), self.loop)
        self.servers.append(future.result(30))
        return upstream

    def call(self, action: Callable[[], object]) -> None:
        self.loop.call_soon_threadsafe(action)

    def close(self) -> None:
        for server in self.servers:
            asyncio.run_coroutine_threadsafe(server.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def peers_text(keys: dict[str, str]) -> str:
    return "# the fleet's peer keys\n" + "".join(f"{m} {k}\n" for m, k in keys.items())


def write_peers(path: Path, keys: dict[str, str]) -> None:
    path.write_text(peers_text(keys))
    path.chmod(0o600)


def fleet_settings(machine: str, port: int, dsn: str, peers: Path, extra: str = "") -> str:
    return (
        f'[record]\ndsn = "{dsn}"\n'
        f'[fleet]\nmachine = "{machine}"\nadvertise = "http://127.0.0.1:{port}"\n'
        f'peers_file = "{peers}"\n'
        "[budget]\ndaily_tokens = 1000\n"
        "[limits]\nrunning = 4\nwaiting = 8\nload_wait_s = 60\n" + extra
    )


@contextlib.contextmanager
def machine_gateway(
    work: Path, name: str, dsn: str, peers: Path, upstream: Upstream
) -> Iterator[Gateway]:
    """Machine `name`'s gateway over a data directory of its own, its engine `small`."""
    data = work / f"data-{name}"
    data.mkdir(parents=True)
    write_status(data, "small", "running", url=upstream.url)
    port = free_port()
    settings = fleet_settings(name, port, dsn, peers)
    with running_gateway(work / f"gateway-{name}", data, settings, port=port) as gateway:
        yield gateway


@dataclass
class Fleet:
    dsn: str
    peers_file: Path
    keys: dict[str, str]  # machine -> its peer key
    engines: EngineLoop
    upstreams: dict[str, Upstream]
    gateways: dict[str, Gateway]

    def fresh(self) -> None:
        """The engines' status as their workers write it: fresh again (60 s: stale)."""
        for name, gateway in self.gateways.items():
            write_status(gateway.data_dir, "small", "running", url=self.upstreams[name].url)

    def rows(self, key_id: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            found = conn.execute(
                "SELECT machine, outcome, engine, model FROM generations WHERE key_id = %s "
                "ORDER BY at_us",
                (key_id,),
            )
            return list(found.fetchall())

    def recorded(self, key_id: str, count: int = 1) -> list[tuple[Any, ...]]:
        """The key's rows once `count` are committed (the writer's bound: a second)."""
        return until(lambda: len(self.rows(key_id)) >= count and self.rows(key_id), 30, "rows")

    def reset(self) -> None:
        for upstream in self.upstreams.values():
            if upstream.hold is not None:
                self.engines.call(upstream.hold.set)
            upstream.hold = None
            upstream.ended = asyncio.Event()
            upstream.started = asyncio.Event()


def new_key_id() -> str:
    return f"key_{secrets.token_hex(6)}"


def peer_headers(
    key: str | None, machine: str | None, key_id: str | None, **more: str
) -> dict[str, str]:
    headers = {"Content-Type": "application/json", **more}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if machine is not None:
        headers["X-Lucia-Machine"] = machine
    if key_id is not None:
        headers["X-Lucia-Key-Id"] = key_id
    return headers


def post(
    url: str, path: str, headers: dict[str, str], body: dict[str, Any] | None = None
) -> tuple[int, Any]:
    """A POST's status and its JSON (or text) body, over a connection of its own to the host
    and port of `url` (http://ADDRESS:PORT: loopback, or a machine's address)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", path, body=json.dumps(body or CHAT), headers=headers)
        answer = connection.getresponse()
        raw = answer.read()
    finally:
        connection.close()
    try:
        return answer.status, json.loads(raw)
    except ValueError:
        return answer.status, raw.decode(errors="replace")


@contextlib.asynccontextmanager
async def origin(
    peers_file: Path,
    peer: Peer,
    caller: Identity,
    deadline_s: float = 60,
    tls: ssl.SSLContext | None = None,
) -> AsyncIterator[str]:
    """Machine a's side: a small app that sends every request to `peer` as `caller`'s (the
    forwarding client, as a gateway will use it); its URL."""
    client = PeerClient(Peers.open(peers_file, "a"), tls)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:  # as the gateway's guard answers a refusal
            return await client.send(request, body, peer=peer, caller=caller, deadline_s=deadline_s)
        except Refusal as refusal:
            return refusal_response(refusal)

    app = web.Application()
    for path in FORWARDED:
        app.router.add_post(path, handle)
    app.cleanup_ctx.append(client.session)
    server = TestServer(app, handler_cancellation=True)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@contextlib.contextmanager
def two_machines(postgres: Cluster, work: Path) -> Iterator[Fleet]:
    """Machines a and b, each its gateway and engine; the peers file names a, b and c."""
    keys = {name: secrets.token_urlsafe(32) for name in MACHINES}
    peers = work / "peers.keys"
    write_peers(peers, keys)
    dsn = postgres.database()
    engines = EngineLoop()
    try:
        upstreams = {name: engines.serve(Upstream()) for name in ("a", "b")}
        with (
            machine_gateway(work, "a", dsn, peers, upstreams["a"]) as a,
            machine_gateway(work, "b", dsn, peers, upstreams["b"]) as b,
        ):
            yield Fleet(dsn, peers, keys, engines, upstreams, {"a": a, "b": b})
    finally:
        engines.close()


@pytest.fixture(scope="module")
def fleet(postgres: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Machines a and b, for a module's tests (two_machines)."""
    with two_machines(postgres, tmp_path_factory.mktemp("fleet")) as made:
        yield made


@pytest.fixture(autouse=True)
def fresh(fleet: Fleet) -> Iterator[None]:
    """Each test of a module that imports it: the engines fresh, their holds let go after."""
    fleet.fresh()
    yield
    fleet.reset()
