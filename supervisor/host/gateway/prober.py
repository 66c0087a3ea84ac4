"""The probe's effect: a one-token request to each serving engine's models on a schedule.

What to probe and what an answer means are probe.py's pure decisions; this module sends the
requests, times each to its answer's first byte, and keeps the marks (`degraded`), the
metrics and a record row per probe, of the caller `probe` (a key id no key has: nobody can
present it, and no budget is kept for it; its rows are charged as any other's, under its own
id). A probe goes straight to its engine, beside admission: it holds no slot, and is sent only
while the engine has one free and nobody waits (probe.targets). Every wait is a sleep of the
probe's task or a request's timeout, so the gateway's stop cancels both at once; a probe cut
off by the stop is neither marked nor recorded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Collection
from datetime import datetime
from typing import Any, Final

import aiohttp
from aiohttp import web

from supervisor import logs
from supervisor.host.gateway.recording import Recorder, build_of
from supervisor.host.proxy import probe
from supervisor.host.proxy.catalog import Catalog, CatalogEntry
from supervisor.host.proxy.metrics import GatewayMetrics, build_label
from supervisor.host.proxy.usage import Counts
from supervisor.host.record.row import PROBE_KEY_ID, Row, RowRefused, tokens_of
from supervisor.protocol.documents import utc_now
from supervisor.protocol.names import kept

TICK_S: Final = 1.0  # how often due probes are looked for (at most the interval)
ANSWER_BYTES: Final = 1024 * 1024  # of a probe's answer read; a one-token answer is < 4 KiB
log = logs.get("gateway")

Marks = dict[tuple[str, str], probe.Mark]


class Prober:
    """Probes the serving engines every `interval_s` (0: never) while the app runs."""

    def __init__(
        self,
        catalog: Catalog,
        metrics: GatewayMetrics,
        *,
        interval_s: float,
        timeout_s: float,
        free: Callable[[CatalogEntry], bool],
        stopping: Collection[str],
        recorder: Recorder | None = None,
    ) -> None:
        self.catalog = catalog
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.free = free
        self.stopping = stopping
        self.recorder = recorder
        self.marks: Marks = {}
        self.last: dict[tuple[str, str], probe.Last] = {}
        self.inflight: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.ended = 0  # probes that ended (answered or not), for tests that wait on them
        self.looks = 0  # rounds of looks for due probes, likewise
        self._session: aiohttp.ClientSession | None = None

    def health(self, engine: CatalogEntry) -> dict[str, probe.Mark]:
        """The marks that hold for the engine now, by model (probe.current)."""
        found: dict[str, probe.Mark] = {}
        for model in engine.models:
            mark = probe.current(self.marks.get((engine.name, model)), engine.status)
            if mark is not None:
                found[model] = mark
        return found

    def shown(self, engine: CatalogEntry) -> dict[str, Any]:
        """What the probe says of the engine now, for the host API: `degraded` when a model's
        last conclusive probe failed, and each probed model's mark."""
        marks = self.health(engine)
        return {
            "degraded": any(mark.degraded for mark in marks.values()),
            "models": {model: mark.shown() for model, mark in sorted(marks.items())},
        }

    def degraded(self) -> dict[tuple[str, str], bool]:
        """(engine, model) -> degraded, for the metrics: the marks of serving engines."""
        found: dict[tuple[str, str], bool] = {}
        for engine in self.catalog.engines():
            for model, mark in self.health(engine).items():
                found[(engine.name, model)] = mark.degraded
        return found

    async def task(self, _: web.Application) -> AsyncIterator[None]:
        """The app's cleanup context: the probes run while the app does (when enabled)."""
        if self.interval_s <= 0:
            yield
            return
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(force_close=True),  # a probe dials as a client would
        )
        runner = asyncio.create_task(self.run(), name="probe engines")
        try:
            yield
        finally:
            runner.cancel()
            for task in list(self.inflight.values()):
                task.cancel()
            await asyncio.gather(runner, *self.inflight.values(), return_exceptions=True)
            await self._session.close()

    async def run(self) -> None:
        tick = min(TICK_S, self.interval_s)
        while True:
            self.launch(asyncio.get_running_loop().time())
            self.looks += 1
            await asyncio.sleep(tick)

    def launch(self, now: float) -> None:
        """Start a probe of each target due now (probe.targets)."""
        for target in probe.targets(
            self.catalog.engines(),
            Catalog.now(),
            now,
            last=self.last,
            interval_s=self.interval_s,
            busy=self.inflight.keys(),
            stopping=self.stopping,
            free=self.free,
        ):
            key = (target.engine, target.model)
            self.last[key] = probe.Last(now, target.run)
            task = asyncio.create_task(self.send(target), name=f"probe {target.engine}")
            self.inflight[key] = task
            task.add_done_callback(lambda _, key=key: self.inflight.pop(key, None))  # type: ignore[misc]

    async def send(self, target: probe.ProbeTarget) -> None:
        """One probe, its mark, its metrics and its row."""
        assert self._session is not None
        loop = asyncio.get_running_loop()
        at, began = utc_now(), loop.time()
        first: float | None = None
        usage: dict[str, Any] | None = None
        try:
            async with self._session.post(
                target.url + probe.PATH, json=probe.body(target.model)
            ) as answer:
                first = loop.time()
                raw = await answer.content.read(ANSWER_BYTES)
                document = _document(raw)
                usage = document.get("usage") if isinstance(document.get("usage"), dict) else None
                choices = document.get("choices")
                found = probe.ProbeAnswer(
                    "answered", answer.status, len(choices) if isinstance(choices, list) else 0
                )
        except TimeoutError:
            found = probe.ProbeAnswer("timed_out")
        except aiohttp.ClientConnectorError:
            found = probe.ProbeAnswer("unreachable")
        except aiohttp.ClientError:
            found = probe.ProbeAnswer("broken")
        ended = loop.time()
        ttft = first - began if first is not None and found.ended == "answered" else None
        self._mark(target, found, ttft)
        self._record(target, found, at=at, ttft=ttft, duration=ended - began, usage=usage)
        self.ended += 1

    def _mark(
        self, target: probe.ProbeTarget, found: probe.ProbeAnswer, ttft: float | None
    ) -> None:
        key = (target.engine, target.model)
        before = self.marks.get(key)
        mark = probe.after(
            before, target.run, found, at=utc_now(), ttft_s=ttft, timeout_s=self.timeout_s
        )
        self.marks[key] = mark
        outcome = probe.outcome(found)
        build = build_label(target.status)
        m = self.metrics
        m.child(m.probes, target.engine, target.model, build, outcome).inc()
        if outcome == "ok" and ttft is not None:
            m.child(m.probe_ttft, target.engine, target.model, build).observe(ttft)
        was = before is not None and before.run == target.run and before.degraded
        if mark.degraded and not was:
            log.warning(
                "engine degraded: its probe failed",
                engine=target.engine,
                model=target.model,
                reason=mark.reason,
            )
        elif was and not mark.degraded:
            log.info("engine probed ok again", engine=target.engine, model=target.model)

    def _record(
        self,
        target: probe.ProbeTarget,
        found: probe.ProbeAnswer,
        *,
        at: datetime,
        ttft: float | None,
        duration: float,
        usage: dict[str, Any] | None,
    ) -> None:
        if self.recorder is None:
            return
        source = "engine" if usage is not None else "none"
        if usage is None and found.ended in ("timed_out", "broken"):  # sent, never answered
            usage, source = Counts(len(probe.PROMPT) // 4 + 16, 1).usage(), "bound"
        prompt, completion, cached = tokens_of(usage)
        try:
            self.recorder.record(
                Row(
                    at=at,
                    key_id=PROBE_KEY_ID,
                    model=kept(target.model),
                    engine=kept(target.engine),
                    build=build_of(target.status, target.model),
                    outcome=probe.outcome(found),
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    cached_tokens=cached,
                    wait_s=0.0,
                    ttft_s=ttft,
                    duration_s=duration,
                    usage_source=source,
                )
            )
        except RowRefused as exc:
            log.warning("probe not recorded", engine=target.engine, reason=str(exc))


def _document(raw: bytes) -> dict[str, Any]:
    """The answer's JSON object; {} for anything else (an error page, a cut answer)."""
    try:
        document = json.loads(raw)
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}
