"""Start on demand: one request for `running` per start, shared by every caller waiting on it.

Only an engine no operator stopped is started: one nobody asked to stop, or one the gateway
stopped itself (idle stop, a swap). An operator's stop (the CLI, the host API, the page; and a
`stopped` of an older host, which names no requester) stands until an operator starts the
engine again: a request for it is answered 503 `model_not_loaded` naming who stopped it and
when, also while that stop is still in progress. The gateway writes `running` only on the
request it read when it decided (`request(..., only_if=...)`), so an operator's request made
in between is never overwritten: the start is planned again on it.

The start is a task of its own: a caller that goes away (a client that disconnects) stops
waiting, never the start. The task reads status.json until it answers the generation it asked
for; `failed` (which is also how the worker says a start waits for memory), `stopped`, or a
worker whose heartbeat is older than 60 s end it with 503 `model_not_loaded` and the worker's
message, and so does the load wait running out. A new request on file meanwhile (an operator's
stop or start) is planned again. With swap on (`free` set), a start the worker says waits for
memory first has an unused engine the gateway started stopped, then is asked for again, so the
worker tries at once rather than after its back-off.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Literal

from aiohttp import web

from supervisor.host.protocol import Superseded, classify, request
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import DesiredFile, Status, utc_now
from supervisor.protocol.layout import engine_dir
from supervisor.protocol.reads import load_status, read_desired

POLL_S: Final = 0.25

Step = Literal["ready", "request", "follow", "stopped", "unavailable"]


@dataclass(frozen=True)
class Plan:
    step: Step
    generation: int = 0  # "follow": the request already written; "stopped": the operator's
    reason: str = ""
    url: str = ""  # "ready": where it serves


def plan(desired: DesiredFile | None, status: Status | None, now: datetime) -> Plan:
    """Pure: what a start needs, from the request on file and the worker's answer."""
    if desired is not None and desired.operator_stop:
        return Plan("stopped", desired.generation, "stopped by an operator")
    reading = classify(status, status.generation if status else 0, now)
    if reading.answer == "unavailable":
        return Plan("unavailable", reason=reading.reason)
    assert status is not None
    if (
        status.state == "running"
        and status.url
        and (desired is None or desired.desired == "running")
    ):
        return Plan("ready", url=status.url)
    if (
        desired is not None
        and desired.desired == "running"
        and desired.generation >= status.generation
        and not (desired.generation == status.generation and status.state in ("failed", "stopped"))
    ):
        return Plan("follow", generation=desired.generation)
    return Plan("request")


def not_loaded(engine: str, reason: str, details: dict[str, Any] | None = None) -> Refusal:
    return Refusal(
        503, "model_not_loaded", f"engine {engine} is not loaded: {reason}", details=details
    )


def operator_stop(engine: str, desired: DesiredFile) -> Refusal:
    """503 for an engine an operator stopped: who stopped it and when, and the way on; the
    same in `stoppedBy` (`requestedBy` is `operator` for an older host's stop too)."""
    said = desired.model_dump(mode="json", by_alias=True)
    who = "an operator" if desired.requested_by else "an operator (an older host's request)"
    when = f"at {said['requestedAt']}" if desired.requested_at else "at a time not recorded"
    return not_loaded(
        engine,
        f"stopped by {who} {when} (generation {desired.generation}); it is not started on "
        f"demand until an operator starts it: lucia-supervisor request {engine} running, "
        f"Start on the page, or POST /api/host/engines/{engine}",
        {
            "stoppedBy": {
                "requestedBy": "operator",
                "requestedAt": said.get("requestedAt"),
                "generation": desired.generation,
            }
        },
    )


class Starter:
    def __init__(self, data_dir: Path, load_wait_s: float, poll_s: float = POLL_S) -> None:
        self.data_dir = data_dir
        self.load_wait_s = load_wait_s
        self.poll_s = poll_s
        self._starts: dict[str, asyncio.Task[str]] = {}
        self.requests_written = 0
        # engine -> the generation of `running` the gateway wrote: its own starts, which idle
        # stop may end; a later request by anyone else (a new generation) makes it not ours
        self.started: dict[str, int] = {}
        # swap: stop an unused engine of the gateway's for this one, given the deadline
        self.free: Callable[[str, float], Awaitable[bool]] | None = None

    async def ready(self, engine: str) -> str:
        """The engine's url once it serves; the caller may be cancelled, the start goes on."""
        task = self._starts.get(engine)
        if task is None:
            task = asyncio.create_task(self._start(engine), name=f"start {engine}")
            self._starts[engine] = task
            task.add_done_callback(lambda _: self._starts.pop(engine, None))
        return await asyncio.shield(task)

    async def ready_telling(
        self, engine: str, sse: web.StreamResponse | None, every_s: float
    ) -> str:
        """`ready`, a client's stream (if any) told this often that its engine is starting."""
        waiting = asyncio.ensure_future(self.ready(engine))
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=every_s)
                if done:
                    return waiting.result()
                if sse is not None:
                    await sse.write(f": starting engine {engine}\n\n".encode())
        finally:
            waiting.cancel()  # only this caller's wait: the start is shielded

    async def _start(self, engine: str) -> str:
        directory = engine_dir(self.data_dir, engine)
        deadline = time.monotonic() + self.load_wait_s
        while True:
            desired, status = read_desired(directory), load_status(directory)
            step = plan(desired, status, utc_now())
            if step.step == "stopped":
                assert desired is not None
                raise operator_stop(engine, desired)
            if step.step == "unavailable":
                raise not_loaded(engine, step.reason)
            if step.step == "ready":
                return step.url
            if time.monotonic() >= deadline:
                raise self._too_long(engine, status)
            generation = step.generation
            if step.step == "request":
                try:
                    generation = await self._request(engine, desired)
                except Superseded:
                    continue  # someone asked since: planned again on what they asked
            url = await self._follow(engine, generation, deadline)
            if url is not None:
                return url

    async def _follow(self, engine: str, generation: int, deadline: float) -> str | None:
        """Where the engine serves once the worker answers `generation` with `running`; None
        once another request is on file (the start is planned again on it)."""
        directory = engine_dir(self.data_dir, engine)
        while True:
            desired = read_desired(directory)
            if desired is None or desired.generation != generation:
                return None
            status = load_status(directory)
            reading = classify(status, generation, utc_now())
            if reading.answer == "unavailable":
                raise not_loaded(engine, reading.reason)
            if reading.answer == "current" and status is not None:
                if status.state == "running" and status.url:
                    return status.url
                if (
                    status.waiting_for == "memory"
                    and self.free is not None
                    and await self.free(engine, deadline)
                ):
                    try:
                        generation = await self._request(engine, desired)
                    except Superseded:
                        return None
                    continue
                if status.state in ("failed", "stopped", "stopping"):
                    raise not_loaded(engine, f"{status.state}: {status.message}")
            if time.monotonic() >= deadline:
                raise self._too_long(engine, status)
            await asyncio.sleep(self.poll_s)

    def _too_long(self, engine: str, status: Status | None) -> Refusal:
        return not_loaded(
            engine,
            f"not ready within the load wait of {self.load_wait_s:g} s"
            + (f"; the worker says: {status.message}" if status else ""),
        )

    async def _request(self, engine: str, seen: DesiredFile | None) -> int:
        """`running`, as the gateway, only while desired.json still says what it read."""
        generation = await asyncio.to_thread(
            request,
            self.data_dir,
            engine,
            "running",
            "gateway",
            only_if=lambda current: current == seen,
        )
        self.requests_written += 1
        self.started[engine] = generation
        return generation
