"""The gateway's HTTP application: keys, routing, admission, start on demand, forwarding.

Run it with `handler_cancellation=True` (`service.runner`): a client that goes away then ends its
handler, and with it the upstream request. A start on demand is a task of its own and goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Final

from aiohttp import web

from supervisor.host.failures import FailureLimit
from supervisor.host.fleet.door import PeerDoor
from supervisor.host.fleet.owner import PeerOwner
from supervisor.host.fleet.peers import Peers
from supervisor.host.gateway import health, listing, membership, recording, spans
from supervisor.host.gateway.prober import Prober
from supervisor.host.gateway.settings import GatewaySettings
from supervisor.host.page.memory import LedgerMemory
from supervisor.host.page.routes import PREFIX as PAGE
from supervisor.host.page.routes import Page, to_page
from supervisor.host.page.sessions import Sessions
from supervisor.host.page.sources import Sources
from supervisor.host.proxy import body, capability
from supervisor.host.proxy import budget as budgets
from supervisor.host.proxy.admission import Gate, decide
from supervisor.host.proxy.bodies import Bodies
from supervisor.host.proxy.catalog import Catalog, CatalogEntry, route
from supervisor.host.proxy.forward import Forwarder, Trace
from supervisor.host.proxy.hostapi import HostApi
from supervisor.host.proxy.idle import CHECK_S, IdleStop
from supervisor.host.proxy.metrics import CONTENT_TYPE, GatewayMetrics
from supervisor.host.proxy.reserve import Hold, Reservations
from supervisor.host.proxy.starter import POLL_S, Starter
from supervisor.host.proxy.usageapi import UsageApi
from supervisor.host.web.auth import METRICS_PATH, Authenticator, Caller, allowed, check_bearer
from supervisor.host.web.intake import TRUSTED, answer_and_close, peer
from supervisor.host.web.refusal import Refusal
from supervisor.host.web.responses import open_sse, refusal_response, send_error_event

if TYPE_CHECKING:  # made only when tracing is on: OpenTelemetry is imported then only
    from supervisor.host.gateway.tracing import Open, Tracing

KEEPALIVE_S: Final = 10.0  # an SSE comment this often while a start is waited for
BOUNDS_S: Final = 1.0  # the engines' published slots are read this often for waiting requests
CALLER: Final = web.RequestKey("caller", Caller)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Intervals:
    """How often the gateway keeps a waiting stream alive, polls a start, checks idling and
    re-reads the engines' bounds."""

    keepalive_s: float = KEEPALIVE_S
    poll_s: float = POLL_S
    idle_check_s: float = CHECK_S
    bounds_s: float = BOUNDS_S


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        data_dir: Path,
        auth: Authenticator,
        timing: Intervals,
        *,
        spending: budgets.BudgetSpending,
        recorder: recording.Recorder | None = None,
        tracing: Tracing | None = None,
        peers: Peers | None = None,
    ) -> None:
        self.settings = settings
        self.machine = settings.fleet.machine or None  # named in refusals and rows, in a fleet
        self.door = PeerDoor(peers, certified=settings.listen.tls) if peers else None
        self.tracing = tracing  # None: tracing off, and no OpenTelemetry object is made
        self.auth = auth
        self.failures = FailureLimit()  # invalid bearer keys per client address
        self.spending = spending
        self.reservations = Reservations()  # the bounds of requests in flight, per key and day
        self.recorder = recording.stamped(recorder, self.machine)
        self.timing = timing
        self.catalog = Catalog(data_dir)
        self.starter = Starter(data_dir, settings.limits.load_wait_s, timing.poll_s)
        self.gates: dict[str, Gate] = {}
        self.forwarder = Forwarder(self.machine)
        self.bodies = Bodies(
            settings.listen.bodies_bytes,
            settings.listen.body_timeout_s,
            settings.limits.bounds,
            settings.default_tier,
        )
        # the prober, made below, reports to these metrics: its marks are read when scraped
        self.metrics = GatewayMetrics(self.counts, lambda: self.prober.degraded())  # noqa: PLW0108
        self.idle = IdleStop(
            data_dir,
            self.starter,
            self.gate,
            settings.idle.stop_after_s,
            check_s=timing.idle_check_s,
            swap=settings.idle.swap,
        )
        self.prober = Prober(
            self.catalog,
            self.metrics,
            interval_s=settings.probe.interval_s,
            timeout_s=settings.probe.timeout_s,
            free=self.free,
            stopping=self.idle.stopping,
            recorder=self.recorder,
        )
        self.host_api = HostApi(
            data_dir,
            self.catalog,
            self.gates.get,
            self.idle,
            settings.listen.body_timeout_s,
            bound=self.bound,
            probed=self.prober.shown,
        )
        self.usage_api = UsageApi(data_dir, settings.record.target(data_dir))
        self.fleet: membership.Fleet = None  # the fleet's catalog, with [fleet] on

    def counts(self) -> dict[str, tuple[int, int]]:
        return {name: (gate.running, gate.waiting) for name, gate in self.gates.items()}

    def gate(self, engine: str) -> Gate:
        gate = self.gates.get(engine)
        if gate is None:
            gate = self.gates[engine] = Gate(engine, self.settings.admission(engine))
        return gate

    def bound(self, engine: CatalogEntry) -> int:
        """How many requests the engine gets at once now (settings.running_bound)."""
        return self.settings.admission(engine.name, engine.slots).running

    def free(self, engine: CatalogEntry) -> bool:
        """Whether the engine would run a request at once now (route prefers such)."""
        gate = self.gates.get(engine.name)
        limits = self.settings.admission(engine.name, engine.slots)
        return gate is None or decide(gate.running, gate.waiting, 0, limits) == "run"

    def follow(self, engine: CatalogEntry) -> Gate:
        """The engine's gate, given the limits its status.json says now (its slots)."""
        gate = self.gate(engine.name)
        gate.follow(self.settings.admission(engine.name, engine.slots))
        return gate

    async def follow_bounds(self, _: web.Application) -> AsyncIterator[None]:
        """The app's cleanup context: while requests wait, each engine's bound is read again
        this often, so a bound that rose (an engine that published its slots once it ran)
        admits them with no new request to look."""

        async def run() -> None:
            while True:
                await asyncio.sleep(self.timing.bounds_s)
                if any(gate.waiting for gate in self.gates.values()):
                    for engine in self.catalog.engines():
                        if engine.name in self.gates:
                            self.follow(engine)

        runner = asyncio.create_task(run(), name="follow bounds")
        try:
            yield
        finally:
            runner.cancel()

    # -- middleware ------------------------------------------------------------------------

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            access = allowed(request.path, None)
            if access == "peer" and self.door is not None:  # else 404: no route
                request[CALLER] = self.door.caller(request, self.failures)
            elif access not in ("open", "peer"):
                request[CALLER] = self.caller(request)
            return await handler(request)
        except Refusal as refusal:
            refusal.machine = refusal.machine or self.machine
            self.metrics.refused(refusal.code)
            response = refusal_response(refusal)
            if refusal.close:
                await answer_and_close(request, response)
            return response

    def caller(self, request: web.Request) -> Caller:
        """The verified caller, allowed this path (auth.check_bearer: 401, 429 or 403)."""
        door, path, address = self.door, request.path, peer(request)
        misplaced = door.on_v1(path, address) if door is not None else None
        auth = request.headers.get("Authorization")
        return check_bearer(self.auth, self.failures, path, auth, address, elsewhere=misplaced)

    async def say_unrecorded(self, _: web.Request, response: web.StreamResponse) -> None:
        """Every response says when nothing is recorded and no budget is enforced."""
        if not self.spending.available:
            response.headers[budgets.HEADER] = budgets.NOT_RECORDING

    def standing(self, request: web.Request) -> budgets.Standing:
        return budgets.standing(
            request[CALLER], self.settings.budget.daily_tokens, self.spending, Catalog.now()
        )

    async def budget(self, request: web.Request) -> web.Response:
        """`GET /v1/budget`: where the caller stands today (the RFC's budget RPC), and what its
        requests in flight hold of it."""
        stand = self.standing(request)
        held = self.reservations.held(stand.key_id, stand.day)
        return web.json_response({**stand.body(), "reserved_tokens": held})

    async def serve_metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # -- GET /v1/models ---------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        now = Catalog.now()
        listed = listing.models(
            engines=self.catalog.engines(),
            aliases=self.settings.aliases,
            default_tier=self.settings.default_tier,
            counts=self.counts(),
            marks=self.prober.health,
            now=now,
            machine=self.machine,
            peers=self.fleet.catalog.peers(now) if self.fleet is not None else (),
            stale_s=self.settings.fleet.stale_s,
        )
        return web.json_response(listed)

    # -- the forwarded routes ---------------------------------------------------------------

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """A /v1 request to its engine: within its span with tracing on (Tracing.around);
        with it off, a caller's valid trace context goes on as it came, and nothing is made."""
        trace = Trace(arrived=asyncio.get_running_loop().time())
        if self.tracing is None:
            trace.context = spans.passed_on(request.headers)
            return await self._forward(request, trace, None)
        return await self.tracing.around(request, trace, request[CALLER].key_id, self._forward)

    async def _forward(
        self, request: web.Request, trace: Trace, done: Open | None
    ) -> web.StreamResponse:
        stand = self.standing(request)
        room = self.reservations.room(stand)
        prepared = await self.bodies.take(request, room)  # its bytes held: see create_app
        asked, engines = prepared.model, self.catalog.engines()
        if self.fleet is not None:  # in a fleet: a model no engine here serves goes to a peer
            sent = await self.fleet.send(request, prepared, engines, request[CALLER])
            if sent is not None:
                return sent
        seen = Catalog.now()
        tiers = self.settings.aliases
        engine, model = route(asked, engines, tiers, seen, self.free, path=request.path)
        if model != asked:  # a tier alias: the engine knows the model's own name
            prepared = await self.bodies.renamed(prepared, model)
        url = engine.url(seen) if engine.name not in self.idle.stopping else None
        trace.served_by = engine.status
        start = partial(self._start, request, engine.name, prepared.stream, trace)
        gate = self.follow(engine)
        hold: Hold | None = None
        try:  # a route its model does not serve is refused before any start or hold
            capability.check(request.path, model, engine.name, engine.capabilities(model))
            if stand.over:  # a stream that crossed it finished; this one is refused
                raise budgets.refusal(stand, Catalog.now())
            hold = self.reservations.hold(stand, prepared.reserve, Catalog.now())
            trace.queued = asyncio.get_running_loop().time()
            async with gate.slot(None if url else start, key=stand.key_id) as admitted:
                target = url or admitted.before  # running already, or started on demand
                assert target is not None
                trace.admitted = asyncio.get_running_loop().time()
                self.metrics.child(self.metrics.wait, engine.name).observe(admitted.waited_s)
                return await self.forwarder.send(
                    request,
                    url=target,
                    prepared=prepared,
                    engine=engine.name,
                    deadline_s=gate.limits.deadline_s,
                    trace=trace,
                )
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            if not trace.delivered:  # before the whole answer: else it was served
                trace.outcome = "client_gone"
            raise
        except Refusal as refusal:
            refusal.machine = refusal.machine or self.machine
            trace.outcome = trace.outcome or "refused"
            trace.code = refusal.code
            sse = trace.answer  # a start's stream: its client has the headers already
            if sse is None:
                raise
            self.metrics.refused(refusal.code)
            await send_error_event(sse, refusal.body())
            return sse
        finally:
            recording.count(self.metrics, trace, model, engine.name, request[CALLER].key_id)
            now = asyncio.get_running_loop().time()
            row = recording.record(
                self.recorder,
                trace,
                recording.Request(request[CALLER].key_id, asked, model, engine.name),
                now,
                keep=done is not None,
            )
            if done is not None:  # its span's attributes and figures
                done.row, done.model = row, model
            self.reservations.release(hold)  # the row holds what it cost now

    async def _start(self, request: web.Request, engine: str, stream: bool, trace: Trace) -> str:
        """Start an engine on demand, as a waiter in its gate: a stream's answer begins at once
        (its client hears keep-alives while it waits); the engine's URL once it runs."""
        sse = await open_sse(request) if stream else None
        if sse is not None:
            trace.began(sse)
        trace.starting = asyncio.get_running_loop().time()
        url = await self.starter.ready_telling(engine, sse, self.timing.keepalive_s)
        trace.started = asyncio.get_running_loop().time()
        self.idle.stopping.discard(engine)
        now = self.catalog.engine(engine)  # as it is now: its slots, once it runs
        trace.served_by = now.status
        self.follow(now)
        return url


GATEWAY: Final = web.AppKey("gateway", Gateway)
PAGE_OF: Final = web.AppKey("page", Page)


def create_app(
    settings: GatewaySettings,
    data_dir: Path,
    auth: Authenticator,
    timing: Intervals | None = None,
    *,
    spending: budgets.BudgetSpending | None = None,
    recorder: recording.Recorder | None = None,
    sources: Sources | None = None,
    tracing: Tracing | None = None,
    peers: Peers | None = None,
) -> web.Application:
    """The application; `spending` and `recorder` are the record (record.store.Store), or
    None: nothing is recorded and no budget is enforced; `sources` feed the operator's page
    (memory from the ledger if none); `tracing`, when [tracing] is on (tracing.Tracing);
    `peers`, in a fleet (fleet.peers: the peer route is served then)."""
    gateway = Gateway(
        settings,
        data_dir,
        auth,
        timing or Intervals(),
        spending=spending or budgets.NoRecord(),
        recorder=recorder,
        tracing=tracing,
        peers=peers,
    )
    app = web.Application(middlewares=[gateway.guard], client_max_size=body.ANY_LIMIT)
    app[GATEWAY] = gateway
    app.on_response_prepare.append(gateway.say_unrecorded)
    app[TRUSTED] = settings.listen.proxies  # whose X-Forwarded-For names the client (peer)
    health.routes(app, settings.fleet.machine)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/v1/budget", gateway.budget)
    for path in body.FORWARDED:  # each body's bytes held from before it is read to its end
        app.router.add_post(path, gateway.bodies.holding(gateway.forward))
    if gateway.door is not None:  # /fleet/v1: the same, for a peer gateway's caller
        gateway.door.routes(app, gateway.bodies.holding(gateway.forward))
        PeerOwner(gateway.host_api, settings.listen.body_timeout_s).routes(app)  # Start, Stop
    app.router.add_get(METRICS_PATH, gateway.serve_metrics)
    gateway.host_api.routes(app)
    gateway.usage_api.routes(app)
    page = Page(
        auth,
        gateway.host_api,
        data_dir,
        sources or Sources(LedgerMemory(data_dir)),
        sessions=Sessions(settings.page.session_s),
        fleet=lambda: gateway.fleet,
    )
    app[PAGE_OF] = page
    app.router.add_get(PAGE, to_page)
    app.add_subapp(PAGE, page.app())
    app.cleanup_ctx.append(gateway.forwarder.session)
    app.cleanup_ctx.append(gateway.bodies.parsing)
    app.cleanup_ctx.append(gateway.idle.task)
    app.cleanup_ctx.append(gateway.follow_bounds)
    app.cleanup_ctx.append(gateway.prober.task)
    gateway.fleet = membership.join(
        app, settings, gateway.catalog, gateway.counts, peers=peers, bodies=gateway.bodies
    )
    return app
