"""An SSE stream passed on event by event, less a usage chunk the client did not ask for.

Only an unfinished event is held back; every finished one goes on at once. The bytes are not
split into events: only an event that names `"usage"` is looked at, so that a stream costs a
few searches of its bytes, not a step per event.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

# an event's end: a blank line (the "\r" before "\n\r\n" is the event's own); starting with a
# literal "\n" lets the regex engine skip to it rather than try every byte
_END: Final = re.compile(rb"\n\r?\n")
_DATA: Final = b"data:"
_USAGE: Final = b'"usage"'


def may_hold_usage(data: bytes) -> bool:
    return _USAGE in data and b"[]" in data


def last_end(data: bytes, before: int | None = None) -> int:
    """Where the last finished event in `data[:before]` ends (0: none)."""
    stop = len(data) if before is None else before
    plain, crlf = data.rfind(b"\n\n", 0, stop), data.rfind(b"\n\r\n", 0, stop)
    return max(plain + 2 if plain >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def usage_only(event: bytes) -> dict[str, Any] | None:
    """The usage of an event that carries nothing else (`choices` empty), else None."""
    if not may_hold_usage(event):
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
        held = self._held + data if self._held else data
        end = last_end(held)
        self._held = held[end:]
        done = held[:end]  # finished events only
        if not may_hold_usage(done):
            return done
        out: list[bytes] = []
        start = 0
        at = done.find(_USAGE)
        while at >= 0:
            begin = max(start, last_end(done, at))
            match = _END.search(done, at)
            stop = match.end() if match is not None else end
            usage = usage_only(done[begin:stop])
            if usage is not None:
                self.usage = usage
                if self.hide:
                    out.append(done[start:begin])
                    start = stop
            at = done.find(_USAGE, stop)
        out.append(done[start:])
        return b"".join(out)

    def close(self) -> bytes:
        """What is left of an unfinished last event: passed on as it came."""
        held, self._held = self._held, b""
        return held
