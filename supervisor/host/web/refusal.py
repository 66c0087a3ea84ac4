"""A request the gateway answers itself, with a status and an OpenAI-shaped error body."""

from __future__ import annotations

import json
from typing import Any


class Refusal(Exception):
    """Raised where a request cannot go on; the app turns it into its response."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        details: dict[str, Any] | None = None,
        close: bool = False,
        machine: str | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.details = details or {}  # beside `error` in the body, e.g. admission's counts
        self.close = close  # the connection is closed once the answer is out
        self.machine = machine  # in a fleet: the machine that refuses, named in the error

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        if self.machine is not None:
            error["machine"] = self.machine
        return {"error": error, **self.details}

    def encoded(self) -> bytes:
        return json.dumps(self.body()).encode()
