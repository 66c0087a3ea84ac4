"""The page's sub-application under /page/: its files, the sign-in, and the JSON API it polls.

Every response carries the page's Content-Security-Policy (nothing inline, nothing from
elsewhere, no framing) and nosniff. Under /page/api/ a request a browser says came from
elsewhere (another site, or another origin on the same host: origin.py) is refused (403); then
everything but the sign-in needs the session cookie (401 without it); every POST but the
sign-in also needs the session's CSRF token in X-CSRF-Token (403 without it). The bearer-key
host API (/api/host/) is untouched.

The session cookie is sent to /page/ only (`Path=/page/`): cookies carry no port, so with
`Path=/` every other service on the same host (an engine's web UI, a Grafana) would be sent the
owner's session. Over TLS it is `__Secure-lucia_page` (Secure; a browser accepts that name only
from a secure origin, so no plain-http service on the host can set or replace it); `__Host-`
would demand `Path=/`, and so send it to every path of every service on the host.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from supervisor import paths
from supervisor.host import keys
from supervisor.host.models.control import ACTIONS
from supervisor.host.page.machines import PATH as MACHINE_ENGINE
from supervisor.host.page.machines import Fleet, Machines
from supervisor.host.page.memory import outdated_by
from supervisor.host.page.models import LibraryRefused, ModelsSection
from supervisor.host.page.origin import foreign
from supervisor.host.page.sessions import Session, Sessions, SignInLimit, csrf_matches
from supervisor.host.page.sources import Sources, section
from supervisor.host.proxy.hostapi import HostApi
from supervisor.host.web.auth import Authenticator
from supervisor.host.web.intake import peer, read_body
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import utc_now

PREFIX: Final = "/page"
COOKIE: Final = "lucia_page"  # over plain http
SECURE_COOKIE: Final = "__Secure-lucia_page"  # over TLS
COOKIE_PATH: Final = PREFIX + "/"
MAX_COOKIES: Final = 4  # values of the session cookie's name looked at in one request
CSRF_HEADER: Final = "X-CSRF-Token"
SIGN_IN: Final = "/api/signin"
_BODY_LIMIT: Final = 16 * 1024
_BODY_TIMEOUT_S: Final = 10.0
HEADERS: Final = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
FILES: Final = {
    "/": ("index.html", "text/html"),
    "/page.js": ("page.js", "text/javascript"),
    "/page.css": ("page.css", "text/css"),
}
SESSION: Final = web.RequestKey("page_session", Session)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _static(name: str) -> bytes:
    return (resources.files("supervisor.host.page") / "static" / name).read_bytes()


def _refused(refusal: Refusal) -> web.Response:
    return web.Response(
        status=refusal.status,
        body=refusal.encoded(),
        content_type="application/json",
        headers=refusal.headers,
    )


def _require_json(request: web.Request) -> None:
    """A body the page sends is JSON, said so: a form or a text/plain post (what another site
    can send without asking) is refused (415) before anything is read or counted."""
    if request.content_type != "application/json":
        raise Refusal(
            415,
            "unsupported_media_type",
            "the page's requests are JSON (Content-Type: application/json)",
        )


async def _json(request: web.Request) -> dict[str, Any]:
    _require_json(request)
    raw = await read_body(
        request,
        _BODY_LIMIT,
        _BODY_TIMEOUT_S,
        lambda: Refusal(413, "request_too_large", "the page's requests are limited to 16 KiB"),
    )
    try:
        document = json.loads(raw or b"{}")
    except ValueError:
        raise Refusal(400, "invalid_request", "the body must be a JSON object") from None
    if not isinstance(document, dict):
        raise Refusal(400, "invalid_request", "the body must be a JSON object")
    return document


class Page:
    """The page of one gateway: its sessions, and what it reads and asks through."""

    def __init__(
        self,
        auth: Authenticator,
        host_api: HostApi,
        data_dir: Path,
        sources: Sources,
        *,
        sessions: Sessions,
        limit: SignInLimit | None = None,
        fleet: Callable[[], Fleet | None] = lambda: None,
    ) -> None:
        self.auth = auth
        self.host_api = host_api
        self.keys_file = paths.keys_file(data_dir)
        self.sources = sources
        self.sessions = sessions
        self.limit = limit or SignInLimit()
        self.machines = Machines(fleet)  # the other machines of a fleet (machines.py)
        self.files = {path: (_static(name), kind) for path, (name, kind) in FILES.items()}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard])
        for path in FILES:
            app.router.add_get(path, self.serve_file)
        app.router.add_post(SIGN_IN, self.sign_in)
        app.router.add_post("/api/signout", self.sign_out)
        app.router.add_get("/api/session", self.session)
        app.router.add_get("/api/overview", self.overview)
        app.router.add_post("/api/engines/{name}", self.host_api.set_desired)
        app.router.add_post(MACHINE_ENGINE, self.machine_engine)
        app.router.add_post("/api/keys", self.create_key)
        app.router.add_post("/api/keys/{id}/revoke", self.revoke_key)
        app.router.add_post("/api/models", self.add_model)
        app.router.add_post("/api/models/{id}/{action}", self.model_action)
        return app

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            self._check(request)
            response = await handler(request)
        except Refusal as refusal:
            response = _refused(refusal)
        except web.HTTPException as exc:  # no such route or method: JSON too under /api/
            if request.path.startswith(PREFIX + "/api/"):
                code = exc.reason.lower().replace(" ", "_")
                response = _refused(Refusal(exc.status, code, exc.reason))
            else:
                response = web.Response(status=exc.status, text=exc.text or exc.reason)
        response.headers.update(HEADERS)
        return response

    def _check(self, request: web.Request) -> None:
        """An API request from elsewhere (403), its session (401 without), and a POST's CSRF
        token (403)."""
        path = request.path[len(PREFIX) :]
        if not path.startswith("/api/"):
            return
        headers = request.headers
        elsewhere = foreign(headers.get("Sec-Fetch-Site"), headers.get("Origin"), request.host)
        if elsewhere is not None:
            raise Refusal(
                403, "foreign_origin", f"the page's API answers the page only: {elsewhere}"
            )
        if path == SIGN_IN:
            return
        session = self.find(request)
        if session is None:
            raise Refusal(401, "signed_out", "sign in with the owner key (the session is over)")
        if request.method == "POST" and not csrf_matches(session, request.headers.get(CSRF_HEADER)):
            raise Refusal(403, "csrf_refused", f"a change needs this session's {CSRF_HEADER}")
        request[SESSION] = session

    async def serve_file(self, request: web.Request) -> web.Response:
        body, kind = self.files[request.path[len(PREFIX) :]]
        return web.Response(body=body, content_type=kind, charset="utf-8")

    async def sign_in(self, request: web.Request) -> web.Response:
        """A sign-in from elsewhere (403, in the guard) or not JSON (415) is not counted; any
        other is counted before its body is awaited, and taken back when its key is valid."""
        _require_json(request)
        address = peer(request)
        wait = self.limit.blocked(address)
        if wait > 0:
            raise Refusal(
                429,
                "too_many_sign_ins",
                f"too many failed sign-ins: try again in {wait:.0f} s",
                headers={"Retry-After": str(max(1, round(wait)))},
            )
        attempt = self.limit.failed(address)
        key = (await _json(request)).get("key")
        caller = self.auth.verify(key.strip()) if isinstance(key, str) and key.strip() else None
        if caller is None:
            raise Refusal(401, "invalid_api_key", "that is not a valid key")
        self.limit.forgive(address, attempt)
        if caller.role != "owner":
            raise Refusal(
                403,
                "permission_denied",
                f"the page is the owner's: this key's role is {caller.role}, which may call "
                "/v1 only",
            )
        token, session = self.sessions.open()
        response = web.json_response({"csrf": session.csrf})
        response.set_cookie(
            cookie_name(request.secure),
            token,
            max_age=int(self.sessions.lifetime_s),
            path=COOKIE_PATH,
            httponly=True,
            samesite="Strict",
            secure=request.secure,
        )
        return response

    def find(self, request: web.Request) -> Session | None:
        """The live session of the request's cookie, whichever of its values names one."""
        for token in presented(request):
            session = self.sessions.find(token)
            if session is not None:
                return session
        return None

    async def sign_out(self, request: web.Request) -> web.Response:
        for token in presented(request):
            self.sessions.close(token)
        response = web.json_response({"signedOut": True})
        response.del_cookie(cookie_name(request.secure), path=COOKIE_PATH)
        return response

    async def session(self, request: web.Request) -> web.Response:
        return web.json_response({"csrf": request[SESSION].csrf})

    async def overview(self, _: web.Request) -> web.Response:
        now = utc_now()
        found = self.host_api.catalog.engines()
        statuses = {engine.name: engine.status for engine in found}
        engines = [self.host_api.row(engine, now) for engine in found]
        for row in engines:
            status = row["status"]
            row["heartbeatAge"] = _age(status["checkedAt"], now) if status else None
            row["memoryOutdatedBy"] = outdated_by(statuses, row["name"])
        rest = await asyncio.to_thread(self._files, now)
        fleet = self.machines.overview()
        return web.json_response({"now": _iso(now), "engines": engines, "fleet": fleet, **rest})

    async def machine_engine(self, request: web.Request) -> web.Response:
        """Start or Stop another machine's engine: JSON, as every change the page sends."""
        _require_json(request)
        return await self.machines.set_desired(request)

    def _files(self, now: datetime) -> dict[str, Any]:
        """The sections read from files and sources, off the loop."""
        return {
            "memory": section(self.sources.memory),
            "keys": self._keys(now),
            "models": section(self.sources.models),
            "traffic": section(self.sources.traffic),
        }

    def _keys(self, now: datetime) -> dict[str, Any]:
        try:
            rows = keys.describe(keys.load(self.keys_file), now)
        except keys.KeysFileInvalid as exc:
            return {"problem": str(exc), "keys": []}
        use = section(self.sources.key_use)
        return {"keys": [row for row in rows if row["state"] != "revoked"], "use": use}

    async def create_key(self, request: web.Request) -> web.Response:
        document = await _json(request)
        name, expires = document.get("name"), document.get("expires") or None
        if not isinstance(name, str) or not (expires is None or isinstance(expires, str)):
            raise Refusal(400, "invalid_request", "a key needs a name (and may have an expiry)")
        try:
            now = utc_now()
            when = keys.parse_expiry(expires, now) if expires else None
            new = await asyncio.to_thread(keys.create, self.keys_file, name, now, when)
        except (keys.KeyRefused, keys.BadExpiry, keys.KeysFileInvalid) as exc:
            raise Refusal(400, "invalid_request", str(exc)) from None
        shown = keys.describe([new.entry], now)[0]
        return web.json_response({**shown, "secret": new.secret}, status=201)

    async def revoke_key(self, request: web.Request) -> web.Response:
        ref = request.match_info["id"]
        if keys.ID_PATTERN.fullmatch(ref) is None:
            raise Refusal(400, "invalid_request", "revoke takes a key id (key_ and 12 hex digits)")
        try:
            done = await asyncio.to_thread(keys.revoke_key, self.keys_file, ref, utc_now())
        except (keys.KeyRefused, keys.KeysFileInvalid) as exc:
            raise Refusal(404, "key_not_found", str(exc)) from None
        return web.json_response(keys.describe([done], utc_now())[0])

    def _library(self) -> ModelsSection:
        if not isinstance(self.sources.models, ModelsSection):
            raise Refusal(404, "not_found", "the model library is not connected to this page")
        return self.sources.models

    async def add_model(self, request: web.Request) -> web.Response:
        library, document = self._library(), await _json(request)
        repo, revision = document.get("repo"), document.get("revision") or "main"
        include, name = document.get("include") or [], document.get("name") or None
        if isinstance(include, str):
            include = include.split()
        if (
            not isinstance(repo, str)
            or not isinstance(revision, str)
            or not isinstance(include, list)
            or not all(isinstance(i, str) for i in include)
            or not (name is None or isinstance(name, str))
        ):
            raise Refusal(
                400,
                "invalid_request",
                "a model needs a repo (and may have a revision, include globs and a name)",
            )
        try:
            added = await asyncio.to_thread(
                library.add, repo.strip(), revision.strip(), include, name
            )
        except LibraryRefused as exc:
            raise Refusal(400, "model_refused", str(exc)) from None
        return web.json_response(added, status=201)

    async def model_action(self, request: web.Request) -> web.Response:
        library, action = self._library(), request.match_info["action"]
        if action not in ACTIONS:
            raise Refusal(404, "not_found", f"a model's actions are {', '.join(ACTIONS)}")
        try:
            applied = await asyncio.to_thread(library.request, request.match_info["id"], action)
        except LibraryRefused as exc:
            raise Refusal(400, "model_refused", str(exc)) from None
        return web.json_response({"action": action, "applied": applied})


def cookie_name(secure: bool) -> str:
    """The session cookie's name: `__Secure-` over TLS (see the module's docstring)."""
    return SECURE_COOKIE if secure else COOKIE


def presented(request: web.Request) -> list[str]:
    """Every value the request's Cookie headers give the session cookie's name, in order (a
    browser sends two when it still holds one at another path, as `Path=/` before the page's
    cookie moved to /page/: the mapping of request.cookies would keep only the last)."""
    name, found = cookie_name(request.secure), []
    for header in request.headers.getall("Cookie", ()):
        for pair in header.split(";"):
            key, equals, value = pair.strip().partition("=")
            if equals and key == name:
                found.append(value.strip().strip('"'))
    return found[:MAX_COOKIES]


async def to_page(_: web.Request) -> web.Response:
    """`GET /page`: the page is at /page/ (its files are relative to it)."""
    raise web.HTTPFound(PREFIX + "/")


def _iso(value: datetime) -> str:
    return value.isoformat(timespec="seconds").replace("+00:00", "Z")


def _age(checked_at: str, now: datetime) -> float:
    return (now - datetime.fromisoformat(checked_at.replace("Z", "+00:00"))).total_seconds()
