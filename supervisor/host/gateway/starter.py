"""Start on demand: one request for `running` per start, shared by every caller waiting on it.

The start is a task of its own: a caller that goes away (a client that disconnects) stops
waiting, never the start. The task reads status.json until it answers the generation it asked
for; `failed` (which is also how the worker says a start waits for memory), `stopped`, or a
worker whose heartbeat is older than 60 s end it with 503 `model_not_loaded` and the worker's
message, and so does the load wait running out. With swap on (`free` set), a start the worker
says waits for memory first has an unused engine the gateway started stopped, then is asked for
again, so the worker tries at once rather than after its back-off.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final, Literal

from supervisor.host.gateway.refusal import Refusal
from supervisor.host.protocol import classify, engine_dir, load_status, read_desired, request
from supervisor.protocol.documents import DesiredFile, Status, utc_now

POLL_S: Final = 0.25

Step = Literal["ready", "request", "follow", "unavailable"]


@dataclass(frozen=True)
class Plan:
    step: Step
    generation: int = 0  # "follow": the request already written
    reason: str = ""


def plan(desired: DesiredFile | None, status: Status | None, now: datetime) -> Plan:
    """Pure: what a start needs, from the request on file and the worker's answer."""
    reading = classify(status, status.generation if status else 0, now)
    if reading.answer == "unavailable":
        return Plan("unavailable", reason=reading.reason)
    assert status is not None
    if (
        status.state == "running"
        and status.url
        and (desired is None or desired.desired == "running")
    ):
        return Plan("ready")
    if (
        desired is not None
        and desired.desired == "running"
        and desired.generation >= status.generation
        and not (desired.generation == status.generation and status.state in ("failed", "stopped"))
    ):
        return Plan("follow", generation=desired.generation)
    return Plan("request")


def not_loaded(engine: str, reason: str) -> Refusal:
    return Refusal(503, "model_not_loaded", f"engine {engine} is not loaded: {reason}")


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

    async def _start(self, engine: str) -> str:
        directory = engine_dir(self.data_dir, engine)
        deadline = time.monotonic() + self.load_wait_s
        status = load_status(directory)
        step = plan(read_desired(directory), status, utc_now())
        if step.step == "unavailable":
            raise not_loaded(engine, step.reason)
        if step.step == "ready" and status is not None and status.url:
            return status.url
        generation = step.generation
        if step.step == "request":
            generation = await self._request(engine)
        while True:
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
                    generation = await self._request(engine)
                    continue
                if status.state in ("failed", "stopped", "stopping"):
                    raise not_loaded(engine, f"{status.state}: {status.message}")
            if time.monotonic() >= deadline:
                raise not_loaded(
                    engine,
                    f"not ready within the load wait of {self.load_wait_s:g} s"
                    + (f"; the worker says: {status.message}" if status else ""),
                )
            await asyncio.sleep(self.poll_s)

    async def _request(self, engine: str) -> int:
        generation = await asyncio.to_thread(request, self.data_dir, engine, "running")
        self.requests_written += 1
        self.started[engine] = generation
        return generation
