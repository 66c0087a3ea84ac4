"""Idle stop and swap (both off by default): the gateway stops engines it started, unused.

Idle stop: once nothing has run or waited on one for the configured time. Swap: when a start
the gateway waits on is blocked for memory (the worker's `waitingFor: memory`), the engine it
started that has been unused longest is stopped first, and the start is asked for again once
that engine has stopped. Never an engine an operator started: the gateway stops only while
desired.json still holds the very generation of `running` it wrote itself, checked again under
the request lock as it writes. Its stops say `requestedBy: gateway`, so a later request may
start the engine on demand again (an operator's stop may not be undone so). Requests in flight
finish first: an engine with a request running or waiting is never stopped, and the look and
the write happen with no await between them, so nothing is admitted in between.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from aiohttp import web

from supervisor import logs
from supervisor.host.protocol import Superseded, request
from supervisor.host.proxy.admission import Gate
from supervisor.host.proxy.starter import Starter
from supervisor.protocol.documents import DesiredFile, Status
from supervisor.protocol.layout import engine_dir
from supervisor.protocol.reads import load_status, read_desired

CHECK_S: Final = 1.0
log = logs.get("gateway")


@dataclass(frozen=True)
class IdleLook:
    """What idle stop reads of one engine the gateway started."""

    ours: int  # the generation of `running` the gateway wrote
    desired: DesiredFile | None
    status: Status | None
    busy: bool
    idle_s: float
    engine: str = ""


def stoppable(look: IdleLook) -> bool:
    """Pure: the gateway's own start, serving, with nothing running or waiting on it."""
    desired, status = look.desired, look.status
    return (
        desired is not None
        and (desired.generation, desired.desired) == (look.ours, "running")
        and status is not None
        and status.state == "running"
        and not look.busy
    )


def should_stop(look: IdleLook, stop_after_s: float) -> bool:
    """Pure: stop it now? Only the gateway's own start, serving, unused for long enough."""
    return stop_after_s > 0 and stoppable(look) and look.idle_s >= stop_after_s


def victim(looks: Iterable[IdleLook], blocked: str) -> IdleLook | None:
    """Pure: the engine a swap stops for `blocked`: stoppable, unused longest; None: none."""
    found = [look for look in looks if look.engine != blocked and stoppable(look)]
    return max(found, key=lambda look: look.idle_s, default=None)


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
        *,
        check_s: float = CHECK_S,
        swap: bool = False,
    ) -> None:
        self.data_dir = data_dir
        self.starter = starter
        self.gate = gate
        self.stop_after_s = stop_after_s
        self.check_s = check_s
        self.stopping: set[str] = set()  # stopped here: its url is not used until a new start
        self.stopped = 0
        self.swapped = 0
        self.checks = 0  # rounds of looks, for tests that wait on them
        self._swapping = asyncio.Lock()  # one swap at a time: two blocked starts never trade
        if swap:
            starter.free = self.free

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

    def look(self, engine: str, ours: int) -> IdleLook | None:
        """What the engine is now; None (and forgotten) once someone else has asked since."""
        directory = engine_dir(self.data_dir, engine)
        desired = read_desired(directory)
        if not still_ours(ours, desired):
            self.starter.started.pop(engine, None)  # someone else asked since: not ours
            return None
        gate = self.gate(engine)
        return IdleLook(
            ours,
            desired,
            load_status(directory),
            gate.busy,
            time.monotonic() - gate.last_used,
            engine,
        )

    def check(self, engine: str, ours: int) -> None:
        """One look, and the stop when it is due. Synchronous on the loop: no request is
        admitted between the look and the write (both are small file operations)."""
        look = self.look(engine, ours)
        if look is not None and should_stop(look, self.stop_after_s):
            generation = self._stop(engine, ours)
            if generation is not None:
                log.info(
                    "idle engine stopped",
                    engine=engine,
                    generation=generation,
                    idle_s=round(look.idle_s, 1),
                )

    def _stop(self, engine: str, ours: int) -> int | None:
        """`stopped`, as the gateway, while desired.json still says its own `running`; None
        (and the engine no longer the gateway's) when someone asked since."""
        try:
            generation = request(
                self.data_dir,
                engine,
                "stopped",
                "gateway",
                only_if=lambda current: still_ours(ours, current),
            )
        except Superseded:
            self.starter.started.pop(engine, None)
            return None
        self.starter.started.pop(engine, None)
        self.stopping.add(engine)
        self.stopped += 1
        return generation

    async def free(self, blocked: str, deadline: float) -> bool:
        """Swap: stop the unused engine the gateway started for `blocked`, and wait until its
        worker says it stopped (so its memory is free). False: there was none to stop, or it
        did not stop before the deadline (the monotonic clock)."""
        async with self._swapping:
            looks = [self.look(engine, ours) for engine, ours in list(self.starter.started.items())]
            chosen = victim([look for look in looks if look is not None], blocked)
            if chosen is None:
                return False
            generation = self._stop(chosen.engine, chosen.ours)
            if generation is None:
                return False
            self.swapped += 1
            log.info(
                "engine stopped for a start waiting for memory",
                engine=chosen.engine,
                generation=generation,
                start=blocked,
            )
            directory = engine_dir(self.data_dir, chosen.engine)
            while time.monotonic() < deadline:
                status = load_status(directory)
                if status is not None and status.generation >= generation:
                    if status.state == "stopped":
                        return True
                    if status.state == "failed":
                        return False
                await asyncio.sleep(self.starter.poll_s)
            return False
