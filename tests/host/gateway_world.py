"""The gateway's world for tests: a data directory whose status.json files the test writes (the
worker's side of the file protocol), and a fast local OpenAI-like upstream that records what
reached it and can hold a stream until the test lets it go."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor.host.fleet.peers import Peers
from supervisor.host.gateway.app import GATEWAY, Gateway, Intervals, create_app
from supervisor.host.gateway.recording import Recorder
from supervisor.host.gateway.settings import GatewaySettings, parse
from supervisor.host.keycheck import Identity, KeyRing
from supervisor.host.page.sources import Sources
from supervisor.host.proxy.budget import BudgetSpending
from supervisor.protocol.documents import MemoryPlan, RunningEngine, Status, dump, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic
from supervisor.protocol.reads import read_desired

INFERENCE_KEY = "inference-key-" + "x" * 32
OWNER_KEY = "owner-key-" + "y" * 32


class Keys:
    """The keys module's ring as a fresh install has it: the owner and inference keys, no
    issued key (the service tests read them from files through keycheck.Verifier)."""

    def __init__(self) -> None:
        self._ring = KeyRing.build(OWNER_KEY, INFERENCE_KEY)

    def verify(self, presented: str) -> Identity | None:
        return self._ring.verify(presented, time.time())


KEYS = Keys()
AUTH = {"Authorization": f"Bearer {INFERENCE_KEY}"}
OWNER = {"Authorization": f"Bearer {OWNER_KEY}"}


def write_status(
    data: Path,
    engine: str,
    state: str,
    *,
    url: str | None = None,
    models: tuple[str, ...] = ("tiny",),
    generation: int = 0,
    message: str = "",
    checked_at: datetime | None = None,
    retrying: bool = False,
    waiting_for: str | None = None,
    memory: MemoryPlan | None = None,
    slots: dict[str, int] | None = None,
    running: RunningEngine | None = None,
    since: datetime | None = None,
    capabilities: dict[str, tuple[str, ...]] | None = None,
) -> None:
    now = utc_now()
    status = Status(
        generation=generation,
        state=state,  # type: ignore[arg-type]
        since=since or now,
        message=message or state,
        url=url if state == "running" else None,
        checked_at=checked_at or now,
        models=models,
        retrying=retrying,
        waiting_for=waiting_for,  # type: ignore[arg-type]
        memory=memory,
        slots=slots or {},
        engine=running if state == "running" else None,
        capabilities=capabilities or {},
    )
    write_atomic(ensure_dir(data / engine) / "status.json", dump(status))


def stale() -> datetime:
    return utc_now() - timedelta(seconds=61)


@dataclass
class Upstream:
    """A fast engine stand-in: streams `chunks` content chunks, then usage if asked, then
    [DONE]. With `hold` set, it stops after the first chunk until the test sets it."""

    chunks: int = 3
    hold: asyncio.Event | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)  # each body's bytes as they came
    headers: list[dict[str, str]] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # a stream that was cut off
    started: asyncio.Event = field(default_factory=asyncio.Event)
    status: int = 200
    url: str = ""
    answer_after: asyncio.Event | None = None  # an answer waits for it before its headers
    linger: asyncio.Event | None = None  # a stream's end waits for it after [DONE]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.raw.append(await request.read())
        document = json.loads(self.raw[-1])
        self.bodies.append(document)
        self.headers.append(dict(request.headers))
        self.started.set()
        if self.status != 200:
            body = {"error": {"message": "the engine refuses", "code": "engine_says_no"}}
            return web.json_response(body, status=self.status)
        usage = {
            "prompt_tokens": 5,
            "completion_tokens": self.chunks,
            "total_tokens": 5 + self.chunks,
        }
        if self.answer_after is not None:
            await self.answer_after.wait()
        if not document.get("stream"):
            answer = {
                "id": "c1",
                "object": "chat.completion",
                "created": 1,
                "model": document["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "tok" * self.chunks},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
            if self.hold is None:
                return web.json_response(answer)
            data = json.dumps(answer).encode()
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = len(data)
            await response.prepare(request)
            await response.write(data[:10])  # then holds the rest
            await self.hold.wait()
            await response.write(data[10:])
            return response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for index in range(self.chunks):
                chunk = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": document["model"],
                    "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}],
                }
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if index == 0 and self.hold is not None:
                    await self.hold.wait()
            if (document.get("stream_options") or {}).get("include_usage"):
                last = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": document["model"],
                    "choices": [],
                    "usage": usage,
                }
                await response.write(b"data: " + json.dumps(last).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            if self.linger is not None:  # as an engine may: the last event, then its end later
                await self.linger.wait()
        except (asyncio.CancelledError, ConnectionError):
            self.ended.set()
            raise
        return response


SETTINGS = """
[tiers]
fast = "tiny"
[limits]
running = 2
waiting = 4
max_wait_s = 30
load_wait_s = 60
max_tokens = 1000
"""


@dataclass
class World:
    data: Path
    upstream: Upstream
    gateway: TestServer
    engine: TestServer

    @property
    def base(self) -> str:
        return str(self.gateway.make_url("/v1"))

    @property
    def app(self) -> Gateway:
        return self.gateway.app[GATEWAY]

    def desired(self, engine: str = "small") -> Any:
        return read_desired(self.data / engine)


async def serve_upstream(up: Upstream) -> TestServer:
    """The upstream listening on a port of its own (its url set); the caller closes it."""
    engine_app = web.Application(client_max_size=32 * 1024 * 1024)  # the largest bodies pass
    engine_app.router.add_post("/v1/chat/completions", up.handle)
    engine_app.router.add_post("/v1/completions", up.handle)
    engine_app.router.add_post("/v1/embeddings", up.handle)
    engine = TestServer(engine_app, handler_cancellation=True)
    await engine.start_server()
    up.url = str(engine.make_url("")).rstrip("/")
    return engine


@asynccontextmanager
async def world(
    tmp_path: Path,
    settings: str = SETTINGS,
    upstream: Upstream | None = None,
    keys: Any = None,
    spending: BudgetSpending | None = None,
    recorder: Recorder | None = None,
    sources: Sources | None = None,
    peers: Peers | None = None,
) -> AsyncIterator[World]:
    data = tmp_path / "data"
    data.mkdir()
    up = upstream or Upstream()
    engine = await serve_upstream(up)
    app = create_app(
        parse(without_probe(settings), "test"),
        data,
        keys or KEYS,
        Intervals(keepalive_s=0.05, poll_s=0.02, idle_check_s=0.02, bounds_s=0.02),
        spending=spending,
        recorder=recorder,
        sources=sources,
        peers=peers,
    )
    gateway = TestServer(app, handler_cancellation=True)
    await gateway.start_server()
    try:
        yield World(data, up, gateway, engine)
    finally:
        await gateway.close()
        await engine.close()


def without_probe(settings: str) -> str:
    """The settings with the probe off unless they name [probe]: a test counts the requests
    its engine gets, and a probe would be one more."""
    return settings if "[probe]" in settings else settings + "\n[probe]\ninterval_s = 0\n"


def settings_of(text: str) -> GatewaySettings:
    return parse(without_probe(text), "test")


def run(
    tmp_path: Path,
    scenario: Callable[[World], Awaitable[None]],
    settings: str = SETTINGS,
    upstream: Upstream | None = None,
) -> None:
    """The scenario against a gateway in front of `upstream` (a new Upstream if none)."""

    async def main() -> None:
        async with world(tmp_path, settings, upstream or Upstream()) as w:
            await scenario(w)

    asyncio.run(main())


async def until(check: Callable[[], bool]) -> None:
    """Wait for `check` to hold, at most 30 s."""
    async with asyncio.timeout(30):
        while not check():
            await asyncio.sleep(0.01)
