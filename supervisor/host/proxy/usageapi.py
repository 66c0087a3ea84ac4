"""`GET /api/host/usage` (owner only): the record's figures as `lucia-supervisor usage --json`.

`since` (default 1d) and `by` (key, model, engine or build; default model) as the command reads
them. The record is opened for the one reading, in a thread; one that cannot be read answers 503
with why (never a secret: the reason is redacted).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Final, get_args

from aiohttp import web

from supervisor import paths
from supervisor.host import keys
from supervisor.host.record import database, queries, report
from supervisor.host.record.database import Target
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import utc_now

USAGE: Final = "/api/host/usage"


def _by(value: str) -> queries.By:
    for choice in get_args(queries.By):
        if value == choice:
            return choice  # type: ignore[no-any-return]
    raise Refusal(400, "invalid_request", "by: key, model, engine or build", param="by")


class UsageApi:
    def __init__(self, data_dir: Path, target: Target) -> None:
        self.data_dir = data_dir
        self.target = target

    def routes(self, app: web.Application) -> None:
        app.router.add_get(USAGE, self.usage)

    async def usage(self, request: web.Request) -> web.Response:
        by = _by(request.query.get("by", "model"))
        try:
            since = report.parse_since(request.query.get("since", "1d"), utc_now())
        except report.BadSince as exc:
            raise Refusal(400, "invalid_request", str(exc), param="since") from None
        try:
            lines = await asyncio.to_thread(queries.read, self.target, since, by)
        except database.failures() as exc:
            raise Refusal(
                503, "record_unavailable", f"the record cannot be read: {database.one_line(exc)}"
            ) from None
        names = keys.names(paths.keys_file(self.data_dir)) if by == "key" else None
        return web.json_response(report.as_json(lines, by, since, names))
