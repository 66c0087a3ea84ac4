"""structlog, configured once: journald lines with a syslog priority, or a readable console."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Final, TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

from supervisor import redaction

_PRIORITY: Final = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}
_configured = False


def under_journal(stream: TextIO) -> bool:
    """True when stream is connected to journald (systemd sets JOURNAL_STREAM=dev:inode)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return (info.st_dev, info.st_ino) == (int(dev), int(ino))


def _redact(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = redaction.redact(value)
    return event


def _one_line(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    for key, value in event.items():
        if isinstance(value, str) and ("\n" in value or "\r" in value):
            event[key] = value.replace("\r", "").replace("\n", " | ")
    return event


def _priority_prefix(_: WrappedLogger, method: str, event: EventDict) -> EventDict:
    event["_prefix"] = f"<{_PRIORITY.get(method, 6)}>"
    return event


def _journal_render(_: WrappedLogger, __: str, event: EventDict) -> str:
    prefix = event.pop("_prefix", "<6>")
    event.pop("level", None)
    text = event.pop("event", "")
    rest = " ".join(f"{key}={_quote(value)}" for key, value in event.items())
    return f"{prefix}{text}" + (f" {rest}" if rest else "")


def _quote(value: Any) -> str:
    # _one_line only sees str values; str() of others (an exception, say) can span lines too.
    text = str(value).replace("\r", "").replace("\n", " | ")
    if not text or any(ch in text for ch in ' "='):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def configure(level: str | None = None, stream: TextIO | None = None) -> None:
    """Configure structlog once per process; level from the argument, then LUCIA_LOG_LEVEL."""
    global _configured  # noqa: PLW0603 - logging is process-wide by nature
    if _configured:
        return
    out = stream or sys.stderr
    name = (level or os.environ.get("LUCIA_LOG_LEVEL") or "info").upper()
    threshold = logging.getLevelNamesMapping().get(name, logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.format_exc_info,
        _redact,
    ]
    renderer: list[Any]
    if under_journal(out):
        renderer = [_one_line, _priority_prefix, _journal_render]
    elif out.isatty():
        renderer = [structlog.dev.ConsoleRenderer()]
    else:
        renderer = [
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _one_line,
            structlog.processors.KeyValueRenderer(key_order=["timestamp", "level", "event"]),
        ]
    structlog.configure(
        processors=shared + renderer,
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get(name: str) -> Any:
    return structlog.get_logger(name)
