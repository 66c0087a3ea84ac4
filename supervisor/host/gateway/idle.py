"""Idle stop (off by default): an engine the gateway started is stopped when nothing uses it.

It is stopped once nothing has run or waited on it for the configured time. Never an engine an
operator started: the gateway stops only while desired.json still holds the very generation of
`running` it wrote itself.
Requests in flight finish first: an engine with a request running or waiting is never idle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from aiohttp import web

from supervisor import logs
from supervisor.host.gateway.admission import Gate
from supervisor.host.gateway.starter import Starter
from supervisor.host.protocol import engine_dir, load_status, read_desired, request
from supervisor.protocol.documents import DesiredFile, Status

CHECK_S: Final = 1.0
log = logs.get("gateway")


@dataclass(frozen=True)
class Look:
    """What idle stop reads of one engine the gateway started."""

    ours: int  # the generation of `running` the gateway wrote
    desired: DesiredFile | None
    status: Status | None
    busy: bool
    idle_s: float


def should_stop(look: Look, stop_after_s: float) -> bool:
    """Pure: stop it now? Only the gateway's own start, serving, unused for long enough."""
    desired, status = look.desired, look.status
    return (
        stop_after_s > 0
        and desired is not None
        and (desired.generation, desired.desired) == (look.ours, "running")
        and status is not None
        and status.state == "running"
        and not look.busy
        and look.idle_s >= stop_after_s
    )


def still_ours(ours: int, desired: DesiredFile | None) -> bool:
    """Pure: desired.json still says the gateway's own request."""
    return desired is not None and (desired.generation, desired.desired) == (ours, "running")


class IdleStop:
    def __init__(
        self,
        data_dir: Path,
        starter: Starter,
        gate: Callable[[str], Gate],
        stop_after_s: float,
        check_s: float = CHECK_S,
    ) -> None:
        self.data_dir = data_dir
        self.starter = starter
        self.gate = gate
        self.stop_after_s = stop_after_s
        self.check_s = check_s
        self.stopping: set[str] = set()  # stopped here: its url is not used until a new start
        self.stopped = 0
        self.checks = 0  # rounds of looks, for tests that wait on them

    async def task(self, _: web.Application) -> AsyncIterator[None]:
        """The app's cleanup context: the checks run while the app does (when enabled)."""
        runner = asyncio.create_task(self.run()) if self.stop_after_s > 0 else None
        try:
            yield
        finally:
            if runner is not None:
                runner.cancel()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.check_s)
            for engine, ours in list(self.starter.started.items()):
                self.check(engine, ours)
            self.checks += 1

    def check(self, engine: str, ours: int) -> None:
        """One look, and the stop when it is due. Synchronous on the loop: no request is
        admitted between the look and the write (both are small file operations)."""
        directory = engine_dir(self.data_dir, engine)
        desired = read_desired(directory)
        if not still_ours(ours, desired):
            self.starter.started.pop(engine, None)  # someone else asked since: not ours
            return
        gate = self.gate(engine)
        look = Look(ours, desired, load_status(directory), gate.busy,
                    time.monotonic() - gate.last_used)  # fmt: skip
        if not should_stop(look, self.stop_after_s):
            return
        generation = request(self.data_dir, engine, "stopped")
        self.starter.started.pop(engine, None)
        self.stopping.add(engine)
        self.stopped += 1
        log.info("idle engine stopped", engine=engine, generation=generation,
                 idle_s=round(look.idle_s, 1))  # fmt: skip
