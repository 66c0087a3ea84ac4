"""The gateway as a service: listening, sd_notify, its file_sd target, and the stop.

It opens the record (which never fails the start: without it the gateway serves, records
nothing and enforces no budget, and says so), makes its tracing when `[tracing] endpoint` is
set (OpenTelemetry is imported then only), listens (TLS from the configured files), says
READY and pings the watchdog as a Type=notify unit, publishes its file_sd target, and stops on
SIGTERM: `/healthz` answers 503 at once, its machine's rows leave the fleet's catalog (with
[fleet] on) and, for `[listen] drain_s`, the gateway still listens and serves (a load
balancer's health check takes it out meanwhile); then it stops listening, gives the requests
in flight their time, commits what the record still holds and exports what tracing still
holds (for a few seconds at most).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Final

from aiohttp import web

from supervisor import logs
from supervisor.host.fleet.peers import Peers, taken_by
from supervisor.host.fleet.tls import ask_for_peers
from supervisor.host.gateway.app import GATEWAY, create_app
from supervisor.host.gateway.health import HEALTH
from supervisor.host.gateway.sections import (
    DEFAULT_HEADER_TIMEOUT_S,
    Listen,
    Record,
    TracingSettings,
)
from supervisor.host.gateway.settings import GatewaySettings, SettingsError
from supervisor.host.page.traffic import record_sources
from supervisor.host.proxy.metrics import publish_target, target
from supervisor.host.record.store import Store
from supervisor.host.web.auth import Authenticator
from supervisor.notify import Notifier

if TYPE_CHECKING:
    from supervisor.host.gateway.tracing import Tracing

WATCHDOG_IDLE_S: Final = 5.0  # how often the loop looks when there is no watchdog
UNRECORDED: Final = "not recording: no row is kept and no budget is enforced"
SHUTDOWN_S: Final = 20.0  # streams in flight get this long at a stop (the unit allows 30)
log = logs.get("gateway")


def tls_context(listen: Listen, ca_file: Path | None = None) -> ssl.SSLContext | None:
    """The server's TLS context from the configured files, asking peers for a certificate
    signed by `ca_file` when set (fleet.tls); SettingsError naming the setting."""
    if listen.tls_cert is None or listen.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(listen.tls_cert, listen.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise SettingsError(
            f"listen.tls_cert {listen.tls_cert}, listen.tls_key {listen.tls_key}: cannot be "
            f"used: {_detail(exc)}"
        ) from None
    if ca_file is not None:
        try:
            ask_for_peers(context, ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise SettingsError(
                f"fleet.ca_file {ca_file}: cannot be used: {_detail(exc)}"
            ) from None
    return context


def _detail(exc: OSError | ssl.SSLError) -> str:
    return getattr(exc, "strerror", None) or str(exc)


class Service:
    def __init__(
        self,
        settings: GatewaySettings,
        data_dir: Path,
        auth: Authenticator,
        notifier: Notifier | None = None,
    ) -> None:
        self.settings = settings
        self.data_dir = data_dir
        self.auth = auth
        self.notifier = notifier or Notifier()
        fleet = settings.fleet
        self.context = tls_context(settings.listen, fleet.ca_file)  # before anything binds
        # the peers file, read at start: a bad one is exit 78 too (fleet.peers)
        self.peers = (
            Peers.open(fleet.peers_file, fleet.machine, taken_by(auth)) if fleet.on else None
        )
        self.stop = asyncio.Event()
        self.port: int | None = None  # the bound port, once listening (0 in settings: any)
        self.listening = asyncio.Event()

    async def run(self) -> None:
        listen = self.settings.listen
        for warning in self.settings.warnings():
            log.warning(warning)
        store = await asyncio.to_thread(open_record, self.settings.record, self.data_dir)
        record = self.settings.record
        sources = record_sources(
            self.data_dir,
            record.target(self.data_dir) if record.enabled else None,
            store,
            self.settings.budget.daily_tokens,
        )
        tracing = open_tracing(self.settings.tracing)
        app = create_app(
            self.settings,
            self.data_dir,
            self.auth,
            spending=store,
            recorder=store,
            sources=sources,
            tracing=tracing,
            peers=self.peers,
        )
        app_runner = runner(app, SHUTDOWN_S, listen.header_timeout_s)
        await app_runner.setup()
        try:
            site = web.TCPSite(app_runner, listen.address, listen.port, ssl_context=self.context)
            await site.start()
            self.port = bound_port(app_runner, listen.port)
            path = publish_target(self.data_dir, target(listen.address, self.port, listen.tls))
            scheme = "https" if listen.tls else "http"
            where = f"{scheme}://{listen.address}:{self.port}"
            log.info("gateway listening", url=where, file_sd=str(path))
            self.notifier.ready()
            recording = "recording" if store is not None and store.available else "NOT recording"
            self.notifier.status(f"serving on {where}; {recording}")
            self.listening.set()
            await self._watch()
            app[HEALTH].stop()
            fleet = app[GATEWAY].fleet
            if fleet is not None:  # the other machines send it nothing new either
                await fleet.catalog.withdraw()
            if listen.drain_s > 0:
                log.info("gateway draining: /healthz answers 503", seconds=listen.drain_s)
                await asyncio.sleep(listen.drain_s)
        finally:
            self.notifier.stopping()
            log.info("gateway stopping")
            await app_runner.cleanup()
            if store is not None:
                await asyncio.to_thread(store.close)  # what is queued is committed
            if tracing is not None:
                await tracing.close()

    async def _watch(self) -> None:
        interval = self.notifier.watchdog_interval
        every = interval / 2 if interval else WATCHDOG_IDLE_S
        while not self.stop.is_set():
            self.notifier.watchdog()  # from the loop: a blocked loop misses its pings
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), every)


def runner(
    app: web.Application,
    shutdown_s: float = 60.0,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
) -> web.AppRunner:
    """The runner the gateway serves with: a client that disconnects cancels its handler; at a
    stop, requests in flight get `shutdown_s` to finish.

    aiohttp's keep-alive timer runs from a connection's start and from each answer, and closes
    the connection if no whole request's headers came by then: with `header_timeout_s` it is
    the bound of a client that sends its headers slowly or never finishes them (a slowloris),
    and of an idle keep-alive connection. aiohttp's own default is an hour."""
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_s,
        keepalive_timeout=header_timeout_s,
    )


def open_record(settings: Record, data_dir: Path) -> Store | None:
    """The record, as its settings say; None when disabled. Said in the journal either way."""
    if not settings.enabled:
        log.warning(UNRECORDED, reason="record.enabled is false")
        return None
    store = Store.open(settings.target(data_dir), settings.retention_days)
    where = {"backend": store.target.kind, "where": store.target.describe()}
    if store.available:
        log.info("recording every generation", retention_days=settings.retention_days, **where)
    else:
        log.warning(UNRECORDED, reason=store.reason, **where)
    return store


def open_tracing(settings: TracingSettings) -> Tracing | None:
    """The gateway's tracing when its endpoint is set (said in the journal), else None."""
    if not settings.endpoint:
        return None
    from supervisor.host.gateway.tracing import Tracing

    Tracing.quiet_the_sdk()
    tracing = Tracing(settings)
    log.info(
        "tracing every request",
        endpoint=settings.endpoint,
        service_name=settings.service_name,
        sample_ratio=settings.sample_ratio,
    )
    return tracing


def bound_port(app_runner: web.AppRunner, configured: int) -> int:
    for address in app_runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return configured


def serve(service: Service) -> int:
    """Run until SIGTERM or SIGINT; the exit status."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, service.stop.set)
        await service.run()

    asyncio.run(main())
    return 0
