"""An SSE stream passed on event by event, less a usage chunk the client did not ask for.

Only an unfinished event is held back; every finished one goes on at once.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

_END: Final = re.compile(rb"\r?\n\r?\n")
_DATA: Final = b"data:"


def usage_only(event: bytes) -> dict[str, Any] | None:
    """The usage of an event that carries nothing else (`choices` empty), else None."""
    if b'"usage"' not in event or b"[]" not in event:
        return None
    lines = [line[len(_DATA) :].strip() for line in event.splitlines() if line.startswith(_DATA)]
    try:
        document = json.loads(b"".join(lines))
    except ValueError:
        return None
    if not isinstance(document, dict) or document.get("choices") != []:
        return None
    usage = document.get("usage")
    return usage if isinstance(usage, dict) else None


class UsageFilter:
    """Feed it the upstream's bytes; it returns what the client gets, and keeps the usage."""

    def __init__(self, hide: bool) -> None:
        self.hide = hide
        self.usage: dict[str, Any] | None = None
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        self._held += data
        out: list[bytes] = []
        start = 0
        for match in _END.finditer(self._held):
            event = self._held[start : match.end()]
            start = match.end()
            usage = usage_only(event)
            if usage is not None:
                self.usage = usage
                if self.hide:
                    continue
            out.append(event)
        self._held = self._held[start:]
        return b"".join(out)

    def close(self) -> bytes:
        """What is left of an unfinished last event: passed on as it came."""
        held, self._held = self._held, b""
        return held
