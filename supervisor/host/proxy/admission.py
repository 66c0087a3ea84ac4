"""Admission per engine (the RFC's): how many run at once, how many wait, and for how long.

Beyond either bound a request is refused at once with 429 and Retry-After; a wait that runs
out is refused the same way. The bound holds for every request, loaded engine or not: a
request held while its engine starts counts as waiting too. Slots pass in arrival order.

One key's share of the waiting places is bounded too (`per_key_waiting`): a key that already
has that many requests waiting for the engine is refused (429 `key_busy`) rather than take the
rest of the queue, so a backfill of hundreds of generations leaves room for a person's. What
runs is not counted: a key may have every free slot, and only its waiting is bounded. The
engine's own waiting bound holds beside it, whatever the keys. A waiting request that ends (its
client gone, its wait run out, its start failed) gives its key's place back.

The running bound follows the engine (the gateway settings' running_bound): an engine started
on demand publishes its slots once it runs, so a gate is given new limits as they change
(`follow`). A higher bound hands its new slots to the waiters first in line at once; a lower
one lets the running requests finish and starts none until fewer run than it allows.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final, Generic, Literal, TypeVar

from supervisor.host.web.refusal import Refusal

Verdict = Literal["run", "wait", "refuse", "key_busy"]
RETRY_AFTER_S: Final = 1
T = TypeVar("T")


@dataclass(frozen=True)
class Admission:
    """One engine's resolved admission limits."""

    running: int
    waiting: int
    max_wait_s: float
    deadline_s: float
    per_key_waiting: int  # of the waiting, at most this many of one key


def decide(running: int, waiting: int, key_waiting: int, limits: Admission) -> Verdict:
    """Pure: what a new request gets, `key_waiting` of the `waiting` being its own key's. It
    runs only when a slot is free and nobody waits; else it waits while its key has less than
    its share of the waiting and the queue has room. A key at its share is told so (key_busy)
    even when the queue is full too: slowing down is what it can do about it."""
    if running < limits.running and waiting == 0:
        return "run"
    if key_waiting >= limits.per_key_waiting:
        return "key_busy"
    if waiting < limits.waiting:
        return "wait"
    return "refuse"


def too_busy(engine: str, running: int, waiting: int, waited: float, why: str) -> Refusal:
    retry = max(RETRY_AFTER_S, math.ceil(waited)) if why == "waited too long" else RETRY_AFTER_S
    return Refusal(
        429,
        "engine_busy",
        f"engine {engine} is busy: {why} ({running} running, {waiting} waiting)",
        headers={"Retry-After": str(retry)},
        details={
            "engine": engine,
            "running": running,
            "waiting": waiting,
            "waited_s": round(waited, 3),
        },
    )


def key_busy(engine: str, key_id: str, key_waiting: int, gate: Gate) -> Refusal:
    share = gate.limits.per_key_waiting
    return Refusal(
        429,
        "key_busy",
        f"key {key_id} already has {key_waiting} requests waiting for engine {engine}, the "
        f"most one key may (per_key_waiting {share}; {gate.running} running, {gate.waiting} "
        "waiting in all): send fewer at once",
        headers={"Retry-After": str(RETRY_AFTER_S)},
        details={
            "engine": engine,
            "key_id": key_id,
            "key_waiting": key_waiting,
            "per_key_waiting": share,
            "running": gate.running,
            "waiting": gate.waiting,
        },
    )


@dataclass(frozen=True)
class Admitted(Generic[T]):
    """A slot taken: how long it was waited for, and what the awaited `before` gave."""

    waited_s: float
    before: T | None = None


class Gate:
    """One engine's slots. `slot()` holds one for the body of an `async with`."""

    def __init__(self, engine: str, limits: Admission) -> None:
        self.engine = engine
        self.limits = limits
        self.running = 0
        self.waiting = 0
        self.last_used = time.monotonic()  # when a request last came or went (idle stop)
        self._queue: deque[asyncio.Future[None]] = deque()
        self._key_waiting: dict[str, int] = {}  # each key's requests among the waiting

    def key_waiting(self, key: str | None) -> int:
        """How many of the waiting requests are this key's (None: a caller with no key)."""
        return self._key_waiting.get(key, 0) if key is not None else 0

    @property
    def busy(self) -> bool:
        return self.running > 0 or self.waiting > 0

    def follow(self, limits: Admission) -> None:
        """Take these limits from now on: new slots of a higher bound go to the first waiters
        at once; a lower bound takes effect as running requests finish (`_release`)."""
        self.limits = limits
        while self.running < limits.running and self._queue:
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)
                self.running += 1

    @asynccontextmanager
    async def slot(
        self, before: Callable[[], Awaitable[T]] | None = None, *, key: str | None = None
    ) -> AsyncIterator[Admitted[T]]:
        """A running slot for a request of `key` (the caller's key id, whose share of the
        waiting is bounded; None: no share). `before` (a start on demand) is awaited first, as
        a waiter; its own time does not count against the wait, which starts when it is done.
        What it gives comes with the slot (`Admitted.before`)."""
        began = self.last_used = time.monotonic()
        mine = self.key_waiting(key)
        verdict = decide(self.running, self.waiting, mine, self.limits)
        if verdict == "refuse":
            raise too_busy(self.engine, self.running, self.waiting, 0.0, "the queue is full")
        if verdict == "key_busy":
            raise key_busy(self.engine, key or "", mine, self)
        given: T | None = None
        if verdict == "run" and before is None:
            self.running += 1
        else:
            self.waiting += 1
            self._count(key, 1)
            try:
                if before is not None:
                    given = await before()
                await self._wait_for_slot(began)
            finally:
                self.waiting -= 1
                self._count(key, -1)
        try:
            yield Admitted(time.monotonic() - began, given)
        finally:
            self.last_used = time.monotonic()
            self._release()

    def _count(self, key: str | None, change: int) -> None:
        if key is None:
            return
        now = self._key_waiting.get(key, 0) + change
        if now > 0:
            self._key_waiting[key] = now
        else:
            self._key_waiting.pop(key, None)  # no key is kept once it waits no more

    async def _wait_for_slot(self, began: float) -> None:
        if self.running < self.limits.running and not self._queue:
            self.running += 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.limits.max_wait_s)
        except TimeoutError:
            if turn.done():  # handed a slot just as the wait ran out: take it
                return
            self._queue.remove(turn)
            waited = time.monotonic() - began
            raise too_busy(
                self.engine, self.running, self.waiting - 1, waited, "waited too long"
            ) from None
        except asyncio.CancelledError:
            if turn.done():  # a slot was handed over: pass it on
                self._release()
            else:
                self._queue.remove(turn)
            raise

    def _release(self) -> None:
        """A slot passes to the first waiter, or becomes free; beyond a bound that fell since
        it was taken, it becomes free."""
        while self._queue and self.running <= self.limits.running:
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1
