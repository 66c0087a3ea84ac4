"""The tests' HTTP client for the real servers: a GET or a JSON POST, its status and body."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass
class Response:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def get(url: str, timeout: float) -> Response:
    return send(urllib.request.Request(url), timeout)


def post(url: str, document: dict[str, Any], timeout: float) -> Response:
    request = urllib.request.Request(
        url,
        data=json.dumps(document).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    return send(request, timeout)


def send(request: urllib.request.Request, timeout: float) -> Response:
    """The answer, an HTTP error's included (its status and body)."""
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return Response(answer.status, answer.read())
    except urllib.error.HTTPError as error:
        return Response(error.code, error.read())
